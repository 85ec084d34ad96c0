"""Which device this process computes on: one rule for `terapipe profile` and `terapipe train`."""

from __future__ import annotations

from terapipe_cli.errors import UserError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> str:
    """``auto`` is CUDA when PyTorch sees a GPU, else the CPU; ``cuda`` without a GPU is a user error.

    Returns ``"cpu"`` or ``"cuda"``. PyTorch is imported only here, so the planner side never needs it.
    """
    if name not in DEVICES:
        raise UserError(f"must be auto, cpu or cuda, got {name!r}", where="--device")
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("cuda asked for, but no CUDA GPU is available to PyTorch here", where="--device")
    return name
