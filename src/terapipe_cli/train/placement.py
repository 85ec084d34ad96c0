"""Where a run's workers go: how many one machine takes, the process group's backend, and the sentence that says
so. On a CPU every worker is a single-thread process; on CUDA each worker has a GPU of its own while there are
enough, and beyond that they share the GPUs, talking over gloo through host memory (`engine.p2p.host_staged`).
"""

from __future__ import annotations

import os

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError

CPU_WORKERS_PER_CORE = 4  # beyond this, single-thread workers only queue for the cores


def gpu_count() -> int:
    """The CUDA GPUs PyTorch sees on this machine."""
    import torch

    return torch.cuda.device_count()


def max_workers_per_node(device: str) -> tuple[int, str]:
    """How many workers one machine takes, and why: four per CPU core on CPU and CUDA alike. On CUDA each
    worker is still a process on the cores, and workers beyond the GPUs share them (`backend_for`)."""
    cores = os.cpu_count() or 1
    why = f"{CPU_WORKERS_PER_CORE} x {cores} CPU cores"
    if device == "cuda":
        why += f"; workers beyond the {_gpus(gpu_count())} share them"
    return CPU_WORKERS_PER_CORE * cores, why


def backend_for(device: str, workers_per_node: int = 1, n_gpus: int | None = None) -> str:
    """The process group's backend: gloo on the CPU; on CUDA, NCCL when each of a machine's
    ``workers_per_node`` workers has a GPU of its own (``n_gpus``, default the GPUs here), else gloo.

    Stages that share a GPU cannot use NCCL (it refuses two ranks on one device), and gloo cannot send CUDA
    tensors, so on that gloo group every message and collective goes through host memory (`p2p.host_staged`).
    """
    if device != "cuda":
        return "gloo"
    gpus = gpu_count() if n_gpus is None else n_gpus
    return "nccl" if workers_per_node <= gpus else "gloo"


def placement_note(device: str, workers_per_node: int, n_gpus: int | None = None) -> str:
    """How a machine's workers compute and talk, as `terapipe train`'s launch line says it."""
    backend = backend_for(device, workers_per_node, n_gpus)
    if device != "cuda":
        cores = os.cpu_count() or 1
        if workers_per_node > cores:  # allowed (`max_workers_per_node`), but the user should know
            return f"{backend} on cpu, {workers_per_node} workers sharing {cores} cores: each slower than alone"
        return f"{backend} on cpu"
    if backend == "nccl":
        return "nccl, one GPU per worker"
    gpus = _gpus(gpu_count() if n_gpus is None else n_gpus)
    return f"{workers_per_node} workers share {gpus}: {backend} through host memory"


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def workers_per_node(layout: Layout, nnodes: int, device: str) -> int:
    """D x K x T workers split evenly over the machines, no more per machine than it allows
    (`max_workers_per_node`; on CUDA more workers than GPUs is allowed: they share the GPUs, see `backend_for`)."""
    if layout.world % nnodes:
        raise UserError(f"{layout.shape_text()} do not split evenly over {nnodes} machines", where="nnodes")
    per_node = layout.world // nnodes
    allowed, why = max_workers_per_node(device)
    if per_node > allowed:
        raise UserError(
            f"{layout.shape_text()}{f', {per_node} per machine' if nnodes > 1 else ''}: more than allowed here "
            f"({allowed}: {why})",
            where="--data-parallel / --tensor-parallel / plan field 'stages'",
        )
    return per_node
