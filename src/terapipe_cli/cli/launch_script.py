"""``terapipe launch-script``: write the per-node `terapipe train` commands of a plan (and an sbatch file)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from terapipe_cli.cli.console import make_console
from terapipe_cli.cli.options import given, option, with_settings
from terapipe_cli.config.fields import Fallbacks, out_of_bounds, setting
from terapipe_cli.config.run import TABLE, RunConfig, flag, load_run_config, run_fields
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import Plan, read_plan, replan_advice
from terapipe_cli.train import cluster

HELP = """Write the commands that train a plan on several machines: node-0.sh … node-{N-1}.sh, each the \
`terapipe train` of one node with --nnodes, --node-rank and the rendezvous filled in, and with --slurm an sbatch \
file that starts them all (one task per node, its rank from $SLURM_NODEID). The sbatch file survives pre-emption \
and its time limit: the run saves the step it is at (SIGTERM; SIGUSR1 ahead of --time), the job requeues itself \
and continues the run (train's --resume-if-present). It asks for GPUs only for a GPU run.

--nodes × --gpus-per-node must be the plan's D × K × T workers, and T must divide --gpus-per-node: a stage's T \
tensor-parallel processes all-reduce in every layer, so they stay inside one machine. Ranks fill the nodes in \
order: node i runs ranks i·G … (i+1)·G − 1. All nodes train into one --run-out folder (on a shared file system; \
a node-local path gives each node its own). Paths in the commands are absolute: the nodes start elsewhere.

Examples:

    terapipe launch-script plan.json --nodes 2 --gpus-per-node 8 --rdzv-endpoint node0:29500

    terapipe launch-script plan.json --nodes 4 --gpus-per-node 8 --slurm --steps 2000   # then: sbatch ...

    terapipe launch-script plan.json -n 4 -g 8 --slurm --time 12:00:00 --partition gpu --account proj --grace-s 120

    terapipe launch-script plan.json -n 2 -g 4 --rdzv-endpoint 10.0.0.1:29500 --config run.toml --run-out /shared/exp1

Then run node-I.sh on machine I (any order; node 0 hosts the rendezvous), or submit launch.sbatch. --force \
replaces a folder this command wrote before.
"""

_DOCS = run_fields()


def _passed(name: str) -> str:
    return f"Passed to `terapipe train`: {_DOCS[name].help}"


@dataclass(frozen=True)
class LaunchOptions(Fallbacks):
    """`terapipe launch-script`'s options, each declared once (`cli.options.settings_options`): its own, and the
    settings it passes to every node's `terapipe train`, with train's help (`run_fields`)."""

    nodes: int | None = setting("Machines N (required).", short="-n")
    gpus_per_node: int | None = setting("Processes (GPUs) per machine G; N × G = D × K × T (required).", short="-g")
    slurm: bool | None = setting("Also write launch.sbatch, for `sbatch`.", fallback=False)
    rdzv_endpoint: str | None = setting(
        "HOST:PORT of the rendezvous on node 0, as the other nodes reach it (required without --slurm).",
        shown=f"with --slurm: the allocation's first host, port {cluster.JOB_PORT}",
    )
    run_out: str | None = setting("The run folder the nodes train into (train's --out).", shown="runs/PLAN", path=True)
    out: str | None = setting("The folder the scripts are written to.", short="-o", shown="launch-PLAN", path=True)
    config: str | None = setting(
        "Passed to `terapipe train`: a TOML file of its settings (a \\[train] table); its data-parallel and "
        "tensor-parallel degrees, when set, count in D × K × T.",
        short="-c",
        path=True,
    )
    steps: int | None = setting(_passed("steps"))
    device: str | None = setting(_passed("device"))
    precision: str | None = setting(_passed("precision"), shown="the --config file's, else the plan's")
    rdzv_timeout_s: float | None = setting(_passed("rdzv_timeout_s"), flag="--rdzv-timeout")
    grace_s: float | None = setting(
        f"{_passed('grace_s')} With --slurm, Slurm warns the job (SIGUSR1) this long, one predicted step and "
        f"{cluster.STOP_MARGIN_S} s before --time.",
        shown=f"the --config file's, else {_DOCS['grace_s'].shown_default}",
    )
    time: str | None = setting("Slurm's time limit of the job: minutes (90), HH:MM:SS or D-HH:MM:SS.")
    partition: str | None = setting("Slurm partition.")
    account: str | None = setting("Slurm account charged.")
    cpus_per_task: int | None = setting(
        "Slurm CPUs per node: each worker's compute threads and one for its communication.",
        shown="G × (threads + 1)",
    )
    terapipe: str | None = setting(
        "The command that runs terapipe on the nodes, e.g. 'python -m terapipe_cli'.", fallback="terapipe"
    )
    force: bool | None = setting("Replace the scripts in --out written earlier.", fallback=False)


def launch_script(*, plan: Path, **options) -> None:
    """Everything is checked before anything is written."""
    o = LaunchOptions(**given(options))
    for value, where, what in ((o.nodes, "--nodes", "the machines N"), (o.gpus_per_node, "--gpus-per-node", "G")):
        if value is None:
            raise UserError(f"is required ({what})", where=where)
    program = cluster.parse_program(o.value("terapipe"))
    endpoint = None if o.rdzv_endpoint is None else cluster.parse_endpoint(o.rdzv_endpoint)
    if endpoint is None and not o.slurm:
        raise UserError(
            "required without --slurm: HOST:PORT of node 0, as the other nodes reach it", where="--rdzv-endpoint"
        )
    passed = RunConfig(steps=o.steps, device=o.device, rdzv_timeout_s=o.rdzv_timeout_s, precision=o.precision,
                       grace_s=o.grace_s)  # fmt: skip
    _check_settings(passed)
    slurm_options = _slurm_options(o)
    config = None if o.config is None else Path(o.config)
    from_file = load_run_config(config) if config is not None else RunConfig()
    the_plan = read_plan(plan)
    layout = cluster.run_layout(the_plan, from_file, nodes=o.nodes, where=str(config))
    passed = replace(passed, precision=_node_precision(the_plan, passed, from_file, config))
    cluster.check_layout(layout, o.nodes, o.gpus_per_node)
    out = Path(o.out) if o.out is not None else Path(f"launch-{plan.stem}")
    cluster.check_out_folder(out, force=o.value("force"))

    settings = [("--config", str(config.resolve()))] if config is not None else []
    settings += [(flag(name), str(value)) for name, value in passed.given().items()]
    command = cluster.TrainCommand(
        program=program,
        plan=str(plan.resolve()),
        nnodes=o.nodes,
        rdzv_endpoint=endpoint,
        out=str((Path(o.run_out) if o.run_out is not None else Path("runs") / plan.stem).absolute()),
        settings=tuple(settings),
    )
    job = _slurm_job(o, slurm_options, plan, the_plan, passed, from_file) if o.slurm else None
    files = cluster.launch_files(command, layout, gpus_per_node=o.gpus_per_node, slurm=job)
    written = cluster.write_launch_folder(out, files)
    _render(command, layout, o.gpus_per_node, out, written, o.slurm)


def _slurm_options(o: LaunchOptions) -> tuple:
    """--time, --partition and --account checked (and --cpus-per-task): they are for the sbatch file only."""
    if o.cpus_per_task is not None and o.cpus_per_task < 1:
        raise UserError(f"must be at least 1, got {o.cpus_per_task}", where="--cpus-per-task")
    time = None if o.time is None else cluster.parse_time(o.time)
    partition = None if o.partition is None else cluster.parse_slurm_name(o.partition, "--partition")
    account = None if o.account is None else cluster.parse_slurm_name(o.account, "--account")
    if not o.slurm and (time, partition, account) != (None, None, None):
        given = next(f for f, v in (("--time", time), ("--partition", partition), ("--account", account)) if v)
        raise UserError("is for the sbatch file: add --slurm", where=given)
    return time, partition, account


def _slurm_job(o: LaunchOptions, slurm_options: tuple, plan: Path, the_plan: Plan, passed, from_file):
    """The sbatch file's job: GPUs only for a GPU run, CPUs per task, the warning ahead of --time."""
    time, partition, account = slurm_options
    on_gpus = cluster.runs_on_gpus(the_plan, passed.device or from_file.value("device"))
    return cluster.SlurmJob(
        name=f"terapipe-{plan.stem}",
        cpus_per_task=o.cpus_per_task or o.gpus_per_node * (from_file.value("threads") + 1),
        gpus_per_node=o.gpus_per_node if on_gpus else 0,
        warn_s=cluster.warn_seconds(the_plan, passed.grace_s or from_file.value("grace_s")),
        time=time,
        partition=partition,
        account=account,
    )


def _check_settings(passed: RunConfig) -> None:
    """The passed settings within their `RunConfig` fields' bounds (train would refuse them on every node)."""
    for name, value in passed.given().items():
        problem = out_of_bounds(value, _DOCS[name])
        if problem is not None:
            raise UserError(problem, where=flag(name))


def _node_precision(plan: Plan, passed: RunConfig, from_file: RunConfig, config: Path | None) -> str:
    """The precision every node trains in, written into each command so that it says so: --precision, else the
    --config file's, else the plan's (train's own default). Another one than the plan's needs the file's
    ``accept_precision``, as train would say on every node."""
    asked = next((p for p in (passed.precision, from_file.precision) if p not in (None, "auto")), None)
    if asked is None or asked == plan.precision:
        return plan.precision
    if not from_file.value("accept_precision"):
        where = flag("precision") if asked == passed.precision else f"{config}: field '{TABLE}.precision'"
        raise UserError(
            f"the plan was made for {plan.precision}: {replan_advice(plan, asked)}, or set accept_precision = true "
            f"in the --config file to train in {asked} on this plan anyway",
            where=where,
        )
    return asked


def _render(command: cluster.TrainCommand, layout: Layout, gpus_per_node: int, out: Path, written, slurm) -> None:
    console = make_console(highlight=False)
    console.print(
        f"[bold]terapipe launch-script[/] {layout.shape_text()} on {cluster.machines(command.nnodes, gpus_per_node)} "
        f"-> {out}/"
    )
    table = Table()
    for column in ("node", "ranks", "replica", "stage", "script"):
        table.add_column(column, justify="left" if column == "script" else "right")
    for place in cluster.node_places(layout, gpus_per_node):
        script = cluster.node_script_name(place.node)
        table.add_row(str(place.node), *(cluster.span(x) for x in (place.ranks, place.replicas, place.stages)), script)
    console.print(table)
    for node in range(command.nnodes):
        # Whole and unwrapped, so that each pastes into a shell as it is.
        console.print(f"node {node}: {command.line(node)}", markup=False, soft_wrap=True)
    if command.rdzv_endpoint is None:
        console.print(
            f"${cluster.RDZV_VARIABLE}: port {cluster.JOB_PORT} of the allocation's first host, found when the job "
            "runs",
            markup=False,
            soft_wrap=True,
        )
    console.print(f"wrote {', '.join(str(p) for p in written)}", markup=False, soft_wrap=True)
    if slurm:
        console.print(f"submit: sbatch {out / cluster.SBATCH_FILE}", markup=False, soft_wrap=True)
    else:
        console.print("start node-I.sh on machine I, in any order: node 0 hosts the rendezvous", markup=False)


PlanArgument = Annotated[Path, typer.Argument(help="Plan JSON from `terapipe plan`.", show_default=False)]


def register(app: typer.Typer) -> None:
    command = with_settings(launch_script, LaunchOptions, option("plan", PlanArgument, inspect.Parameter.empty))
    app.command("launch-script", help=HELP)(command)
