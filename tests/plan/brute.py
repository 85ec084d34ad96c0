"""Brute-force references for the planner tests, written independently of `terapipe_cli.plan.search`.

Nothing here shares code or ideas with the planner's DP: it enumerates every composition of the sequence
(2^(n-1) of them for n = L/g token steps), every multiset of batch-slice sizes, and every threshold on the
largest tile. It is exponential on purpose and only meant for n <= ~10, B <= ~4.

Why a threshold search is exact: let a best scheme have largest tile M*. With the threshold M = M*, every
batch slice can choose, independently, its cheapest composition whose tiles all cost <= M*; that sum is no
more than the best scheme's, and the objective of that choice is at most  Σ sums + (K-1)·M*  = T*.
Every threshold M gives an upper bound on the objective of a real scheme (its real max is <= M), so the
minimum over M of  Σ_d best_sum_d(M) + (K-1)·M  is the optimum. `naive_optimum` checks this argument
by enumerating whole schemes on the smallest cases.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

Scheme = list[tuple[int, list[int]]]


# --- random cost tables -------------------------------------------------------------------------------


@dataclass
class TableCost:
    """A vectorised cost ``cost(b, i, j)`` read from a table indexed by (b, i // g, j // g).

    ``table[b, u, v]`` is the cost of a tile of b sequences, u·g new tokens, v·g context tokens. Entries
    the planner has no business using (b = 0, u = 0, u + v > n) are 0: a planner may compute a whole
    (i, j) grid and mask it (legitimate), but one that lets such a free tile into its answer finds a
    "better" optimum than the enumeration and fails the comparison.
    """

    table: np.ndarray  # shape (B + 1, n + 1, n + 1)
    token_step: int
    step_s: float = 0.0

    def __call__(self, b, i, j) -> np.ndarray:
        b, i, j = np.broadcast_arrays(np.asarray(b), np.asarray(i), np.asarray(j))
        g = self.token_step
        for name, x in (("b", b), ("i", i), ("j", j)):
            # The planner contract: integer token counts that are multiples of the token step.
            assert np.all(np.asarray(x) == np.round(x)), f"cost called with non-integer {name}"
        i_units, i_rem = np.divmod(i.astype(np.int64), g)
        j_units, j_rem = np.divmod(j.astype(np.int64), g)
        assert not np.any(i_rem) and not np.any(j_rem), "cost called with tokens that are not multiples of g"
        bb = b.astype(np.int64)
        nb, nu, nv = self.table.shape
        assert np.all((bb >= 0) & (bb < nb)), "cost called with a batch size outside 0..B"
        assert np.all((i_units >= 0) & (i_units < nu) & (j_units >= 0) & (j_units < nv)), "tokens outside 0..L"
        return self.table[bb, i_units, j_units].astype(float)


def random_table(rng: np.random.Generator, batch: int, n: int, kind: str) -> np.ndarray:
    """A (batch + 1, n + 1, n + 1) table of tile costs of one of several families.

    * ``increasing``: strictly increasing in b, i and j (the shape real costs have), float.
    * ``affine``: overhead + per-token + context term, like docs/design.md §3's model, float.
    * ``arbitrary``: independent uniform values, no structure at all.
    * ``integer``: small integers 1..4 — many exact ties between tiles and between schemes.
    * ``context_free``: does not depend on j at all (then the order of slices is irrelevant).
    * ``with_zeros``: integers 0..3, some tiles free (a planner must not assume costs are positive).
    """
    shape = (batch + 1, n + 1, n + 1)
    if kind == "increasing":
        steps = rng.uniform(0.01, 1.0, size=shape)
        t = steps.cumsum(axis=0).cumsum(axis=1).cumsum(axis=2)
    elif kind == "affine":
        b = np.arange(batch + 1)[:, None, None]
        u = np.arange(n + 1)[None, :, None]
        v = np.arange(n + 1)[None, None, :]
        c0, c1, c2, c3 = rng.uniform(0.0, 2.0, size=4)
        t = c0 + c1 * b * u + c2 * b * v + c3 * b * u * v * rng.uniform(0.0, 0.5)
        t = t * rng.uniform(0.9, 1.1, size=shape)  # measurement-like noise: not exactly monotone any more
    elif kind == "arbitrary":
        t = rng.uniform(0.0, 1.0, size=shape)
    elif kind == "integer":
        t = rng.integers(1, 5, size=shape).astype(float)
    elif kind == "context_free":
        t = np.broadcast_to(rng.uniform(0.1, 1.0, size=(batch + 1, n + 1, 1)), shape).copy()
    elif kind == "with_zeros":
        t = rng.integers(0, 4, size=shape).astype(float)
    else:
        raise ValueError(kind)
    u = np.arange(n + 1)[:, None]
    v = np.arange(n + 1)[None, :]
    invalid = (u == 0) | (u + v > n)
    t[:, invalid] = 0.0
    t[0] = 0.0
    return t


KINDS = ("increasing", "affine", "arbitrary", "integer", "context_free", "with_zeros")


@dataclass
class Case:
    seed: int
    kind: str
    n: int  # L / g
    token_step: int
    batch: int
    stages: int
    cost: TableCost

    @property
    def seq_len(self) -> int:
        return self.n * self.token_step

    def __repr__(self) -> str:  # what pytest prints for a failing case
        return (
            f"Case(seed={self.seed}, kind={self.kind!r}, L={self.seq_len}, g={self.token_step}, "
            f"B={self.batch}, K={self.stages})"
        )


def make_case(seed: int, *, max_n: int = 10, max_batch: int = 4, stages: Sequence[int] = (1, 2, 3, 8)) -> Case:
    """Everything about the case comes from the seed, so a failing seed reproduces on its own."""
    rng = np.random.default_rng(seed)
    kind = KINDS[seed % len(KINDS)]
    n = int(rng.integers(1, max_n + 1))
    g = int(rng.choice([1, 2, 8]))
    batch = int(rng.integers(1, max_batch + 1))
    k = int(rng.choice(list(stages)))
    return Case(seed, kind, n, g, batch, k, TableCost(random_table(rng, batch, n, kind), g))


# --- enumeration --------------------------------------------------------------------------------------


def compositions(n: int) -> Iterator[tuple[int, ...]]:
    """All ordered ways to write n as a sum of positive integers (2^(n-1) of them)."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        parts, run = [], 1
        for cut in cuts:
            if cut:
                parts.append(run)
                run = 1
            else:
                run += 1
        parts.append(run)
        yield tuple(parts)


def partitions(total: int, largest: int | None = None) -> Iterator[tuple[int, ...]]:
    """All multisets of positive integers summing to total, as non-increasing tuples."""
    largest = total if largest is None else largest
    if total == 0:
        yield ()
        return
    for first in range(min(total, largest), 0, -1):
        for rest in partitions(total - first, first):
            yield (first,) + rest


def tile_costs(cost: Callable, b: int, lengths: Sequence[int]) -> np.ndarray:
    """Costs of the tiles of one batch slice, in order: tile m has i = lengths[m], j = sum(lengths[:m])."""
    lengths = np.asarray(lengths, dtype=np.int64)
    context = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.asarray(cost(np.full_like(lengths, b), lengths, context), dtype=float)


def objective(cost: Callable, scheme: Scheme, stages: int) -> float:
    """docs/design.md §4 computed straight from the definition: Σ tiles + (K-1)·max tile + step_s."""
    tiles = np.concatenate([tile_costs(cost, b, lengths) for b, lengths in scheme])
    return float(tiles.sum() + (stages - 1) * tiles.max() + getattr(cost, "step_s", 0.0))


@dataclass
class BruteResult:
    optimum: float
    scheme: Scheme


def _composition_table(cost: Callable, b: int, n: int, g: int):
    """For batch size b: every composition's (sum, max), sorted by max, with a running min of the sums.

    The tiles of every composition are priced in one call (a cost prices each tile on its own), then summed and
    maxed per composition, as `tile_costs` one composition at a time would."""
    comps = list(compositions(n))
    lengths = np.concatenate([np.asarray(comp, dtype=np.int64) * g for comp in comps])
    context = np.concatenate([np.concatenate([[0], np.cumsum(comp)[:-1]]) * g for comp in comps]).astype(np.int64)
    t = np.broadcast_to(np.asarray(cost(np.full_like(lengths, b), lengths, context), dtype=float), lengths.shape)
    starts = np.cumsum([0] + [len(comp) for comp in comps[:-1]])
    sums, maxes = np.add.reduceat(t, starts), np.maximum.reduceat(t, starts)
    order = np.argsort(maxes, kind="stable")
    sums, maxes = sums[order], maxes[order]
    best_index = np.empty(len(comps), dtype=np.int64)  # index (in sorted order) of the cheapest so far
    best = 0
    for c in range(len(comps)):
        if sums[c] < sums[best]:
            best = c
        best_index[c] = best
    return [comps[o] for o in order], sums, maxes, best_index


def brute_optimum(cost: Callable, seq_len: int, batch_size: int, stages: int, token_step: int) -> BruteResult:
    """The exact optimum of docs/design.md §4 by enumeration (see the module docstring for why it is exact)."""
    assert seq_len % token_step == 0
    n, g = seq_len // token_step, token_step
    tables = {b: _composition_table(cost, b, n, g) for b in range(1, batch_size + 1)}
    thresholds = np.unique(np.concatenate([tables[b][2] for b in tables]))
    best_value, best_scheme = np.inf, None
    for parts in partitions(batch_size):
        total = np.zeros(len(thresholds))
        picks = []
        for b in parts:
            comps, sums, maxes, best_index = tables[b]
            # Last composition whose max is <= threshold; none -> infeasible at that threshold.
            pos = np.searchsorted(maxes, thresholds, side="right") - 1
            feasible = pos >= 0
            pick = np.where(feasible, best_index[np.maximum(pos, 0)], 0)
            total = total + np.where(feasible, sums[pick], np.inf)
            picks.append(pick)
        values = total + (stages - 1) * thresholds
        m = int(np.argmin(values))
        if values[m] < best_value:
            best_value = float(values[m])
            best_scheme = [(b, [u * g for u in tables[b][0][picks[d][m]]]) for d, b in enumerate(parts)]
    step = getattr(cost, "step_s", 0.0)
    return BruteResult(best_value + step, best_scheme)


def naive_optimum(cost: Callable, seq_len: int, batch_size: int, stages: int, token_step: int) -> float:
    """Every ordered list of batch-slice sizes × every tuple of compositions, objective from the definition.

    Exponential twice over; only for n <= 5 and B <= 2. It exists to check `brute_optimum` itself.
    """
    n, g = seq_len // token_step, token_step
    comps = list(compositions(n))
    best = np.inf
    for parts in _ordered_partitions(batch_size):
        for choice in itertools.product(comps, repeat=len(parts)):
            scheme = [(b, [u * g for u in c]) for b, c in zip(parts, choice, strict=True)]
            best = min(best, objective(cost, scheme, stages))
    return float(best)


def _ordered_partitions(total: int) -> Iterator[tuple[int, ...]]:
    if total == 0:
        yield ()
        return
    for first in range(1, total + 1):
        for rest in _ordered_partitions(total - first):
            yield (first,) + rest


def dp_reference(cost: Callable, seq_len: int, batch_size: int, stages: int, token_step: int) -> float:
    """The optimum for sizes too large to enumerate: docs/design.md §5's DP run for EVERY threshold at once.

    Written here, plainly, as a second opinion on the planner's pruned search: no candidate is skipped,
    so this is exact by the threshold argument of the module docstring. Thresholds above U/K, where U is
    the objective of any real scheme (the best uniform one), cannot hold the optimum: the best scheme's
    largest tile M* satisfies T* >= K·M* (its sum is at least M*), and T* <= U.
    """
    n, g = seq_len // token_step, token_step
    b = np.arange(1, batch_size + 1)[:, None, None]
    u = np.arange(1, n + 1)[None, :, None]  # new units
    v = np.arange(0, n)[None, None, :]  # context units
    table = np.broadcast_to(np.asarray(cost(b, u * g, v * g), dtype=float), (batch_size, n, n))
    valid = np.broadcast_to((u + v <= n)[0], (n, n))
    bound = uniform_reference(cost, seq_len, batch_size, stages, token_step) - getattr(cost, "step_s", 0.0)
    thresholds = np.unique(table[:, valid])
    if stages > 1:
        thresholds = thresholds[thresholds * stages <= bound * (1 + 1e-12)]
    else:
        thresholds = thresholds[-1:]  # no bubble: only the least sum matters
    per_b = []
    for bi in range(batch_size):
        best = np.full((n + 1, len(thresholds)), np.inf)
        best[0] = 0.0
        for end in range(1, n + 1):
            for length in range(1, end + 1):
                c = table[bi, length - 1, end - length]
                # The tile is allowed under the thresholds >= c: a suffix of the sorted thresholds.
                allowed = int(np.searchsorted(thresholds, c, side="left"))
                row = best[end, allowed:]
                np.minimum(row, best[end - length, allowed:] + c, out=row)
        per_b.append(best[n])
    total = [np.zeros(len(thresholds))]
    for s in range(1, batch_size + 1):
        total.append(np.min([total[s - d] + per_b[d - 1] for d in range(1, s + 1)], axis=0))
    return float(np.min(total[batch_size] + (stages - 1) * thresholds) + getattr(cost, "step_s", 0.0))


# --- baselines by enumeration -------------------------------------------------------------------------


def divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def gpipe_reference(cost: Callable, seq_len: int, batch_size: int, stages: int) -> float:
    """Best GPipe scheme [(m, [L])] * (B/m) over the divisors m of B."""
    return min(objective(cost, [(m, [seq_len])] * (batch_size // m), stages) for m in divisors(batch_size))


def uniform_reference(cost: Callable, seq_len: int, batch_size: int, stages: int, token_step: int) -> float:
    """Best over n equal token slices (n a power of two dividing L/g) × equal batch slices of m | B."""
    units = seq_len // token_step
    counts = [c for c in (2**p for p in range(units.bit_length())) if units % c == 0]
    return min(
        objective(cost, [(m, [seq_len // c] * c)] * (batch_size // m), stages)
        for m in divisors(batch_size)
        for c in counts
    )
