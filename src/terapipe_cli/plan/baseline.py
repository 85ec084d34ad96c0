"""The GPipe baseline of a plan, as a plan of its own: the same model, stages, batch, order and recomputation, and
the GPipe scheme the planner priced for it — only the slicing differs, so two runs of the two plans compare the
slicing alone (docs/design.md §6: both are the same synchronous training). Imports no torch.
"""

from __future__ import annotations

from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import Plan, make_plan_dict, normalize_slices


def gpipe_plan_dict(plan: Plan) -> dict:
    """The baseline's plan: the GPipe scheme the planner priced for this plan (best microbatch size, same cost
    model), or — for a hand-made plan without baselines — GPipe with microbatch 1, the smallest bubble."""
    gpipe = (plan.raw.get("baselines") or {}).get("gpipe")
    where = f"{plan.path}: field 'baselines.gpipe'"
    if isinstance(gpipe, dict) and "slices" in gpipe:
        slices = normalize_slices(gpipe["slices"], where=f"{where}.slices")
        predicted = gpipe.get("predicted_s")
        microbatch = gpipe.get("microbatch", slices[0][0])
    else:
        slices, predicted, microbatch = [(1, [plan.seq_len])] * plan.batch_size, None, 1
    if any(lengths != [plan.seq_len] for _, lengths in slices):
        raise UserError(
            "is not a GPipe scheme (every batch slice must be one token slice of the whole sequence)", where=where
        )
    extra = {"scheme": "gpipe", "microbatch": microbatch, "baseline_of": plan.path}
    if isinstance(plan.raw.get("profile"), dict):
        extra["profile"] = plan.raw["profile"]  # the same cost model priced it
    if "step_s" in plan.raw:
        extra["step_s"] = plan.raw["step_s"]
    return make_plan_dict(
        model=plan.model,
        stages=plan.stages,
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        token_step=plan.token_step,
        slices=slices,
        predicted_s=predicted,
        data_parallel=plan.data_parallel,
        precision=plan.precision,
        tensor_parallel=plan.tensor_parallel,
        order=plan.order,  # the same order, recomputation and chunks: the two runs differ only in slicing
        recompute=plan.recompute,
        partition=plan.partition,
        **extra,
    )
