"""Timing tiles through the runtime's own per-slice code path (docs/design.md §3): `TileTimer`, the rounds of
`time_points`, and one layer's whole timing (`time_layer`).

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

The split backward (schema /2's I and W, docs/design.md §11b): on the tiles without context (the grid), that other
batch slice's tile — the same (b, i) — then runs its backward as the zero-bubble executor runs it, I
(`StageRunner.backward_input`) then W (`StageRunner.backward_weight`), each timed. So a grid visit times the
whole backward and the split one of the same tile, and I + W is the split's own cost, not a share of B's: on a
CPU the split's two calls cost more than B (its graph walk and its per-consumer autograd calls are Python, which
small tiles feel most), and timing it adds to the tiles' timing (docs/results.md, the split backward). The
context tiles are not split: a tile's context adds to its I alone (attention's backward and the K/V hand-back), the
context term of the whole backward.

Timing discipline: one thread on CPU (a stage owns one core), timed by default with the process's CPU
clock: time the OS gives to other processes on a shared machine is not the stage's cost (with both cores
of this machine kept busy by others, a tile's wall time tripled while its CPU time moved by 1–4%). CUDA
events after a synchronisation on GPU. A warm-up, then ``repeats`` rounds, each visiting every point in a
fresh random order, so a drift of the machine's speed spreads over all points instead of bending the
curve; the median is kept, with min and max. The Python garbage collector is paused while timing and collects
between rounds, with what was alive before the timing frozen out of its sight (PyTorch's few hundred thousand
objects, a quarter of a second a collection to walk).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from terapipe_cli.engine.optim import make_optimizer
from terapipe_cli.engine.stage import AUTOCAST_DTYPES, StageRunner
from terapipe_cli.models import ModelConfig
from terapipe_cli.profile.tiles import CLOCKS, Point, Settings, Tiles

if TYPE_CHECKING:
    from terapipe_cli.engine.tensor import TensorGroup

# (phase, done, total): work done so far in arbitrary units, for a progress bar with an ETA.
Progress = Callable[[str, float, float], None]

CLOCK_NAMES = {
    "cpu": "process CPU time (time.process_time)",
    "wall": "wall time (time.perf_counter)",
    "cuda-events": "CUDA events after torch.cuda.synchronize",
}


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
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(5)]

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
        fwd, bwd, _, _ = self._time_tile(b, i, j, split=False)
        return fwd, bwd

    def time_tile_split(self, b: int, i: int) -> tuple[float, float, float, float]:
        """Seconds of the forward and of the backward of tile (b, i, 0) on one layer, and of its backward split: I,
        then W (the module docstring), on another batch slice's copy of the tile."""
        fwd, bwd, inp, wgt = self._time_tile(b, i, 0, split=True)
        return fwd, bwd, inp, wgt

    def _time_tile(self, b: int, i: int, j: int, *, split: bool) -> tuple[float, float, float, float]:
        runner = self.runner
        runner.reset()
        token_slice = 0
        x, grad = self._tensors(b, i)
        if j:
            runner.forward_tile(0, 0, self._tensors(b, j)[0])
            token_slice = 1
        else:
            # In a pipeline step forwards run back to back, and the first forward after a backward is slower
            # on a CPU (caches, the allocator). So every timed forward follows an untimed
            # one: the context tile, or here the same tile of another batch slice (whose split backward follows).
            runner.forward_tile(1, 0, x)
        inp = wgt = 0.0
        if self.device.type == "cuda":
            start, mid, end, input_end, weight_end = self._events
            torch.cuda.synchronize(self.device)
            start.record()
            runner.forward_tile(0, token_slice, x)
            mid.record()
            runner.backward_tile(0, token_slice, grad)
            end.record()
            if split:
                runner.backward_input(1, 0, grad)
                input_end.record()
                runner.backward_weight(1, 0)
                weight_end.record()
                weight_end.synchronize()
                inp, wgt = end.elapsed_time(input_end) / 1e3, input_end.elapsed_time(weight_end) / 1e3
            end.synchronize()
            fwd, bwd = start.elapsed_time(mid) / 1e3, mid.elapsed_time(end) / 1e3
        else:
            now = self._now
            t0 = now()
            runner.forward_tile(0, token_slice, x)
            t1 = now()
            runner.backward_tile(0, token_slice, grad)
            t2 = now()
            if split:
                runner.backward_input(1, 0, grad)
                t3 = now()
                runner.backward_weight(1, 0)
                inp, wgt = t3 - t2, now() - t3
            fwd, bwd = t1 - t0, t2 - t1
        # The context tile's own backward is not timed; reset() frees its graph, so it is not run at all.
        runner.reset()
        return fwd, bwd, inp, wgt

    def optimizer_step_s(self, repeats: int) -> float:
        """Median seconds of one AdamW step (the runtime's optimizer) over one layer's parameters.

        In bf16/fp16 it includes the per-step cost of autocast's low-precision copy of the layer's weight
        matrices, which the next step's first tile makes once for the whole step (see `StageRunner.step`).
        """
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
        keeps for its backward (`engine.stage.SavedBytes`: the storages autograd saves, the tile's input and
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
        of shape (b, kv_heads, L, head_dim) in the compute type (docs/design.md §6) — this tensor rank's heads only."""

        low = AUTOCAST_DTYPES[self.precision]
        element = torch.empty(0, dtype=low or torch.float32).element_size()
        ranks = self.runner.tensor.size if self.runner.tensor is not None else 1
        return 2 * b * (self.layer_model.seq_len - i) * (self.layer_model.kv_width // ranks) * element

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class Timings:
    """Per point: the forward and backward samples of every visit over the repeat rounds, and on the split points
    (`time_points`' ``split``) the split backward's I and W of every visit (empty elsewhere)."""

    points: list[Point]
    forward: list[list[float]]  # [point][visit] seconds
    backward: list[list[float]]
    input: list[list[float]] | None = None  # [point][visit] seconds; None: no point split
    weight: list[list[float]] | None = None

    def stats(self, which: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Median, min and max per point of "forward", "backward", "total", or the split's "input" and "weight"
        (nan at the points not split)."""
        if which == "total":
            samples = [np.add(f, b) for f, b in zip(self.forward, self.backward, strict=True)]
        else:
            kept = {"forward": self.forward, "backward": self.backward, "input": self.input, "weight": self.weight}
            samples = [np.asarray(s) for s in kept[which] or [[] for _ in self.points]]
        return tuple(np.array([f(s) if s.size else np.nan for s in samples]) for f in (np.median, np.min, np.max))

    def by_point(self, which: str, stat: int = 0) -> dict[Point, float]:
        """One statistic per point (0 median, 1 min, 2 max) of "forward", "backward", "total", "input" or
        "weight"."""
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


@contextmanager
def collector_paused() -> Iterator[None]:
    """Within: the garbage collector runs only where the timing calls it (between rounds, outside any timed region),
    and what was alive on entry (PyTorch's modules, the model: a few hundred thousand objects) is frozen out of its
    sight, so each of those collections walks only the timing's own objects. A caller's freeze is kept as it is."""
    was_enabled = gc.isenabled()
    freeze = gc.get_freeze_count() == 0
    gc.collect()
    gc.disable()
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def time_points(
    timer: TileTimer,
    points: Sequence[Point],
    *,
    repeats: int,
    warmup_all: bool,
    seed: int,
    progress: Progress | None = None,
    phase: str = "timing tiles",
    split: bool = False,
) -> Timings:
    """Warm up, then ``repeats`` rounds over all points, each round in a fresh random order.

    ``warmup_all``: warm up on every point (first-call costs per shape: allocator, kernels, masks) instead
    of on one small and one large tile per batch size. ``split``: every visit of a grid point (no context) times
    the split backward too (`TileTimer.time_tile_split`).
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
    inp: list[list[float]] = [[] for _ in points]
    wgt: list[list[float]] = [[] for _ in points]
    splits = [split and p.role == "grid" for p in points]
    with collector_paused():
        for p in warm:
            if split and p.role == "grid":
                timer.time_tile_split(p.b, p.i)
            else:
                timer.time_tile(p.b, p.i, p.j)
            done += p.work
            if progress:
                progress(f"{phase} (warm-up)", done, total)
        for r in range(repeats):
            for k in rng.permutation(order):
                p = points[k]
                if splits[k]:
                    f, b, i, w = timer.time_tile_split(p.b, p.i)
                    inp[k].append(i)
                    wgt[k].append(w)
                else:
                    f, b = timer.time_tile(p.b, p.i, p.j)
                fwd[k].append(f)
                bwd[k].append(b)
                done += p.work
                if progress:
                    progress(f"{phase} (round {r + 1}/{repeats})", done, total)
            gc.collect()  # between rounds, outside any timed region
    return Timings(points, fwd, bwd, inp if split else None, wgt if split else None)


@contextmanager
def one_thread_per_stage(device: torch.device) -> Iterator[None]:
    """On a CPU, time with one thread (a pipeline stage owns one core); the caller's count comes back after."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    with one_thread_per_stage(device):
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
                split=True,
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
