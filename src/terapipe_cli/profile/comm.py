"""The two links of docs/design.md §3: stage to stage (comm(b, i)) and the data-parallel gradient all-reduce.

**Point-to-point.** Two processes are started by torchrun (``torch.distributed.run``, run through
`terapipe_cli.engine.torchrun`) — gloo on CPU, NCCL when two GPUs are present — and play ping-pong with
messages of the sizes a tile's activation takes. Rank 0 times round trips and writes the one-way times to a
JSON file; `measure_link` fits ``latency_s + bytes / bytes_per_s`` to them (`fit.fit_link`). With a single
GPU there is no second device to send to: we then time a device-to-device copy on that GPU, which is what
moving a tile between two stages sharing it costs, and record that this is what was measured.

**All-reduce.** `measure_allreduce` starts D processes the same way (one per GPU with NCCL, or D CPU
processes with gloo, one core each) and times ``all_reduce`` of one flat fp32 buffer, as the workers reduce
a stage's gradients (docs/design.md §6), for buffer sizes from a fraction of one layer's gradients to the
whole model's. ``latency + bytes / bandwidth`` is fitted to the whole all-reduce's time, then turned into
the per-step link of the ring formula the cost model prices (`costmodel.ring_link_from_allreduce`): the
profile's ``data_parallel_link``, in the same form an analytic profile gives it.

This module is also the worker: ``python -m terapipe_cli.profile.comm --worker ...`` (started by torchrun).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from terapipe_cli.ending import entry_point
from terapipe_cli.engine.forking import run_agent_in_child
from terapipe_cli.engine.torchrun import rendezvous_args, run_torchrun
from terapipe_cli.errors import UserError
from terapipe_cli.files import read_json, write_json_atomic
from terapipe_cli.plan.costmodel import ring_link_from_allreduce
from terapipe_cli.profile.fit import LinkFit, fit_link


@dataclass(frozen=True)
class _Fitted:
    """``latency + bytes / bandwidth`` fitted to per-size medians, with the medians, extremes and fit error."""

    fit: LinkFit
    median_s: list[float]
    min_s: list[float]
    max_s: list[float]
    rel_err_mean: float
    rel_err_max: float

    def record(self, sizes_bytes: list[int], label: str) -> dict:
        """The measurement's part of a profile object: sizes, per-size times (``LABEL_s_median`` …), fit error."""
        return {
            "sizes_bytes": sizes_bytes,
            f"{label}_s_median": self.median_s,
            f"{label}_s_min": self.min_s,
            f"{label}_s_max": self.max_s,
            "fit_rel_err_mean": self.rel_err_mean,
            "fit_rel_err_max": self.rel_err_max,
        }


@dataclass(frozen=True)
class LinkMeasurement:
    """The fitted link and the raw medians it was fitted to."""

    latency_s: float
    bytes_per_s: float
    method: str
    sizes_bytes: list[int]
    fitted: _Fitted

    def to_dict(self) -> dict:
        """The profile's ``comm`` object: the two numbers the cost model reads, plus how they were obtained."""
        return {
            "latency_s": self.latency_s,
            "bytes_per_s": self.bytes_per_s,
            "method": self.method,
            **self.fitted.record(self.sizes_bytes, "one_way"),
        }


def message_sizes(smallest: int, largest: int, count: int) -> list[int]:
    """``count`` sizes spaced evenly in log between the smallest and largest tile message (bytes, 4-aligned)."""
    smallest, largest = max(4, smallest), max(4, largest)
    if largest <= smallest:
        largest = smallest * 16  # the fit needs a spread of sizes to separate latency from bandwidth
    sizes = np.unique(np.round(np.geomspace(smallest, largest, max(count, 2)) / 4).astype(np.int64) * 4)
    return [int(s) for s in sizes]


def _fit_medians(sizes: Sequence[int], samples: np.ndarray) -> _Fitted:
    """``samples``: (rounds, sizes) seconds. The fit is to the per-size medians: a shared CPU preempts a
    transfer now and then for milliseconds, and one such sample would bend a fit to all of them."""
    med = np.median(samples, axis=0)
    x = np.asarray(sizes, dtype=float)
    fit = fit_link(x, med)
    err = np.abs(fit(x) - med) / med
    return _Fitted(
        fit,
        [float(v) for v in med],
        [float(v) for v in samples.min(axis=0)],
        [float(v) for v in samples.max(axis=0)],
        float(err.mean()),
        float(err.max()),
    )


def _summarise(method: str, sizes: Sequence[int], samples: np.ndarray) -> LinkMeasurement:
    """The link fitted to one-way times ``samples`` (rounds, sizes)."""
    f = _fit_medians(sizes, samples)
    return LinkMeasurement(f.fit.latency_s, f.fit.bytes_per_s, method, [int(s) for s in sizes], f)


def measure_link(
    device: str,
    sizes: Sequence[int],
    *,
    rounds: int = 5,
    iters: int = 10,
    timeout_s: float = 120.0,
) -> LinkMeasurement:
    """Measure and fit the stage-to-stage link for ``device`` ("cpu" or "cuda")."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        return _measure_copy_one_gpu(sizes, rounds=rounds, iters=iters)
    backend = "nccl" if device == "cuda" else "gloo"
    samples = _run_torchrun(backend, {"pingpong": sizes}, nproc=2, rounds=rounds, iters=iters, timeout_s=timeout_s)
    return _link_of(backend, sizes, samples["pingpong"])


def _link_of(backend: str, sizes: Sequence[int], samples: np.ndarray) -> LinkMeasurement:
    what = "two CUDA processes (NCCL)" if backend == "nccl" else "two CPU processes (gloo)"
    return _summarise(f"torchrun ping-pong between {what}, one-way = round trip / 2", sizes, samples)


def _measure_copy_one_gpu(sizes: Sequence[int], *, rounds: int, iters: int) -> LinkMeasurement:
    dev = torch.device("cuda", 0)
    rng = np.random.default_rng(0)
    samples = np.zeros((rounds, len(sizes)))
    bufs = {n: (torch.empty(n // 4, device=dev), torch.empty(n // 4, device=dev)) for n in sizes}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds + 1):  # round 0 is the warm-up
        for k in rng.permutation(len(sizes)):
            src, dst = bufs[sizes[k]]
            torch.cuda.synchronize(dev)
            start.record()
            for _ in range(iters):
                dst.copy_(src)
            end.record()
            end.synchronize()
            if r:
                samples[r - 1, k] = start.elapsed_time(end) / 1e3 / iters
    name = torch.cuda.get_device_name(dev)
    return _summarise(f"device-to-device copy on one GPU ({name}); no second GPU to send to", sizes, samples)


@dataclass(frozen=True)
class AllreduceMeasurement(LinkMeasurement):
    """The all-reduce over ``replicas`` processes: the whole operation's fit (``fitted``), and the per-step ring
    link (``latency_s``, ``bytes_per_s``) that reproduces it in `costmodel.ring_allreduce_seconds`."""

    replicas: int = 2

    def to_dict(self) -> dict:
        """The profile's ``data_parallel_link``: the two numbers the cost model reads, plus how they were found."""
        whole = self.fitted.fit
        return {
            "latency_s": self.latency_s,
            "bytes_per_s": self.bytes_per_s,
            "method": self.method,
            "replicas": self.replicas,
            "allreduce_fit": {"latency_s": whole.latency_s, "bytes_per_s": whole.bytes_per_s},
            **self.fitted.record(self.sizes_bytes, "allreduce"),
        }


def allreduce_from_samples(
    method: str, replicas: int, sizes: Sequence[int], samples: np.ndarray
) -> AllreduceMeasurement:
    """Fit ``samples`` (rounds, sizes) seconds of whole all-reduces over ``replicas`` processes."""
    f = _fit_medians(sizes, samples)
    latency, bandwidth = ring_link_from_allreduce(f.fit.latency_s, f.fit.bytes_per_s, replicas)
    return AllreduceMeasurement(latency, bandwidth, method, [int(s) for s in sizes], f, replicas)


def allreduce_processes(device: str) -> int | None:
    """How many processes the all-reduce is measured with: one per visible GPU on CUDA (None with fewer
    than two: nothing to reduce across), two on a CPU (the smallest ring, one core each; the ring formula
    carries the fitted link to other replica counts)."""
    if device == "cuda":
        count = torch.cuda.device_count()
        return count if count >= 2 else None
    return 2


def measure_allreduce(
    device: str,
    sizes: Sequence[int],
    replicas: int,
    *,
    rounds: int = 5,
    iters: int = 10,
    timeout_s: float = 120.0,
) -> AllreduceMeasurement:
    """Measure and fit the gradient all-reduce over ``replicas`` processes on ``device`` ("cpu" or "cuda")."""
    if replicas < 2:
        raise UserError(f"needs at least 2 processes, got {replicas}", where="all-reduce measurement")
    backend = "nccl" if device == "cuda" else "gloo"
    samples = _run_torchrun(
        backend, {"allreduce": sizes}, nproc=replicas, rounds=rounds, iters=iters, timeout_s=timeout_s
    )
    return _allreduce_of(backend, replicas, sizes, samples["allreduce"])


def _allreduce_of(backend: str, replicas: int, sizes: Sequence[int], samples: np.ndarray) -> AllreduceMeasurement:
    what = f"{replicas} CUDA processes (NCCL)" if backend == "nccl" else f"{replicas} CPU processes (gloo)"
    method = f"torchrun all_reduce of one flat fp32 buffer over {what}, fitted then read as a ring link"
    return allreduce_from_samples(method, replicas, sizes, samples)


def measure_both(
    device: str,
    link_sizes: Sequence[int],
    allreduce_sizes: Sequence[int],
    *,
    rounds: int = 5,
    iters: int = 10,
    timeout_s: float = 120.0,
) -> tuple[LinkMeasurement, AllreduceMeasurement | None]:
    """The stage-to-stage link and the all-reduce, in one torchrun launch where both take the same two processes
    (two CPU processes; a machine with two GPUs): a launch costs seconds of start-up. Elsewhere one each, or none
    for the all-reduce of a single GPU (`allreduce_processes`)."""
    replicas = allreduce_processes(device)
    one_launch = replicas == 2 and (device != "cuda" or torch.cuda.device_count() == 2)
    if not one_launch:
        link = measure_link(device, link_sizes, rounds=rounds, iters=iters, timeout_s=timeout_s)
        if replicas is None:
            return link, None
        return link, measure_allreduce(device, allreduce_sizes, replicas, rounds=rounds, iters=iters)
    backend = "nccl" if device == "cuda" else "gloo"
    ops = {"pingpong": link_sizes, "allreduce": allreduce_sizes}
    samples = _run_torchrun(backend, ops, nproc=2, rounds=rounds, iters=iters, timeout_s=timeout_s)
    return _link_of(backend, link_sizes, samples["pingpong"]), _allreduce_of(
        backend, 2, allreduce_sizes, samples["allreduce"]
    )


def _run_torchrun(
    backend: str, ops: dict[str, Sequence[int]], *, nproc: int, rounds: int, iters: int, timeout_s: float
) -> dict[str, np.ndarray]:
    """Start ``nproc`` workers timing each op of ``ops`` (op -> message sizes) under torchrun (standalone rendezvous
    on this machine), all in one launch, and collect rank 0's times: per op, (rounds, sizes) seconds."""
    with tempfile.TemporaryDirectory(prefix="terapipe-comm-") as tmp:
        out = Path(tmp) / "times.json"
        spec = ";".join(f"{op}:{','.join(str(s) for s in sizes)}" for op, sizes in ops.items())
        args = [
            *rendezvous_args(nproc), "--module", "terapipe_cli.profile.comm", "--worker", "--backend", backend,
            "--ops", spec, "--out", str(out), "--rounds", str(rounds), "--iters", str(iters),
            "--timeout", str(int(timeout_s)),
        ]  # fmt: skip
        # The workers' own distributed timeout goes first, with its clearer message.
        data = run_workers(args, out, limit_s=timeout_s + 30, what="communication measurement", backend=backend)
    return {op: np.asarray(data[op]["seconds"], dtype=float) for op in ops}


def run_workers(args: Sequence[str], out: Path, *, limit_s: float, what: str, backend: str) -> dict:
    """Run torchrun with ``args``, one thread per worker (one core per process, and torchrun stays quiet about
    it), and read the JSON file ``out`` its rank 0 wrote. On gloo the agent runs in a child forked from this
    process and forks its workers (`engine.forking`: no worker imports torch again); on NCCL torchrun is a child
    process starting fresh interpreters. A timeout, a failure or a missing file is one line naming ``what`` and
    the last error line the workers printed."""
    if backend == "gloo":
        with tempfile.TemporaryDirectory(prefix="terapipe-torchrun-") as tmp:
            output = Path(tmp) / "output.txt"
            code = run_agent_in_child(args, output=output, timeout_s=limit_s)
            printed = output.read_text(errors="replace")
    else:
        try:
            proc = run_torchrun(args, threads=1, timeout_s=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        else:
            code, printed = proc.returncode, proc.stderr + proc.stdout
    if code is None:
        raise UserError(f"torchrun did not finish within {limit_s:.0f} s", where=what)
    if code != 0 or not out.exists():
        lines = [ln for ln in printed.splitlines() if ln.strip()]
        cause = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
        raise UserError(f"torchrun failed with exit code {code}: {cause.strip()}", where=what)
    return read_json(out, what=what)


def join_worker_group(backend: str, timeout_s: float):
    """A profile worker's (device, rank): its own GPU on NCCL (chosen before NCCL starts, so its communicator
    binds to the right device), else the CPU; then the process group."""
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device, dist.get_rank()


def _worker(args: argparse.Namespace) -> None:
    """One rank of the measurements, each ``OP:SIZES`` of ``--ops`` in turn in one process group. ``pingpong``: rank
    0 sends, rank 1 echoes, the time kept is half the round trip. ``allreduce``: every rank reduces the buffer.
    Rank 0 writes the times of each, by op."""
    torch.set_num_threads(1)
    dev, rank = join_worker_group(args.backend, args.timeout)
    out = {}
    for spec in args.ops.split(";"):
        op, sizes = spec.split(":")
        sizes = [int(s) for s in sizes.split(",")]
        out[op] = {"sizes_bytes": sizes, "seconds": _time_op(op, sizes, dev, rank, args.rounds, args.iters).tolist()}
    dist.barrier()
    if rank == 0:
        write_json_atomic(args.out, out)
    dist.destroy_process_group()


def _time_op(op: str, sizes: list[int], dev: torch.device, rank: int, rounds: int, iters: int) -> np.ndarray:
    """(rounds, sizes) seconds of ``op`` on every size, rank 0's (the others' are not kept)."""
    once = _pingpong(rank) if op == "pingpong" else lambda buf: dist.all_reduce(buf)
    share = 0.5 if op == "pingpong" else 1.0

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    bufs = {n: torch.zeros(n // 4, dtype=torch.float32, device=dev) for n in sizes}
    # Every rank draws the same order from the same seed, so they always agree on the next message size.
    rng = np.random.default_rng(0)
    seconds = np.zeros((rounds, len(sizes)))
    for r in range(rounds + 1):  # round 0 warms up connections and buffers
        for k in rng.permutation(len(sizes)):
            buf = bufs[sizes[k]]
            dist.barrier()
            times = []
            for _ in range(iters):
                sync()
                t0 = time.perf_counter()
                once(buf)
                sync()
                times.append(time.perf_counter() - t0)
            if r and rank == 0:
                # The median: robust to the odd transfer during which the OS ran something else.
                seconds[r - 1, k] = float(np.median(times)) * share
    return seconds


def _pingpong(rank: int):
    """One round trip between ranks 0 and 1 (rank 0 sends first)."""
    peer = 1 - rank

    def once(buf) -> None:
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return once


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="terapipe communication-measurement worker (started by torchrun)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--ops", required=True, help="OP:SIZES;OP:SIZES with OP pingpong or allreduce, SIZES in bytes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=120)
    _worker(ap.parse_args(argv))


if __name__ == "__main__":
    entry_point(main)
