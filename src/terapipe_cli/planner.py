"""The planner as a library (documented API, stable): `solve` finds the optimal token slicing of a cost model's
pipeline (docs/design.md §5), `evaluate` prices a given slicing, and the two baselines (GPipe's whole sequences and
the best uniform slicing) that `terapipe plan` compares with; they live in `plan.search`.

    from terapipe_cli.costmodel import CostModel
    from terapipe_cli.planner import solve

    cost = CostModel.from_profile("profile.json", stages=4)
    result = solve(cost, seq_len=2048, batch_size=8, stages=4, token_step=64)  # None: no slicing fits
"""

from terapipe_cli.plan.search import PlanResult, evaluate, gpipe_baseline, solve, uniform_baseline

__all__ = ["PlanResult", "evaluate", "gpipe_baseline", "solve", "uniform_baseline"]
