"""The choice among pipeline configurations (docs/design.md §11): how the layers are cut into chunks (the
partition), how many chunks each device runs (v, interleaving) and the schedule order. Imports no torch.

`plan_configured` is what `terapipe plan` calls. For every v it may use (the one asked for, or with
``--virtual-stages auto`` each v = 1, 2, … up to `MAX_VIRTUAL` while the K·v chunks leave every middle chunk a layer;
v > 1 only with K > 1), and every partition it may use (the one given, the most even by layers, or with
``--partition auto`` the candidates of `partition_candidates`), it plans the configuration with `plan_for_profile`:
the exact slicing under the objective, the memory limit, the schedule-aware re-ranking.

* Across partitions of one v the objective decides, exactly: the partitions are taken in the order of their lower
  bound (`search.lower_bound`, one DP pass each) and the search stops once a bound reaches the best objective found,
  so the result is the exact optimum over partitions and slicings (brute force agrees: tests/plan/test_configs.py).
* Across v, and between GPipe and 1F1B order, the simulator decides: the objective prices both orders alike and
  leaves out the wrap-around stall of interleaving (a tile comes back to device 0 after K chunk-times; with fewer
  tiles than K the device waits), which the simulator replays. The fastest simulated configuration is the plan; the
  runner-up is recorded beside it. With v > 1 the memory-aware search (§10, whose closed forms are for one chunk per
  device) does not run: a configuration whose estimate exceeds an enforced limit is dropped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from terapipe_cli.errors import UserError
from terapipe_cli.plan.choice import Planned, outside_profile, plan_for_profile, plan_one, smallest_peak
from terapipe_cli.plan.costmodel import CostModel, GridKinds, Profile
from terapipe_cli.plan.memory import check_memory, scheme_memory
from terapipe_cli.plan.request import PlanRequest
from terapipe_cli.plan.search import grid_kinds, grid_prices, lower_bound, solve
from terapipe_cli.schedule import memo
from terapipe_cli.schedule.orders import SPLIT_INTERLEAVED, order_of
from terapipe_cli.schedule.orders.one_f_one_b import ONE_F_ONE_B
from terapipe_cli.schedule.orders.zero_bubble import ZB_V
from terapipe_cli.schedule.partition import Partition, refuses_tied
from terapipe_cli.schedule.schedule import ORDERS

# What the search tells as it goes (`plan_configured(progress=…)`): one line of text.
Progress = Callable[[str], None]

MAX_VIRTUAL = 4  # --virtual-stages auto tries v = 1 … 4 (Megatron-LM's runs use 2–4 chunks per device)
# With --partition auto and at most this many partitions, every one is a candidate (small cases: exact by brute
# force); beyond it, those within `_window` layers of the even split.
ALL_PARTITIONS = 64


@dataclass(frozen=True)
class Configured:
    """The plan of the chosen configuration, and the runner-up's (another v, order or partition), if any."""

    planned: Planned
    runner_up: Planned | None
    tried: int  # configurations planned (partitions whose bound ruled them out are not counted)
    # Every configuration planned (each v's best and next best partition), fastest simulated first (`plan.tune`).
    considered: tuple[Planned, ...] = ()

    def line(self) -> str:
        """What was chosen, and what the runner-up would cost (simulated)."""
        p = self.planned
        text = f"configuration: {describe(p)}, simulated {_ms(p.simulated_s[p.scheme])}"
        if self.runner_up is not None:
            r = self.runner_up
            text += f"; runner-up: {describe(r)}, simulated {_ms(r.simulated_s[r.scheme])}"
        return text + f" ({self.tried} planned)"


def describe(planned: Planned) -> str:
    """``1F1B order, 2 virtual stages, layers 1 2 | 2 1``."""
    part = planned.partition
    text = planned.choice_text()
    if part.virtual > 1:
        text += f", {part.virtual} virtual stages"
    return text + f", layers {part.text()}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def virtual_candidates(request: PlanRequest, layers: int) -> list[int]:
    if request.partition is not None:
        return [request.partition.virtual]
    if request.virtual is not None:
        return [request.virtual]
    if not request.order_free and order_of(request.order).placement == "v":
        return [2]  # the V holds two chunks per device (ZB-V)
    K = request.stages
    return [v for v in range(1, MAX_VIRTUAL + 1) if v == 1 or (K > 1 and K * v - 2 <= layers)]


def partition_candidates(profile: Profile, request: PlanRequest, virtual: int) -> list[Partition]:
    """The partitions to plan for one v: the fixed one, the most even by layers, or (``--partition auto``) every
    valid partition when there are at most `ALL_PARTITIONS` (small cases: exact), else those whose middle chunks are
    as even as can be and whose first and last chunks are within `_window` layers of the even split (the ends weigh
    that many layers at the most; only the slowest middle chunk counts with v = 1)."""
    N, K = profile.model.layers, request.stages
    if request.partition is not None:
        return [request.partition]
    place = request.placement
    balanced = Partition.balanced(N, K, virtual, place)
    S = K * virtual
    if request.partition_mode != "auto" or S == 1:
        return [balanced]
    if count_partitions(N, S) <= ALL_PARTITIONS:
        return [Partition(c, K, place) for c in _compositions(N, S)]
    lo, hi = _window(profile, N, S)
    out = {balanced}
    for a in range(lo, hi + 1):
        for c in range(lo, hi + 1) if S > 2 else [N - a]:
            rest = N - a - c
            if S == 2 and 0 <= c <= N:
                out.add(Partition((a, c), K, place))
            elif S > 2 and rest >= S - 2:
                out.add(Partition((a, *Partition.balanced(rest, S - 2).layers, c), K, place))
    return sorted(out, key=lambda p: p.layers)


def count_partitions(layers: int, chunks: int) -> int:
    """Partitions of ``layers`` into ``chunks`` chunks, each middle chunk holding at least one layer."""
    if chunks == 1:
        return 1
    free = layers - (chunks - 2)
    return math.comb(free + chunks - 1, chunks - 1) if free >= 0 else 0


def _compositions(layers: int, chunks: int):
    """Every partition counted by `count_partitions`, as tuples of layer counts."""
    if chunks == 1:
        yield (layers,)
        return
    free = layers - (chunks - 2)
    for cuts in itertools.combinations(range(free + chunks - 1), chunks - 1):
        counts = [b - a - 1 for a, b in zip((-1, *cuts), (*cuts, free + chunks - 1), strict=True)]
        yield tuple(n + (1 if 0 < k < chunks - 1 else 0) for k, n in enumerate(counts))


def _window(profile: Profile, layers: int, chunks: int) -> tuple[int, int]:
    """The first (and last) chunk's layers worth trying: from the even share less the most the ends cost in layers
    (their time over one layer's, at the largest ratio on the profile's grid), to one more than the even share."""
    even = layers / chunks
    ends = profile.ends
    weight = 0.0
    if ends is not None:
        layer = profile.forward_s + profile.backward_s
        for grid in (ends.embed_forward_s + ends.embed_backward_s, ends.head_forward_s + ends.head_backward_s):
            weight = max(weight, float(np.max(grid / np.maximum(layer, 1e-30))))
    if chunks == 2:
        spread = math.ceil(weight / 2) + 1
        return max(0, math.floor(even) - spread), min(layers, math.ceil(even) + spread)
    return max(0, math.floor(even) - math.ceil(weight) - 1), math.ceil(even) + 1


@memo.sharing()  # the tile prices and tables of the many configurations compared, each made once (`schedule.memo`)
def plan_configured(profile: Profile, request: PlanRequest, progress: Progress | None = None) -> Configured:
    """The plan of the fastest configuration (module docstring). ``progress`` hears, as the search goes, what is
    being searched, how much is left and the best so far (one line each time: `terapipe plan`'s moving line)."""
    N = profile.model.layers
    best: list[Planned] = []  # per v, its best configuration
    seconds: list[Planned] = []  # per v, the next best partition planned
    refused: list[UserError] = []  # why a configuration fit nowhere (the memory limit)
    tried = 0
    report = progress or (lambda text: None)
    vs = virtual_candidates(request, N)
    configs = [(v, request) for v in vs] + [(2, r) for r in _on_the_v(profile, request, vs)]
    for n, (v, r) in enumerate(configs):
        where = f"v = {v}" + (", ZB-V" if r is not request else "")
        where += f" ({n + 1} of {len(configs)})" if len(configs) > 1 else ""
        if best:
            fastest = min(best, key=lambda p: p.simulated_s[p.scheme])
            where += f", fastest so far {describe(fastest)}: simulated {_ms(fastest.simulated_s[fastest.scheme])}"
        tell = lambda text, where=where: report(f"{where}: {text}")  # noqa: E731
        first, second, count = _best_partition(profile, r, v, refused, tell)
        tried += count
        best += [first] if first is not None else []
        seconds += [second] if second is not None else []
    if not best:
        if refused:  # every partition fits nowhere: the one whose smallest peak is the least
            raise min(refused, key=lambda e: getattr(e, "least_bytes", math.inf))
        raise _none_fits(request)
    simulated = lambda p: p.simulated_s[p.scheme]  # noqa: E731
    ranked = sorted(best, key=simulated)
    others = ranked[1:] or sorted(seconds, key=simulated)
    return Configured(ranked[0], others[0] if others else None, tried, tuple(sorted(best + seconds, key=simulated)))


def _none_fits(request: PlanRequest) -> UserError:
    """Why nothing was planned when no configuration fits the memory limit and none was refused with its smallest
    peak: each has more than one chunk per device, whose plans are searched without the limit and then checked (the
    memory-aware search, §10, is for one chunk per device), and the way round (which options allow one chunk)."""
    if request.placement == "v":
        return UserError(
            "zbv runs two chunks per device, and none of its plans fits the memory limit (plans with more than one "
            "chunk per device are searched without the limit, then checked); use --order auto or 1f1b, whose plans "
            "with one chunk per device are searched within the limit",
            where="--order",
        )
    if request.partition is not None:
        return UserError(
            f"no plan of these {request.partition.chunks} chunks ({request.partition.virtual} per device) fits the "
            "memory limit (plans with more than one chunk per device are searched without the limit, then "
            "checked); give one layer count per stage, whose plans are searched within the limit",
            where="--layers-per-stage",
        )
    return UserError(
        "no configuration with more than one virtual stage fits the memory limit (they are searched without the "
        "limit, then checked); use --virtual-stages 1, whose plans are searched within the limit",
        where="--virtual-stages",
    )


def split_timed(profile: Profile) -> bool:
    """Whether the profile timed I and W apart as the runtime runs them (measured, schema /2 on): only then does
    ``--order auto`` plan the split orders. Split by the architecture's ratio (/1) or estimated (analytic, example),
    the split's price is an estimate, which the runtime's two calls can exceed by more than the bubble W fills (the
    tiny model on a CPU: I + W about 40% dearer than B); such a profile plans them only when asked."""
    return profile.split_source == "measured"


def split_orders(profile: Profile) -> tuple[str, ...]:
    """The split orders on a configuration's own partition that ``--order auto`` tries: none unless the profile
    timed I and W apart (`split_timed`)."""
    return SPLIT_INTERLEAVED if split_timed(profile) else ()


def _on_the_v(profile: Profile, request: PlanRequest, vs: list[int]) -> list[PlanRequest]:
    """With the order free: ZB-V's configuration (two chunks per device in a V: a placement, hence partitions, of its
    own) beside those of ``vs``, when two chunks per device are among them, no partition is given, the head is not
    tied to the embedding (the V puts both ends on device 0, which the tied copy's gradient sum does not know) and the
    profile timed I and W apart (`split_timed`)."""
    tied = profile.model.tie_embeddings and refuses_tied(ZB_V.placement)
    if not request.order_free or 2 not in vs or request.partition is not None or tied:
        return []
    if not split_timed(profile):
        return []
    return [replace(request, order=ZB_V.name, order_free=False)]


def _best_partition(
    profile: Profile, request: PlanRequest, virtual: int, refused: list[UserError], progress: Progress
) -> tuple[Planned | None, Planned | None, int]:
    """The best plan over the partitions for one v by the objective (exact: bound order, module docstring), then in
    the order the simulator prefers when the order is free, and the next best partition planned; (None, None, n)
    when none fits. ``refused`` collects the one-line reasons of partitions that fit nowhere."""
    r = request
    candidates = partition_candidates(profile, r, virtual)
    order = None if r.order_free else r.order
    shape = {"seq_len": r.seq_len, "batch_size": r.batch_size, "stages": r.stages, "token_step": r.token_step}
    costs = {p: CostModel(profile, r.stages, r.data_parallel, within_profile=True, partition=p) for p in candidates}
    kept, dominated = _undominated(costs, r) if len(candidates) > 1 else (candidates, {})
    bounds = {p: lower_bound(costs[p], **shape) for p in kept} if len(kept) > 1 else {kept[0]: -math.inf}
    free_of: dict[Partition, float] = {}  # each partition's optimum without the memory limit, where searched
    scored: list[tuple[float, Partition]] = []  # the objective's optimum of each partition searched, within memory
    deferred: list[tuple[float, Partition]] = []  # (a bound, partition) for the pass within the memory limit

    def best_so_far() -> float:
        return min((t for t, _ in scored), default=math.inf) * (1 - 1e-12)

    def ceiling() -> float:
        # Only the two best partitions matter (the plan and its runner-up): a search prunes against the second.
        values = sorted(t for t, _ in scored)
        return values[1] if len(values) > 1 else math.inf

    def unconstrained(part: Partition) -> bool:
        free, fits = _unconstrained(profile, r.with_config(part, order), ceiling())
        free_of[part] = free  # with fits None, a bound: the partition's optimum is no less
        if fits:
            scored.append((free, part))
        return bool(fits)

    def tell(what: str, done: int, left: int) -> None:
        best = min(scored, key=lambda x: x[0], default=None)
        text = f"{what} {done + 1} of {len(candidates)} partitions ({left} left after bounds)"
        progress(text + (f"; best {_ms(best[0])} by the objective, layers {best[1].text()}" if best else ""))

    order_of_bounds = sorted(kept, key=lambda p: (bounds[p], p.layers))
    for n, part in enumerate(order_of_bounds):
        if bounds[part] >= best_so_far():
            break
        tell("searching partition", n, sum(1 for p in order_of_bounds[n:] if bounds[p] < best_so_far()))
        if not unconstrained(part) and part.virtual == 1:  # its optimum within the limit is no less than ``free``
            deferred.append((free_of[part], part))
    if deferred:  # the limit binds: a partition no faster anywhere may still fit where the faster ones do not
        for part, by in dominated.items():
            deferred.append((free_of.get(by, bounds.get(by, -math.inf)), part))
    recomputing = _Prices({}, r)  # the recomputing cost models of the partitions that only fit recomputed
    passed: list[Partition] = []  # of those, the ones found unable to beat the best found at the time
    for bound, part in sorted(deferred, key=lambda x: (x[0], x[1].layers)):
        if bound >= best_so_far():
            break
        # Where only recomputation fits, the search without the limit (priced without it) finds nothing that fits.
        recomputed = part.virtual == 1 and _only_recomputed(profile, r.with_config(part, order))
        if part not in free_of and not recomputed and unconstrained(part):
            continue
        if recomputed:
            cost = CostModel(profile, r.stages, r.data_parallel, recompute=True, within_profile=True, partition=part)
            recomputing.add(part, cost)
            # Recomputed, no cheaper on any tile nor per step than one that could not beat the best (which only
            # falls): it cannot either. Else its bound (`_memory_bound`).
            no_cheaper = (q for q in passed if recomputing.costs[q].step_s <= cost.step_s)
            if any(recomputing.dominates(q, part) for q in no_cheaper) or (
                _memory_bound(profile, r.with_config(part, order), cost, bound, best_so_far()) >= best_so_far()
            ):
                passed.append(part)
                continue
        progress(f"searching layers {part.text()} within the memory limit")
        optimum = _within_memory(profile, r.with_config(part, order), refused, ceiling())
        scored += [(optimum, part)] if optimum is not None else []
    if not scored:
        return None, None, 0
    scored.sort(key=lambda x: x[0])  # stable: among equals, the bound's order (then the layers)
    progress(f"simulating the best of {len(scored)} partitions searched, layers {scored[0][1].text()}, in each order")
    if order is None and virtual > 1:  # planned, re-ranked and simulated in each order; the fastest that fits
        orders = ORDERS + split_orders(profile)
        each = [_plan_partition(profile, r.with_config(scored[0][1], o)) for o in orders]
        best = min([p for p in each if not _over(p)] or each, key=lambda p: p.simulated_s[p.scheme])
        runner_order = best.order
    else:
        best = _order_by_simulation(profile, _plan_partition(profile, r.with_config(scored[0][1], order)))
        runner_order = order
    # The runner-up only for its line: the objective's optimum, simulated (no re-ranking).
    second = None
    if len(scored) > 1:
        second = _plan_partition(profile, replace(r, rank="formula").with_config(scored[1][1], runner_order))
    return best, second, len(scored)


def _undominated(costs: dict[Partition, CostModel], request: PlanRequest) -> tuple[list[Partition], dict]:
    """The partitions no other prices lower or equal on every tile a scheme may use (what the objective sums, and
    what its bubble takes the largest of), and each dominated one with a partition that dominates it: the
    objective is non-decreasing in every tile's cost, so a dominated partition's optimum is no better (§11a).
    Taken in the order of their prices' sums (then layers), each is checked against those kept before it
    (`_Prices.dominates`)."""
    prices = _Prices(costs, request)
    sums = {part: prices.finite_sum(part) for part in costs}
    kept: list[tuple[Partition, list[np.ndarray]]] = []
    dominated: dict[Partition, Partition] = {}
    for part in sorted(costs, key=lambda p: (sums[p], p.layers)):
        by = next((k for k, theirs in kept if prices.dominates(k, part, theirs)), None)
        if by is None:
            kept.append((part, prices.prices(part)))
        else:
            dominated[part] = by
    return [part for part, _ in kept], dominated


class _Prices:
    """The tile prices of several partitions' cost models of one profile and request, on every tile a scheme may
    use: what the objective sums, and what its bubble takes the largest of. Each is the slowest of the partition's
    kinds of device (and chunk) (`CostModel.grid_kinds`, shared within the plan), so one partition is no dearer than
    another where each of its kinds is no dearer than one of the other's — by their makings (`GridKinds.below`), else
    by their times — and only where that fails are the two partitions' prices compared tile by tile."""

    def __init__(self, costs: dict[Partition, CostModel], request: PlanRequest) -> None:
        r = request
        self.units, self.token_step, self.batch_size = r.seq_len // r.token_step, r.token_step, r.batch_size
        self.costs: dict[Partition, CostModel] = {}
        self.kinds: dict[Partition, GridKinds] = {}
        self.below: dict[tuple, bool] = {}  # (parts, kind, kind', devices or chunks) → no dearer on every tile
        self.sizes: np.ndarray | None = None
        self.room: np.ndarray | None = None  # a partition's prices, while they are summed
        for part, cost in costs.items():
            self.add(part, cost)

    def add(self, part: Partition, cost: CostModel) -> None:
        if self.sizes is None:
            self.sizes = np.arange(1, min(self.batch_size, cost.max_batch_slice or self.batch_size) + 1)
        self.costs[part] = cost
        self.kinds[part] = grid_kinds(cost, self.sizes, self.units, self.token_step)

    def _alike(self, *parts: Partition) -> bool:
        """Whether these partitions' kinds are priced from one set of parts, for every batch slice asked."""
        kinds = [self.kinds[p] for p in parts]
        return len({k.key for k in kinds}) == 1 and all(np.array_equal(k.span, self.sizes) for k in kinds)

    def prices(self, part: Partition) -> list[np.ndarray]:
        """[cost] or [cost, bubble], a row per batch-slice size."""
        if not self._alike(part):  # rows outside the profile: the prices themselves
            return grid_prices(self.costs[part], self.sizes, self.units, self.token_step)
        k = self.kinds[part]
        return [k.slowest(list(times.values())) for times in (k.devices, k.chunks) if times is not None]

    def finite_sum(self, part: Partition) -> float:
        """The sum of the partition's finite costs."""
        k = self.kinds[part]
        if self._alike(part) and k.nonnegative:  # every price finite: the sum of the prices as they are
            if self.room is None:
                self.room = np.empty((len(self.sizes), self.units * (self.units + 1) // 2))
            return float(np.sum(k.slowest(list(k.devices.values()), out=self.room)))
        total = self.prices(part)[0]
        return float(np.sum(np.where(np.isfinite(total), total, 0)))

    def dominates(self, cheap: Partition, dear: Partition, cheap_prices: list[np.ndarray] | None = None) -> bool:
        """Whether ``cheap``'s prices are no greater than ``dear``'s on every tile (``cheap_prices``: its prices, when
        at hand)."""
        theirs = self.kinds[dear]
        if self._alike(cheap, dear):
            mine = self.kinds[cheap]
            if all(
                all(any(self._kind_below(a, b, which, mine, theirs) for b in getattr(theirs, which)) for a in times)
                for which, times in (("devices", mine.devices), ("chunks", mine.chunks))
                if times is not None
            ):
                return True
        cheap_prices = self.prices(cheap) if cheap_prices is None else cheap_prices
        if not self._alike(dear):
            return _no_dearer(cheap_prices, lambda at: [x[at] for x in self.prices(dear)])
        slowest = [[*times.values()] for times in (theirs.devices, theirs.chunks) if times is not None]
        return _no_dearer(cheap_prices, lambda at: [theirs.slowest([x[at] for x in t]) for t in slowest])

    def _kind_below(self, a: tuple, b: tuple, which: str, mine: GridKinds, theirs: GridKinds) -> bool:
        if mine.below(a, b):
            return True
        key = (mine.key, a, b, which)
        if key not in self.below:
            times = getattr(theirs, which)[b]
            self.below[key] = _no_dearer([getattr(mine, which)[a]], lambda at: [times[at]])
        return self.below[key]


def _no_dearer(cheap: list[np.ndarray], dear) -> bool:
    """Whether every array of ``cheap`` is ≤ the same of ``dear(at)`` (the arrays at index ``at``) on every tile:
    first on a sample of the tiles, which usually finds a dearer one at once, then on all of them."""
    sample = (slice(None), slice(None, None, 61))
    if not all(np.all(c[sample] <= d) for c, d in zip(cheap, dear(sample), strict=True)):
        return False
    return all(np.all(c <= d) for c, d in zip(cheap, dear(...), strict=True))


def _unconstrained(profile: Profile, request: PlanRequest, ceiling: float = math.inf) -> tuple[float, bool | None]:
    """The objective's optimum of one configuration without the memory limit, and whether it fits the limit (a
    search alone: the cheap first pass over the partitions). With v > 1 and the order free, it fits when it fits in
    either order (the objective prices both alike; `_best_partition` then plans both and keeps one that fits): in GPipe
    order every batch slice of a chunk stays open until the backwards start, and checking that order alone dropped
    every v > 1 of Megatron-LM's 310.1B setting, recomputed, although it fits in 1F1B order (docs/results.md).
    ``ceiling``: only an optimum below it is wanted (`search.solve(ceiling=…)`); (ceiling, None) when there is none."""
    r, part = request, request.partition
    cost = CostModel(profile, r.stages, r.data_parallel, recompute=r.recompute, within_profile=True, partition=part)
    shape = {"seq_len": r.seq_len, "batch_size": r.batch_size, "stages": r.stages, "token_step": r.token_step}
    res = solve(cost, **shape, epsilon=r.epsilon, method=r.method, ceiling=ceiling)
    if res is None:  # the same for every configuration: the profile's batch sizes cannot make up the batch
        raise UserError(outside_profile(profile, r.batch_size, "no batch slicing"), where="--batch")
    if res.predicted_s >= ceiling:
        return ceiling, None
    orders = ORDERS if r.order_free and part.virtual > 1 else (r.order,)
    copies = r.data_parallel * r.tensor_parallel

    def fits(order: str) -> bool:
        per_stage = scheme_memory(profile, res.slices, r.stages, order, (r.recompute,) * part.chunks, part)
        memory = check_memory(per_stage, profile.device, r.memory_limit_gib, copies)
        return memory is None or not (memory.enforced and memory.exceeded)

    return res.predicted_s, any(fits(order) for order in orders)


def _only_recomputed(profile: Profile, request: PlanRequest) -> bool:
    """Whether every scheme of one configuration (v = 1) within its enforced limit per device must recompute: no
    scheme without recomputation reaches a peak within it (`choice.smallest_peak`), while recomputation is the
    planner's to choose (not already ``--recompute``, nor ruled out by ``--no-recompute``)."""
    r = request
    limit = r.memory_limit_gib * 2**30 if r.memory_limit_gib is not None else profile.device.get("memory_bytes")
    if (
        r.recompute
        or not r.recompute_free
        or not isinstance(limit, (int, float))
        or profile.device.get("kind") == "cpu"
    ):
        return False  # already priced recomputed, recomputation is not the planner's to choose, or a shared limit
    least, _ = smallest_peak(profile, r, float(limit), plain=True, recomputed=False)
    return least > limit


def _memory_bound(profile: Profile, request: PlanRequest, cost: CostModel, free: float, ceiling: float) -> float:
    """A lower bound on the optimum within the memory limit of one configuration whose schemes must recompute there
    (`_only_recomputed`), given ``free``, its optimum without the limit (or a bound on it): the optimum of ``cost``,
    its recomputing cost model (the objective prices recomputation with one more forward per tile), searched only
    below ``ceiling`` (the best found: ``ceiling`` when nothing is below it, and when its bound, one DP pass, says
    so). Far tighter than ``free`` (Llama 3 70B on 8 H100s, B = 16), and a partition it rules out is not searched
    within the limit."""
    r = request
    shape = {"seq_len": r.seq_len, "batch_size": r.batch_size, "stages": r.stages, "token_step": r.token_step}
    if lower_bound(cost, **shape) * (1 - 1e-12) >= ceiling:  # (the bound sums in another order than a scheme)
        return max(free, ceiling)
    res = solve(cost, **shape, epsilon=r.epsilon, method=r.method, ceiling=ceiling)
    return math.inf if res is None else max(free, min(res.predicted_s, ceiling))


def _within_memory(
    profile: Profile, request: PlanRequest, refused: list[UserError], ceiling: float = math.inf
) -> float | None:
    """The objective's optimum of one configuration (v = 1) within the memory limit (`plan_for_profile`'s search);
    None when nothing fits, ``refused`` getting the one-line reason, or when nothing that fits is below
    ``ceiling``."""
    try:
        planned = plan_for_profile(profile, replace(request, rank="formula"), ceiling=ceiling)
        return None if planned is None else _objective(planned)
    except UserError as e:
        if e.where != "--memory-limit":
            raise
        refused.append(e)
        return None


def _plan_partition(profile: Profile, request: PlanRequest) -> Planned:
    """One configuration planned in full (`plan_for_profile`; `plan_one` alone with v > 1)."""
    if request.partition.virtual == 1:
        return plan_for_profile(profile, request)
    return plan_one(profile, request)


def _objective(planned: Planned) -> float:
    """The objective's optimum of a planned configuration (the formula; the schedule-aware choice may run another
    scheme of it)."""
    return (planned.formula_optimal or planned.terapipe).predicted_s


def _order_by_simulation(profile: Profile, planned: Planned) -> Planned:
    """With the order left free (v = 1): the same scheme in another order when the simulator finds it faster and it
    fits — 1F1B order where no memory limit chose the order (the objective prices GPipe and 1F1B alike), and ZB-H1
    (the plan's order of forwards with every backward split into I and W, W filling the bubble) with the plan's
    recomputation, where its estimate fits (W keeps a tile's tensors longer) and the profile timed I and W apart
    (`split_orders`)."""
    r = planned.request
    if not r.order_free:
        return planned
    others = []
    if planned.order != ONE_F_ONE_B.name and planned.unfitted is None and r.batch_size > 1:
        others.append(ONE_F_ONE_B.name)
    others += split_orders(profile)
    # Each other order re-ranks the same candidates (the objective's optimum, its neighbours, the baselines) in its
    # own simulation: the scheme GPipe order preferred can be slower in 1F1B order than the optimum is there.
    optimum = planned.formula_optimal or planned.terapipe
    for order in others:
        other = plan_one(profile, r, optimum, order=order, recompute=planned.recompute)
        if not _over(other) and other.simulated_s["terapipe"] < planned.simulated_s["terapipe"] * (1 - 1e-9):
            planned = replace(other, unfitted=planned.unfitted, equal_slices_only=planned.equal_slices_only)
    return planned


def _over(planned: Planned) -> bool:
    """Whether the plan's memory estimate exceeds an enforced limit."""
    memory = planned.memory
    return memory is not None and memory.enforced and memory.exceeded
