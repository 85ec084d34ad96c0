"""Time this device's operators into an operator table (`profile.operator_table` reads and prices it).

Each operator is the runtime's own call, in the run's precision (bf16/fp16: its tensors in that type, what autocast
hands the kernels): ``torch.nn.functional.linear`` for the products, `models.attention.attend` (with a K/V cache
holding the context, as a stage's later token slices run it) forward and backward for attention, a residual add
``x + y`` for every element-wise pass (bytes moved: two reads and a write), and a one-element add for the host's
cost of one kernel. The backward's products are timed in the layouts autograd runs them in (the input's gradient
dy · w, the weight's xᵀ · dy), which on a CPU take up to a few tens of percent more or less than a ``linear``.

Timing as `profile.timer` times tiles: one thread on a CPU (a stage owns one core), process CPU time there (CUDA
events after a synchronisation on a GPU), the garbage collector paused; a warm-up visit of every point, then
``rounds`` rounds each in a fresh random order, the median kept. A call shorter than about a millisecond is repeated
back to back within one sample and divided. The attention's timed forward follows an untimed one of the same shape,
since on a CPU the first forward after a backward is slower.

Last, each model family's per-tile host term (`operator_table.TILE_HOST_KEYS`): one layer's tiles timed through the
runtime's stage code as `profile.timer` times a profile's (`timer.TileTimer`), at a shape so small its kernels take
next to nothing (`TILE_HOST_SHAPE`), less that same tile priced from the table just timed, so no kernel is counted
twice. What is left is the host's per-tile work the kernels do not hold; a remainder below zero is kept as zero.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from terapipe_cli.engine.stage import AUTOCAST_DTYPES
from terapipe_cli.models import ARCHS, ModelConfig
from terapipe_cli.models.attention import KVCache, attend
from terapipe_cli.profile.analytic import layer_seconds_split
from terapipe_cli.profile.operator_table import (
    ATTENTION_AXES,
    GEMM_LAYOUTS,
    OPERATORS_SCHEMA,
    TILE_HOST_KEYS,
    TablePricer,
    operator_table_from_dict,
    table_hardware,
)
from terapipe_cli.profile.probe import device_info
from terapipe_cli.profile.timer import Progress, TileTimer, collector_paused, one_thread_per_stage
from terapipe_cli.units import utc_timestamp

SAMPLE_S = 1e-3  # a sample of a shorter call repeats it back to back up to about this long
# The per-tile host term's model and tiles: 2 heads of 8, one sequence, a slice of 8 tokens without and after 8 of
# context; each family's other widths (its MLP's) at their defaults, or 4 × hidden.
TILE_HOST_SHAPE = {"hidden": 16, "heads": 2, "vocab": 16, "seq_len": 16, "ffn_hidden": 64}
TILE_HOST_B, TILE_HOST_I, TILE_HOST_J = 1, 8, 8
TILE_HOST_VISITS = 8  # visits of each tile per round


@dataclass(frozen=True)
class OperatorGrid:
    """The points an operator table times: products' (m, n, k), attention's axes (`ATTENTION_AXES`), bytes."""

    m: tuple[int, ...]
    n: tuple[int, ...]
    k: tuple[int, ...]
    heads: tuple[int, ...]
    group: tuple[int, ...]
    head_dim: tuple[int, ...]
    i: tuple[int, ...]
    j: tuple[int, ...]
    bytes: tuple[int, ...]
    rounds: int

    def describe(self) -> str:
        products = len(self.m) * len(self.n) * len(self.k)
        attention = int(np.prod([len(getattr(self, axis)) for axis in ATTENTION_AXES]))
        return (
            f"{products} matrix-product shapes in {len(GEMM_LAYOUTS)} layouts, {attention} attention shapes, "
            f"{len(self.bytes)} element-wise sizes, {self.rounds} rounds"
        )


# Sized for models of hidden ≤ 512, vocabularies ≤ 32K and tiles ≤ 2K tokens on one CPU core: about a minute.
CPU_GRID = OperatorGrid(
    m=(8, 32, 128, 512, 2048), n=(32, 128, 512, 2048), k=(32, 128, 512, 2048),
    heads=(4, 16), group=(1, 4), head_dim=(32, 128), i=(8, 64, 512), j=(0, 64, 512),
    bytes=tuple(4**e for e in range(5, 14)), rounds=5,
)  # fmt: skip
# Sized for GPU models of hidden 512-8192, head sizes 64-128, K/V groups of 1-8, MLPs of 2.7-4 H, vocabularies of
# 32K-152K (past the grid's last point a product is scaled by its FLOPs) and tiles of 8-32K tokens.
GPU_GRID = OperatorGrid(
    m=(8, 64, 512, 4096, 32768), n=(512, 2048, 8192, 32768, 131072), k=(512, 2048, 8192, 32768),
    heads=(8, 32, 64), group=(1, 4, 8), head_dim=(64, 128), i=(8, 128, 2048, 16384), j=(0, 2048, 16384),
    bytes=tuple(4**e for e in range(5, 17)), rounds=3,
)  # fmt: skip
# Coarser, the same range of tiles (m and i to 2K tokens): a few seconds.
QUICK_GRID = OperatorGrid(
    m=(8, 128, 2048), n=(64, 512), k=(64, 512), heads=(4,), group=(1,), head_dim=(64,), i=(8, 128, 1024), j=(0, 256),
    bytes=(4**5, 4**8, 4**11), rounds=3,
)  # fmt: skip


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def time(self, fn: Callable[[], object], repeat: int = 1) -> float:
        """Seconds of one call of ``fn``, the mean of ``repeat`` back to back."""
        if self.cuda:
            start, end = self.events
            torch.cuda.synchronize()
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / repeat
        t0 = time.process_time()
        for _ in range(repeat):
            fn()
        return (time.process_time() - t0) / repeat


KEEP_BYTES = (
    64 * 2**20
)  # a point's tensors up to this size stay allocated between its visits; larger ones are made anew


class _Point:
    """One operator to time, its tensors made when first timed: kept between visits when they are small (every
    point of the CPU grid), made again for each visit when large (a GPU grid's products reach gigabytes: all at once
    they would not fit)."""

    def __init__(self, make, nbytes: int, device, dtype, shape: tuple) -> None:
        self.make, self.nbytes, self.args = make, nbytes, (device, dtype, *shape)
        self.kept = None

    def __call__(self, clock: _Clock, repeat: int):
        run = self.kept or self.make(*self.args)
        if self.nbytes <= KEEP_BYTES:
            self.kept = run
        return run(clock, repeat)


def _gemm_bytes(layout: str, m: int, n: int, k: int) -> int:
    """Elements of a product's two inputs and its output (float32's size: an upper bound for every precision)."""
    return 4 * (m * k + k * n + m * n)


def _attention_bytes(heads: int, group: int, head_dim: int, i: int, j: int) -> int:
    """Elements of attention's queries, keys, values, context, output and their gradients (float32's size)."""
    kv = max(1, heads // group)
    return 4 * head_dim * (3 * heads * i + 4 * kv * (i + j))


def _gemm_point(device, dtype, layout: str, m: int, n: int, k: int):
    """An (m × n) product over k in ``layout`` (`GEMM_LAYOUTS`): the forward's ``linear`` (x · wᵀ, w of shape (n,
    k)), the input gradient's ``dgrad`` (dy · w, both as stored) or the weight gradient's ``wgrad`` (xᵀ · dy, x of
    shape (k, m) transposed), as autograd runs `models.spec.backward_gemms`' products."""

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    if layout == "forward":
        x, w = randn(m, k), randn(n, k)
        return lambda clock, repeat: clock.time(lambda: F.linear(x, w), repeat)
    if layout == "dgrad":
        a, b = randn(m, k), randn(k, n)
        return lambda clock, repeat: clock.time(lambda: a @ b, repeat)
    a, b = randn(k, m), randn(k, n)
    return lambda clock, repeat: clock.time(lambda: a.t() @ b, repeat)


def _stream_point(device, dtype, nbytes: int):
    size = torch.empty(0, dtype=dtype).element_size()
    numel = max(1, nbytes // (3 * size))  # x + y: read two tensors, write one
    x, y = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)
    return lambda clock, repeat: clock.time(lambda: x + y, repeat)


def _attention_point(device, dtype, heads: int, group: int, head_dim: int, i: int, j: int):
    """Forward and backward of `attend` for i queries after j context rows in a K/V cache, at batch 1."""
    kv_heads = max(1, heads // group)

    def tensors(n, h):  # made on the device: a GPU grid's are gigabytes
        return torch.randn(1, h, n, head_dim, device=device, dtype=dtype)

    q, k, v = tensors(i, heads), tensors(i, kv_heads), tensors(i, kv_heads)
    ctx_k, ctx_v = tensors(j, kv_heads), tensors(j, kv_heads)
    grad = tensors(i, heads)

    def run(clock: _Clock, repeat: int) -> tuple[float, float]:
        fwd = bwd = 0.0
        for _ in range(repeat):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            cache = KVCache(i + j)
            if j:
                cache.window(ctx_k, ctx_v, 0)
            attend(*leaves, cache, j, gqa=group > 1)  # untimed: a forward after a backward is slower on a CPU
            cache = KVCache(i + j)
            if j:
                cache.window(ctx_k, ctx_v, 0)
            out: list[torch.Tensor] = []
            fwd += clock.time(lambda: out.append(attend(*leaves, cache, j, gqa=group > 1)))  # noqa: B023
            bwd += clock.time(lambda: out[0].backward(grad))  # noqa: B023
        return fwd / repeat, bwd / repeat

    return run


def measure_operators(
    device: torch.device, precision: str, grid: OperatorGrid, *, seed: int = 0, progress: Progress | None = None
) -> dict:
    """The operator table (``terapipe.operators/1``) of ``device`` in ``precision``, timed on ``grid``."""
    dtype = AUTOCAST_DTYPES[precision] or torch.float32
    gemms = list(itertools.product(GEMM_LAYOUTS, grid.m, grid.n, grid.k))
    attention = list(itertools.product(grid.heads, grid.group, grid.head_dim, grid.i, grid.j))
    points = (
        [("gemm", p, _Point(_gemm_point, _gemm_bytes(*p), device, dtype, p)) for p in gemms]
        + [("attention", p, _Point(_attention_point, _attention_bytes(*p), device, dtype, p)) for p in attention]
        + [("stream", (b,), _Point(_stream_point, b, device, dtype, (b,))) for b in grid.bytes]
    )
    one, other = torch.ones(1, device=device, dtype=dtype), torch.ones(1, device=device, dtype=dtype)
    samples: list[list] = [[] for _ in points]
    rng = np.random.default_rng(seed)
    with one_thread_per_stage(device), collector_paused():
        clock = _Clock(device)
        total = len(points) * (grid.rounds + 1)
        repeats = []
        for n, (_, _, run) in enumerate(points):  # warm-up, and how many calls make a sample
            run(clock, 1)  # the first call of a shape pays its one-off costs
            second = run(clock, 1)
            seconds = sum(second) if isinstance(second, tuple) else second
            repeats.append(int(min(1000, max(1, SAMPLE_S // max(seconds, 1e-7)))))
            if progress:
                progress("operators (warm-up)", n + 1, total)
        for r in range(grid.rounds):
            for n in rng.permutation(len(points)):
                samples[n].append(points[n][2](clock, repeats[n]))
                if progress:
                    progress(f"operators (round {r + 1}/{grid.rounds})", len(points) * (r + 2), total)
        host_s = float(np.median([clock.time(lambda: one + other, 1000) for _ in range(grid.rounds)]))
    table = _table(device, precision, grid, points, samples, host_s, (gemms, attention))
    del points  # the operators' tensors: not alive while the tiles are timed
    priced = operator_table_from_dict(table, "the table being timed")
    table["tile_host_s"] = tile_host_seconds(priced, device, precision, grid.rounds, seed)
    table["tile_host_shape"] = {**TILE_HOST_SHAPE, "b": TILE_HOST_B, "i": TILE_HOST_I, "j": TILE_HOST_J}
    return table


def tiny_model(arch: str) -> ModelConfig:
    """The per-tile host term's model of family ``arch`` (`TILE_HOST_SHAPE`)."""
    fields = {"name": f"{arch}-tile-host", "arch": arch, "layers": 1, **TILE_HOST_SHAPE}
    if "ffn_hidden" not in ARCHS[arch].config.__dataclass_fields__:
        fields.pop("ffn_hidden")
    return ModelConfig.from_dict(fields, "the per-tile host term's model")


def tile_host_seconds(table, device: torch.device, precision: str, rounds: int, seed: int = 0) -> dict[str, dict]:
    """Each family's per-tile host term (`operator_table.TILE_HOST_KEYS`): the median of its tiny tiles timed
    through `timer.TileTimer` less their price from ``table`` (an `operator_table.OperatorTable` without the term).
    The families' tiles are visited in rounds, each in a fresh random order, so a drift of the machine's speed spreads
    over all of them."""
    b, i, j = TILE_HOST_B, TILE_HOST_I, TILE_HOST_J
    models = {arch: tiny_model(arch) for arch in ARCHS}
    rng = np.random.default_rng(seed)
    split: dict[str, list] = {arch: [] for arch in ARCHS}
    context: dict[str, list] = {arch: [] for arch in ARCHS}
    with one_thread_per_stage(device), collector_paused(), ExitStack() as steps:
        timers = {arch: TileTimer(model, device, seed=seed, precision=precision) for arch, model in models.items()}
        for timer in timers.values():
            steps.enter_context(timer.runner.step())
            timer.time_tile_split(b, i)  # warm-up: the first calls pay their one-off costs
            timer.time_tile(b, i, j)
        visits = [arch for arch in ARCHS for _ in range(TILE_HOST_VISITS)]
        for _ in range(rounds):
            for n in rng.permutation(len(visits)):
                timer = timers[visits[n]]
                split[visits[n]].append(timer.time_tile_split(b, i))
                context[visits[n]].append(timer.time_tile(b, i, j))
    hardware, pricer = table_hardware(table), TablePricer(table)
    terms = {}
    for arch, model in models.items():
        measured = [*np.median(split[arch], axis=0), *np.median(context[arch], axis=0)]
        alone = layer_seconds_split(model, hardware, b, i, 0, 1, pricer)
        with_context = layer_seconds_split(model, hardware, b, i, j, 1, pricer)[:2]
        prices = [float(x) for x in (*alone, *with_context)]
        terms[arch] = {key: max(float(m) - p, 0.0) for key, m, p in zip(TILE_HOST_KEYS, measured, prices, strict=True)}
    return terms


def _table(device, precision, grid: OperatorGrid, points, samples, host_s, shapes) -> dict:
    gemms, attention = shapes
    medians = [np.median(np.asarray(s), axis=0) for s in samples]
    kinds = [kind for kind, _, _ in points]
    gemm_s = np.array([m for m, kind in zip(medians, kinds, strict=True) if kind == "gemm"])
    gemm_s = gemm_s.reshape(len(GEMM_LAYOUTS), len(grid.m), len(grid.n), len(grid.k))
    att = np.array([m for m, kind in zip(medians, kinds, strict=True) if kind == "attention"])
    stream_s = np.array([m for m, kind in zip(medians, kinds, strict=True) if kind == "stream"])
    att_shape = tuple(len(getattr(grid, axis)) for axis in ATTENTION_AXES)
    return {
        "schema": OPERATORS_SCHEMA,
        "created": utc_timestamp(),
        "device": device_info(device),
        "precision": precision,
        "torch": torch.__version__,
        "clock": "cuda-events" if device.type == "cuda" else "cpu",
        "rounds": grid.rounds,
        "host_s": host_s,
        "host_op": "a one-element add (x + y)",
        "gemm": {
            "op": "forward_s: torch.nn.functional.linear of an (m, k) input and an (n, k) weight; dgrad_s: (m, k) @ "
            "(k, n); wgrad_s: (k, m)ᵀ @ (k, n)",
            "m": list(grid.m),
            "n": list(grid.n),
            "k": list(grid.k),
            **{f"{layout}_s": gemm_s[n].tolist() for n, layout in enumerate(GEMM_LAYOUTS)},
        },
        "attention": {
            "op": "terapipe_cli.models.attention.attend at batch 1, i queries after j rows of a K/V cache",
            **{axis: list(getattr(grid, axis)) for axis in ATTENTION_AXES},
            "forward_s": att[:, 0].reshape(att_shape).tolist(),
            "backward_s": att[:, 1].reshape(att_shape).tolist(),
        },
        "stream": {
            "op": "a residual add x + y; bytes: two tensors read, one written",
            "bytes": list(grid.bytes),
            "seconds": stream_s.tolist(),
        },
    }
