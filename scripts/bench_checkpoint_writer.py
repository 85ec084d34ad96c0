#!/usr/bin/env python3
"""What a stage file written in the background costs the training thread: the writer as a thread (as the runtime
writes it, `train.checkpoint.StageWriter`) against the same write in a process of its own.

    python scripts/bench_checkpoint_writer.py                  # 300 MiB state, 5 rounds
    python scripts/bench_checkpoint_writer.py --mib 100 --rounds 9
    python scripts/bench_checkpoint_writer.py --copy         # the writer's host copy: fresh buffers or the last ones

The training thread runs a stand-in for a CPU step of many small operators (eight linear layers of 512 and their
GELUs, forward and backward on 16 rows, eight times), one thread. Each round times steps while nothing is written,
then while the state is written by `checkpoint._stream_atomic` (serialised by `torch.save`, hashed, fsync'd, renamed;
at nice 10, as the runtime's writer) from a thread of this process, then while a separate process (which loaded the
same state first) writes it — the two modes in turn within every round. Prints each mode's slowdown of the median
step over the clean steps of its round: median (min-max) over the rounds. If the writer's hold on the interpreter's
lock were what stalls the step, the process would stall it less.

--copy times the host copy the update waits for (`checkpoint.host_copy`, in a thread as the writer makes it, under
the runtime's allocator settings, `engine.hostmem`): into fresh tensors, and in turn written over the copy before.

Timing holds /tmp/terapipe-cpu.lock (flock) so no other measurement on this machine runs at the same time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from bench_train import cpu_lock  # noqa: E402

from terapipe_cli.engine.hostmem import retain_freed_memory  # noqa: E402
from terapipe_cli.train.checkpoint import WRITER_NICE, _stream_atomic, host_copy  # noqa: E402

STEPS = 6  # timed steps per window: a window ends before the write does (checked)

CHILD = """
import os, sys
from pathlib import Path
import torch
sys.path.insert(0, {src!r})
from terapipe_cli.train.checkpoint import _stream_atomic
os.nice({nice})
state = torch.load({source!r})
Path({ready!r}).touch()
_stream_atomic(Path({target!r}), state)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=300, help="size of the state written (MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--copy", action="store_true", help="time the writer's host copy instead")
    a = parser.parse_args()
    torch.set_num_threads(1)
    if a.copy:
        copy_times(a)
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())])
    x = torch.randn(16, 512)

    def step() -> None:
        for _ in range(8):
            model(x).sum().backward()

    def window() -> float:
        times = []
        for _ in range(STEPS):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    parts = 16
    state = {f"w{n}": torch.randn(a.mib * 2**20 // 4 // parts) for n in range(parts)}
    folder = Path(tempfile.mkdtemp(prefix="bench_writer."))
    source = folder / "source.pt"
    torch.save(state, source)

    def in_thread() -> tuple[float, bool]:
        def write() -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
            _stream_atomic(folder / "thread.pt", state)

        writer = threading.Thread(target=write)
        writer.start()
        busy = window()
        still = writer.is_alive()
        writer.join()
        return busy, still

    def in_process() -> tuple[float, bool]:
        ready = folder / "ready"
        ready.unlink(missing_ok=True)
        code = CHILD.format(
            src=str(ROOT / "src"), nice=WRITER_NICE, source=str(source), ready=str(ready), target=str(folder / "p.pt")
        )
        child = subprocess.Popen([sys.executable, "-c", code])
        while not ready.exists():
            if child.poll() is not None:
                raise SystemExit(f"the writer process ended with {child.returncode}")
            time.sleep(0.005)
        busy = window()
        still = child.poll() is None
        if child.wait():
            raise SystemExit(f"the writer process ended with {child.returncode}")
        return busy, still

    for _ in range(3):
        step()
    slowdowns: dict[str, list[float]] = {"thread": [], "process": []}
    cut_short = 0
    print(f"writer: {a.mib} MiB state, {a.rounds} rounds, {STEPS} steps a window, load {os.getloadavg()[0]:.1f}")
    with cpu_lock():
        for r in range(a.rounds):
            modes = (("thread", in_thread), ("process", in_process))
            for name, run in modes if r % 2 == 0 else modes[::-1]:
                clean = window()
                busy, still = run()
                cut_short += not still
                slowdowns[name].append(busy / clean - 1)
    for name, values in slowdowns.items():
        print(
            f"{name:8} step slowed by {statistics.median(values):+.1%} (min {min(values):+.1%}, max "
            f"{max(values):+.1%}) while the writer ran"
        )
    if cut_short:
        print(f"({cut_short} window(s) outlasted their write: raise --mib)")


def copy_times(a: argparse.Namespace) -> None:
    retain_freed_memory()  # as every training worker
    parts = 24
    state = {f"w{n}": torch.randn(a.mib * 2**20 // 4 // parts) for n in range(parts)}

    def in_thread(make):
        out = []
        thread = threading.Thread(target=lambda: out.append(make()))
        started = time.perf_counter()
        thread.start()
        thread.join()
        return time.perf_counter() - started, out[0]

    times: dict[str, list[float]] = {"fresh": [], "written over": []}
    held = None
    with cpu_lock():
        for _ in range(a.rounds):
            seconds, copy = in_thread(lambda: host_copy(state))
            times["fresh"].append(seconds)
            del copy
            seconds, held = in_thread(lambda earlier=held: _copy_over(state, earlier))
            times["written over"].append(seconds)
    print(f"host copy of a {a.mib} MiB state, {a.rounds} rounds, in turn:")
    for name, values in times.items():
        each = ", ".join(f"{v * 1e3:.0f}" for v in values)
        print(f"{name:13} {statistics.median(values) * 1e3:6.1f} ms median (each: {each} ms)")


def _copy_over(state: dict, held: dict | None) -> dict:
    if held is None:
        return host_copy(state)
    for k, v in state.items():
        held[k].copy_(v)
    return held


if __name__ == "__main__":
    main()
