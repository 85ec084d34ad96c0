"""terapipe: plan and launch token-level pipeline-parallel training (TeraPipe). The package's face: its version and
`load_exported`, what a user's own code reads of a run; the commands live in `cli`, the layers below it in their
packages (docs/design.md, "Layout")."""

from __future__ import annotations

from terapipe_cli.version import __version__

__all__ = ["__version__", "load_exported"]


def load_exported(path, map_location="cpu"):
    """``(model, info)`` of a ``terapipe export`` file: the single-device model (eval mode, weights loaded with
    ``strict=True``) and ``{"model_config", "step", "run", "schema"}`` (`terapipe_cli.train.export.load_exported`).

    PyTorch is imported here, when called: ``import terapipe_cli`` stays free of it (planning needs no torch)."""
    from terapipe_cli.train.export import load_exported as load

    return load(path, map_location)
