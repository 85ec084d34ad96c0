"""The bytes of every storage the ops of a region create, live over time: `LiveBytes`, the tracker under which the
memory estimate is traced on fake tensors (profile/memtrace.py) and a CPU run's first step is measured on real ones
(engine/trainer.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Within: the bytes of every storage an op creates, from its creation until it is released (a weakref
    finalizer on the storage), keyed by the storage's identity — fake tensors have no data pointers. Storages that
    existed before (parameters, anything an op reads that was made outside) never count, nor do views of them.
    ``block``: the bytes one storage of n bytes holds (default: n; `cuda_block_bytes` for a CUDA allocator).
    ``timeline``, while a list: the live bytes after each op, appended (the step's live bytes over time)."""

    def __init__(self, block: Callable[[int], int] | None = None) -> None:
        super().__init__()
        self.block = block or (lambda n: n)
        self.alive = 0
        self.peak = 0
        self.timeline: list[int] | None = None
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted (0: made outside)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in _tensors(args, kwargs):
            self._see(t.untyped_storage(), 0)
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out, None):
            storage = t.untyped_storage()
            self._see(storage, self.block(storage.nbytes()))
        if self.timeline is not None:
            self.timeline.append(self.alive)
        return out

    def _see(self, storage, size: int) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        self._sizes[key] = size
        weakref.finalize(storage, self._release, key)
        if size:
            self.alive += size
            self.peak = max(self.peak, self.alive)

    def _release(self, key: int) -> None:
        self.alive -= self._sizes.pop(key, 0)

    def restart_peak(self) -> int:
        """The live bytes now; the peak counts again from them."""
        self.peak = self.alive
        return self.alive


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results (one level of lists and tuples deep, as ATen ops take them)."""
    out = []
    for a in (*(args if isinstance(args, (tuple, list)) else (args,)), *(kwargs.values() if kwargs else ())):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out
