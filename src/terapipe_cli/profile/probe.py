"""What this machine is, for a profile: the device to time on, its description, and whether a tile fits in its
memory before anything is timed."""

from __future__ import annotations

import os
import platform

import torch

from terapipe_cli.config.device import machine_memory_bytes
from terapipe_cli.config.device import resolve_device as device_kind
from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig

DTYPE_BYTES = 4  # activations and gradients go between stages in fp32 at every precision (docs/design.md §6)


def resolve_device(name: str) -> torch.device:
    """The device to time on (see `terapipe_cli.config.device.resolve_device`), with the current CUDA index."""
    kind = device_kind(name)
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def gpu_count() -> int:
    """The CUDA GPUs PyTorch sees here."""
    return torch.cuda.device_count()


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "kind": "cuda",
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "gpus_visible": torch.cuda.device_count(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }
    info = {"kind": "cpu", "name": _cpu_name(), "threads": 1, "cores": os.cpu_count(), "torch": torch.__version__}
    memory = machine_memory_bytes()
    if memory is not None:
        info["memory_bytes"] = memory  # shared by every worker on the machine (plan.choice.check_memory)
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _free_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits_in_memory(
    model: ModelConfig,
    max_batch: int,
    device: torch.device,
    *,
    where: str = "--model",
    advice: str = "use smaller --batch-sizes, or estimate with `terapipe profile --analytic`",
) -> None:
    """Refuse, with one line, a profile whose largest tile cannot fit on the device (instead of an OOM crash).
    ``where`` and ``advice``: the option at fault and what to do, for the one line.

    A rough upper bound: one layer's weights, gradients and AdamW state (16 bytes per parameter), plus the
    largest tile's activations with its full-length context: ~34·H floats per token and the attention
    probabilities b·heads·L² that the explicit context mask keeps for the backward.
    """
    free = _free_memory_bytes(device)
    if free is None:
        return
    H, L = model.hidden, model.seq_len
    params = model.params_per_layer(bias=False)
    need = 16 * params + DTYPE_BYTES * max_batch * (2 * 34 * H * L + 2 * model.heads * L * L)
    if need > 0.9 * free:
        raise UserError(
            f"one layer of model '{model.name}' at batch {max_batch} × {L} tokens needs about {need / 2**30:.1f} GiB, "
            f"but {device.type} has {free / 2**30:.1f} GiB free; {advice}",
            where=where,
        )
