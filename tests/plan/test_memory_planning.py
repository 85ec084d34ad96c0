"""Memory-aware planning is exact (docs/design.md §10): compared with brute force over every scheme (every batch
grouping in every order of its batch slices, each batch slice with its own token slicing), every schedule order
and every choice of recomputing stages, under limits that bind.

The brute force shares nothing with the planner's search: it walks each candidate's schedule for its memory
(`memory.stage_memory`) and prices it with the objective straight from its definition."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import numpy as np
import pytest
from brute import compositions
from conftest import ROOT

from terapipe_cli.errors import UserError
from terapipe_cli.plan.choice import plan_for_profile, plan_one
from terapipe_cli.plan.costmodel import CostModel, read_profile
from terapipe_cli.plan.memory import stage_memory
from terapipe_cli.plan.request import plan_request
from terapipe_cli.plan.search import evaluate
from terapipe_cli.schedule.schedule import ORDERS, Schedule
from terapipe_cli.units import format_bytes

MEASURED = read_profile(ROOT / "tests" / "data" / "tiny-cpu-measured-schema1.json")


def _peak(slices, stages, order, recompute) -> float:
    return max(m.total_bytes for m in stage_memory(Schedule.build(slices, stages, order, recompute), MEASURED))


def _schemes(batch, seq_len, step):
    """Every scheme: each ordered batch grouping, each batch slice with any token slicing of its own."""
    slicings = [[u * step for u in comp] for comp in compositions(seq_len // step)]
    for grouping in compositions(batch):
        for lengths in itertools.product(slicings, repeat=len(grouping)):
            yield [(b, list(ls)) for b, ls in zip(grouping, lengths, strict=True)]


class _PricedOnce:
    """A cost model's price of every tile (b, i, j) of the instance, each tile priced alone by the model once and
    looked up after: the brute force prices the same few dozen tiles hundreds of thousands of times. `evaluate`
    takes it for the model (the same tile prices, the same per-step constant, one chunk per device)."""

    def __init__(self, cost: CostModel, batch: int, seq_len: int, step: int):
        assert cost.bubble is None and cost.virtual == 1  # one chunk per device: a tile's bubble is its own price
        self.step_s, self.virtual, self.bubble = cost.step_s, cost.virtual, None
        self._price = {
            (b, i, j): float(cost(np.array([b]), np.array([i]), np.array([j]))[0])
            for b in range(1, batch + 1)
            for i in range(step, seq_len + 1, step)
            for j in range(0, seq_len - i + 1, step)
        }

    def __call__(self, b, i, j) -> np.ndarray:
        return np.array([self._price[t] for t in zip(b.tolist(), i.tolist(), j.tolist(), strict=True)])


@functools.cache
def _every_candidate(batch, seq_len, step, stages):
    """(objective, peak of the fullest stage, scheme, order, recompute) of every scheme, order and choice of
    recomputing stages."""
    plain = _PricedOnce(CostModel(MEASURED, stages), batch, seq_len, step)
    rerun = _PricedOnce(CostModel(MEASURED, stages, recompute=True), batch, seq_len, step)
    out = []
    for slices in _schemes(batch, seq_len, step):
        value = {False: evaluate(plain, slices, stages), True: evaluate(rerun, slices, stages)}
        for order in ORDERS:
            # A stage's peak depends on its own recomputation only: walk every stage both ways once (the order's
            # actions do not depend on it: one schedule, recomputing nowhere and everywhere).
            schedule = Schedule.build(slices, stages, order)
            per_stage = {
                on: [m.total_bytes for m in stage_memory(replace(schedule, recompute=(on,) * stages), MEASURED)]
                for on in (False, True)
            }
            for recompute in itertools.product((False, True), repeat=stages):
                peak = max(per_stage[on][k] for k, on in enumerate(recompute))
                out.append((value[any(recompute)], peak, slices, order, recompute))
    return out


CASES = [
    (B, L, 8, K) for B, L, K in [(1, 48, 1), (1, 48, 2), (2, 40, 2), (4, 24, 2), (2, 40, 4), (3, 32, 4), (5, 16, 4)]
]


@pytest.mark.parametrize("batch, seq_len, step, stages", CASES)
def test_memory_aware_plans_equal_brute_force(batch, seq_len, step, stages):
    """The planner's optimum under each limit is brute force's. The cases: one stage and two stages with one batch
    slice (the token DP alone); two and four stages with up to two, three, four and five batch slices (the search
    over groupings and their orders), more batch slices than stages in (4, 24, 2) and (5, 16, 4) (1F1B's steady
    state); under the limits there, the optima slice batch slices of one grouping differently, recompute some
    stages only, and take either order; in (5, 16, 4) the fastest scheme overall fits at the loosest limit."""
    candidates = _every_candidate(batch, seq_len, step, stages)
    peaks = np.unique([c[1] for c in candidates])
    fastest = plan_one(
        MEASURED, plan_request(MEASURED, stages=stages, batch_size=batch, seq_len=seq_len, token_step=step)
    )
    binding = 0
    for q in (0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95):
        limit = float(np.quantile(peaks, q))
        request = plan_request(
            MEASURED, stages=stages, batch_size=batch, seq_len=seq_len, token_step=step, memory_limit_gib=limit / 2**30
        )
        fits = [c for c in candidates if c[1] <= request.memory_limit_gib * 2**30]
        # The fastest scheme overall (any batch slices) is the answer whenever it fits in some order unrecomputed.
        if any(_peak(fastest.terapipe.slices, stages, o, (False,) * stages) <= limit for o in ORDERS):
            expected = fastest.terapipe.predicted_s
        else:
            expected = min(c[0] for c in fits)
            binding += 1
        planned = plan_for_profile(MEASURED, request)
        optimum = planned.formula_optimal or planned.terapipe  # the objective's optimum; the plan may re-rank it
        assert optimum.predicted_s == pytest.approx(expected, rel=1e-9), (q, optimum.slices)
        # The published enumeration of t_max (at ε = 0) searches the same groupings to the same optimum.
        published = plan_for_profile(MEASURED, replace(request, method="enumerate"))
        assert (published.formula_optimal or published.terapipe).predicted_s == pytest.approx(expected, rel=1e-9)
        schedule = Schedule.build(planned.terapipe.slices, stages, planned.order, planned.recompute)
        memory = stage_memory(schedule, MEASURED)
        assert max(m.total_bytes for m in memory) <= limit * (1 + 1e-12)
        assert memory == planned.memory.per_stage
    assert binding >= 3  # the limit decided the answer in most of them


@pytest.mark.parametrize("batch, seq_len, step, stages", CASES[1:4])
def test_nothing_fits_gives_the_smallest_peak_of_brute_force(batch, seq_len, step, stages):
    least = min(c[1] for c in _every_candidate(batch, seq_len, step, stages))
    request = plan_request(
        MEASURED, stages=stages, batch_size=batch, seq_len=seq_len, token_step=step,
        memory_limit_gib=0.999 * least / 2**30,
    )  # fmt: skip
    with pytest.raises(UserError, match="no scheme fits") as err:
        plan_for_profile(MEASURED, request)
    assert f"smallest possible peak is {format_bytes(least)}" in str(err.value)
    # At that limit exactly, a plan exists, and its fullest stage is that peak.
    ok = plan_for_profile(MEASURED, replace(request, memory_limit_gib=least / 2**30))
    assert ok.memory.peak_bytes == pytest.approx(least, rel=1e-9)


def test_a_fixed_order_or_recomputation_is_kept():
    """What the user fixed is searched around, not changed."""
    request = plan_request(MEASURED, stages=2, batch_size=4, seq_len=24, token_step=8)
    candidates = _every_candidate(4, 24, 8, 2)
    limit = float(np.quantile([c[1] for c in candidates], 0.3))
    for order, recompute in [("gpipe", None), ("1f1b", None), (None, True), (None, False)]:
        r = plan_request(
            MEASURED, stages=2, batch_size=4, seq_len=24, token_step=8, memory_limit_gib=limit / 2**30, order=order,
            recompute=recompute,
        )  # fmt: skip
        allowed = [
            c for c in candidates
            if c[1] <= limit and (order is None or c[3] == order)
            and (recompute is None or all(c[4]) == recompute and any(c[4]) == recompute)
        ]  # fmt: skip
        if not allowed:
            with pytest.raises(UserError, match="no scheme fits"):
                plan_for_profile(MEASURED, r)
            continue
        planned = plan_for_profile(MEASURED, r)
        assert order is None or planned.order == order
        assert recompute is None or set(planned.recompute) == {recompute}
        optimum = planned.formula_optimal or planned.terapipe
        assert optimum.predicted_s <= min(c[0] for c in allowed) * (1 + 1e-9)
    assert request.memory_limit_gib is None


def test_unequal_batch_slices_win_under_a_limit_and_the_fallback_says_so(monkeypatch):
    """Negative control for the search over every grouping: restricted to equal batch slices (as it is when every
    grouping is too large a search), the same binding limit gives a slower plan, and the plan line says so."""
    import terapipe_cli.plan.groupings as groupings

    batch, seq_len, step, stages = 2, 40, 8, 2
    candidates = _every_candidate(batch, seq_len, step, stages)
    equal = [c for c in candidates if len({(b, tuple(ls)) for b, ls in c[2]}) == 1]
    gains = []
    for q in (0.05, 0.2, 0.4):
        limit = float(np.quantile(np.unique([c[1] for c in candidates]), q))
        fits_all = min(c[0] for c in candidates if c[1] <= limit)
        fits_equal = min(c[0] for c in equal if c[1] <= limit)
        request = plan_request(
            MEASURED, stages=stages, batch_size=batch, seq_len=seq_len, token_step=step, memory_limit_gib=limit / 2**30
        )
        planned = plan_for_profile(MEASURED, request)
        assert (planned.formula_optimal or planned.terapipe).predicted_s == pytest.approx(fits_all, rel=1e-9)
        assert planned.equal_slices_only == () and "equal batch slices only" not in planned.memory_choice()
        with monkeypatch.context() as m:
            m.setattr(groupings, "MAX_GROUPING_STATES", 0)
            m.setattr(groupings, "MAX_GROUPING_CELLS", 0)
            fallback = plan_for_profile(MEASURED, request)
        assert (fallback.formula_optimal or fallback.terapipe).predicted_s == pytest.approx(fits_equal, rel=1e-9)
        assert fallback.equal_slices_only == ORDERS and "equal batch slices only" in fallback.memory_choice()
        gains.append(fits_equal / fits_all)
    assert max(gains) > 1.01  # the groupings the equal search cannot see decide at least one of these limits
