"""Point-to-point link between two pipeline stages: latency + bytes / bandwidth (docs/design.md §3, comm(b, i)).

Two processes are started by torchrun (``torch.distributed.run``, run through `terapipe_cli.runtime.launch`)
— gloo on CPU, NCCL when two GPUs are present — and play ping-pong with messages of the sizes a tile's
activation takes. Rank 0 times round trips and writes the one-way times to a JSON file; `measure_link` fits
``latency_s + bytes / bytes_per_s`` to them (`fit.fit_link`). With a single GPU there is no second device to
send to: we then time a device-to-device copy on that GPU, which is what moving a tile between two stages
sharing it costs, and record that this is what was measured.

This module is also the worker: ``python -m terapipe_cli.profile.comm --worker ...`` (started by torchrun).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from terapipe_cli.errors import UserError
from terapipe_cli.files import read_json, write_json_atomic
from terapipe_cli.profile.fit import fit_link
from terapipe_cli.runtime.launch import rendezvous_args, run_torchrun


@dataclass(frozen=True)
class LinkMeasurement:
    """The fitted link and the raw medians it was fitted to."""

    latency_s: float
    bytes_per_s: float
    method: str
    sizes_bytes: list[int]
    median_s: list[float]
    min_s: list[float]
    max_s: list[float]
    fit_rel_err_mean: float
    fit_rel_err_max: float

    def to_dict(self) -> dict:
        """The profile's ``comm`` object: the two numbers the cost model reads, plus how they were obtained."""
        return {
            "latency_s": self.latency_s,
            "bytes_per_s": self.bytes_per_s,
            "method": self.method,
            "sizes_bytes": self.sizes_bytes,
            "one_way_s_median": self.median_s,
            "one_way_s_min": self.min_s,
            "one_way_s_max": self.max_s,
            "fit_rel_err_mean": self.fit_rel_err_mean,
            "fit_rel_err_max": self.fit_rel_err_max,
        }


def message_sizes(smallest: int, largest: int, count: int) -> list[int]:
    """``count`` sizes spaced evenly in log between the smallest and largest tile message (bytes, 4-aligned)."""
    smallest, largest = max(4, smallest), max(4, largest)
    if largest <= smallest:
        largest = smallest * 16  # the fit needs a spread of sizes to separate latency from bandwidth
    sizes = np.unique(np.round(np.geomspace(smallest, largest, max(count, 2)) / 4).astype(np.int64) * 4)
    return [int(s) for s in sizes]


def _summarise(method: str, sizes: Sequence[int], samples: np.ndarray) -> LinkMeasurement:
    """``samples``: (rounds, sizes) one-way seconds. The fit is to the per-size medians: a shared CPU
    preempts a ping-pong now and then for milliseconds, and one such sample would bend a fit to all of them."""
    med = np.median(samples, axis=0)
    fit = fit_link(np.asarray(sizes, dtype=float), med)
    err = np.abs(fit(np.asarray(sizes, dtype=float)) - med) / med
    return LinkMeasurement(
        latency_s=fit.latency_s,
        bytes_per_s=fit.bytes_per_s,
        method=method,
        sizes_bytes=[int(s) for s in sizes],
        median_s=[float(x) for x in med],
        min_s=[float(x) for x in samples.min(axis=0)],
        max_s=[float(x) for x in samples.max(axis=0)],
        fit_rel_err_mean=float(err.mean()),
        fit_rel_err_max=float(err.max()),
    )


def measure_link(
    device: str,
    sizes: Sequence[int],
    *,
    rounds: int = 5,
    iters: int = 10,
    timeout_s: float = 120.0,
) -> LinkMeasurement:
    """Measure and fit the stage-to-stage link for ``device`` ("cpu" or "cuda")."""
    import torch

    if device == "cuda" and torch.cuda.device_count() < 2:
        return _measure_copy_one_gpu(sizes, rounds=rounds, iters=iters)
    backend = "nccl" if device == "cuda" else "gloo"
    samples = _run_torchrun(backend, sizes, rounds=rounds, iters=iters, timeout_s=timeout_s)
    what = "two CUDA processes (NCCL)" if backend == "nccl" else "two CPU processes (gloo)"
    return _summarise(f"torchrun ping-pong between {what}, one-way = round trip / 2", sizes, samples)


def _measure_copy_one_gpu(sizes: Sequence[int], *, rounds: int, iters: int) -> LinkMeasurement:
    import torch

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


def _run_torchrun(backend: str, sizes: Sequence[int], *, rounds: int, iters: int, timeout_s: float) -> np.ndarray:
    """Start two workers under torchrun (standalone rendezvous on this machine) and collect rank 0's times."""
    where = "communication measurement"
    limit_s = timeout_s + 30  # the workers' own distributed timeout goes first, with its clearer message
    with tempfile.TemporaryDirectory(prefix="terapipe-comm-") as tmp:
        out = Path(tmp) / "link.json"
        args = [
            *rendezvous_args(2), "--module", "terapipe_cli.profile.comm", "--worker", "--backend", backend,
            "--out", str(out), "--sizes", ",".join(str(s) for s in sizes), "--rounds", str(rounds),
            "--iters", str(iters), "--timeout", str(int(timeout_s)),
        ]  # fmt: skip
        try:
            # One thread per worker: one core per stage, and torchrun stays quiet about it.
            proc = run_torchrun(args, threads=1, timeout_s=limit_s)
        except subprocess.TimeoutExpired:
            raise UserError(f"torchrun did not finish within {limit_s:.0f} s", where=where) from None
        if proc.returncode != 0 or not out.exists():
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            cause = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
            raise UserError(f"torchrun failed with exit code {proc.returncode}: {cause.strip()}", where=where)
        data = read_json(out, what="link measurement")
    return np.asarray(data["one_way_s"], dtype=float)


def _worker(args: argparse.Namespace) -> None:
    """One of two ping-pong ranks. Rank 0 sends, rank 1 echoes; rank 0 writes the one-way times."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.backend == "nccl":
        # Pick this rank's GPU before NCCL starts, so its communicator binds to the right device.
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    peer = 1 - rank

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    bufs = {n: torch.zeros(n // 4, dtype=torch.float32, device=dev) for n in sizes}
    # Both ranks draw the same order from the same seed, so they always agree on the next message size.
    rng = np.random.default_rng(0)
    one_way = np.zeros((args.rounds, len(sizes)))
    for r in range(args.rounds + 1):  # round 0 warms up connections and buffers
        for k in rng.permutation(len(sizes)):
            buf = bufs[sizes[k]]
            dist.barrier()
            round_trips = []
            for _ in range(args.iters):
                sync()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                sync()
                round_trips.append(time.perf_counter() - t0)
            if r and rank == 0:
                # The median round trip: robust to the odd trip on which the OS ran something else.
                one_way[r - 1, k] = float(np.median(round_trips)) / 2
    dist.barrier()
    if rank == 0:
        write_json_atomic(args.out, {"sizes_bytes": sizes, "one_way_s": one_way.tolist()})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="terapipe link-measurement worker (started by torchrun)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=120)
    _worker(ap.parse_args(argv))


if __name__ == "__main__":
    main()
