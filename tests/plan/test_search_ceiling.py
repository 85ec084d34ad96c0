"""`solve(ceiling=…)`: the search of many cost models (one per partition, `plan.configs`) passes the best
found so far, and each search prunes against it from the start. Below the ceiling the answer is the brute-force
optimum; at or above it, the result only says that nothing is faster than the ceiling."""

from __future__ import annotations

import pytest
from brute import brute_optimum, make_case

from terapipe_cli.plan.search import solve

SEEDS = range(120)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_ceiling_keeps_the_optimum_below_it_and_bounds_it_above(seed: int) -> None:
    case = make_case(seed)
    optimum = brute_optimum(case.cost, case.seq_len, case.batch, case.stages, case.token_step).optimum
    shape = dict(seq_len=case.seq_len, batch_size=case.batch, stages=case.stages, token_step=case.token_step)
    for ceiling in (optimum * 1.5 + 1e-9, optimum * 1.0001 + 1e-12):
        res = solve(case.cost, **shape, ceiling=ceiling)
        assert res.predicted_s == pytest.approx(optimum, rel=1e-9), ceiling
    for ceiling in (optimum, optimum * 0.9, optimum * 0.5):
        res = solve(case.cost, **shape, ceiling=ceiling)
        # Some scheme, and nothing faster than the ceiling: the optimum is no less than it.
        assert res is not None and res.predicted_s >= optimum * (1 - 1e-9)
        assert optimum >= ceiling * (1 - 1e-9)
