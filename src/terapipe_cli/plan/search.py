"""The slicing planner (docs/design.md §4–§5): pure numpy, no torch, no I/O.

Given ``cost(b, i, j)`` — seconds for one stage's forward + backward of a tile of ``b`` sequences × ``i`` new
tokens after ``j`` context tokens — find the scheme ``[(b_1, [l_11, …]), (b_2, [l_21, …]), …]`` minimising

    T = Σ tiles t + (K − 1) · max tile t   (+ cost.step_s, a per-step constant)

The exact method (the default)
------------------------------
``T* = min over t_max of S*(t_max) + (K−1)·t_max`` where ``S*(t)`` is the least total tile time over schemes whose
tiles all cost ≤ t. For one t, ``S*(t)`` is a one-dimensional DP over the prefix length per batch-slice size b,
followed by an unbounded knapsack over b. The published method evaluates t_max for the distinct tile costs in
ascending order (optionally skipping candidates within ε). We instead run an exact branch-and-bound over the
sorted candidate costs ``c[0] < c[1] < …``:

* Evaluating at ``c[p]`` gives ``S*(c[p])`` and a scheme whose largest tile is ``c[q] ≤ c[p]``. Every candidate in
  ``[c[q], c[p]]`` has the same ``S*`` (the scheme stays feasible, and S* is non-increasing), so that whole range is
  settled by one value: ``S*(c[p]) + (K−1)·c[q]``.
* For a still-open index interval ``[lo, hi]`` whose upper neighbour was evaluated with value ``S_up``:
  ``T(t) ≥ S_up + (K−1)·c[lo]`` for every t in it (S* only grows as t falls). Intervals whose bound reaches the
  best objective found are discarded; the others are probed again.
* Everything above ``(best − S*(∞)) / (K−1)`` is discarded up front, since ``T(t) ≥ S*(∞) + (K−1)·t``.

Each round probes many candidates at once: the DP runs vectorised over (candidates × batch-slice sizes × slice
lengths), one numpy step per prefix length, and only over slice lengths whose cost can fit under the round's
largest candidate. With ε > 0, intervals within K·ε of the best are discarded too, so the answer is within K·ε of
the optimum.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import Slices, short_form
from terapipe_cli.schedule import memo

Cost = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

METHODS = ("exact", "enumerate")
# Candidates probed per round of the exact search, and per batch of the enumeration. Larger rounds amortise the
# per-prefix numpy overhead; smaller ones prune more between rounds.
_PROBES_PER_ROUND = 32
_ENUMERATE_BATCH = 32
# Batch-slice sizes whose widest usable token slice is within this factor share one DP array.
_GROUP_RATIO = 3
# Two objectives closer than this (relative) are treated as equal when pruning: floating-point summation noise.
_REL_TOL = 1e-12


@dataclass
class PlanResult:
    """A scheme and its predicted iteration time."""

    slices: Slices
    predicted_s: float
    t_max_s: float
    stages: int
    seq_len: int
    batch_size: int
    token_step: int
    method: str = "exact"
    epsilon: float = 0.0
    seconds: float = 0.0
    candidates: int = 0
    sum_s: float = 0.0
    extra: dict = field(default_factory=dict)
    # Schemes the search ranks next to this one (`solve(neighbours=…)`), by the objective, best first.
    alternatives: list[PlanResult] = field(default_factory=list)

    def short_form(self, *, fold: bool = False) -> str:
        return short_form(self.slices, fold=fold)

    @property
    def tiles(self) -> int:
        return sum(len(lengths) for _, lengths in self.slices)

    def to_dict(self) -> dict:
        return {
            "slices": [[b, list(lengths)] for b, lengths in self.slices],
            "short_form": self.short_form(),
            "predicted_s": self.predicted_s,
            "t_max_s": self.t_max_s,
            "sum_s": self.sum_s,
            "tiles": self.tiles,
        }


@dataclass(frozen=True)
class Sequencing:
    """Batch groupings as paths through a state machine, for searches where a batch slice's place in the batch
    matters (the memory-aware search, docs/design.md §10; built by `groupings.grouping_search`).

    A *row* is a batch-slice size with the tiles allowed to it: ``row_sizes[r]`` sequences, and ``row_fits[r](i, j)``
    True for the tiles of i tokens after j that it may use (None: every tile). A *move* ``(a, c, r)`` goes from
    state a to state c > a by placing one batch slice of row r. Every path from state 0 to one of ``finals`` is
    a batch grouping the search may return, its batch slices in the order placed, or the reverse of it when
    ``placed_last_first``. Without a Sequencing the batch is an unordered multiset of batch-slice sizes (a knapsack).
    """

    row_sizes: tuple[int, ...]
    row_fits: tuple[Callable | None, ...]
    moves: tuple[tuple[int, int, int], ...]
    states: int
    finals: tuple[int, ...]
    placed_last_first: bool = False


# --------------------------------------------------------------------------------------------------------------
# Pricing any scheme


def _tile_arrays(slices: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    bs, ii, jj = [], [], []
    for b, lengths in slices:
        j = 0
        for n in lengths:
            bs.append(b)
            ii.append(n)
            jj.append(j)
            j += n
    return np.asarray(bs, dtype=np.int64), np.asarray(ii, dtype=np.int64), np.asarray(jj, dtype=np.int64)


def tile_costs(cost: Cost, slices: Sequence) -> np.ndarray:
    """Cost of every tile of a scheme, in pipeline order."""
    b, i, j = _tile_arrays(slices)
    return np.broadcast_to(np.asarray(cost(b, i, j), dtype=float), b.shape)


def bubble_costs(cost: Cost, slices: Sequence) -> np.ndarray:
    """What the objective's bubble term takes the largest of, per tile: ``cost.bubble`` where the cost has one
    (interleaved chunks: one chunk's time, `CostModel`), else the tile's cost itself."""
    bubble = getattr(cost, "bubble", None)
    if bubble is None:
        return tile_costs(cost, slices)
    b, i, j = _tile_arrays(slices)
    return np.broadcast_to(np.asarray(bubble(b, i, j), dtype=float), b.shape)


def objective(sum_s: float, t_max_s: float, stages: int, step_s: float = 0.0, virtual: int = 1) -> float:
    """The objective of docs/design.md §4: Σ t + (K−1)·max t, plus a per-step constant.

    Given the sum and the largest of a scheme's tile times; every search and every report prices through here. With
    v > 1 interleaved chunks per device (§11, ``sum_s`` the devices' tile times, ``t_max_s`` the largest chunk's)
    a tile comes back to its first device after K chunk-times: each of the v − 1 returns leaves the device idle for
    max(0, K·t_max − Σ/v) — the stall when the tiles of one round are fewer than the devices. The objective stays
    non-decreasing in both Σ and t_max (its slope in Σ is at least 1/v), so the search stays exact under it.
    """
    if stages == 1:  # no pipeline: nothing waits (and an unpriceable tile's +inf stays +inf, not 0·inf)
        return sum_s + step_s
    if sum_s == math.inf or t_max_s == math.inf:  # an unpriceable tile: +inf (not the stall's inf − inf)
        return math.inf
    stall = (virtual - 1) * max(0.0, stages * t_max_s - sum_s / virtual) if virtual > 1 else 0.0
    return sum_s + (stages - 1) * t_max_s + stall + step_s


def evaluate(cost: Cost, slices: Sequence, stages: int) -> float:
    """The objective of any scheme, with the cost's per-step constant."""
    if stages < 1:
        raise UserError(f"must be at least 1, got {stages}", where="stages")
    t, m = tile_costs(cost, slices), bubble_costs(cost, slices)
    return float(objective(t.sum(), m.max(), stages, getattr(cost, "step_s", 0.0), getattr(cost, "virtual", 1)))


def _result(
    cost: Cost, slices: Slices, *, stages: int, seq_len: int, batch_size: int, token_step: int, priced=None, **kw
) -> PlanResult:
    """The scheme priced by ``cost`` (``priced``: its tiles' costs and bubble costs, already at hand)."""
    t, m = (tile_costs(cost, slices), bubble_costs(cost, slices)) if priced is None else priced
    return PlanResult(
        slices=slices,
        predicted_s=float(
            objective(t.sum(), m.max(), stages, getattr(cost, "step_s", 0.0), getattr(cost, "virtual", 1))
        ),
        t_max_s=float(m.max()),
        sum_s=float(t.sum()),
        stages=stages,
        seq_len=seq_len,
        batch_size=batch_size,
        token_step=token_step,
        **kw,
    )


def _results(cost: Cost, schemes: list[Slices], **kw) -> list[PlanResult]:
    """`_result` of every scheme; a cost model's (`CostModel.price_key`: every tile priced alone) tiles priced in one
    call — each scheme's costs then the same values, summed alike."""
    if getattr(cost, "price_key", None) is None or len(schemes) < 2:
        return [_result(cost, slices, **kw) for slices in schemes]
    tiles = [_tile_arrays(slices) for slices in schemes]
    b, i, j = (np.concatenate([x[k] for x in tiles]) for k in range(3))
    t = np.asarray(cost(b, i, j), dtype=float)
    bubble = getattr(cost, "bubble", None)
    m = t if bubble is None else np.asarray(bubble(b, i, j), dtype=float)
    ends = np.cumsum([len(x[0]) for x in tiles])
    return [
        _result(cost, slices, priced=(t[end - len(x[0]) : end], m[end - len(x[0]) : end]), **kw)
        for slices, x, end in zip(schemes, tiles, ends, strict=True)
    ]


def _baseline(name: str, cost: Cost, shape: tuple, find):
    """``find()``, shared within one plan by the cost models that price alike (`memo`; a copy each time)."""
    key = getattr(cost, "price_key", None)
    if key is None:
        return find()
    step = (getattr(cost, "step_s", 0.0), getattr(cost, "virtual", 1))
    return copy.deepcopy(memo.remembered((name, key, step, *shape), find))


# --------------------------------------------------------------------------------------------------------------
# Baselines


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def gpipe_baseline(cost: Cost, *, seq_len: int, batch_size: int, stages: int) -> PlanResult | None:
    """GPipe: whole sequences, microbatch size m among the divisors of B, the best m by the same objective (None
    when the cost forbids every m: +inf)."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, stages=stages, token_step=1)

    def find() -> PlanResult | None:
        sizes = divisors(batch_size)
        schemes = [[(m, [seq_len])] * (batch_size // m) for m in sizes]
        shape = {"stages": stages, "seq_len": seq_len, "batch_size": batch_size, "token_step": seq_len}
        best = None
        for res, m in zip(_results(cost, schemes, **shape, method="gpipe"), sizes, strict=True):
            res.extra["microbatch"] = m
            if math.isfinite(res.predicted_s) and (best is None or res.predicted_s < best.predicted_s):
                best = res
        return best

    return _baseline("gpipe", cost, (seq_len, batch_size, stages), find)


def _uniform_schemes(seq_len: int, batch_size: int, token_step: int):
    """Every uniform scheme: n equal token slices (n a power of two dividing L/g), batch slices all of size m | B.

    Yields ``(slices, n, m)``; n = 1 is GPipe with microbatch m.
    """
    units = seq_len // token_step
    n = 1
    while n <= units:
        if units % n == 0:
            for m in divisors(batch_size):
                yield [(m, [seq_len // n] * n)] * (batch_size // m), n, m
        n *= 2


def uniform_baseline(
    cost: Cost, *, seq_len: int, batch_size: int, stages: int, token_step: int = 1
) -> PlanResult | None:
    """The best uniform slicing: n equal token slices (n a power of two dividing L/g), batch slices all of size m
    (None when the cost forbids every one: +inf)."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, stages=stages, token_step=token_step)

    def find() -> PlanResult | None:
        uniform = list(_uniform_schemes(seq_len, batch_size, token_step))
        shape = {"stages": stages, "seq_len": seq_len, "batch_size": batch_size, "token_step": token_step}
        best = None
        for res, (_, n, m) in zip(
            _results(cost, [x[0] for x in uniform], **shape, method="uniform"), uniform, strict=True
        ):
            res.extra.update(token_slices=n, microbatch=m)
            if math.isfinite(res.predicted_s) and (best is None or res.predicted_s < best.predicted_s):
                best = res
        return best

    return _baseline("uniform", cost, (seq_len, batch_size, stages, token_step), find)


# --------------------------------------------------------------------------------------------------------------
# The DP for many t_max at once


class _Tables:
    """Tile costs laid out for the DP, in units of the token step, one *row* per batch-slice size (rows b = 1 … B
    for the knapsack) or per row of a `Sequencing`.

    ``cost[r, start[p] + i − 1]`` is the cost of the tile of row r's batch slice that ends at prefix ``p`` (units)
    and is ``i`` units long (1 ≤ i ≤ p), so its context is ``p − i``: the tiles ending at p lie together, in the
    order of `grid_tiles`. +inf marks the tiles a row may not use. ``cost_max`` is what the objective's bubble takes
    the largest of (`bubble_costs`): ``cost`` itself but for interleaved chunks, where the threshold t_max is on the
    bubble's cost and the DP sums the other.
    """

    def __init__(
        self, cost: Cost, *, seq_len: int, batch_size: int, token_step: int, grouping: Sequencing | None = None
    ) -> None:
        n = seq_len // token_step
        self.units, self.batch_size, self.token_step = n, batch_size, token_step
        self.virtual = getattr(cost, "virtual", 1)  # interleaved chunks per device: the objective's stall term
        # A cost that prices no batch slice above its ``max_batch_slice`` (`CostModel(within_profile=True)`) needs no
        # knapsack rows for them: rows b = 1 … min(B, max_batch_slice).
        widest = min(batch_size, getattr(cost, "max_batch_slice", None) or batch_size)
        sizes = np.arange(1, widest + 1) if grouping is None else np.asarray(grouping.row_sizes)
        self.row_sizes, self.rows = sizes, len(sizes)
        self.combine = _Knapsack(batch_size) if grouping is None else _Paths(grouping)
        # Only the valid (prefix, length) pairs are priced: half the cube, and the cost model's time.
        self.start = np.arange(n + 1) * (np.arange(n + 1) - 1) // 2  # where prefix p's tiles begin
        self.start_list = self.start.tolist()
        distinct, at = np.unique(sizes, return_inverse=True)
        raws = [self._priced(raw, at, n, grouping) for raw in grid_prices(cost, distinct, n, token_step)]
        self.cost, self.cost_max = raws[0], raws[-1]
        self._longer = None  # `_longer_min`, made when a search first needs it (a bound does not)
        self._distinct = None  # every distinct cost of `cost_max`, sorted (`distinct_costs`)
        self.probed: dict[float, _Probe] = {}  # every probe made on these tables, by its t_max (`_probe`)
        self.bottleneck = self._bottleneck()

    @property
    def nbytes(self) -> int:
        """Bytes of the tables' arrays once every lazy one is made (`memo`)."""
        return self.cost.nbytes * (2 if self.cost_max is self.cost else 3) + self.cost_max.nbytes

    def at(self, ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The columns of the tiles of ``lengths`` units ending at prefixes ``ends``."""
        return self.start[ends] + lengths - 1

    @property
    def _longer_min(self) -> np.ndarray:
        """Suffix minimum: _longer_min[r, start[p] + i − 1] = the cheapest tile (of ``cost_max``) of length ≥ i ending
        at p. Under a threshold t the entries ≤ t are the lengths 1..w up to the longest tile that fits, so the DP
        can skip longer ones."""
        if self._longer is None:
            out = np.empty_like(self.cost_max)
            for p in range(1, self.units + 1):
                at = slice(self.start[p], self.start[p] + p)
                out[:, at] = np.minimum.accumulate(self.cost_max[:, at][:, ::-1], axis=1)[:, ::-1]
            self._longer = out
        return self._longer

    def top(self) -> _Probe:
        """The probe at t_max = ∞: S*(∞) and its scheme (every search and bound starts from it)."""
        return _probe(self, np.array([np.inf]))[0]

    def _priced(self, raw: np.ndarray, at, units: int, grouping: Sequencing | None) -> np.ndarray:
        """``raw`` (the prices of every tile per distinct row size, `grid_prices`) per row; +inf marks a tile no
        scheme may use (the memory-aware search forbids tiles that do not fit)."""
        if np.any(np.isnan(raw)) or np.any(raw == -np.inf):
            raise UserError("the cost function returned a non-finite time", where="cost")
        if grouping is None:
            return np.ascontiguousarray(raw)
        i, j = grid_tiles(units, self.token_step)  # one row per Sequencing row, its forbidden tiles at +inf
        raw = raw[at.reshape(-1)]
        allowed = [
            np.ones(raw.shape[1], dtype=bool) if f is None else np.asarray(f(i[0], j[0])) for f in grouping.row_fits
        ]
        return np.where(np.stack(allowed), raw, np.inf)

    def _bottleneck(self) -> np.ndarray:
        """For each row: the smallest possible largest tile over all token slicings of its batch slice."""
        n, top = self.units, self.cost_max
        worst = np.full((self.rows, n + 1), np.inf)
        worst[:, 0] = -np.inf
        for p in range(1, n + 1):
            tiles = top[:, self.start[p] : self.start[p] + p]  # lengths 1..p ending at p
            worst[:, p] = np.maximum(worst[:, p - 1 :: -1][:, :p], tiles).min(axis=1)
        return worst[:, n]

    def smallest_feasible_t_max(self) -> float:
        """Below this no scheme exists: the batch cannot be composed of batch slices that fit."""
        return self.combine.smallest_feasible(self.bottleneck)

    def widths(self, t_max: float) -> np.ndarray:
        """``w[r, p]``: the longest slice ending at p whose cost in row r is ≤ t_max (0 if none)."""
        w = np.zeros((self.rows, self.units + 1), dtype=np.int64)
        if t_max == np.inf:  # every entry is ≤ ∞ (no NaN): every length
            w[:, 1:] = np.arange(1, self.units + 1)
            return w
        fits = self._longer_min <= t_max  # the lengths 1..w of each prefix, w the longest that fits
        w[:, 1:] = np.add.reduceat(fits, self.start[1:], axis=1, dtype=np.int64)
        return w

    def distinct_costs(self, lo: float, hi: float) -> np.ndarray:
        """The distinct tile costs in [lo, hi], ascending."""
        if self._distinct is None:
            self._distinct = np.unique(self.cost_max)
        c = self._distinct
        return c[np.searchsorted(c, lo, side="left") : np.searchsorted(c, hi, side="right")]


def _tables(cost: Cost, *, seq_len: int, batch_size: int, token_step: int, grouping: Sequencing | None = None):
    """`_Tables` of ``cost``, shared within one plan (`memo`) by the bounds and searches of cost models that price
    every tile alike (`CostModel.price_key`): a partition's bound, its search and its searches within the memory
    limit. A `Sequencing`'s tables (their rows by place) are made afresh, from shared prices."""
    key = getattr(cost, "price_key", None)
    shape = {"seq_len": seq_len, "batch_size": batch_size, "token_step": token_step}
    if key is None or grouping is not None:
        return _Tables(cost, **shape, grouping=grouping)
    return memo.remembered(("tables", key, seq_len, batch_size, token_step), lambda: _Tables(cost, **shape))


def grid_tiles(units: int, token_step: int) -> tuple[np.ndarray, np.ndarray]:
    """The tiles the search prices, as rows ``i`` (new tokens) and ``j`` (context) of one column per valid (prefix,
    length) pair of ``units`` token steps — prefix p's lengths 1..p together, p ascending (`_Tables.cost`)."""

    def make() -> tuple[np.ndarray, np.ndarray]:
        ends, lengths = np.nonzero(np.tri(units + 1, dtype=bool) & (np.arange(units + 1) >= 1)[None, :])
        return (lengths * token_step)[None, :], ((ends - lengths) * token_step)[None, :]

    return memo.remembered(("tiles", units, token_step), make)


def grid_kinds(cost: Cost, sizes: np.ndarray, units: int, token_step: int):
    """The times of a cost model's kinds of device and chunk on the tiles of `grid_tiles` (`CostModel.grid_kinds`,
    shared within one plan), for the batch slices of ``sizes`` it prices."""
    i, j = grid_tiles(units, token_step)
    return cost.grid_kinds(sizes, i, j, ("grid", units, token_step))


def grid_prices(cost: Cost, sizes: np.ndarray, units: int, token_step: int) -> list[np.ndarray]:
    """What the objective sums for every tile of `grid_tiles` and batch slice of ``sizes`` (a row each), and, where
    the cost has a ``bubble``, what the bubble takes the largest of. A cost with ``grid_prices`` (`CostModel`) prices
    them shared within one plan (`memo`); any other is called."""
    i, j = grid_tiles(units, token_step)
    shape = (len(sizes), i.shape[1])
    bubble = getattr(cost, "bubble", None)
    if hasattr(cost, "grid_prices"):
        total, over = cost.grid_prices(sizes, i, j, ("grid", units, token_step))
        raws = [total] if bubble is None else [total, over]
    else:
        raws = [f(sizes[:, None], i, j) for f in ([cost] if bubble is None else [cost, bubble])]
    return [np.broadcast_to(np.asarray(raw, dtype=float), shape) for raw in raws]


def _width_groups(b_alive: np.ndarray, widest: np.ndarray) -> list[np.ndarray]:
    """Group rows (batch-slice sizes) whose widest usable slice is within ``_GROUP_RATIO``× of the group's widest.

    Large batch slices can only use short token slices under a given t_max; padding their DP rows to the width of
    small batch slices would multiply the work, so each group runs with its own widths.
    """
    order = b_alive[np.argsort(-widest[b_alive], kind="stable")]
    groups: list[list[int]] = []
    for b in order:
        if groups and widest[b] * _GROUP_RATIO >= widest[groups[-1][0]]:
            groups[-1].append(int(b))
        else:
            groups.append([int(b)])
    return [np.sort(np.asarray(g)) for g in groups]


def _batched_dp(tables: _Tables, t_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token-slicing DP for every candidate t_max and every batch-slice size at once.

    Returns ``best[m, r, p]`` (least total tile time covering the first p units of row r's batch slice with every
    tile ≤ t_max[m]; +inf if impossible) and ``choice[m, r, p]`` (the length of the last slice, less one).
    """
    n, B, M = tables.units, tables.rows, len(t_max)
    best = np.full((M, B, n + 1), np.inf)
    best[:, :, 0] = 0.0
    choice = np.zeros((M, B, n + 1), dtype=np.intp)
    t_top = float(np.max(t_max))
    widths = np.minimum(tables.widths(t_top), np.arange(n + 1)[None, :])  # (B, n+1)
    alive = np.nonzero(tables.bottleneck <= t_top)[0]  # the others cannot be sliced under any t_max here
    limit = t_max[:, None, None]
    bounded = bool(np.isfinite(t_max).any())  # else no tile is over any candidate (the prices hold no NaN)
    separate = tables.cost_max is not tables.cost
    start = tables.start_list
    for group in _width_groups(alive, widths.max(axis=1)):
        contiguous = group[-1] - group[0] + 1 == len(group)
        rows = slice(int(group[0]), int(group[-1]) + 1) if contiguous else group
        cost, cost_max = tables.cost[rows], tables.cost_max[rows]
        sub = best[:, rows]
        sub_choice = choice[:, rows]
        group_widths = widths[rows].max(axis=0).tolist()
        G, wide = len(group), max(group_widths)
        # Room for one prefix's values and their mask, each used as a contiguous (M, G, w) array: numpy's masked copy
        # runs several times slower on a strided one.
        room, over = np.empty(M * G * wide), np.empty(M * G * wide, dtype=bool)
        # ``sub`` backwards, back[..., n − q] = sub[..., q]: the prefixes a slice ending at p starts from, p − 1
        # down to p − w, lie in order there (a contiguous read instead of a reversed one).
        back = np.ascontiguousarray(sub[:, :, ::-1])
        each_m, each_g = np.arange(M)[:, None], np.arange(G)[None, :]
        for p in range(1, n + 1):
            w = group_widths[p]
            if w == 0:
                continue
            c = cost[:, start[p] : start[p] + w]  # (G, w): slice lengths 1..w ending at p
            c_max = cost_max[:, start[p] : start[p] + w] if separate else c
            prev = back[:, :, n - p + 1 : n - p + 1 + w]
            # (M, G, w), +inf where a slice is over the candidate
            vals = np.add(prev, c, out=room[: M * G * w].reshape(M, G, w))
            if bounded:
                np.copyto(vals, np.inf, where=np.greater(c_max, limit, out=over[: M * G * w].reshape(M, G, w)))
            # The least is the value at the first least (no NaN): read there, not reduced again.
            arg = vals.argmin(axis=2, out=sub_choice[:, :, p])
            sub[:, :, p] = back[:, :, n - p] = vals[each_m, each_g, arg]
        if not contiguous:  # fancy indexing copied the rows: write them back
            best[:, rows] = sub
            choice[:, rows] = sub_choice
    return best, choice


def _knapsack(per_b: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Unbounded knapsack over batch-slice sizes, for every candidate: ``total[m, s]`` for s sequences."""
    M, B = per_b.shape
    total = np.full((M, batch_size + 1), np.inf)
    total[:, 0] = 0.0
    last = np.zeros((M, batch_size + 1), dtype=np.int32)
    for s in range(1, batch_size + 1):
        k = min(s, B)
        vals = total[:, s - 1 :: -1][:, :k] + per_b[:, :k]  # using b = 1..k as the last batch slice
        arg = vals.argmin(axis=1)
        total[:, s] = vals[np.arange(M), arg]
        last[:, s] = arg + 1
    return total, last


class _Knapsack:
    """The batch as a multiset of batch-slice sizes (rows b = 1 … B): an unbounded knapsack."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def combine(self, per_row: np.ndarray) -> tuple[np.ndarray, object]:
        """Least total per candidate (``per_row[m, r]``: row r's best), and what `rows_of` reads back."""
        total, last = _knapsack(per_row, self.batch_size)
        return total[:, self.batch_size], last

    def rows_of(self, back, m: int) -> list[int]:
        """Candidate m's rows in pipeline order (larger batch slices first)."""
        sizes, s = [], self.batch_size
        while s > 0:
            sizes.append(int(back[m, s]))
            s -= sizes[-1]
        return [b - 1 for b in sorted(sizes, reverse=True)]

    def smallest_feasible(self, bottleneck: np.ndarray) -> float:
        for t in np.unique(bottleneck[np.isfinite(bottleneck)]):
            allowed = np.nonzero(bottleneck <= t)[0] + 1
            reach = np.zeros(self.batch_size + 1, dtype=bool)
            reach[0] = True
            for s in range(1, self.batch_size + 1):
                use = allowed[allowed <= s]
                reach[s] = bool(reach[s - use].any())
            if reach[self.batch_size]:
                return float(t)
        return math.inf  # every slicing uses a forbidden tile


class _Paths:
    """The batch as a path through a `Sequencing`: a shortest-path DP over its states, for every candidate."""

    def __init__(self, grouping: Sequencing) -> None:
        self.grouping = grouping
        into: list[list[tuple[int, int]]] = [[] for _ in range(grouping.states)]
        for a, c, r in grouping.moves:
            if not a < c < grouping.states:
                raise ValueError(f"move {(a, c, r)} does not go forward")
            into[c].append((a, r))
        self.into = [
            (np.array([a for a, _ in m], dtype=np.int64), np.array([r for _, r in m], dtype=np.int64)) for m in into
        ]
        self.finals = np.asarray(grouping.finals, dtype=np.int64)

    def combine(self, per_row: np.ndarray) -> tuple[np.ndarray, object]:
        M, S = per_row.shape[0], self.grouping.states
        value = np.full((M, S), np.inf)
        value[:, 0] = 0.0
        arg = np.zeros((M, S), dtype=np.int64)
        for c in range(1, S):
            froms, rows = self.into[c]
            if len(froms):
                vals = value[:, froms] + per_row[:, rows]
                arg[:, c] = vals.argmin(axis=1)
                value[:, c] = vals[np.arange(M), arg[:, c]]
        ends = value[:, self.finals]
        end = ends.argmin(axis=1)
        return ends[np.arange(M), end], (arg, end)

    def rows_of(self, back, m: int) -> list[int]:
        arg, end = back
        state, rows = int(self.finals[end[m]]), []
        while state != 0:
            froms, moved = self.into[state]
            k = int(arg[m, state])
            rows.append(int(moved[k]))
            state = int(froms[k])
        # `rows` runs from the last batch slice placed back to the first.
        return rows if self.grouping.placed_last_first else rows[::-1]

    def smallest_feasible(self, bottleneck: np.ndarray) -> float:
        """The least largest tile over all paths: a bottleneck shortest path."""
        worst = np.full(self.grouping.states, np.inf)
        worst[0] = -np.inf
        for c in range(1, self.grouping.states):
            froms, rows = self.into[c]
            if len(froms):
                worst[c] = np.maximum(worst[froms], bottleneck[rows]).min()
        least = float(worst[self.finals].min())
        return least if least > -np.inf else math.inf


def _scheme(tables: _Tables, choice: np.ndarray, rows: Sequence[int], m: int) -> tuple[Slices, float]:
    """Read candidate m's scheme back from the argmins, for its rows in pipeline order; and its largest tile."""
    g, start = tables.token_step, tables.start_list
    paths: dict[int, tuple[list[int], float]] = {}
    for r in set(rows):
        # Plain Python on the few token slices of one path: numpy's per-call cost outweighs the work here.
        last = choice[m, r]
        units, p = [], tables.units
        while p > 0:
            units.append(int(last[p]) + 1)
            p -= units[-1]
        units.reverse()
        columns, end = [], 0
        for n in units:
            end += n
            columns.append(start[end] + n - 1)  # `_Tables.at`
        worst = float(tables.cost_max[r, columns].max())
        paths[r] = ([i * g for i in units], worst)
    slices = [(int(tables.row_sizes[r]), list(paths[r][0])) for r in rows]
    return slices, max(paths[r][1] for r in rows)


def _scheme_sum_max(tables: _Tables, slices: Slices) -> tuple[float, float]:
    """Total and largest tile cost of a scheme, read from the tables (identical batch slices priced once)."""
    g = tables.token_step
    total, worst = 0.0, 0.0
    counts: dict[tuple[int, tuple[int, ...]], int] = {}
    for b, lengths in slices:
        key = (b, tuple(lengths))
        counts[key] = counts.get(key, 0) + 1
    for (b, lengths), count in counts.items():
        units = np.asarray(lengths) // g
        ends = np.cumsum(units)
        total += count * float(tables.cost[b - 1, tables.at(ends, units)].sum())
        worst = max(worst, float(tables.cost_max[b - 1, tables.at(ends, units)].max()))
    return total, worst


def _seed_schemes(tables: _Tables) -> list[Slices]:
    """GPipe and the uniform slicings: cheap to price and often close to the optimum, so the exact search starts
    with a tight bound and a small candidate range. (None for a `Sequencing`, whose paths they may not be.)"""
    if not isinstance(tables.combine, _Knapsack):
        return []
    L = tables.units * tables.token_step
    schemes = _uniform_schemes(L, tables.batch_size, tables.token_step)
    return [slices for slices, _, m in schemes if m <= tables.rows]


@dataclass
class _Probe:
    t_max: float
    total: float  # S*(t_max)
    slices: Slices | None
    realised: float  # the scheme's largest tile (≤ t_max)


def _probe(tables: _Tables, t_values: np.ndarray) -> list[_Probe]:
    """S*(t) and its scheme for every t of ``t_values``: the probes the tables keep, to be read and not changed (a
    scheme leaves the search as a copy, `_solve`).

    A probe depends on its tables and its t alone — each candidate's DP and knapsack run on their own, whichever
    others share the batch — so the probes made on one set of tables are kept (`_Tables.probed`) and only new ones
    run: the searches of one cost model (a partition's bound, its search below a ceiling, its search with
    neighbours) probe many of the same t."""
    t_values = [float(t) for t in np.asarray(t_values, dtype=float).reshape(-1)]
    known = tables.probed
    new = list(dict.fromkeys(t for t in t_values if t not in known))
    if new:
        best, choice = _batched_dp(tables, np.asarray(new))
        total, back = tables.combine.combine(best[:, :, tables.units])
        for m, t in enumerate(new):
            s_star = float(total[m])
            if not math.isfinite(s_star):
                known[t] = _Probe(t, math.inf, None, math.inf)
                continue
            slices, realised = _scheme(tables, choice, tables.combine.rows_of(back, m), m)
            known[t] = _Probe(t, s_star, slices, realised)
    return [known[t] for t in t_values]


# --------------------------------------------------------------------------------------------------------------
# Searching t_max


def _check_sizes(*, seq_len: int, batch_size: int, stages: int, token_step: int) -> None:
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("stages", stages), ("token_step", token_step)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise UserError(f"must be a positive integer, got {v!r}", where=name)
    if seq_len % token_step:
        raise UserError(
            f"the sequence length {seq_len} is not a multiple of the token step {token_step}", where="token_step"
        )


def _improve(
    results: list[_Probe],
    stages: int,
    best_T: float,
    best_slices: Slices | None,
    best_max: float,
    copies: int = 1,
    virtual: int = 1,
) -> tuple[float, Slices | None, float]:
    """The best objective among the probes' schemes and the incumbent (each scheme priced by its realised max), its
    scheme and its largest tile."""
    for pr in results:
        if pr.slices is not None:
            T = objective(copies * pr.total, pr.realised, stages, virtual=virtual)
            if T < best_T:
                best_T, best_slices, best_max = T, pr.slices, pr.realised
    return best_T, best_slices, best_max


class _ScaledBatch:
    """The cost of a batch slice of b sequences, as the cost of "one" sequence (for equal batch slices)."""

    def __init__(self, cost: Cost, b: int) -> None:
        self.cost, self.b, self.virtual = cost, b, getattr(cost, "virtual", 1)
        inner = getattr(cost, "bubble", None)
        self.bubble = None if inner is None else (lambda bb, i, j: inner(np.asarray(bb) * b, i, j))
        if hasattr(cost, "grid_prices"):  # a cost model's shared prices (`grid_prices`), of b times the sizes
            self.grid_prices = lambda sizes, i, j, grid: cost.grid_prices(np.asarray(sizes) * b, i, j, grid)
            self.price_key = (*cost.price_key, "batch slices of", b)

    def __call__(self, bb, i, j):
        return self.cost(np.asarray(bb) * self.b, i, j)


def _search_exact(
    tables: _Tables, stages: int, epsilon: float, copies: int = 1, ceiling: float = math.inf
) -> tuple[Slices | None, float, int]:
    """The best scheme, its largest tile and the candidates probed. ``copies``: the scheme runs ``copies`` times (D
    equal batch slices, `solve(batch_slice=…)`): the objective is copies·S + (K−1)·t_max. ``ceiling``: only a scheme
    below it matters — every t whose bound reaches it is pruned as if a scheme of that value were known, so the
    result is the optimum when the optimum is below ``ceiling``, and otherwise some scheme, the optimum being no
    less than ``ceiling`` (`solve(ceiling=…)`)."""
    top = tables.top()
    probes = 1
    if top.slices is None:
        return None, math.inf, probes
    v = tables.virtual
    best_T = objective(copies * top.total, top.realised, stages, virtual=v)
    best_slices, best_max = top.slices, top.realised
    if stages == 1:
        return best_slices, best_max, probes
    for seed in _seed_schemes(tables):
        sum_s, max_s = _scheme_sum_max(tables, seed)
        T = objective(copies * sum_s, max_s, stages, virtual=v)
        if T < best_T:
            best_T, best_slices, best_max = T, seed, max_s
    slack = stages * epsilon

    def prune() -> float:
        return min(best_T, ceiling)

    def cutoff() -> float:
        # No t above this can win: T(t) ≥ copies·S*(∞) + (K−1)·t.
        return (prune() - copies * top.total) / (stages - 1)

    c = tables.distinct_costs(tables.smallest_feasible_t_max(), cutoff())
    # Open intervals of candidate indices [lo, hi] with s_up = a value ≤ S*(t) for all t in them.
    open_ = [(0, len(c) - 1, top.total)]
    while open_:
        limit = prune() - slack - _REL_TOL * abs(prune())
        hi_cut = int(np.searchsorted(c, cutoff(), side="right")) - 1
        live = []
        for lo, hi, s_up in open_:
            hi = min(hi, hi_cut)
            if lo <= hi and copies * s_up + (stages - 1) * c[lo] < limit:
                live.append((lo, hi, s_up))
        if not live:
            break
        # Spread this round's probes over the live intervals, more where the interval is wider.
        sizes = np.array([hi - lo + 1 for lo, hi, _ in live], dtype=float)
        share = np.maximum(1, np.floor(_PROBES_PER_ROUND * sizes / sizes.sum())).astype(int)
        picks: list[tuple[int, int]] = []  # (interval number, candidate index)
        for k, ((lo, hi, _), q) in enumerate(zip(live, share, strict=True)):
            q = min(q, hi - lo + 1)
            idx = np.unique(np.linspace(lo, hi, q + 1)[1:].round().astype(int))
            picks += [(k, int(x)) for x in idx]
        results = _probe(tables, c[[x for _, x in picks]])
        probes += len(picks)
        # Update the best, then split each interval at its probes.
        best_T, best_slices, best_max = _improve(results, stages, best_T, best_slices, best_max, copies, v)
        new_open = []
        for k, (lo, hi, s_up) in enumerate(live):
            mine = sorted((x, results[n]) for n, (kk, x) in enumerate(picks) if kk == k)
            cursor_hi, cursor_s = hi, s_up
            for x, pr in reversed(mine):  # from the top of the interval down
                if x < cursor_hi:
                    new_open.append((x + 1, cursor_hi, cursor_s))
                if pr.slices is None:  # infeasible at c[x]: so is everything below
                    cursor_hi = lo - 1
                    break
                q = int(np.searchsorted(c, pr.realised, side="left"))
                cursor_hi, cursor_s = min(q, x) - 1, pr.total
            if lo <= cursor_hi:
                new_open.append((lo, cursor_hi, cursor_s))
        open_ = new_open
    return best_slices, best_max, probes


def _search_enumerate(
    tables: _Tables, stages: int, epsilon: float, copies: int = 1
) -> tuple[Slices | None, float, int]:
    """The published method: t_max ascending over the distinct tile costs, stopping once K·t_max exceeds the best.

    With ε > 0 the costs are taken in windows [s, s + ε] and only the window's largest cost is evaluated: every
    skipped t* in the window then has S*(top) ≤ S*(t*) and a largest tile ≤ t* + ε, so the answer stays within
    (K−1)·ε of the optimum.
    """
    c = tables.distinct_costs(0.0, np.inf)
    starts, tops = [], []
    k = 0
    while k < len(c):
        top = int(np.searchsorted(c, c[k] + epsilon, side="right")) - 1 if epsilon > 0 else k
        starts.append(c[k])
        tops.append(c[top])
        k = top + 1
    starts, tops = np.asarray(starts), np.asarray(tops)
    best_T, best_slices, best_max, probes = math.inf, None, math.inf, 0
    for first in range(0, len(tops), _ENUMERATE_BATCH):
        window = slice(first, first + _ENUMERATE_BATCH)
        # A scheme whose largest tile is t costs at least K·t: nothing from here on can beat best_T.
        alive = (copies + stages - 1) * starts[window] <= best_T
        if not alive.any():
            break
        results = _probe(tables, tops[window][alive])
        probes += len(results)
        best_T, best_slices, best_max = _improve(results, stages, best_T, best_slices, best_max, copies, tables.virtual)
    return best_slices, best_max, probes


def solve(
    cost: Cost,
    *,
    seq_len: int,
    batch_size: int,
    stages: int,
    token_step: int = 1,
    epsilon: float = 0.0,
    method: str = "exact",
    batch_slice: int | None = None,
    grouping: Sequencing | None = None,
    neighbours: int = 0,
    ceiling: float = math.inf,
) -> PlanResult | None:
    """Choose token and batch slicing minimising the objective of docs/design.md §4.

    ``method="exact"`` (default) returns the exact optimum for ``epsilon=0`` and stays within ``stages·epsilon``
    of it otherwise; ``method="enumerate"`` is the published ε-enumeration, kept for comparison.
    ``batch_slice=b`` (dividing the batch) plans B/b equal batch slices of b sequences, all sliced alike. A cost of
    +inf forbids a tile; None when every scheme needs a forbidden tile. ``grouping`` (a `Sequencing`) restricts the
    batch groupings, in order, and the tiles each batch slice may use by its place. ``neighbours=n`` also returns, in
    ``alternatives``, the cheapest schemes under the n distinct tile costs on either side of the optimum's largest
    tile (each the exact optimum for its threshold): the candidates a schedule-aware choice re-ranks. A cost with a
    ``max_batch_slice`` attribute (`CostModel(within_profile=True)`) prices no larger batch slice: none is searched.
    ``ceiling`` (seconds, as ``predicted_s``; exact method): only a scheme faster than it is wanted — the search prunes
    against it from the start, and a result with ``predicted_s`` ≥ ``ceiling`` only says that no scheme is faster
    than ``ceiling`` (the search of many cost models, `plan.configs`, passes the best found so far).
    """
    _check_sizes(seq_len=seq_len, batch_size=batch_size, stages=stages, token_step=token_step)
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0 and math.isfinite(epsilon)):
        raise UserError(f"must be a non-negative number of seconds, got {epsilon!r}", where="epsilon")
    if method not in METHODS:
        raise UserError(f"must be one of {', '.join(METHODS)}, got {method!r}", where="method")
    args = (seq_len, batch_size, stages, token_step, epsilon, method, batch_slice, grouping, neighbours, ceiling)
    key = getattr(cost, "price_key", None)
    if key is None or grouping is not None:
        return _solve(cost, *args)
    # The same search of a cost model that prices alike, within one plan (`memo`): its answer, a copy each time.
    step = (getattr(cost, "step_s", 0.0), getattr(cost, "virtual", 1))
    res = memo.remembered(("solve", key, step, *args), lambda: _solve(cost, *args))
    return copy.deepcopy(res)


def _solve(
    cost: Cost,
    seq_len: int,
    batch_size: int,
    stages: int,
    token_step: int,
    epsilon: float,
    method: str,
    batch_slice: int | None,
    grouping: Sequencing | None,
    neighbours: int,
    ceiling: float,
) -> PlanResult | None:
    started = time.perf_counter()
    search = _search_exact if method == "exact" else _search_enumerate
    if method == "exact" and ceiling < math.inf:  # in the search's units: without the per-step constant
        high = ceiling - getattr(cost, "step_s", 0.0)
        search = lambda *args: _search_exact(*args, ceiling=high)  # noqa: E731
    if batch_slice is not None and grouping is not None:
        raise ValueError("batch_slice and grouping exclude each other")
    if batch_slice is None:
        tables = _tables(cost, seq_len=seq_len, batch_size=batch_size, token_step=token_step, grouping=grouping)
        slices, t_max, probes = search(tables, stages, float(epsilon))
        whole = lambda sl: [(b, list(lengths)) for b, lengths in sl]  # noqa: E731  (a copy: the probe's is kept)
    else:
        if batch_size % batch_slice:
            raise UserError(f"{batch_slice} does not divide the batch of {batch_size}", where="batch_slice")
        one = _ScaledBatch(cost, batch_slice)
        tables = _tables(one, seq_len=seq_len, batch_size=1, token_step=token_step)
        slices, t_max, probes = search(tables, stages, float(epsilon), batch_size // batch_slice)
        whole = lambda sl: [(batch_slice, list(sl[0][1]))] * (batch_size // batch_slice)  # noqa: E731
    if slices is None:
        return None
    shape = {"stages": stages, "seq_len": seq_len, "batch_size": batch_size, "token_step": token_step}
    chosen = whole(slices)
    near = [whole(sl) for sl in _neighbour_schemes(tables, t_max, neighbours)] if neighbours and stages > 1 else []
    # The scheme and its neighbours priced together (`_results`: one call of a cost model for all their tiles).
    res, *alternatives = _results(cost, [chosen, *(sl for sl in near if sl != chosen)], **shape, method=method)
    res.epsilon, res.candidates = float(epsilon), probes
    if near:
        res.alternatives = sorted(alternatives, key=lambda r: r.predicted_s)
    res.seconds = time.perf_counter() - started
    return res


def lower_bound(cost: Cost, *, seq_len: int, batch_size: int, stages: int, token_step: int = 1) -> float:
    """A bound no scheme's objective falls below: the least total tile time of any scheme, S*(∞), plus K − 1 times
    the least largest tile any scheme can have (one DP pass; `solve` takes many). +inf when the cost forbids every
    scheme. Used to search several cost models (one per partition of the layers, `plan.configs`) exactly: a model
    whose bound reaches the best objective found need not be solved."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, stages=stages, token_step=token_step)
    tables = _tables(cost, seq_len=seq_len, batch_size=batch_size, token_step=token_step)
    top = tables.top()
    if top.slices is None:
        return math.inf
    least = tables.smallest_feasible_t_max()  # the stall term is left out: it only adds (a bound stays a bound)
    return objective(top.total, least, stages, getattr(cost, "step_s", 0.0))


def _neighbour_schemes(tables: _Tables, t_max: float, count: int) -> list[Slices]:
    """Distinct schemes S*(t) for ``count`` thresholds t spread evenly (by rank) over the feasible tile costs below
    ``t_max`` and ``count`` over those from ``t_max`` up to twice it."""
    c = tables.distinct_costs(tables.smallest_feasible_t_max(), 2 * t_max)
    c = c[np.isfinite(c)]
    at = int(np.searchsorted(c, t_max))
    below = np.unique(np.linspace(0, at - 1, count).round().astype(int)) if at > 0 else np.array([], dtype=int)
    above = np.unique(np.linspace(at + 1, len(c) - 1, count).round().astype(int)) if at + 1 < len(c) else below[:0]
    picks = c[np.concatenate([below, above])]
    out: list[Slices] = []
    for pr in _probe(tables, picks) if len(picks) else []:
        if pr.slices is not None and pr.slices not in out:
            out.append(pr.slices)
    return out
