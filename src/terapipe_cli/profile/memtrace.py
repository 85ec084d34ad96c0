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
CPU context path and with packed documents) and checked on tiles it was not fitted on. The transients of the stages
with the head (``last``, ``only``) are fitted in pieces of tile tokens b·i instead, on tiles of their own: the chunked
head holds one chunk's logits at a time, so they stop growing at its chunk (`_head_shapes`; the chunk the runner
takes is recorded, ``loss_chunk_tokens``). ``cache`` (K/V bytes per token of a batch slice's sequence, per layer) and
``copies`` (a 16-bit compute type's copies of the weights, one per step) are constants. A CUDA profile's trace rounds
each storage as the CUDA caching allocator does (`cuda_block_bytes`); the CPU's counts bytes exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache

from terapipe_cli.engine.live import LiveBytes
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.engine.tensor import TensorGroup
from terapipe_cli.models import ModelConfig
from terapipe_cli.models.attention import forced_branch
from terapipe_cli.plan.traced import LAYER_QUANTITIES, QUANTITIES, terms
from terapipe_cli.schedule.partition import Partition

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


class _FakeMode(FakeTensorMode):
    """Fake tensors whose dispatch cache never keys an op by a storage: it would keep that storage alive (the K/V
    caches' row views, `Tensor.set_` on the cache's storage), so that the K/V caches would never go as the runtime
    lets them go."""

    def _cache_key(self, state, func, args, kwargs):
        if any(isinstance(a, torch.UntypedStorage) for a in (*args, *kwargs.values())):
            raise _BypassDispatchCache("a storage argument")  # no key made, none kept
        return super()._cache_key(state, func, args, kwargs)


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

    def runner(
        self, model: ModelConfig, precision: str, tensor_parallel: int, loss_chunk_tokens: int | None = None
    ) -> StageRunner:
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
                cfg, stage, stages, precision=precision, tensor=tensor, partition=Partition(tuple(counts), stages),
                loss_chunk_tokens=loss_chunk_tokens,
            )  # fmt: skip


_CONFIGS = (
    _Config("middle1", 1, False, False),
    _Config("middle2", 2, False, False),
    _Config("first", 1, True, False),
    _Config("last", 1, False, True),
    _Config("only", 1, True, True),
)


class _Tracer:
    """One runner on fake tensors, tiles traced through it within one step (as the executor runs them)."""

    def __init__(
        self,
        config: _Config,
        model: ModelConfig,
        precision: str,
        tensor_parallel: int,
        cuda: bool,
        loss_chunk_tokens: int | None = None,
    ):
        self.config, self.model = config, model
        self.stack = ExitStack()
        # The CPU's attention path, also for a CUDA profile: the CUDA branch's mask is a tensor subclass fake tensors
        # cannot make (`causal_lower_right`); both fused paths keep the output and a log-sum-exp per query, and the
        # CPU's mask is a strided view of O(L) bytes, so what a tile holds is the same up to the allocator's blocks.
        self.stack.enter_context(forced_branch("cpu"))
        self.stack.enter_context(_FakeMode())
        self.runner = config.runner(model, precision, tensor_parallel, loss_chunk_tokens)
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


# The head's kinds (``last``, ``only``) fit their transients in pieces of tile tokens n = b·i. The chunked head
# (engine/loss.py) holds a chunk's logits, c tokens' worth, at a time: its backward's grow with n up to c and then stay,
# its forward's up to 2c (a chunk's logits are made while the previous chunk's still live), and above c the backward's
# block of vocabulary rows, so its 16-bit weight gradient, shrinks as 1/n. One list of forms linear in n, fitted on
# tiles on both sides of c, keeps growing where the head stops (a whole sequence over-estimated by up to 2x) and may
# pass under it between its tiles. So: n ≤ c, (c, 2c] and above 2c, the last two fitted with a column in 1/n besides
# and bounded by its chords over pieces of a ratio √2 (over it: 1/n is convex) up to the largest tile a plan may run,
# and beyond by its value there.
_MAX_BATCH = 64  # the most sequences a tile of a plan holds (the grid `_fit_pieces` keeps forms on)


def _head_tiles(n: int, seq_len: int) -> tuple[list, list]:
    """Tiles of about n tokens b·i, without context and with: b a power of two from 2, i at most L/2, context up to
    the rest of the sequence and half of it (the columns of `terms` told apart, over all a tile's context may be)."""
    b = 2
    while b < n and n // b > max(1, seq_len // 2):
        b *= 2
    i = max(1, -(-n // b))
    half = max(1, i // 2)
    rest = max(1, seq_len - i)
    plain = [(b, i, 0), (2 * b, half, 0)]
    return plain, [(b, i, max(1, rest // 2)), (b, i, rest), (2 * b, half, max(1, seq_len - half))]


def _head_shapes(seq_len: int, chunk: int) -> list[tuple[float, float, dict[str, tuple[list, list]]]]:
    """The head's pieces: (lo, hi, {group: (tiles to fit on, tiles to check on)}) for tiles of lo < b·i ≤ hi: up to
    the chunk, to twice it, above; none when no tile a plan may run (b ≤ 64 sequences) has more tokens than the
    chunk."""
    if chunk >= _MAX_BATCH * seq_len or seq_len < 4:
        return []
    c = chunk
    pieces = [
        (0.0, float(c), [max(1, c // 4), c], [max(1, c // 2)]),
        (float(c), float(2 * c), [c, 3 * c // 2, 2 * c], [5 * c // 4, 7 * c // 4]),
        (float(2 * c), float("inf"), [2 * c, 4 * c, 8 * c], [3 * c, 6 * c]),
    ]
    out = []
    for lo, hi, fit_at, held_at in pieces:
        shapes: dict[str, tuple[list, list]] = {"no_context": ([], []), "context": ([], [])}
        for at, part in ((fit_at, 0), (held_at, 1)):
            for n in at:
                plain, context = _head_tiles(n, seq_len)
                shapes["no_context"][part].extend(plain if part == 0 else plain[:1])
                shapes["context"][part].extend(context if part == 0 else context[:1])
        out.append((lo, hi, shapes))
    return out


def envelope(coefs, b, i, j) -> np.ndarray:
    """A quantity's bytes at tiles (b, i, j): the largest of its linear forms (``coefs``: one row of four each)."""
    return np.max(terms(b, i, j) @ np.asarray(coefs, dtype=float).T, axis=-1)


def _fit_pieces(
    points,
    series: list[list[float]],
    seq_len: int,
    tokens: tuple[float, float] = (0.0, float("inf")),
    inverse: bool = False,
) -> list[tuple[float, list[list[float]]]]:
    """The linear forms of a quantity over a group of tiles: where every tile ran the same ops, one form per moment
    of the window, fitted through the tiles (raised to bound them), kept where it is the largest at some tile a plan
    may run; else (the op sequences differ) one form through the tiles' peaks, raised to bound them all. Returned as
    pieces (above b·i tokens, forms): one, from ``tokens``'s lo, for tiles b·i in (lo, hi]. With ``inverse`` (the
    head's pieces above its chunk) a column in 1/(b·i) joins the fit, and the pieces go from lo on, each √2 times the
    last, the fit's chord over each (never under it: the 1/n term is convex); past 64 sequences (``tokens`` open
    above) the term at its value there."""
    b, i, j = (np.array(x, dtype=float) for x in zip(*points, strict=True))
    X = terms(b, i, j)
    # Without context no term in i²: nothing of a tile's own (i, i) grows so on the runtime's paths (the fused
    # attention keeps no scores, the CPU's mask is a strided view), and fitted on three tiles it would extrapolate
    # a count of chunks (the chunked head's) quadratically to a whole sequence.
    cols = [0, 1] if not j.any() else [0, 1, 2, 3]
    A = np.column_stack([X[:, cols]] + ([1.0 / (b * i)] if inverse else []))
    same_ops = len({len(s) for s in series}) == 1
    Y = np.array(series, dtype=float) if same_ops else np.array([[max(s)] for s in series])  # (tiles, forms)
    sol = np.linalg.lstsq(A, Y, rcond=None)[0]
    coef = np.zeros((Y.shape[1], 4))
    coef[:, cols] = sol[: len(cols)].T
    inv = np.maximum(sol[len(cols)], 0.0) if inverse else np.zeros(Y.shape[1])  # (a term below 1/n: none)
    fitted = X @ coef.T + inv / (b * i)[:, None]
    coef[:, 0] += np.maximum(np.max(Y - fitted, axis=0), 0.0)  # each form bounds its moment's tiles
    lo, hi = tokens
    pieces = []
    if inverse:  # the chord of C/n over [m, r·m]: C·(1 + 1/r)/m − C·n/(r·m²); from 64 sequences on, C/m
        r, m, top = np.sqrt(2.0), lo, min(hi, _MAX_BATCH * seq_len)
        while m < top * (1 - 1e-9):
            chord = coef.copy()
            chord[:, 0] += inv * (1 + 1 / r) / m
            chord[:, 1] -= inv / (r * m * m)
            pieces.append((m, min(r * m, hi), chord))
            m *= r
        if np.isinf(hi):
            last = coef.copy()
            last[:, 0] += inv / m
            pieces.append((m, hi, last))
    else:
        pieces.append((lo, hi, coef))
    # Keep the forms that are the largest somewhere a plan may go: b up to 64, i and j over the sequence.
    lengths = np.unique(np.geomspace(1, seq_len, 24).round())
    bb, ii, jj = np.meshgrid([1, 2, 4, 8, 16, 64], lengths, [0.0] if not j.any() else lengths, indexing="ij")
    out = []
    for p_lo, p_hi, forms in pieces:
        ok = (ii + jj <= seq_len) & (bb * ii > p_lo) & (bb * ii <= p_hi)
        best = np.unique(np.argmax(terms(bb[ok], ii[ok], jj[ok]) @ forms.T, axis=1)) if ok.any() else range(len(forms))
        out.append((float(p_lo), [[float(x) for x in forms[k]] for k in best]))
    return out


def trace_memory(
    model: ModelConfig,
    *,
    precision: str = "fp32",
    tensor_parallel: int = 1,
    cuda: bool = False,
    token_step: int = 8,
    loss_chunk_tokens: int | None = None,
) -> dict:
    """The profile's ``memory`` entry: every quantity's linear forms per stage kind and group of tiles (the module
    docstring), traced through the runtime's StageRunner on fake tensors, with their largest relative error on the
    held-out tiles. ``loss_chunk_tokens``: the head's chunk (default: the runtime's for a device that records no
    memory; a GPU's runner sizes it from the device's, `plan.memory.planned_loss_chunk_tokens`)."""
    groups = _shapes(model.seq_len, token_step)
    traced: dict[str, dict[str, list[dict]]] = {}
    heads: dict[str, list[dict[str, list[dict]]]] = {}  # the head's kinds: per piece, per group, the tiles traced
    pieces: list = []
    chunk = None
    cache, copies = 0.0, {}
    for config in _CONFIGS:
        tracer = _Tracer(config, model, precision, tensor_parallel, cuda, loss_chunk_tokens)
        seen: dict[tuple, dict] = {}
        tile = lambda p: seen[p] if p in seen else seen.setdefault(p, tracer.tile(*p))  # noqa: E731, B023
        try:
            traced[config.kind] = {g: [tile(p) for p in fit + held] for g, (fit, held) in groups.items()}
            if config.last:
                chunk = tracer.runner.loss_chunk_tokens
                pieces = _head_shapes(model.seq_len, chunk)
                heads[config.kind] = [
                    {g: [tile(p) for p in fit + held] for g, (fit, held) in shapes.items()} for _, _, shapes in pieces
                ]
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

    worst, worst_at = 0.0, None

    def fitted(kind: str, quantity: str, group: str, fit, held, values, tokens=(0.0, float("inf")), inverse=False):
        """The pieces (above b·i tokens, forms) through ``fit``'s values, checked on ``held``'s (the rest of
        ``values``)."""
        nonlocal worst, worst_at
        pieces = _fit_pieces(fit, values[: len(fit)], model.seq_len, tokens, inverse)
        for p, v in zip(held, values[len(fit) :], strict=True):
            forms = [f for lo, f in pieces if p[0] * p[1] > lo or lo == pieces[0][0]][-1]
            actual = max(v)
            error = abs(float(envelope(forms, *p)) - actual) / abs(actual) if abs(actual) > 4096 else 0.0
            if error > worst:  # (bytes of a few scalars say nothing of the fit)
                worst, worst_at = error, f"{kind} {quantity} at (b, i, j) = {tuple(p)}"
        return pieces

    entry: dict = {}
    for kind in KINDS:
        entry[kind] = {}
        for quantity in QUANTITIES:
            if kind == "layer" and quantity not in LAYER_QUANTITIES:
                continue
            entry[kind][quantity] = {}
            if heads.get(kind) and quantity not in LAYER_QUANTITIES:  # the head's transients, in pieces of b·i
                by_piece: dict[float, dict] = {}
                for k, (lo, hi, shapes) in enumerate(pieces):
                    for group, (fit, held) in groups.items():
                        # The piece's own tiles, and those of the group's that fall in it.
                        inside = lambda p: lo < p[0] * p[1] <= hi  # noqa: E731, B023
                        own, values = heads[kind][k][group], series(kind, group, quantity)
                        pfit, pheld = shapes[group]
                        f_pts = pfit + [p for p in fit if inside(p)]
                        f_val = [t[quantity] for t in own[: len(pfit)]]
                        f_val += [v for p, v in zip(fit, values, strict=False) if inside(p)]
                        h_pts = pheld + [p for p in held if inside(p)]
                        h_val = [t[quantity] for t in own[len(pfit) :]]
                        h_val += [v for p, v in zip(held, values[len(fit) :], strict=True) if inside(p)]
                        inverse = k > 0  # above the chunk: a column in 1/(b·i)
                        for above, forms in fitted(
                            kind, quantity, group, f_pts, h_pts, f_val + h_val, (lo, hi), inverse
                        ):
                            by_piece.setdefault(above, {})[group] = forms
                out = entry[kind][quantity]
                for above, forms in sorted(by_piece.items()):
                    if above == 0:
                        out.update(forms)
                    else:
                        out.setdefault("pieces", []).append({"above_tokens": int(above), **forms})
                continue
            for group, (fit, held) in groups.items():
                values = series(kind, group, quantity)
                entry[kind][quantity][group] = fitted(kind, quantity, group, fit, held, values)[0][1]
    layer_copies = copies["middle2"] - copies["middle1"]
    n_fit = sum(len(f) for f, _ in groups.values())
    n_held = sum(len(h) for _, h in groups.values())
    head_note = (
        f"; the head's transients in pieces of b·i from its chunk ({chunk} tokens) on, fitted on "
        f"{sum(len(f) for _, _, s in pieces for f, _ in s.values())} tiles more"
        if pieces
        else ""
    )
    return {
        "method": (
            "traced: the runtime's StageRunner on fake tensors (FakeTensorMode) under a tracker of every storage's "
            f"creation and release ({'the CUDA caching allocator modelled' if cuda else 'exact bytes'}); each "
            f"quantity the largest of linear forms in {', '.join(MEMORY_TERMS)}, fitted on {n_fit} tiles, checked "
            f"on {n_held} others{head_note}"
        ),
        "allocator": "cuda" if cuda else "cpu",
        "terms": list(MEMORY_TERMS),
        "loss_chunk_tokens": chunk,
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
    """Each device's most live bytes over one step of ``schedule`` (a `schedule.schedule.Schedule`), its actions run
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
