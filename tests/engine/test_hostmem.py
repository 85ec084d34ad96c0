"""engine.hostmem: the allocator setting the workers and the profiler share — a freed buffer is reused, not faulted
in again (page faults counted by the kernel, not timed), through malloc itself, which PyTorch's CPU tensors come
from. Each case runs in its own process: mallopt is process-wide."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# 40 MiB: above glibc's largest adaptive mmap threshold (32 MiB), so by default every such buffer is a fresh mapping.
_CHILD = """
import ctypes, resource, sys
from terapipe_cli.engine.hostmem import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
n = 40 << 20
faults = []
for _ in range(5):  # the first one faults its pages in either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[1:]))
"""


def _max_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


def test_a_freed_buffer_is_reused_without_page_faults():
    pages = (40 << 20) // 4096
    assert _max_faults("retain") < pages // 20
    assert _max_faults("default") >= pages // 2  # the control: glibc's defaults map it afresh every time
