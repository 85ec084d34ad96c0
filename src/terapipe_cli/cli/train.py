"""``terapipe train``: check everything, write the run directory, launch the torchrun workers, verify."""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from terapipe_cli.cli.console import ProgressBar, make_console
from terapipe_cli.cli.options import config_option, given, option, with_settings
from terapipe_cli.config.controls import Controls
from terapipe_cli.config.run import TABLE, LRSchedule, RunConfig, as_option, flag, load_run_config, run_fields
from terapipe_cli.engine import require_torch
from terapipe_cli.errors import UserError
from terapipe_cli.train.placement import placement_note
from terapipe_cli.train.rundir import check_not_live, run_lock

CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"

if TYPE_CHECKING:
    from terapipe_cli.train.prepare import PreparedRun

HELP = """Train on a plan: launch D x K x T torchrun workers (D data-parallel replicas of K pipeline stages, each \
stage split over T tensor-parallel processes) that run every step cut into the plan's tiles, with exactly the \
update single-device training would make.

Every step: the lr of a linear warm-up, then a cosine decay to --min-lr at the last step; the gradient norm over \
all stages clipped to --grad-clip; AdamW on fp32 master weights (--weight-decay, --beta1, --beta2, --eps). \
--precision bf16 or fp16 computes under autocast (fp16 with one dynamic loss scale for the whole pipeline: a step \
with an inf/nan gradient on any stage is skipped by all). --precision defaults to the plan's, the one its \
profile timed; another is refused unless --accept-precision.

Examples:

    terapipe train --plan plan.json --steps 30 --verify

    terapipe train --plan plan.json --steps 2000 --lr 6e-4 --warmup-steps 100 --min-lr 6e-5 --grad-clip 1.0

    terapipe train --plan plan.json --weight-decay 0.05 --beta2 0.99 --no-decay-embeddings

    terapipe train --plan plan.json --precision fp16 --verify

    terapipe train --plan plan.json --tensor-parallel 2 --dry-run     # show the process mesh, run nothing

    terapipe train --config runs/exp1/run.toml --out runs/exp1-again  # the same run again

    terapipe train --plan plan.json --steps 2000 --out runs/exp1 --resume-if-present  # a job script: start or continue

    terapipe train --plan plan.json --schedule my-order.csv --verify  # walk a hand-written schedule

Every setting can also come from a TOML file (--config FILE, a \\[train] table whose keys are the options' names \
with underscores: warmup_steps = 100); flags given override the file. Writes runs/NAME/: config.json, plan.json, \
run.toml (the resolved settings), metrics.jsonl, timelines/, checkpoints/, summary.json. gloo on CPU \
(one thread per worker unless --threads), NCCL on CUDA with a GPU per worker; with more workers than GPUs \
(e.g. K stages on one GPU, for --verify) they share the GPUs over gloo through host memory.
"""


def train(*, config: Path | None, resume: bool, dry_run: bool, **settings) -> None:
    """``terapipe train``: the run's settings from ``--config`` with the flags given over them (`RunConfig`)."""
    _quiet_torch_logging()
    require_torch("terapipe train")
    from terapipe_cli.train import launch, prepare  # PyTorch: only the commands that train load it

    from_file = load_run_config(config) if config is not None else RunConfig()
    flags = given(settings)
    run_config = replace(from_file, **flags)
    try:
        if run_config.value("node_rank") == 0:  # other nodes join node 0's run, which holds the lock of a shared folder
            out = None if run_config.out is None else Path(run_config.out)
            again = resume or run_config.value("resume_if_present")
            check_not_live(out, "resume it" if again else "use another --out, or --resume it")
        run_config, resume = prepare.start_or_continue(run_config, resume=resume)
        controls = Controls.from_environment()
        prepared = prepare.prepare_run(run_config, resume=resume, write=not dry_run, controls=controls)
    except UserError as e:
        raise located(e, flags, from_file, config) from None
    except prepare.RunComplete as e:
        make_console(highlight=False).print(str(e), soft_wrap=True, markup=False)
        return
    note = LRSchedule.of_run(prepared.args).note(prepared.args.steps)
    if note is not None:
        make_console(highlight=False).print(f"note: {note}", soft_wrap=True)
    if dry_run:
        console = make_console(highlight=False)
        console.print(prepared.data_line, soft_wrap=True)
        console.print(_schedule_line(prepared, run_config.schedule), soft_wrap=True)
        console.print(f"process mesh (data, pipeline, tensor): {prepared.layout.shape_text()}")
        console.print(_mesh_table(prepared))
        print(launch.command_line(prepared.launch))
        return
    _launch(prepared, prepared.args.verify)


def _schedule_line(prepared, given: str | None) -> str:
    """What the workers will walk: the plan's own order, or the schedule file given (read, checked, as kept)."""
    from terapipe_cli.schedule.orders import order_of
    from terapipe_cli.train.rundir import run_schedule

    schedule = run_schedule(prepared.plan, prepared.args, where="--schedule")
    kinds = sorted({a.phase.value for row in schedule.actions for a in row}, key="FIWB".index)
    own = f"the plan's own ({order_of(prepared.plan.order).title})"
    whose = f"{given} (a custom order)" if given is not None else own
    split = ", every backward split into I and W" if {"I", "W"} <= set(kinds) else ""
    counts = ", ".join(str(len(row)) for row in schedule.actions)
    return f"schedule: {whose}, actions {'/'.join(kinds)}{split}; per device {counts}"


def located(error: UserError, flags: dict, from_file: RunConfig, config: Path | None) -> UserError:
    """An error about a `RunConfig` field (``where`` is its name), naming what the user wrote: the flag, or the
    field of the ``--config`` file the value came from."""
    name = error.where
    if name not in run_fields():
        return error
    if config is not None and name not in flags and getattr(from_file, name) is not None:
        return UserError(error.message, where=f"{config}: field '{TABLE}.{name}'")
    given = flags.get(name)  # a switch as written: --no-decay-embeddings
    return UserError(error.message, where=as_option(name, given) if isinstance(given, bool) else flag(name))


def register(app: typer.Typer) -> None:
    leading = (
        option("config", ConfigOption, None),
        option("resume", ResumeOption, False),
        option("dry_run", DryRunOption, False),
    )
    app.command("train", help=HELP)(with_settings(train, RunConfig, *leading))


ConfigOption = config_option(TABLE, "a run folder's run.toml trains that run again")
ResumeOption = Annotated[
    bool, typer.Option("--resume", help="Continue the run in --out from its last complete checkpoint.")
]
DryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="Check everything, print the torchrun command, run nothing.")
]


def _launch(prepared: PreparedRun, verify: bool) -> None:
    """Start the workers, wait for them, and verify when asked; a failure ends with one line."""
    from terapipe_cli.train.launch import WorkerFailed, launch

    console = make_console(stderr=False, highlight=False)
    console.print(_headline(prepared))
    console.print(prepared.data_line, soft_wrap=True)
    start = time.perf_counter()
    # Node 0 holds the run folder while it trains: a second train, --resume or report on it is refused.
    with run_lock(prepared.launch.run_dir) if prepared.launch.node_rank == 0 else nullcontext():
        try:
            launch(prepared.launch)
        except WorkerFailed as e:
            _fail(str(e), e.exit_code)
        console.print(f"done in {time.perf_counter() - start:.1f} s: {prepared.launch.run_dir}")
        if verify:
            _verify(console, prepared)


def _quiet_torch_logging() -> None:
    """PyTorch's C++ side logs every failed connection to the rendezvous with a stack trace (a page per try) on
    stderr; this process says what failed in one line instead. The level is read once, when torch is first
    imported, so it is set just for that import: the workers keep the caller's."""
    if "torch" in sys.modules:
        return
    before = os.environ.get(CPP_LOG_LEVEL)
    os.environ[CPP_LOG_LEVEL] = "FATAL"
    try:
        import torch  # noqa: F401
    except ImportError:
        pass  # require_torch says so
    finally:
        if before is None:
            del os.environ[CPP_LOG_LEVEL]
        else:
            os.environ[CPP_LOG_LEVEL] = before


def _headline(prepared: PreparedRun) -> str:
    p, spec, args = prepared.plan, prepared.launch, prepared.args
    tensor = f" T={args.tensor_parallel}" if args.tensor_parallel > 1 else ""
    return (
        f"[bold]terapipe train[/] {p.short_form()}  K={p.stages} D={args.data_parallel}{tensor} "
        f"({spec.nproc_per_node * spec.nnodes} workers, "
        f"{placement_note(prepared.device, spec.nproc_per_node)}, "
        f"{prepared.args.precision})  -> {spec.run_dir}"
        + (f"  (resuming after step {spec.resume_step})" if spec.resume_step is not None else "")
    )


def _mesh_table(prepared: PreparedRun, most: int = 64) -> Table:
    """The process mesh (data, pipeline, tensor): where each rank sits and on which machine (the first ``most``)."""
    layout, spec = prepared.layout, prepared.launch
    table = Table()
    for column in ("rank", "node", "replica", "stage", "tensor rank", "sends to"):
        table.add_column(column, justify="right")
    for rank in range(min(layout.world, most)):
        _, after = layout.neighbours(rank)
        node = rank // spec.nproc_per_node
        row = (rank, node, layout.replica(rank), layout.stage(rank), layout.tensor_rank(rank))
        table.add_row(*map(str, row), "—" if after is None else f"rank {after}")
    if layout.world > most:
        table.caption = f"… and {layout.world - most} more ranks"
    return table


def _fail(message: str, code: int) -> None:
    """The one error line after whatever the workers printed, and the exit code."""
    sys.stdout.flush()
    sys.stderr.write(f"terapipe: error: {message}\n")
    raise SystemExit(code) from None


def _verify(console: Console, prepared: PreparedRun) -> None:
    from terapipe_cli.train.verify import SPREAD_FACTOR, verify_and_record

    console.print("verifying against a single-process reference (same seed, same batches) ...")
    with ProgressBar(console) as progress:
        result = verify_and_record(prepared, progress)
    table = Table(
        title=f"--verify: pipelined run vs single process ({result.precision})",
        caption="rel: |Δ|/|ref| per step's loss; ‖Δ‖₂/‖ref‖₂ per gradient or weight tensor. spread: a second "
        f"single-process run ({result.spread_run}) vs the same reference; tol = max(floor, {SPREAD_FACTOR:g} x spread)",
    )
    for col in ("compared", "run rel", "spread rel", "tol (rel)", "run max abs", "worst at", "result"):
        table.add_column(col)
    for c in result.checks:
        table.add_row(
            c.what,
            f"{c.max_rel:.3g}",
            f"{c.spread:.3g}",
            f"{c.tolerance:.3g}",
            f"{c.max_abs:.3g}",
            c.worst,
            "[green]ok[/]" if c.ok else "[red]MISMATCH[/]",
        )
    console.print(table)
    if not result.ok:
        bad = ", ".join(c.what for c in result.checks if not c.ok)
        _fail(f"verification failed ({bad}): see the table above", 1)
    console.print("[green]verified[/]: the pipelined run matches single-device training")
