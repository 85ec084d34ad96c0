"""Timing a decoder layer as one of a stage's T tensor ranks (`terapipe profile --tensor-parallel T`).

With T > 1 a stage is T processes, each holding its share of the heads and MLP columns, with two all-reduces
forward and two backward per layer and tile (`engine.tensor`). A tile's cost is then that of a rank *inside*
its group — its own share of the work plus the waits in those all-reduces — so it is timed that way: torchrun
starts T processes (gloo on CPU, one thread each; NCCL on CUDA, one GPU each), each builds the `TileTimer` over a
tensor-parallel `StageRunner` and runs `measure.time_layer` with the identical tile list, seed, warm-up and
visit order, so the ranks stay in lockstep through every all-reduce. An untimed forward (the tile's context, or
another batch slice's tile) runs before every timed one, as in a pipeline step, and its all-reduces line the
ranks up again before the clock starts. The clock is wall time on CPU: process CPU time would not see the
waits inside the all-reduces. Then the pipeline's ends, split by vocabulary rows as the runtime runs them
(`ends.time_ends` with the same group). Rank 0 writes its samples, its layer's numbers (parameters of its shard,
optimizer step, activation bytes) and its ends to a JSON file; the parent assembles the profile as for T = 1
(`measure.measure_profile`).

Progress: rank 0 appends ``{"phase", "done", "total"}`` lines to a file, which a thread of the parent passes on to
the progress bar while torchrun runs.

This module is also the worker: ``python -m terapipe_cli.profile.tensor_parallel --worker ...`` (started by
torchrun).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from terapipe_cli.ending import entry_point
from terapipe_cli.engine.comm import DistGroup
from terapipe_cli.engine.forking import import_what_a_backward_loads
from terapipe_cli.engine.hostmem import retain_freed_memory
from terapipe_cli.engine.tensor import TensorGroup
from terapipe_cli.engine.torchrun import polling, rendezvous_args
from terapipe_cli.files import read_json, write_json_atomic
from terapipe_cli.models import ModelConfig
from terapipe_cli.profile.comm import join_worker_group, run_workers
from terapipe_cli.profile.ends import time_ends
from terapipe_cli.profile.tiles import Point, Settings, Tiles
from terapipe_cli.profile.timer import Progress, Timings, time_layer

WORKER_MODULE = "terapipe_cli.profile.tensor_parallel"
COLLECTIVE_TIMEOUT_S = 300  # a rank that hangs stops the others within this (their all-reduce times out)
LIMIT_S = 24 * 3600  # the whole timing: a hang is caught by the collectives' timeout long before


def time_layer_tensor_parallel(
    model: ModelConfig,
    settings: Settings,
    tiles: Tiles,
    device: torch.device,
    tensor_parallel: int,
    progress: Progress | None = None,
) -> tuple[Timings, dict, dict]:
    """`measure.time_layer`'s result and `ends.time_ends`', timed by rank 0 of ``tensor_parallel`` torchrun
    processes."""

    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="terapipe-tp-") as tmp:
        folder = Path(tmp)
        request, out, lines = folder / "request.json", folder / "timings.json", folder / "progress.jsonl"
        write_json_atomic(request, {"model": model.to_dict(), "settings": asdict(settings)})
        args = [
            *rendezvous_args(tensor_parallel), "--module", WORKER_MODULE, "--worker", "--request", str(request),
            "--backend", backend, "--out", str(out), "--progress", str(lines), "--timeout", str(COLLECTIVE_TIMEOUT_S),
        ]  # fmt: skip
        if backend == "gloo":  # the ranks are forked from this process (`comm.run_workers`)
            import_what_a_backward_loads()
        with _relay_progress(lines, progress, f"starting {tensor_parallel} tensor ranks (torchrun, {backend})"):
            data = run_workers(args, out, limit_s=LIMIT_S, what="tensor-parallel tile timing", backend=backend)
    points = [Point(**p) for p in data["points"]]
    if points != tiles.all:
        raise RuntimeError("the tensor-parallel workers timed other tiles than the ones asked for")
    timings = Timings(points, data["forward"], data["backward"], data["input"], data["weight"])
    return timings, data["layer"], data["ends"]


@contextmanager
def _relay_progress(path: Path, progress: Progress | None, start: str) -> Iterator[None]:
    """While the body runs, a thread passes the progress lines rank 0 appends to ``path`` on to ``progress``;
    the phase ``start`` (torchrun starting the ranks) is done when the first line comes."""
    if progress is None:
        yield
        return
    progress(start, 0, 1)
    offset = [0]

    def pass_on() -> None:
        before, offset[0] = offset[0], _pass_on(path, offset[0], progress)
        if before == 0 and offset[0] > 0:
            progress(start, 1, 1)

    with polling(pass_on):
        yield


def _pass_on(path: Path, offset: int, progress: Progress) -> int:
    """Call ``progress`` for every whole line after byte ``offset``; the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    whole = chunk[: chunk.rfind(b"\n") + 1]
    for line in whole.splitlines():
        entry = json.loads(line)
        progress(entry["phase"], entry["done"], entry["total"])
    return offset + len(whole)


class _ProgressFile:
    """Rank 0's progress callback: one JSON line per update, at most every 0.2 s within a phase."""

    def __init__(self, path: str) -> None:
        self.path, self.phase, self.last = path, None, 0.0

    def __call__(self, phase: str, done: float, total: float) -> None:
        now = time.monotonic()
        if phase == self.phase and now - self.last < 0.2 and done < total:
            return
        self.phase, self.last = phase, now
        with open(self.path, "a") as f:
            f.write(json.dumps({"phase": phase, "done": done, "total": total}) + "\n")


def _worker(args: argparse.Namespace) -> None:
    """One tensor rank: the same `time_layer` and `time_ends` as every other rank; rank 0 writes the result."""

    request = read_json(args.request, what="tensor-parallel timing request")
    model = ModelConfig.from_dict(request["model"], args.request)
    settings = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in request["settings"].items()})
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 sets a fresh worker's (`comm.run_workers`)
    device, rank = join_worker_group(args.backend, args.timeout)
    retain_freed_memory()  # the allocator training's workers use (engine/hostmem.py)
    tensor = TensorGroup(rank, dist.get_world_size(), DistGroup(dist.group.WORLD))
    progress = _ProgressFile(args.progress) if rank == 0 else None
    timings, layer = time_layer(model, settings, settings.tiles(model.seq_len), device, progress, tensor=tensor)
    ends = time_ends(model, settings, device, progress, tensor=tensor)
    dist.barrier()
    if rank == 0:
        result = {"points": [asdict(p) for p in timings.points], "forward": timings.forward}
        result.update(backward=timings.backward, input=timings.input, weight=timings.weight)
        write_json_atomic(args.out, dict(result, layer=layer, ends=ends))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="terapipe tensor-parallel tile-timing worker (started by torchrun)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--request", required=True)
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--timeout", type=int, default=COLLECTIVE_TIMEOUT_S)
    _worker(ap.parse_args(argv))


if __name__ == "__main__":
    entry_point(main)
