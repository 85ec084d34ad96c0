"""The planner's public face, kept where users first imported it: `solve` and `evaluate` live in `plan.search`."""

from terapipe_cli.plan.search import PlanResult, evaluate, gpipe_baseline, solve, uniform_baseline

__all__ = ["PlanResult", "evaluate", "gpipe_baseline", "solve", "uniform_baseline"]
