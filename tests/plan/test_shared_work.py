"""Work shared within one plan (`schedule.memo`): the tile prices of a profile's partitions, the search's tables
and answers, the baselines — each computed once and the same to the last bit as computed afresh; the dominance check
over partitions as it was (every partition's prices compared tile by tile); and a plan the same with and without
the sharing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT

from terapipe_cli.plan import configs, search
from terapipe_cli.plan.costmodel import CostModel, read_profile
from terapipe_cli.plan.request import plan_request
from terapipe_cli.schedule import memo
from terapipe_cli.schedule.partition import Partition

TINY = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
EXAMPLE = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"


def test_remembered_only_inside_sharing_and_the_oldest_dropped_first() -> None:
    made = []

    def make(n: int):
        made.append(n)
        return np.zeros(n)

    memo.remembered(("x",), lambda: make(1))
    memo.remembered(("x",), lambda: make(1))
    assert made == [1, 1]  # outside `sharing`, nothing is kept
    with memo.sharing(budget_bytes=4 * 8):  # four values
        for key in ("a", "b", "a"):
            memo.remembered((key,), lambda: make(2))
        assert made == [1, 1, 2, 2]
        memo.remembered(("c",), lambda: make(1))  # 2 + 2 + 1 values: the least recently used ("b") goes
        memo.remembered(("a",), lambda: make(2))
        memo.remembered(("b",), lambda: make(2))
        assert made == [1, 1, 2, 2, 1, 2]


@pytest.mark.parametrize("layers, stages, virtual", [((1, 2, 1), 3, 1), ((2, 1, 0, 1), 2, 2), ((0, 4), 2, 1)])
def test_grid_prices_are_the_cost_models_own_to_the_bit(layers, stages, virtual) -> None:
    profile = read_profile(EXAMPLE)
    layers = tuple(n + (profile.model.layers - sum(layers)) * (c == 1) for c, n in enumerate(layers))
    part = Partition(layers, stages)
    sizes = np.arange(1, 6)  # beyond the profile's batch sizes too: +inf there
    i, j = search.grid_tiles(8, 16)
    for recompute in (False, True):
        cost = CostModel(profile, stages, recompute=recompute, within_profile=True, partition=part)
        with memo.sharing():
            for _ in range(2):  # made, then shared
                total, bubble = cost.grid_prices(sizes, i, j, ("grid", 8, 16))
                assert np.array_equal(total, cost(sizes[:, None], i, j))
                expected = cost(sizes[:, None], i, j) if cost.bubble is None else cost.bubble(sizes[:, None], i, j)
                assert np.array_equal(bubble, expected)


def _reference_undominated(costs, r):
    """The dominance check as it was: every partition's prices on every tile, kept in memory, compared."""
    n, g = r.seq_len // r.token_step, r.token_step
    some = next(iter(costs.values()))
    b = np.arange(1, min(r.batch_size, some.max_batch_slice or r.batch_size) + 1)[:, None]
    i, j = search.grid_tiles(n, g)
    priced = {p: (c(b, i, j), c(b, i, j) if c.bubble is None else c.bubble(b, i, j)) for p, c in costs.items()}
    kept, dominated = [], {}
    for part in sorted(
        costs, key=lambda p: (float(np.sum(np.where(np.isfinite(priced[p][0]), priced[p][0], 0))), p.layers)
    ):
        by = next((k for k in kept if all(np.all(x <= y) for x, y in zip(priced[k], priced[part], strict=True))), None)
        if by is None:
            kept.append(part)
        else:
            dominated[part] = by
    return kept, dominated


@pytest.mark.parametrize("path", [TINY, EXAMPLE])
@pytest.mark.parametrize("stages, batch", [(2, 2), (3, 4), (2, 8)])
def test_undominated_is_the_tile_by_tile_check(path, stages: int, batch: int) -> None:
    profile = read_profile(path)
    request = plan_request(profile, stages=stages, batch_size=batch, virtual="auto", partition="auto", token_step=32)
    with memo.sharing():
        for v in configs.virtual_candidates(request, profile.model.layers):
            candidates = configs.partition_candidates(profile, request, v)
            costs = {p: CostModel(profile, stages, within_profile=True, partition=p) for p in candidates}
            assert configs._undominated(costs, request) == _reference_undominated(costs, request)


def test_shared_searches_and_baselines_answer_alike_and_apart() -> None:
    profile = read_profile(TINY)
    cost = CostModel(profile, 2, within_profile=True)
    shape = {"seq_len": profile.model.seq_len, "batch_size": 4, "stages": 2, "token_step": 16}
    alone = search.solve(cost, **shape, neighbours=2)
    uniform = search.uniform_baseline(cost, **shape)
    with memo.sharing():
        first = search.solve(cost, **shape, neighbours=2)
        first.slices.append((9, [9]))  # a caller's change stays its own
        again = search.solve(cost, **shape, neighbours=2)
        shared_uniform = search.uniform_baseline(cost, **shape)
    for res in (again,):
        assert res.slices == alone.slices and res.predicted_s == alone.predicted_s
        assert [a.slices for a in res.alternatives] == [a.slices for a in alone.alternatives]
    assert shared_uniform.slices == uniform.slices and shared_uniform.predicted_s == uniform.predicted_s
    assert shared_uniform.predicted_s == search.evaluate(cost, uniform.slices, 2)


GPT3_1B = ROOT / "configs" / "profiles" / "gpt3-1b-h100-fp32-measured.json"


@pytest.mark.parametrize("path, stages, limit_gib", [(EXAMPLE, 3, 0.03), (EXAMPLE, 3, 0.05), (GPT3_1B, 3, 10)])
def test_a_plan_is_the_same_with_and_without_sharing(monkeypatch, path, stages: int, limit_gib: float) -> None:
    """Without the sharing, and without ruling a partition that only fits recomputed out by another that could not
    beat the best (GPT3-1B within 10 GiB rules out six so)."""
    profile = read_profile(path)
    request = plan_request(
        profile, stages=stages, batch_size=8, virtual="auto", partition="auto", token_step=32,
        memory_limit_gib=limit_gib,
    )  # fmt: skip

    def key(configured):
        p = configured.planned
        runner = configured.runner_up
        second = None if runner is None else (runner.chosen.slices, runner.order, runner.partition.layers)
        return p.chosen.slices, p.order, p.partition.layers, p.recompute, p.simulated_s[p.scheme], second

    shared = key(configs.plan_configured(profile, request))

    class EverySearched(configs._Prices):
        def __init__(self, costs, request) -> None:
            super().__init__(costs, request)
            self.deferred = not costs  # the recomputing models of `_best_partition`'s pass within the limit

        def dominates(self, cheap, dear, cheap_prices=None) -> bool:
            return False if self.deferred else super().dominates(cheap, dear, cheap_prices)

    monkeypatch.setattr(memo, "remembered", lambda key, make: make())
    monkeypatch.setattr(configs, "_Prices", EverySearched)
    assert key(configs.plan_configured(profile, request)) == shared
