"""Exported models as a library (documented API, stable): `load_exported` reads a ``terapipe export`` file back into
the single-device model; it lives in `train.export`, with the file's format. Importing this module imports torch.

    from terapipe_cli.exported import load_exported

    model, info = load_exported("model.pt")  # eval mode, weights loaded strictly; info: model_config, step, run, schema
"""

from terapipe_cli.train.export import load_exported

__all__ = ["load_exported"]
