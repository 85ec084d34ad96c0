"""The host allocator every process that runs tiles uses — the training workers and the profiler alike, so a
profile times the memory behaviour training has (docs/design.md §3b).

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a buffer above its mmap threshold (128 KiB
at first, raised adaptively up to 32 MiB as such buffers are freed) with fresh pages from the kernel, and gives the
heap's top back once more than the trim threshold is free there. A tile's buffers are megabytes (a head's logits),
so each tile page-faulted much of its memory in again, at a cost that depended on what ran before it: the ends'
times on the profile's grid then depended on the order they were timed in, and their held-out error was several
times what it is with the thresholds below (docs/results.md, "The ends' held-out error").

The thresholds below keep what the process frees for reuse, as PyTorch's CUDA caching allocator keeps device
memory: a process's resident memory stays at its peak (which is what the memory estimate bounds, §10). Only glibc
is tuned; elsewhere (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 1 << 30  # buffers up to 1 GiB come from the heap, and are reused when freed
TRIM_THRESHOLD = (1 << 31) - 1  # the heap's free top is kept up to the largest value mallopt takes (an int)
TOP_PAD = 64 << 20  # the heap grows 64 MiB at a time: fewer brk calls, pages still faulted in once, when used

_done = False


def retain_freed_memory() -> bool:
    """Set glibc's thresholds (once per process); whether they are set (False off glibc)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    return _done
