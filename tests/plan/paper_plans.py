"""The published settings' analytic profiles and their plans, made once per process: several test files plan the same
setting with the same request (the one judge, the schedule-aware choice), and a plan is a function of its profile and
request alone. Callers read the plans they get, never change them."""

from __future__ import annotations

import functools

from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.plan.choice import Planned, plan_for_profile
from terapipe_cli.plan.costmodel import profile_from_dict
from terapipe_cli.plan.request import plan_request
from terapipe_cli.profile.analytic import experiment_profile


@functools.cache
def paper_profile(name: str):
    """The experiment ``name`` (a published setting's full name) and its analytic profile of one pipeline replica, as
    `terapipe plan --experiment` prices it."""
    exp = load_experiment(name)
    obj = experiment_profile(
        exp, batch_size=exp.batch_per_replica, tensor_parallel=exp.tensor_parallel, token_step=exp.token_step
    )
    return exp, profile_from_dict(obj, name)


@functools.cache
def paper_planned(name: str, rank: str = "simulated") -> Planned:
    """The setting ``name`` planned on `paper_profile` for one replica of its data-parallel run, without a memory
    limit (1e6 GiB: every scheme is compared), its scheme chosen by ``rank``."""
    exp, prof = paper_profile(name)
    request = plan_request(
        prof, stages=exp.stages, batch_size=exp.batch_per_replica, token_step=exp.token_step,
        data_parallel=exp.data_parallel, memory_limit_gib=1e6, rank=rank,
    )  # fmt: skip
    return plan_for_profile(prof, request)


def assert_optimum_not_beaten(planned: Planned, label) -> int:
    """The objective's exact optimum is no slower than GPipe or the best uniform slicing priced by the same formula;
    a baseline that is faster does not fit the memory limit the optimum was chosen within, and the plan says so.
    Returns the number of baselines compared (2)."""
    optimum = planned.formula_optimal or planned.terapipe
    for key in ("gpipe", "uniform"):
        baseline = getattr(planned, key)
        if baseline.predicted_s < optimum.predicted_s * (1 - 1e-12):
            assert planned.unfitted is not None and planned.scheme_memory[key].exceeded, (label, key)
    return 2
