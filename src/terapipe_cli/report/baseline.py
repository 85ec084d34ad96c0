"""The GPipe baseline of a run: the plan's GPipe scheme, trained through the same runtime as the run.

Same model, data, seed, learning rate, steps and process layout (data-parallel replicas × stages × tensor
ranks, device, threads) — only the slicing differs — so any difference in time is the slicing's, and the losses must be
equal up to floating-point summation order (docs/design.md §6: both are the same synchronous training).
"""

from __future__ import annotations

from pathlib import Path

from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan import Plan, make_plan_dict, normalize_slices
from terapipe_cli.report.runs import Run

BASELINE_SUFFIX = "-gpipe"


def baseline_dir(run_dir: Path) -> Path:
    """Where the report trains a run's baseline: a sibling folder, ``RUN_DIR-gpipe``."""
    run_dir = Path(run_dir)
    if run_dir.name in ("", ".", ".."):  # "." has no name to extend; keep other paths as the user gave them
        run_dir = run_dir.resolve()
    return run_dir.with_name(run_dir.name + BASELINE_SUFFIX)


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
        order=plan.order,  # the same order and recomputation: the two runs differ only in slicing
        recompute=plan.recompute,
        **extra,
    )


def check_baseline(run: Run, out: Path) -> None:
    """Everything `train_baseline` would refuse, checked without writing anything (the report runs this before
    it trains, so a bad request fails at once, not after the baseline's training)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="terapipe-baseline-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        write_json_atomic(plan_path, gpipe_plan_dict(run.plan))
        _prepare(run, plan_path, Path(out), write=False)


def train_baseline(run: Run, out: Path) -> Path:
    """Train the GPipe baseline of ``run`` into ``out`` through `terapipe train`'s own preparation and launch.

    Raises UserError for what the user must change (a multi-machine run, an occupied folder) and
    `terapipe_cli.runtime.launch.WorkerFailed` when a worker fails.
    """
    from terapipe_cli.runtime.launch import launch

    out = Path(out)
    _refuse_several_machines(run)
    # The run directory's own plan.json (train rewrites it with the same content), so nothing lands outside.
    plan_path = out / "plan.json"
    write_json_atomic(plan_path, gpipe_plan_dict(run.plan))
    launch(_prepare(run, plan_path, out, write=True).launch)
    return out


def _refuse_several_machines(run: Run) -> None:
    if int(run.config.get("nnodes", 1)) > 1:
        raise UserError(
            "ran on several machines; train its GPipe baseline with `terapipe train` on the same "
            "machines and pass it with --baseline",
            where=str(run.path),
        )


def _prepare(run: Run, plan_path: Path, out: Path, *, write: bool):
    """`terapipe train`'s preparation of the baseline: the run's own arguments with the GPipe plan."""
    from terapipe_cli.runtime.prepare import prepare_run

    _refuse_several_machines(run)
    a = run.args
    return prepare_run(
        plan_path=plan_path,
        steps=a.steps,
        data=Path(a.data) if a.data else None,
        out=out,
        seed=a.seed,
        lr=a.lr,
        data_parallel=a.data_parallel,
        verify=False,
        resume=False,
        nnodes=1,
        node_rank=0,
        rdzv_endpoint=None,
        checkpoint_every=a.checkpoint_every,
        threads=a.threads,
        timeout_s=a.timeout_s,
        device=str(run.config.get("device", "auto")),
        kv_handback=a.kv_handback,
        tp_allreduce=a.tp_allreduce,
        tensor_parallel=a.tensor_parallel,
        write=write,
        precision=a.precision,
        warmup_steps=a.warmup_steps,
        min_lr=a.min_lr,
        grad_clip=a.grad_clip,
        accept_precision=a.accept_precision,
        val_fraction=a.val_fraction,  # the same training windows, and the same held-out ones
        eval_every=a.eval_every,
    )
