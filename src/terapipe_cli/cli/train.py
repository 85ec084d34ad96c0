"""``terapipe train``: check everything, write the run directory, launch the torchrun workers, verify."""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from terapipe_cli.cli.console import make_console
from terapipe_cli.cli.options import DeviceOption, PrecisionOption
from terapipe_cli.engine import require_torch

CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"

if TYPE_CHECKING:
    from terapipe_cli.train.prepare import PreparedRun

HELP = """Train on a plan: launch D x K x T torchrun workers (D data-parallel replicas of K pipeline stages, each \
stage split over T tensor-parallel processes) that run every step cut into the plan's tiles, with exactly the \
update single-device training would make.

Every step: the lr of a linear warm-up, then a cosine decay to --min-lr at the last step; the gradient norm over \
all stages clipped to --grad-clip; AdamW on fp32 master weights. --precision bf16 or fp16 computes under \
autocast (fp16 with one dynamic loss scale for the whole pipeline: a step with an inf/nan gradient on any stage \
is skipped by all). A plan profiled at another precision is refused unless --accept-precision.

Examples:

    terapipe train --plan plan.json --steps 30 --verify

    terapipe train --plan plan.json --steps 2000 --lr 6e-4 --warmup-steps 100 --min-lr 6e-5 --grad-clip 1.0

    terapipe train --plan plan.json --precision fp16 --verify

    terapipe train --plan plan.json --tensor-parallel 2 --dry-run     # show the process mesh, run nothing

Writes runs/NAME/: config.json, plan.json, metrics.jsonl, timelines/, checkpoints/, summary.json. gloo on CPU \
(one thread per worker unless --threads), NCCL on CUDA with a GPU per worker; with more workers than GPUs \
(e.g. K stages on one GPU, for --verify) they share the GPUs over gloo through host memory.
"""


# The optimizer step's options (docs/design.md §6a). None: the default of a new run, or a resumed run's own value.
LrOption = Annotated[
    float | None,
    typer.Option(
        "--lr",
        help="Peak AdamW learning rate, e.g. --lr 6e-4. The default (the demo's too) lies between GPT-3's peaks for "
        "its 125M-1.3B shapes and trains the tiny model without a spike; bigger models want less.",
        show_default="3e-4",
    ),
]
WarmupStepsOption = Annotated[
    int | None,
    typer.Option(
        "--warmup-steps",
        help="Steps of linear lr warm-up up to --lr, e.g. --warmup-steps 100.",
        show_default="10% of --steps, at least 3 (a third of a shorter run)",
    ),
]
MinLrOption = Annotated[
    float | None,
    typer.Option(
        "--min-lr",
        help="The lr the cosine decay reaches at the last step, e.g. --min-lr 6e-5.",
        show_default="0.1 x --lr",
    ),
]
GradClipOption = Annotated[
    float | None,
    typer.Option(
        "--grad-clip",
        help="Clip the gradients to this global norm over all stages, e.g. --grad-clip 0.5; 0 does not clip "
        "(the norm is logged either way).",
        show_default="1.0",
    ),
]
AcceptPrecisionOption = Annotated[
    bool,
    typer.Option(
        "--accept-precision",
        help="Train at --precision even though the plan was profiled at another (its predicted times do not hold).",
    ),
]

# Several machines (docs/design.md §6, "Several nodes").
NnodesOption = Annotated[
    int,
    typer.Option(
        "--nnodes", help="Machines; run the same command on each (--out: one shared folder, or one per node)."
    ),
]
NodeRankOption = Annotated[int, typer.Option("--node-rank", help="This machine's rank among --nnodes.")]
RdzvEndpointOption = Annotated[
    str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous on node 0.")
]
RdzvTimeoutOption = Annotated[
    float, typer.Option("--rdzv-timeout", help="Seconds the nodes wait for each other at the rendezvous, e.g. 60.")
]


def register(app: typer.Typer) -> None:
    app.command("train", help=HELP)(train)


def train(
    plan: Annotated[
        Path | None, typer.Option("--plan", help="Plan JSON from `terapipe plan` (optional with --resume).")
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps",
            help="Training steps (with --resume: the new total).",
            show_default="20; with --resume, the run's",
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option("--data", help="Text file (bytes) or uint16 token file (.bin/.npy) (default: the embedded text)."),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default: runs/<timestamp>).")] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of the weights and of the batches.", show_default="0")
    ] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option(
            "--val-fraction",
            help="The data's last part held out for the validation loss; 0 trains on all of it.",
            show_default="0.1",
        ),
    ] = None,
    eval_every: Annotated[
        int | None,
        typer.Option(
            "--eval-every",
            help="Validation loss every N steps and after the last (forward only, same pipeline); 0: never.",
            show_default="a tenth of --steps; a run under 10 steps: after the last",
        ),
    ] = None,
    lr: LrOption = None,
    warmup_steps: WarmupStepsOption = None,
    min_lr: MinLrOption = None,
    grad_clip: GradClipOption = None,
    precision: PrecisionOption = None,
    accept_precision: AcceptPrecisionOption = False,
    data_parallel: Annotated[
        int | None, typer.Option("--data-parallel", "-d", help="Data-parallel replicas D (default: the plan's).")
    ] = None,
    tensor_parallel: Annotated[
        int | None,
        typer.Option(
            "--tensor-parallel",
            "-t",
            help="Tensor-parallel processes T per stage, splitting heads and MLP (default: the plan's).",
        ),
    ] = None,
    verify: Annotated[
        bool, typer.Option("--verify", help="Compare with a single-process reference; exit 1 on a mismatch.")
    ] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in --out from its last complete checkpoint.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check everything, print the torchrun command, run nothing.")
    ] = False,
    nnodes: NnodesOption = 1,
    node_rank: NodeRankOption = 0,
    rdzv_endpoint: RdzvEndpointOption = None,
    rdzv_timeout: RdzvTimeoutOption = 300.0,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", help="Checkpoint every N steps (and after the last).")
    ] = 10,
    threads: Annotated[int, typer.Option("--threads", help="CPU threads per worker.")] = 1,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Limit on every distributed wait (seconds).")] = 120.0,
    device: DeviceOption = "auto",
) -> None:
    _quiet_torch_logging()
    require_torch("terapipe train")
    from terapipe_cli.train.launch import command_line
    from terapipe_cli.train.prepare import negative_controls, prepare_run
    from terapipe_cli.train.rundir import check_not_live

    if node_rank == 0:  # other nodes join node 0's run, which holds the lock of a shared folder
        check_not_live(out, "resume it" if resume else "use another --out, or --resume it")
    prepared = prepare_run(
        plan_path=plan,
        steps=steps,
        data=data,
        out=out,
        seed=seed,
        lr=lr,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        verify=verify,
        resume=resume,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        checkpoint_every=checkpoint_every,
        threads=threads,
        timeout_s=timeout_s,
        device=device,
        **negative_controls(),
        write=not dry_run,
        precision=precision,
        warmup_steps=warmup_steps,
        min_lr=min_lr,
        grad_clip=grad_clip,
        accept_precision=accept_precision,
        rdzv_timeout_s=rdzv_timeout,
        val_fraction=val_fraction,
        eval_every=eval_every,
    )
    if dry_run:
        console = make_console(highlight=False)
        console.print(f"process mesh (data, pipeline, tensor): {prepared.layout.shape_text()}")
        console.print(_mesh_table(prepared))
        print(command_line(prepared.launch))
        return
    _launch(prepared, verify)


def _launch(prepared: PreparedRun, verify: bool) -> None:
    """Start the workers, wait for them, and verify when asked; a failure ends with one line."""
    from terapipe_cli.train.launch import WorkerFailed, launch
    from terapipe_cli.train.rundir import run_lock

    console = make_console(stderr=False, highlight=False)
    console.print(_headline(prepared))
    start = time.perf_counter()
    # Node 0 holds the run folder while it trains: a second train, --resume or report on it is refused.
    with run_lock(prepared.launch.run_dir) if prepared.launch.node_rank == 0 else nullcontext():
        try:
            launch(prepared.launch)
        except WorkerFailed as e:
            _fail(str(e), WorkerFailed.exit_code)
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
    from terapipe_cli.train.prepare import placement_note

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
    result = verify_and_record(prepared)
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
