"""terapipe: plan and launch token-level pipeline-parallel training (TeraPipe)."""

from __future__ import annotations

__version__ = "0.1.0"


def load_exported(path, map_location="cpu"):
    """``(model, info)`` of a ``terapipe export`` file: the single-device model (eval mode, weights loaded with
    ``strict=True``) and ``{"model_config", "step", "run", "schema"}`` (`terapipe_cli.train.export.load_exported`).

    PyTorch is imported here, when called: ``import terapipe_cli`` stays free of it (planning needs no torch)."""
    from terapipe_cli.train.export import load_exported as load

    return load(path, map_location)
