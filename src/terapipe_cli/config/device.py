"""Which device and which precision this process computes in: one rule for `terapipe profile` and `terapipe train`."""

from __future__ import annotations

import os
import re

from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields

DEVICES = ("auto", "cpu", "cuda")
# fp32: everything in fp32. bf16/fp16: fp32 master weights and optimizer state, compute under autocast in that
# type (docs/design.md §6a).
PRECISIONS = ("fp32", "bf16", "fp16")


def device_setting(**doc):
    """The ``--device`` setting, declared once for every command that takes one (`config.fields.setting`)."""
    from terapipe_cli.config.fields import setting

    return setting("auto (CUDA when present), cpu or cuda.", choices=DEVICES, fallback="auto", **doc)


def precision_setting(shown: str, **doc):
    """The ``--precision`` setting, declared once for every command that takes one; ``shown``: its default in words
    (the plan's, the device's)."""
    from terapipe_cli.config.fields import setting

    return setting(
        "fp32, bf16 or fp16: bf16/fp16 compute under autocast with fp32 master weights.",
        choices=("auto", *PRECISIONS),
        shown=shown,
        **doc,
    )


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


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the system does not say): what CPU workers share."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def available_memory_bytes() -> int | None:
    """Memory this machine can give a process now (Linux: MemAvailable), else its physical memory; None where the
    system says neither."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return machine_memory_bytes()


def default_precision(device: str) -> str:
    """The precision `terapipe profile` times when none is asked for: bf16 on ``"cuda"``, fp32 on ``"cpu"``
    (`terapipe train` takes its plan's, which that profile timed: `train.prepare._run_precision`).

    A GPU without native bf16 (before Ampere) gets fp16 instead: PyTorch only emulates bf16 there, without
    its tensor cores.
    """
    if device == "cuda":
        return "bf16" if _native_bf16() else "fp16"
    return "fp32"


def resolve_precision(name: str | None, device: str) -> str:
    """``None`` or ``"auto"``: `default_precision` of ``device`` (``"cpu"`` or ``"cuda"``); else one of
    `PRECISIONS`, checked. bf16 on a GPU without native bf16 is refused (use fp16 there).

    CPU autocast handles both bf16 and fp16 in the supported PyTorch versions, so neither is refused on a CPU.
    """
    if name is None or name == "auto":
        return default_precision(device)
    if name not in PRECISIONS:
        raise UserError(f"must be auto, fp32, bf16 or fp16, got {name!r}", where="--precision")
    if name == "bf16" and device == "cuda" and not _native_bf16():
        raise UserError("this GPU has no native bf16 (it is older than Ampere); use fp16", where="--precision")
    return name


def runs_natively(precision: str, device: str) -> bool:
    """Whether ``device`` (``"cpu"`` or ``"cuda"``) computes in ``precision`` without emulation: everything but bf16
    on a GPU older than Ampere."""
    return precision != "bf16" or device != "cuda" or _native_bf16()


# A GPU model in a device name: H100, A100, V100, L40S, GH200 (not a form factor such as SXM5 or memory as HBM3).
_GPU_MODEL = re.compile(r"(?!sxm|hbm)[a-z]{1,3}\d{2,4}[a-z]?")
_MEMORY = re.compile(r"\d+gb")
_FORM_FACTORS = ("sxm", "pcie", "nvl")


def same_device_name(described: str, local: str) -> bool:
    """Whether a profile's device name (``described``, e.g. a hardware file's "NVIDIA H100-SXM5-80GB") names the
    device PyTorch reports here (``local``, e.g. "NVIDIA H100 80GB HBM3").

    Vendors spell one GPU differently, so names with a GPU model (H100, A100, V100, ...) match when the models are
    equal and they agree on memory size (80GB) and form factor (SXM, PCIe, NVL) wherever both state one. Names
    without one (CPUs) must be equal, ignoring case, spacing and punctuation. Imports no torch.
    """
    a, b = (re.findall(r"[a-z0-9]+", name.lower()) for name in (described, local))
    model_a, model_b = (next((t for t in tokens if _GPU_MODEL.fullmatch(t)), None) for tokens in (a, b))
    if model_a is None or model_b is None:
        return a == b
    if model_a != model_b:
        return False
    return all(not x or not y or x == y for x, y in zip(_details(a), _details(b), strict=True))


def _details(tokens: list[str]) -> tuple[set[str], set[str]]:
    """The memory sizes and form factors a device name states (usually one each, or none)."""
    memory = {t for t in tokens if _MEMORY.fullmatch(t)}
    return memory, {f for t in tokens for f in _FORM_FACTORS if t.startswith(f)}


def _native_bf16() -> bool:
    """True unless a CUDA GPU is present and lacks native bf16 (so a machine without a GPU says True)."""
    import torch

    if not torch.cuda.is_available():
        return True
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def precision_field(f: Fields) -> str:
    """The ``precision`` field of a profile or plan file: fp32 when absent (files from before it existed).

    Imports no torch, so the planner side can use it."""
    name = f.get("precision", "fp32")
    if name not in PRECISIONS:
        raise f.fail("precision", f"must be fp32, bf16 or fp16, got {name!r}")
    return name
