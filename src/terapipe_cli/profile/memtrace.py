"""The memory estimate traced from the runtime's own code (docs/design.md §10): a stage's `StageRunner` runs tiles on
fake tensors (`FakeTensorMode`: shapes and dtypes, no data, no memory) under `LiveBytes`, a tracker of every storage's
creation and release, and the bytes live over time become the profile's ``memory`` coefficients.

What is traced, per stage kind: ``layer`` (a middle stage's decoder layer, the difference between stages of two and of
one layer), and ``first``, ``last`` and ``only`` (a one-layer stage with the embedding, the head and loss, or both,
less one layer). For each tile (b, i, j) — a context tile of j tokens first, as in a step — the tracker reads:

* ``tile``: what the tile keeps from its forward to its backward (its saved tensors, input and output; not its K/V
  rows, which are the batch slice's ``cache``);
* ``kept``: the same for a recomputed tile (its input), and ``rerun``: the most live during its backward, over what
  was live before it (the re-run's saved tensors on top of everything, then the backward's own transients);
* ``forward``: the most live during the forward over what is live after it (the forward's transients: the logits
  before the loss reduces them, an MLP's inner activation before the next product);
* ``backward``: the most live during the backward over what was live before it (gradients of the activations and
  of the weights while the tile's saved tensors are still held);
* the split backward's ``weight_grads`` (what I leaves for W), ``input`` and ``weight`` (their peaks over what was
  live before each).

Each is fitted as ``c0 + c1·b·i + c2·b·j + c3·b·i·(i + j)`` (the last term for masks of (b, 1, i, i + j), kept on the
CPU context path and with packed documents) and checked on tiles it was not fitted on. ``cache`` (K/V bytes per
token of a batch slice's sequence, per layer) and ``copies`` (a 16-bit compute type's copies of the weights, one per
step) are constants. A CUDA profile's trace rounds each storage as the CUDA caching allocator does
(`cuda_block_bytes`); the CPU's counts bytes exactly.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache
from torch.utils._python_dispatch import TorchDispatchMode

from terapipe_cli.config.model import ModelConfig
from terapipe_cli.engine.attention import forced_branch
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.engine.tensor import TensorGroup
from terapipe_cli.plan.partition import Partition
from terapipe_cli.plan.traced import LAYER_QUANTITIES, QUANTITIES, terms

MEMORY_TERMS = ("1", "b*i", "b*j", "b*i*(i+j)")  # the columns the coefficients multiply (`plan.traced.terms`)
KINDS = ("layer", "middle", "first", "last", "only")  # a decoder layer; a stage's rest, by where it is
_MiB = 2**20


def cuda_block_bytes(nbytes: int) -> int:
    """The bytes the CUDA caching allocator holds for one request: under 1 MiB a 512-byte block of a 2 MiB segment,
    1–10 MiB a 512-byte-rounded block split from a 20 MiB segment, larger requests their own segment rounded to
    2 MiB (its remainder under 1 MiB is not split off)."""
    if nbytes <= 0:
        return 0
    if nbytes < 10 * _MiB:
        return -(-nbytes // 512) * 512
    return -(-nbytes // (2 * _MiB)) * (2 * _MiB)


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


class _FakeMode(FakeTensorMode):
    """Fake tensors whose dispatch cache never keys an op by a storage: it would keep that storage alive (the K/V
    caches' row views, `Tensor.set_` on the cache's storage), so that the K/V caches would never go as the runtime
    lets them go."""

    def _cache_key(self, state, func, args, kwargs):
        if any(isinstance(a, torch.UntypedStorage) for a in (*args, *kwargs.values())):
            raise _BypassDispatchCache("a storage argument")  # no key made, none kept
        return super()._cache_key(state, func, args, kwargs)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results (one level of lists and tuples deep, as ATen ops take them)."""
    out = []
    for a in (*(args if isinstance(args, (tuple, list)) else (args,)), *(kwargs.values() if kwargs else ())):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


@contextmanager
def _no_data_pointer_warning() -> Iterator[None]:
    """`SavedBytes` reads its parameters' data pointers (0 for fake tensors, a warning each: unused here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield


class _FakeGroup:
    """A tensor-parallel group of T ranks on fake tensors: every rank holds the same shapes, so a reduction keeps its
    tensor and a gather concatenates T tensors like this rank's (as the real collective allocates them)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str = "") -> None:
        return None

    def all_gather(self, tensor: torch.Tensor, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
        sizes = sizes or [tensor.shape[dim]] * self.size
        parts = [tensor.new_empty(tensor.shape[:dim] + (n,) + tensor.shape[dim + 1 :]) for n in sizes]
        return torch.cat(parts, dim)


@dataclass(frozen=True)
class _Config:
    """One traced runner: a stage of ``layers`` decoder layers, with the embedding (``first``) and/or the head."""

    kind: str
    layers: int
    first: bool
    last: bool

    def runner(self, model: ModelConfig, precision: str, tensor_parallel: int) -> StageRunner:
        counts = [self.layers]
        if not self.first:
            counts.insert(0, 1)
        if not self.last:
            counts.append(1)
        stages = len(counts)
        cfg = ModelConfig.from_dict(dict(model.to_dict(), layers=sum(counts)), "the traced model")
        stage = 0 if self.first else 1
        tensor = TensorGroup(0, tensor_parallel, _FakeGroup(tensor_parallel)) if tensor_parallel > 1 else None
        # Parameters are fake already, on the runner's device: `Module.to` would try to swap them (refused for
        # fake tensors, which carry weak references).
        with mock.patch.object(torch.nn.Module, "to", lambda module, *a, **k: module), _no_data_pointer_warning():
            return StageRunner(
                cfg, stage, stages, precision=precision, tensor=tensor, partition=Partition(tuple(counts), stages)
            )


_CONFIGS = (
    _Config("middle1", 1, False, False),
    _Config("middle2", 2, False, False),
    _Config("first", 1, True, False),
    _Config("last", 1, False, True),
    _Config("only", 1, True, True),
)


class _Tracer:
    """One runner on fake tensors, tiles traced through it within one step (as the executor runs them)."""

    def __init__(self, config: _Config, model: ModelConfig, precision: str, tensor_parallel: int, cuda: bool):
        self.config, self.model = config, model
        self.stack = ExitStack()
        # The CPU's attention path, also for a CUDA profile: the CUDA branch's mask is a tensor subclass fake tensors
        # cannot make (`causal_lower_right`); both fused paths keep the output and a log-sum-exp per query, and the
        # CPU's mask is a strided view of O(L) bytes, so what a tile holds is the same up to the allocator's blocks.
        self.stack.enter_context(forced_branch("cpu"))
        self.stack.enter_context(_FakeMode())
        self.runner = config.runner(model, precision, tensor_parallel)
        self.live = LiveBytes(cuda_block_bytes if cuda else None)
        self.stack.enter_context(self.live)
        self.stack.enter_context(self.runner.step())
        self._slice = 0
        self.copies = self._warm_up()
        self.cache = 0.0

    def close(self) -> None:
        self.stack.close()

    def _inputs(self, b: int, i: int):
        m, first, last = self.model, self.config.first, self.config.last
        x = torch.randint(0, m.vocab, (b, i)) if first else torch.randn(b, i, m.hidden)
        targets = torch.randint(0, m.vocab, (b, i)) if last else None
        return x, targets

    def _grad(self, b: int, i: int):
        return None if self.config.last else torch.randn(b, i, self.model.hidden)

    def _warm_up(self) -> float:
        """A tile forward and backward: the parameters' gradients and the step's 16-bit weight copies exist after
        it, as in any step but the first tile of the first. Returns the copies' bytes."""
        self.runner.forward_tile(self._slice, 0, *self._inputs(1, 1))
        self.runner.backward_tile(self._slice, 0, self._grad(1, 1))
        self._slice += 1
        grads = [p.grad for p in self.runner.module.parameters() if p.grad is not None]
        return float(self.live.alive - sum(self.live.block(g.untyped_storage().nbytes()) for g in grads))

    def _window(self, run) -> tuple[list[int], int]:
        """Run ``run()``; the live bytes after each of its ops, and the live bytes before it."""
        live = self.live
        before, live.timeline = live.alive, []
        try:
            run()
            return live.timeline + [live.alive], before
        finally:
            live.timeline = None

    def tile(self, b: int, i: int, j: int) -> dict[str, list[float]]:
        """Trace the tile (b, i) after j tokens three ways — plain (F, B), split (F, I, W), recomputed (F, B) — and
        return each quantity's series: one value for what is kept, the live bytes over the window less its
        reference for a peak (the module docstring)."""
        out: dict[str, list[float]] = {}
        runner, c = self.runner, self.runner.chunks[0]
        for way in ("plain", "split", "recompute"):
            runner.recompute[c] = way == "recompute"
            s, self._slice = self._slice, self._slice + 1
            token = 1 if j else 0
            if j:
                runner.forward_tile(s, 0, *self._inputs(b, j))
            # The input made within: the tile keeps it (as the runtime keeps the activation it received).
            series, before = self._window(lambda: runner.forward_tile(s, token, *self._inputs(b, i)))  # noqa: B023
            caches = runner._slices[(c, s)].caches
            self.cache = float(
                sum(self.live.block(t.untyped_storage().nbytes()) for kv in caches for t in (kv.keys, kv.values))
            ) / (b * self.model.seq_len * self.config.layers)
            after = series[-1]
            kept = after - before - (0.0 if j else self.cache * b * self.model.seq_len * self.config.layers)
            if way == "recompute":
                out["kept"] = [kept]
            elif way == "plain":
                out["tile"] = [kept]
                out["forward"] = [v - after for v in series]
            if way == "split":
                series, before_i = self._window(lambda: runner.backward_input(s, token, self._grad(b, i)))  # noqa: B023
                out["input"] = [v - before_i for v in series]
                out["weight_grads"] = [series[-1] - before_i]
                series, before = self._window(lambda: runner.backward_weight(s, token))  # noqa: B023
                out["weight"] = [v - before for v in series]
                # Left behind after W: the K/V gradients of the earlier rows, until the earlier tile's W.
                out["handback_split"] = [series[-1] - before_i + out["tile"][0]]
            else:
                series, before = self._window(lambda: runner.backward_tile(s, token, self._grad(b, i)))  # noqa: B023
                out["rerun" if way == "recompute" else "backward"] = [v - before for v in series]
                if way == "plain":  # left behind: the K/V gradients of the earlier rows, for the earlier slices
                    out["handback"] = [series[-1] - before + out["tile"][0]]
            if j:
                runner.backward_tile(s, 0, self._grad(b, j))
            runner.recompute[c] = False
        return out


def _shapes(seq_len: int, token_step: int) -> dict[str, tuple[list, list]]:
    """Tiles (b, i, j) to fit on and to check the fit on, without context and with, spread over the sequence in
    token steps. Fitted on batches of two or more sequences, which run the same ops whatever their size; a batch of
    one can skip a copy (a transpose of a dimension of one is a view), so the fit bounds it from above."""
    step = max(1, min(token_step, seq_len // 8))
    u = max(step, (seq_len // 8) // step * step)
    u = min(u, seq_len // 4) if seq_len >= 4 else 1
    plain = ([(2, u, 0), (4, u, 0), (2, 2 * u, 0)], [(1, 2 * u, 0), (3, 3 * u, 0)])
    context = ([(2, u, u), (4, u, u), (2, 2 * u, u), (2, u, 2 * u)], [(1, u, 2 * u)])
    if 4 * u <= seq_len:
        context[1].append((3, u, 3 * u))
    return {"no_context": plain, "context": context}


def envelope(coefs, b, i, j) -> np.ndarray:
    """A quantity's bytes at tiles (b, i, j): the largest of its linear forms (``coefs``: one row of four each)."""
    return np.max(terms(b, i, j) @ np.asarray(coefs, dtype=float).T, axis=-1)


def _fit_envelope(points, series: list[list[float]], seq_len: int) -> list[list[float]]:
    """The linear forms of a quantity over a group of tiles: where every tile ran the same ops, one form per moment
    of the window, fitted through the tiles (raised to bound them), kept where it is the largest at some tile a plan
    may run; else (the op sequences differ) one form through the tiles' peaks, raised to bound them all."""
    b, i, j = (np.array(x, dtype=float) for x in zip(*points, strict=True))
    X = terms(b, i, j)
    # Without context no term in i²: nothing of a tile's own (i, i) grows so on the runtime's paths (the fused
    # attention keeps no scores, the CPU's mask is a strided view), and fitted on three tiles it would extrapolate
    # a count of chunks (the chunked head's) quadratically to a whole sequence.
    cols = [0, 1] if not j.any() else [0, 1, 2, 3]
    if len({len(s) for s in series}) == 1:
        Y = np.array(series, dtype=float)  # (tiles, moments)
        coef = np.zeros((Y.shape[1], 4))
        coef[:, cols] = np.linalg.lstsq(X[:, cols], Y, rcond=None)[0].T
        coef[:, 0] += np.maximum(np.max(Y - X @ coef.T, axis=0), 0.0)  # each form bounds its moment's tiles
    else:
        peaks = np.array([max(s) for s in series])
        coef = np.zeros((1, 4))
        coef[0, cols] = np.linalg.lstsq(X[:, cols], peaks, rcond=None)[0]
        coef[0, 0] += max(0.0, float(np.max(peaks - X @ coef[0])))
    # Keep the forms that are the largest somewhere a plan may go: b up to 64, i and j over the sequence.
    lengths = np.unique(np.geomspace(1, seq_len, 24).round())
    bb, ii, jj = np.meshgrid([1, 2, 4, 8, 16, 64], lengths, [0.0] if not j.any() else lengths, indexing="ij")
    ok = ii + jj <= seq_len
    grid = terms(bb[ok], ii[ok], jj[ok])
    best = np.unique(np.argmax(grid @ coef.T, axis=1))
    return [[float(x) for x in coef[k]] for k in best]


def trace_memory(
    model: ModelConfig,
    *,
    precision: str = "fp32",
    tensor_parallel: int = 1,
    cuda: bool = False,
    token_step: int = 8,
) -> dict:
    """The profile's ``memory`` entry: every quantity's linear forms per stage kind and group of tiles (the module
    docstring), traced through the runtime's StageRunner on fake tensors, with their largest relative error on the
    held-out tiles."""
    groups = _shapes(model.seq_len, token_step)
    traced: dict[str, dict[str, list[dict]]] = {}
    cache, copies = 0.0, {}
    for config in _CONFIGS:
        tracer = _Tracer(config, model, precision, tensor_parallel, cuda)
        try:
            traced[config.kind] = {g: [tracer.tile(*p) for p in fit + held] for g, (fit, held) in groups.items()}
            copies[config.kind], cache = tracer.copies, tracer.cache if config.kind == "middle1" else cache
        finally:
            tracer.close()

    def series(kind: str, group: str, quantity: str) -> list[list[float]]:
        """A layer's (two layers less one), a stage's rest (its one-layer stage less a layer: what is kept adds up
        over layers), or a one-layer stage's peaks (the transients of the layer the backward meets first)."""
        get = lambda name: [t[quantity] for t in traced[name][group]]  # noqa: E731
        if quantity not in LAYER_QUANTITIES:
            return get("middle1" if kind == "middle" else kind)
        layer = [[a[0] - b[0]] for a, b in zip(get("middle2"), get("middle1"), strict=True)]
        if kind == "layer":
            return layer
        return [[a[0] - b[0]] for a, b in zip(get("middle1" if kind == "middle" else kind), layer, strict=True)]

    entry: dict = {}
    worst, worst_at = 0.0, None
    for kind in KINDS:
        entry[kind] = {}
        for quantity in QUANTITIES:
            if kind == "layer" and quantity not in LAYER_QUANTITIES:
                continue
            entry[kind][quantity] = {}
            for group, (fit, held) in groups.items():
                values = series(kind, group, quantity)
                forms = _fit_envelope(fit, values[: len(fit)], model.seq_len)
                entry[kind][quantity][group] = forms
                for p, v in zip(held, values[len(fit) :], strict=True):
                    actual = max(v)
                    error = abs(float(envelope(forms, *p)) - actual) / abs(actual) if abs(actual) > 4096 else 0.0
                    if error > worst:  # (bytes of a few scalars say nothing of the fit)
                        worst, worst_at = error, f"{kind} {quantity} at (b, i, j) = {tuple(p)}"
    layer_copies = copies["middle2"] - copies["middle1"]
    n_fit = sum(len(f) for f, _ in groups.values())
    n_held = sum(len(h) for _, h in groups.values())
    return {
        "method": (
            "traced: the runtime's StageRunner on fake tensors (FakeTensorMode) under a tracker of every storage's "
            f"creation and release ({'the CUDA caching allocator modelled' if cuda else 'exact bytes'}); each "
            f"quantity the largest of linear forms in {', '.join(MEMORY_TERMS)}, fitted on {n_fit} tiles, checked "
            f"on {n_held} others"
        ),
        "allocator": "cuda" if cuda else "cpu",
        "terms": list(MEMORY_TERMS),
        "cache_bytes_per_token_per_layer": cache,
        "copies_bytes": {
            "layer": layer_copies,
            "middle": copies["middle1"] - layer_copies,
            **{k: copies[k] - layer_copies for k in ("first", "last", "only")},
        },
        "stages": {k: v for k, v in entry.items() if k != "layer"},
        "layer": entry["layer"],
        "heldout_rel_err_max": worst,
        "heldout_worst": worst_at,
    }


def tracked_step_peaks(
    model: ModelConfig, schedule, *, precision: str = "fp32", tensor_parallel: int = 1, cuda: bool = False
) -> list[float]:
    """Each device's most live bytes over one step of ``schedule`` (a `plan.schedule.Schedule`), its actions run
    by the runtime's StageRunner on fake tensors under `LiveBytes`, less the parameters' gradients (the stage's
    state): the measured side of the estimate's activation bytes (with a 16-bit type's weight copies)."""
    out = []
    part = schedule.partition or Partition.balanced(model.layers, schedule.stages)
    for k in range(schedule.stages):
        mine = part.chunks_on(k)
        with ExitStack() as stack:
            stack.enter_context(forced_branch("cpu"))  # as `_Tracer`
            stack.enter_context(_FakeMode())
            tensor = TensorGroup(0, tensor_parallel, _FakeGroup(tensor_parallel)) if tensor_parallel > 1 else None
            with mock.patch.object(torch.nn.Module, "to", lambda module, *a, **kw: module), _no_data_pointer_warning():
                runner = StageRunner(
                    model, k, schedule.stages, precision=precision, tensor=tensor, partition=part, chunks=mine,
                    recompute={c: schedule.recompute[c] for c in mine},
                )  # fmt: skip
            for p in runner.module.parameters():  # the gradients are state: there from the start
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            live = stack.enter_context(LiveBytes(cuda_block_bytes if cuda else None))
            stack.enter_context(runner.step())
            for a in schedule[k]:
                t, c = a.tile, a.stage
                first, last = c == 0, c == part.chunks - 1
                if a.phase == "F":
                    shape = (t.batch_size, t.tokens)
                    x = torch.randint(0, model.vocab, shape) if first else torch.randn(*shape, model.hidden)
                    targets = torch.randint(0, model.vocab, (t.batch_size, t.tokens)) if last else None
                    runner.forward_tile(t.batch_slice, t.token_slice, x, targets, chunk=c)
                    del x, targets
                elif a.phase == "W":
                    runner.backward_weight(t.batch_slice, t.token_slice, chunk=c)
                else:
                    grad = None if last else torch.randn(t.batch_size, t.tokens, model.hidden)
                    backward = runner.backward_input if a.phase == "I" else runner.backward_tile
                    backward(t.batch_slice, t.token_slice, grad, chunk=c)
                    del grad
            out.append(float(live.peak))
    return out
