"""Measure the cost model on the local device (docs/design.md §3) through the runtime's own per-slice code path.

Every time here is a tile run by `terapipe_cli.engine.stage.StageRunner` — the object the training workers
use — on the middle stage of a 3-layer copy of the model, which holds exactly one decoder layer. So the
per-slice overhead the workers pay (the K/V cache, the context mask, the K/V gradient hand-back, autocast,
Python) is in the numbers; on a CPU it is a large part of a small slice's cost.

Precision. Tiles run at the profile's precision (``Settings.precision``: fp32, or bf16/fp16 under autocast),
all inside one ``StageRunner.step()`` as in a training step, so they share one low-precision copy of each
weight; making that copy is paid once per step and is timed with the optimizer step.

A tile (b, i, j) is timed as: forward a context tile of j tokens (token slice 0, untimed), then forward
(timed) and backward (timed) the tile of i tokens as token slice 1, then reset. With j = 0 the tile is token
slice 0 itself, and an untimed forward of another batch slice goes first, as in a pipeline step.

Timing discipline: one thread on CPU (a stage owns one core), timed by default with the process's CPU
clock: time the OS gives to other processes on a shared machine is not the stage's cost (with both cores
of this machine kept busy by others, a tile's wall time tripled while its CPU time moved by 1–4%). CUDA
events after a synchronisation on GPU. A warm-up, then ``repeats`` rounds, each visiting every point in a
fresh random order, so a drift of the machine's speed spreads over all points instead of bending the
curve; the median is kept, with min and max. The Python garbage collector is paused while timing.
"""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from terapipe_cli.config.device import machine_memory_bytes
from terapipe_cli.config.device import resolve_device as device_kind
from terapipe_cli.config.model import ModelConfig
from terapipe_cli.errors import UserError
from terapipe_cli.plan.costmodel import PROFILE_SCHEMA, CostModel, profile_from_dict
from terapipe_cli.profile.fit import RelErr, fit_context
from terapipe_cli.units import utc_timestamp

if TYPE_CHECKING:
    from terapipe_cli.engine.tensor import TensorGroup

# (phase, done, total): work done so far in arbitrary units, for a progress bar with an ETA.
Progress = Callable[[str, float, float], None]

DTYPE_BYTES = 4  # activations and gradients go between stages in fp32 at every precision (docs/design.md §6)
CLOCKS = ("cpu", "wall")
CLOCK_NAMES = {
    "cpu": "process CPU time (time.process_time)",
    "wall": "wall time (time.perf_counter)",
    "cuda-events": "CUDA events after torch.cuda.synchronize",
}


# ----------------------------------------------------------------------------------------------- device


def resolve_device(name: str) -> torch.device:
    """The device to time on (see `terapipe_cli.config.device.resolve_device`), with the current CUDA index."""
    kind = device_kind(name)
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


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
        info["memory_bytes"] = memory  # shared by every worker on the machine (planning.check_memory)
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


# ----------------------------------------------------------------------------------------------- grids


def token_grid(seq_len: int, token_step: int, *, quick: bool = False) -> list[int]:
    """Token lengths to measure: a geometric subset of the multiples of ``token_step``, and ``seq_len``.

    Per-layer time is smooth in the token count (a per-call overhead, then linear and a small quadratic
    attention term), so ~4 points per octave and piecewise-linear interpolation (`costmodel`) reproduce the
    full grid to well within timing noise at a fraction of its cost; ``quick`` keeps one point per octave.
    """
    if token_step < 1:
        raise UserError(f"must be at least 1, got {token_step}", where="--token-step")
    if token_step > seq_len:
        raise UserError(f"{token_step} is longer than the model's sequence length {seq_len}", where="--token-step")
    factors = (1,) if quick else (1, 1.25, 1.5, 1.75)
    steps: set[int] = set()
    octave = 1
    while octave * token_step <= seq_len:
        for f in factors:
            k = int(round(octave * f))
            if k * token_step <= seq_len:
                steps.add(k)
        octave *= 2
    return sorted({k * token_step for k in steps} | {seq_len})


@dataclass(frozen=True)
class Point:
    """One tile to time: b sequences, i new tokens, j context tokens; ``role`` says what it is for."""

    b: int
    i: int
    j: int
    role: str  # "grid" (j = 0, on the token grid), "fit", "heldout" (context points), "check" (off the grids)

    @property
    def work(self) -> float:
        """Rough cost for the progress bar: the context tile's forward, the tile, and a per-call overhead."""
        return self.b * (self.j + 3 * self.i) + 64


def context_points(
    batch_sizes: Sequence[int],
    lengths: Sequence[int],
    seq_len: int,
    token_step: int,
    *,
    fit: int,
    heldout: int,
    seed: int,
) -> list[Point]:
    """Random (b, i, j) with i on the token grid and j a positive multiple of the token step, i + j ≤ L.

    i is drawn from the (geometric) grid, so short slices, where relative errors are largest, are well
    represented; j uniformly over what fits. The first ``fit`` points are for the fit, the rest held out.
    """
    candidates = [
        (b, i, j) for b in batch_sizes for i in lengths for j in range(token_step, seq_len - i + 1, token_step)
    ]
    need = fit + heldout
    if len(candidates) < need:
        raise UserError(
            f"the sequence length {seq_len} leaves only {len(candidates)} distinct context tiles at this token step, "
            f"{need} are needed to fit and check the context term; use a smaller --token-step",
            where="--token-step",
        )
    rng = np.random.default_rng(seed)
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for c in candidates:
        by_length.setdefault(c[1], []).append(c)
    chosen: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int, int]] = set()
    # Draw a length first, then a (b, j) for it: every grid length gets its share of points.
    usable = [n for n in lengths if n in by_length]
    while len(chosen) < need:
        pool = by_length[usable[rng.integers(len(usable))]]
        c = pool[rng.integers(len(pool))]
        if c not in seen:
            seen.add(c)
            chosen.append(c)
    return [Point(b, i, j, "fit" if k < fit else "heldout") for k, (b, i, j) in enumerate(chosen)]


def check_points(
    batch_sizes: Sequence[int], lengths: Sequence[int], seq_len: int, token_step: int, *, count: int, seed: int
) -> list[Point]:
    """Tiles off the measured grid: i between grid lengths, b between batch sizes where there is room.

    They test the profile as the planner uses it — interpolation in i and b plus the context fit — against
    direct timings.
    """
    off_lengths = [n for n in range(token_step, seq_len + 1, token_step) if n not in set(lengths)] or list(lengths)
    between = {(a + c) // 2 for a, c in zip(batch_sizes, batch_sizes[1:], strict=False) if c - a > 1}
    bs = sorted(set(batch_sizes) | between)
    rng = np.random.default_rng(seed + 1)
    out: list[Point] = []
    seen: set[tuple[int, int, int]] = set()
    tries = 0
    while len(out) < count and tries < 100 * count:
        tries += 1
        b = int(bs[len(out) % len(bs)])
        i = int(off_lengths[rng.integers(len(off_lengths))])
        room = (seq_len - i) // token_step
        # One point in every few without context checks the no-context interpolation alone.
        j = 0 if (len(out) % 4 == 3 or room == 0) else token_step * int(rng.integers(1, room + 1))
        if (b, i, j) not in seen:
            seen.add((b, i, j))
            out.append(Point(b, i, j, "check"))
    return out


# ----------------------------------------------------------------------------------------------- timing


class TileTimer:
    """Times tiles of one decoder layer through the runtime's StageRunner."""

    def __init__(
        self,
        model: ModelConfig,
        device: torch.device,
        *,
        seed: int = 0,
        clock: str = "cpu",
        precision: str = "fp32",
        tensor: TensorGroup | None = None,
    ) -> None:
        from terapipe_cli.engine.stage import StageRunner

        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        # On CPU: process CPU time ("cpu") or wall time ("wall"); CUDA is always timed with events.
        self.clock = "cuda-events" if device.type == "cuda" else clock
        self._now = time.process_time if self.clock == "cpu" else time.perf_counter

        # The middle stage of a 3-layer, 3-stage split owns exactly one decoder layer and neither the
        # embedding nor the head: the per-layer cost the planner multiplies by ℓ.
        self.layer_model = replace(model, layers=3)
        self.device = device
        # With ``tensor`` (T > 1) the layer is this rank's shard, and every tile runs the stage's tensor-parallel
        # all-reduces: all T ranks must time the same tiles in the same order (`profile.tensor_parallel`).
        self.runner = StageRunner(
            self.layer_model, stage=1, stages=3, seed=seed, device=device, precision=precision, tensor=tensor
        )
        self.precision = precision
        self.hidden = model.hidden
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        self._inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if device.type == "cuda":
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def _tensors(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An input activation and an output gradient of shape (b, n, H), made once per shape, outside timing."""
        key = (b, n)
        if key not in self._inputs:
            if len(self._inputs) > 64:
                self._inputs.clear()
            x = torch.randn(b, n, self.hidden, generator=self._gen).to(self.device)
            g = torch.randn(b, n, self.hidden, generator=self._gen).mul_(1e-2).to(self.device)
            self._inputs[key] = (x, g)
        return self._inputs[key]

    def time_tile(self, b: int, i: int, j: int) -> tuple[float, float]:
        """Seconds of the forward and of the backward of tile (b, i, j) on one layer."""
        runner = self.runner
        runner.reset()
        token_slice = 0
        x, grad = self._tensors(b, i)
        if j:
            runner.forward_tile(0, 0, self._tensors(b, j)[0])
            token_slice = 1
        else:
            # In a pipeline step forwards run back to back, and the first forward after a backward is slower
            # on a CPU (~0.4 ms on a 1-ms tile: caches, allocator). So every timed forward follows an untimed
            # one: the context tile, or here the same tile of another batch slice.
            runner.forward_tile(1, 0, x)
        if self.device.type == "cuda":
            start, mid, end = self._events
            torch.cuda.synchronize(self.device)
            start.record()
            runner.forward_tile(0, token_slice, x)
            mid.record()
            runner.backward_tile(0, token_slice, grad)
            end.record()
            end.synchronize()
            fwd, bwd = start.elapsed_time(mid) / 1e3, mid.elapsed_time(end) / 1e3
        else:
            now = self._now
            t0 = now()
            runner.forward_tile(0, token_slice, x)
            t1 = now()
            runner.backward_tile(0, token_slice, grad)
            t2 = now()
            fwd, bwd = t1 - t0, t2 - t1
        # The context tile's own backward is not timed; reset() frees its graph, so it is not run at all.
        runner.reset()
        return fwd, bwd

    def optimizer_step_s(self, repeats: int) -> float:
        """Median seconds of one AdamW step (the runtime's optimizer) over one layer's parameters.

        In bf16/fp16 it includes the per-step cost of autocast's low-precision copy of the layer's weight
        matrices, which the next step's first tile makes once for the whole step (see `StageRunner.step`).
        """
        from terapipe_cli.engine.optim import make_optimizer
        from terapipe_cli.engine.stage import AUTOCAST_DTYPES

        module = self.runner.module
        low = AUTOCAST_DTYPES[self.precision]
        matrices = [p for p in module.parameters() if p.dim() >= 2]
        for p in module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # A throw-away copy of the weights: the step must not change the layer that later tiles time.
        saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
        opt = make_optimizer(module, lr=1e-4)
        times = []
        for r in range(repeats + 1):
            self._sync()
            t0 = self._now()
            opt.step()
            copies = [p.detach().to(low) for p in matrices] if low is not None else []
            self._sync()
            del copies
            if r:  # the first step allocates AdamW's state
                times.append(self._now() - t0)
        module.load_state_dict(saved)
        return float(np.median(times))

    def activation_bytes_per_token(self, b: int, i: int) -> tuple[float, str]:
        """Bytes a tile keeps alive from its forward to its backward, per token, on one layer.

        CUDA: the growth of allocated memory across the forward (measured). CPU: the growth of what the runner
        keeps for its backward (`runtime.stage.SavedBytes`: the storages autograd saves, the tile's input and
        output, the K/V cache), counted exactly. Another batch slice's forward runs first, as in a step; what
        both tiles share (the step's low-precision weight copies, when called inside `StageRunner.step`) is not
        counted. The batch slice's K/V cache holds the whole sequence's rows; only the tile's own i rows of it
        are counted.
        """
        runner = self.runner
        runner.reset()
        x, grad = self._tensors(b, i)
        cuda = self.device.type == "cuda"
        runner.forward_tile(1, 0, x)
        self._sync()
        before = torch.cuda.memory_allocated(self.device) if cuda else runner.saved.alive
        runner.forward_tile(0, 0, x)
        self._sync()
        after = torch.cuda.memory_allocated(self.device) if cuda else runner.saved.alive
        held = after - before - self._later_kv_rows_bytes(b, i)
        what = "CUDA allocated memory" if cuda else "the storages the runner keeps for the backward (counted)"
        runner.backward_tile(0, 0, grad)
        runner.reset()
        return held / (b * i), f"measured: the growth of {what} across one tile's forward, less later K/V rows"

    def _later_kv_rows_bytes(self, b: int, i: int) -> int:
        """Bytes of the K/V cache rows past a first tile of i tokens: its first tile allocates keys and values
        of shape (b, heads, L, head_dim) in the compute type (docs/design.md §6)."""
        from terapipe_cli.engine.stage import AUTOCAST_DTYPES

        low = AUTOCAST_DTYPES[self.precision]
        element = torch.empty(0, dtype=low or torch.float32).element_size()
        return 2 * b * (self.layer_model.seq_len - i) * self.hidden * element

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class Timings:
    """Per point: the forward and backward samples of every visit over the repeat rounds."""

    points: list[Point]
    forward: list[list[float]]  # [point][visit] seconds
    backward: list[list[float]]

    def stats(self, which: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Median, min and max per point of "forward", "backward" or "total"."""
        if which == "total":
            samples = [np.add(f, b) for f, b in zip(self.forward, self.backward, strict=True)]
        else:
            samples = [np.asarray(s) for s in {"forward": self.forward, "backward": self.backward}[which]]
        return (
            np.array([np.median(s) for s in samples]),
            np.array([s.min() for s in samples]),
            np.array([s.max() for s in samples]),
        )

    def by_point(self, which: str, stat: int = 0) -> dict[Point, float]:
        """One statistic per point (0 median, 1 min, 2 max) of "forward", "backward" or "total"."""
        values = self.stats(which)[stat]
        return {p: values[k] for k, p in enumerate(self.points)}

    def rows(self) -> list[dict]:
        """Per point, in order: b, i, j, the median forward and backward seconds and the min and max of their
        sum: what a profile records of a timed tile, and what `check_against` compares."""
        fwd, bwd = self.stats("forward")[0], self.stats("backward")[0]
        lo, hi = self.stats("total")[1:]
        return [
            {
                "b": p.b,
                "i": p.i,
                "j": p.j,
                "forward_s": float(fwd[k]),
                "backward_s": float(bwd[k]),
                "total_min_s": float(lo[k]),
                "total_max_s": float(hi[k]),
            }
            for k, p in enumerate(self.points)
        ]


def visits_per_round(points: Sequence[Point], most: int = 4) -> list[int]:
    """Cheap tiles are visited up to ``most`` times per round: their relative noise is the largest and
    extra samples of them cost little (a 16th of the largest tile buys the smallest ones four visits)."""
    ref = max(p.work for p in points) / 16
    return [int(min(most, max(1, ref // p.work))) for p in points]


def time_points(
    timer: TileTimer,
    points: Sequence[Point],
    *,
    repeats: int,
    warmup_all: bool,
    seed: int,
    progress: Progress | None = None,
    phase: str = "timing tiles",
) -> Timings:
    """Warm up, then ``repeats`` rounds over all points, each round in a fresh random order.

    ``warmup_all``: warm up on every point (first-call costs per shape: allocator, kernels, masks) instead
    of on one small and one large tile per batch size.
    """
    points = list(points)
    rng = np.random.default_rng(seed)
    if warmup_all:
        warm = points
    else:
        warm = []
        for b in sorted({p.b for p in points}):
            mine = [p for p in points if p.b == b]
            warm += [min(mine, key=lambda p: p.work), max(mine, key=lambda p: p.work)]
    visits = visits_per_round(points)
    order = np.repeat(np.arange(len(points)), visits)
    total = sum(p.work for p in warm) + repeats * sum(p.work * v for p, v in zip(points, visits, strict=True))
    done = 0.0
    fwd: list[list[float]] = [[] for _ in points]
    bwd: list[list[float]] = [[] for _ in points]
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for p in warm:
            timer.time_tile(p.b, p.i, p.j)
            done += p.work
            if progress:
                progress(f"{phase} (warm-up)", done, total)
        for r in range(repeats):
            for k in rng.permutation(order):
                p = points[k]
                f, b = timer.time_tile(p.b, p.i, p.j)
                fwd[k].append(f)
                bwd[k].append(b)
                done += p.work
                if progress:
                    progress(f"{phase} (round {r + 1}/{repeats})", done, total)
            gc.collect()  # between rounds, outside any timed region
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timings(points, fwd, bwd)


# ----------------------------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class Tiles:
    """The tiles one profile times. They share the same rounds, so a drift of the machine hits them alike."""

    grid: list[Point]  # j = 0 on the token grid: the no-context tables
    context: list[Point]  # random (b, i, j): the context term's fit and held-out points
    check: list[Point]  # off the grids, with --check; else empty

    @property
    def all(self) -> list[Point]:
        return self.grid + self.context + self.check


@dataclass(frozen=True)
class Settings:
    """What to measure. `Settings.make` builds it from the command's options; ``quick`` picks the coarse
    preset (`_QUICK`) instead of the default one (`_DEFAULT`)."""

    batch_sizes: tuple[int, ...]
    token_step: int
    token_lengths: tuple[int, ...]
    repeats: int
    warmup_all: bool
    fit_points: int
    heldout_points: int
    check_points: int  # 0: no check
    comm_sizes: int
    comm_rounds: int
    comm_iters: int
    seed: int = 0
    quick: bool = False
    clock: str = "cpu"
    precision: str = "fp32"  # one of `terapipe_cli.config.device.PRECISIONS`, already resolved for the device

    @staticmethod
    def make(
        model: ModelConfig,
        batch_sizes: Sequence[int],
        token_step: int,
        *,
        quick: bool,
        check: bool,
        seed: int = 0,
        clock: str = "cpu",
        precision: str = "fp32",
    ) -> Settings:
        bs = tuple(sorted(set(batch_sizes)))
        if not bs or bs[0] < 1:
            raise UserError(f"must be positive integers, got {list(batch_sizes)}", where="--batch-sizes")
        if clock not in CLOCKS:
            raise UserError(f"must be one of {', '.join(CLOCKS)}, got {clock!r}", where="--clock")
        lengths = tuple(token_grid(model.seq_len, token_step, quick=quick))
        L = model.seq_len
        if L % token_step:  # before anything is timed: a plan cuts the sequence into multiples of the token step
            near = max(d for d in range(1, token_step + 1) if L % d == 0)
            raise UserError(
                f"the model's sequence length {L} is not a multiple of {token_step}, so no plan could use this "
                f"profile; take a divisor of {L} (e.g. {near})",
                where="--token-step",
            )
        preset = _QUICK if quick else _DEFAULT
        check_count = preset["fit_points"] // 4 if check else 0
        settings = Settings(
            bs,
            token_step,
            lengths,
            **preset,
            check_points=check_count,
            seed=seed,
            quick=quick,
            clock=clock,
            precision=precision,
        )
        # Fail now, not after the grid was timed, if the sequence is too short for the context points.
        settings.context_tiles(model.seq_len)
        return settings

    def context_tiles(self, seq_len: int) -> list[Point]:
        return context_points(
            self.batch_sizes,
            self.token_lengths,
            seq_len,
            self.token_step,
            fit=self.fit_points,
            heldout=self.heldout_points,
            seed=self.seed,
        )

    def tiles(self, seq_len: int) -> Tiles:
        grid = [Point(b, n, 0, "grid") for b in self.batch_sizes for n in self.token_lengths]
        check = (
            check_points(
                self.batch_sizes, self.token_lengths, seq_len, self.token_step, count=self.check_points, seed=self.seed
            )
            if self.check_points
            else []
        )
        return Tiles(grid, self.context_tiles(seq_len), check)


# Sized so that the tiny model (H = 256, L = 1024) takes under 30 s (quick) and 3 minutes (default) on a
# 2-core CPU, including torchrun's start-up (~10 s) for the link.
_QUICK = dict(repeats=3, warmup_all=False, fit_points=16, heldout_points=8, comm_sizes=5, comm_rounds=2, comm_iters=5)
_DEFAULT = dict(repeats=5, warmup_all=True, fit_points=48, heldout_points=16, comm_sizes=8, comm_rounds=4, comm_iters=8)


@contextmanager
def _one_thread_per_stage(device: torch.device) -> Iterator[None]:
    """On a CPU, time with one thread (a pipeline stage owns one core); the caller's count comes back after."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_profile(
    model: ModelConfig,
    settings: Settings,
    device: torch.device,
    *,
    progress: Progress | None = None,
    measure_comm: bool = True,
    measure_allreduce: bool = True,
    tensor_parallel: int = 1,
) -> dict:
    """Measure everything and return a ``terapipe.profile/1`` dict (validated before it is returned).
    ``measure_comm`` / ``measure_allreduce`` False: skip the stage-to-stage link (recorded as free) / the
    data-parallel all-reduce (no ``data_parallel_link``: plans with replicas leave it unpriced).
    ``tensor_parallel`` T > 1: the layer is timed as one of a stage's T tensor ranks, by T torchrun processes
    (`profile.tensor_parallel`); the rest is measured here, as for T = 1."""
    from terapipe_cli.profile.tensor_parallel import time_layer_tensor_parallel

    check_fits_in_memory(model, max(settings.batch_sizes), device)
    started = time.perf_counter()
    tiles = settings.tiles(model.seq_len)
    if tensor_parallel > 1:
        timings, layer = time_layer_tensor_parallel(model, settings, tiles, device, tensor_parallel, progress)
    else:
        timings, layer = time_layer(model, settings, tiles, device, progress)
    tables = _grid_tables(timings, settings)
    context = {which: _context_fit(timings, tiles, which) for which in ("forward", "backward")}
    comm = _link(model, settings, device, progress) if measure_comm else dict(_FREE_LINK)
    params = layer["params"]  # one tensor rank's share with T > 1: what each device all-reduces over replicas
    dp_link = (
        _allreduce(model, params, settings, device, progress)
        if measure_allreduce
        else {"data_parallel_link_skipped": "not measured (--no-allreduce)"}
    )
    rows = dict(zip(timings.points, timings.rows(), strict=True))
    profile = {
        "schema": PROFILE_SCHEMA,
        "source": "measured",
        "note": (
            f"Measured by `terapipe profile{' --quick' if settings.quick else ''}` through the runtime's StageRunner "
            f"(one decoder layer{_tensor_note(tensor_parallel)}) in {settings.precision}, median of "
            f"{settings.repeats} interleaved rounds. token_lengths is a geometric subset of the multiples of "
            "token_step; the cost model interpolates between them piecewise-linearly."
        ),
        "created": utc_timestamp(),
        "device": dict(device_info(device), clock=CLOCK_NAMES[layer["clock"]], tensor_parallel=tensor_parallel),
        "model": model.to_dict(),
        "precision": settings.precision,
        "dtype_bytes": DTYPE_BYTES,
        "token_step": settings.token_step,
        "batch_sizes": list(settings.batch_sizes),
        "token_lengths": list(settings.token_lengths),
        "forward_s": tables["forward_s"],
        "backward_s": tables["backward_s"],
        "context": context,
        "comm": comm,
        "optimizer_s_per_layer": layer["optimizer_s"],
        "activation_bytes_per_token_per_layer": layer["activation_bytes"],
        "params_per_layer": params,
        **dp_link,
        "grid": {
            "kind": "quick" if settings.quick else "default",
            "interpolation": "piecewise-linear in tokens, then in batch size (terapipe_cli.plan.costmodel)",
            "repeats": settings.repeats,
            **{f"{w}_{s}_s": tables[f"{w}_{s}_s"] for w in ("forward", "backward") for s in ("min", "max")},
        },
        "context_points": [dict(rows[p], role=p.role) for p in tiles.context],
        "activation_method": layer["activation_method"],
        "seconds_to_measure": round(time.perf_counter() - started, 1),
    }
    profile_from_dict(profile, "measured profile")  # the one validating reader accepts what we write
    if tiles.check:
        profile["check"] = check_against(profile, [rows[p] for p in tiles.check])
    return profile


def _tensor_note(tensor_parallel: int) -> str:
    if tensor_parallel == 1:
        return ""
    return f" as one of {tensor_parallel} tensor ranks: rank 0's times of {tensor_parallel} torchrun processes"


def time_layer(
    model: ModelConfig,
    settings: Settings,
    tiles: Tiles,
    device: torch.device,
    progress: Progress | None,
    tensor: TensorGroup | None = None,
) -> tuple[Timings, dict]:
    """Time all tiles in shared rounds, then one layer's optimizer step and the activations a tile keeps.
    ``layer``: optimizer_s, activation_bytes, activation_method, params (of this process's layer: one tensor
    rank's shard with ``tensor``) and clock. With ``tensor`` every rank of the group must call this alike."""
    with _one_thread_per_stage(device):
        timer = TileTimer(
            model, device, seed=settings.seed, clock=settings.clock, precision=settings.precision, tensor=tensor
        )
        act_i = min(model.seq_len, 256)
        with timer.runner.step():  # as in a training step: the tiles share one low-precision copy of each weight
            timings = time_points(
                timer,
                tiles.all,
                repeats=settings.repeats,
                warmup_all=settings.warmup_all,
                seed=settings.seed,
                progress=progress,
            )
            if progress:
                progress("optimizer step and activation memory", 0, 1)
            act_bytes, act_method = timer.activation_bytes_per_token(1, act_i)
        optimizer_s = timer.optimizer_step_s(repeats=5 if settings.quick else 20)
        if progress:
            progress("optimizer step and activation memory", 1, 1)
    layer = {
        "optimizer_s": optimizer_s,
        "activation_bytes": act_bytes,
        "activation_method": f"{act_method}, at b = 1, i = {act_i}",
        "params": sum(p.numel() for p in timer.runner.module.parameters()),
        "clock": timer.clock,
    }
    return timings, layer


def _grid_tables(timings: Timings, settings: Settings) -> dict[str, list[list[float]]]:
    """The no-context tables [batch size][token length]: ``forward_s``/``backward_s`` (medians) and their
    ``_min_s`` and ``_max_s``."""
    tables = {}
    for which in ("forward", "backward"):
        for stat, suffix in enumerate(("s", "min_s", "max_s")):
            value = timings.by_point(which, stat)
            tables[f"{which}_{suffix}"] = [
                [float(value[Point(b, n, 0, "grid")]) for n in settings.token_lengths] for b in settings.batch_sizes
            ]
    return tables


def _context_fit(timings: Timings, tiles: Tiles, which: str) -> dict:
    """Fit the context term of the ``which`` ("forward" or "backward") pass and report it on held-out tiles."""
    median = timings.by_point(which)
    t_nc = {(p.b, p.i): median[p] for p in tiles.grid}
    fit_pts = [p for p in tiles.context if p.role == "fit"]
    held = [p for p in tiles.context if p.role == "heldout"]
    b, i, j = (np.array([getattr(p, a) for p in fit_pts], dtype=float) for a in "bij")
    fit = fit_context(b, i, j, [t_nc[(p.b, p.i)] for p in fit_pts], np.array([median[p] for p in fit_pts]))
    held_err = _fit_report(fit, held, t_nc, np.array([median[p] for p in held]))
    return {
        "coef": list(fit.coef),
        # Relative error of the predicted per-layer tile time t_nc + t_ctx on the held-out tiles: the
        # quantity the planner adds up. The context term alone, a difference of two timings, is below.
        "heldout_rel_err_mean": held_err["tile"].mean,
        "heldout_rel_err_max": held_err["tile"].max,
        "heldout_points": held_err["tile"].count,
        "heldout_context_only_rel_err_mean": held_err["context_only"].mean,
        "heldout_context_only_rel_err_max": held_err["context_only"].max,
        "fit_rel_err_mean": fit.fit_err.mean,
        "fit_rel_err_max": fit.fit_err.max,
        "fit_points": fit.fit_err.count,
    }


def _fit_report(fit, pts: list[Point], t_nc: dict, t: np.ndarray) -> dict:
    b, i, j = (np.array([getattr(p, a) for p in pts], dtype=float) for a in "bij")
    nc = np.array([t_nc[(p.b, p.i)] for p in pts])
    return {"tile": fit.errors(b, i, j, nc, t), "context_only": fit.context_errors(b, i, j, nc, t)}


# What the profile records with --no-comm: the planner then prices the link as free.
_FREE_LINK = {"latency_s": 0.0, "bytes_per_s": 1e12, "method": "not measured (--no-comm): a free link"}


def _link(model: ModelConfig, settings: Settings, device: torch.device, progress: Progress | None) -> dict:
    """Measure the stage-to-stage link with messages from the smallest to the largest tile's activation."""
    from terapipe_cli.profile.comm import measure_link, message_sizes

    if progress:
        progress("point-to-point link (torchrun)", 0, 1)
    H = model.hidden
    smallest = min(settings.batch_sizes) * settings.token_lengths[0] * H * DTYPE_BYTES
    largest = max(settings.batch_sizes) * model.seq_len * H * DTYPE_BYTES
    sizes = message_sizes(smallest, largest, settings.comm_sizes)
    comm = measure_link(device.type, sizes, rounds=settings.comm_rounds, iters=settings.comm_iters).to_dict()
    if progress:
        progress("point-to-point link (torchrun)", 1, 1)
    return comm


def _allreduce(
    model: ModelConfig, params_per_layer: int, settings: Settings, device: torch.device, progress: Progress | None
) -> dict:
    """The profile's ``data_parallel_link``, measured as the all-reduce of fp32 gradient buffers from a
    sixteenth of one layer's to the whole model's; or ``data_parallel_link_skipped`` with the reason when this
    machine has nothing to reduce across (one GPU)."""
    from terapipe_cli.profile.comm import allreduce_processes, measure_allreduce, message_sizes

    replicas = allreduce_processes(device.type)
    if replicas is None:
        return {"data_parallel_link_skipped": "not measured: one GPU, no second device to reduce with"}
    phase = f"gradient all-reduce over {replicas} processes (torchrun)"
    if progress:
        progress(phase, 0, 1)
    layer_bytes = params_per_layer * DTYPE_BYTES
    sizes = message_sizes(layer_bytes // 16, model.layers * layer_bytes, settings.comm_sizes)
    link = measure_allreduce(
        device.type, sizes, replicas, rounds=settings.comm_rounds, iters=settings.comm_iters
    ).to_dict()
    if progress:
        progress(phase, 1, 1)
    return {"data_parallel_link": link}


# ----------------------------------------------------------------------------------------------- check


def check_against(profile: dict, measured: list[dict]) -> dict:
    """Compare the profile's tile cost with direct timings of tiles off its grids.

    The prediction is `CostModel` for a stage of one layer (stages = layers) minus the link, which a
    single-process timing does not include: ``cost(b, i, j) − comm(b, i)``.
    """
    prof = profile_from_dict(profile, "profile")
    cost = CostModel(prof, stages=prof.model.layers)
    rows = []
    for m in measured:
        predicted = float(cost(m["b"], m["i"], m["j"]) - cost.comm(m["b"], m["i"]))
        total = m["forward_s"] + m["backward_s"]
        rows.append(dict(m, measured_s=total, predicted_s=predicted, rel_err=abs(predicted - total) / total))
    err = RelErr.of([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    return {"points": rows, "rel_err_mean": err.mean, "rel_err_max": err.max}


def recheck_profile(
    profile: dict,
    device: torch.device,
    *,
    count: int,
    repeats: int,
    seed: int = 0,
    clock: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """Time ``count`` off-grid tiles now, on this device and at the profile's precision, and compare them with
    an existing profile.

    A few tiles ON the profile's grid are timed in the same rounds as a reference: their ratio to the
    profiled times is the machine's speed drift since the profile was taken (a shared CPU can be 10%
    slower minutes later), reported next to the check so that drift is not mistaken for model error.
    ``clock``: None uses the clock the profile was measured with.
    """
    prof = profile_from_dict(profile, "profile")
    model = prof.model
    if clock is None:
        clock = "wall" if prof.device.get("clock") == CLOCK_NAMES["wall"] else "cpu"
    pts = check_points(prof.batch_sizes, prof.token_lengths, model.seq_len, prof.token_step, count=count, seed=seed)
    lengths = prof.token_lengths
    refs = list(
        dict.fromkeys(
            Point(b, lengths[(k * (len(lengths) - 1)) // 3], 0, "reference")
            for b in prof.batch_sizes
            for k in (1, 2, 3)
        )
    )
    with _one_thread_per_stage(device):
        timer = TileTimer(model, device, seed=seed, clock=clock, precision=prof.precision)
        with timer.runner.step():
            timings = time_points(
                timer,
                pts + refs,
                repeats=repeats,
                warmup_all=True,
                seed=seed,
                progress=progress,
                phase="timing check tiles",
            )
    measured = timings.rows()
    result = check_against(profile, measured[: len(pts)])
    ref = check_against(profile, measured[len(pts) :])
    drift = float(np.median([r["measured_s"] / r["predicted_s"] for r in ref["points"]]))
    result["reference"] = {"points": ref["points"], "speed_ratio": drift}
    # The same check with the drift divided out: what remains is the cost model's own error.
    adjusted = RelErr.of(
        [r["predicted_s"] * drift for r in result["points"]], [r["measured_s"] for r in result["points"]]
    )
    result["drift_adjusted_rel_err_mean"] = adjusted.mean
    result["drift_adjusted_rel_err_max"] = adjusted.max
    return result
