"""Training a run's GPipe baseline (`plan.baseline`): the run's own settings with the baseline's plan, through
`terapipe train`'s preparation and launch. Same model, data, seed, learning rate, steps and process layout
(data-parallel replicas × stages × tensor ranks, device, threads) — only the slicing differs — so any difference in
time is the slicing's, and the losses must be equal up to floating-point summation order. `terapipe report` and
`terapipe run` start it; the report library only reads runs.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan.baseline import gpipe_plan_dict
from terapipe_cli.plan.file import Plan, plan_from_dict
from terapipe_cli.train.launch import launch
from terapipe_cli.train.prepare import PreparedRun, prepare_run
from terapipe_cli.train.rundir import RunArguments, read_config


@dataclass(frozen=True)
class _Run:
    """The run whose baseline is trained, as its folder's config.json describes it."""

    path: Path
    config: dict
    args: RunArguments
    plan: Plan

    @classmethod
    def of(cls, run_dir: Path) -> _Run:
        config, args = read_config(Path(run_dir))
        plan = plan_from_dict(config["plan"], f"{Path(run_dir) / 'config.json'}: field 'plan'")
        return cls(Path(run_dir), config, args, plan)


def check_baseline(run_dir: Path, out: Path) -> None:
    """Everything `train_baseline` would refuse, checked without writing anything (the report runs this before
    it trains, so a bad request fails at once, not after the baseline's training)."""
    run = _Run.of(run_dir)
    with tempfile.TemporaryDirectory(prefix="terapipe-baseline-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        write_json_atomic(plan_path, gpipe_plan_dict(run.plan))
        _prepare(run, plan_path, Path(out), write=False)


def train_baseline(run_dir: Path, out: Path) -> Path:
    """Train the GPipe baseline of ``run`` into ``out`` through `terapipe train`'s own preparation and launch.

    Raises UserError for what the user must change (a multi-machine run, an occupied folder) and
    `terapipe_cli.train.launch.WorkerFailed` when a worker fails.
    """
    run = _Run.of(run_dir)
    out = Path(out)
    _refuse_several_machines(run)
    # The run directory's own plan.json (train rewrites it with the same content), so nothing lands outside.
    plan_path = out / "plan.json"
    write_json_atomic(plan_path, gpipe_plan_dict(run.plan))
    launch(_prepare(run, plan_path, out, write=True).launch)
    return out


def _refuse_several_machines(run: _Run) -> None:
    if int(run.config.get("nnodes", 1)) > 1:
        raise UserError(
            "ran on several machines; train its GPipe baseline with `terapipe train` on the same "
            "machines and pass it with --baseline",
            where=str(run.path),
        )


def _prepare(run: _Run, plan_path: Path, out: Path, *, write: bool) -> PreparedRun:
    """`terapipe train`'s preparation of the baseline: the run's own arguments with the GPipe plan."""
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
