"""``terapipe launch-script``: write the per-node `terapipe train` commands of a plan (and an sbatch file)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from terapipe_cli.cli.console import make_console
from terapipe_cli.config.fields import out_of_bounds
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


def launch_script(
    plan: Annotated[Path, typer.Argument(help="Plan JSON from `terapipe plan`.", show_default=False)],
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="Machines N.", show_default=False)],
    gpus_per_node: Annotated[
        int,
        typer.Option(
            "--gpus-per-node", "-g", help="Processes (GPUs) per machine G; N × G = D × K × T.", show_default=False
        ),
    ],
    slurm: Annotated[bool, typer.Option("--slurm", help="Also write launch.sbatch, for `sbatch`.")] = False,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            help="HOST:PORT of the rendezvous on node 0, as the other nodes reach it (required without --slurm).",
            show_default=f"with --slurm: the allocation's first host, port {cluster.JOB_PORT}",
        ),
    ] = None,
    run_out: Annotated[
        Path | None,
        typer.Option(
            "--run-out", help="The run folder the nodes train into (train's --out).", show_default="runs/PLAN"
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="The folder the scripts are written to.", show_default="launch-PLAN"),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Passed to `terapipe train`: a TOML file of its settings (a \\[train] table); its data-parallel and "
            "tensor-parallel degrees, when set, count in D × K × T.",
            show_default=False,
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help=_passed("steps"), show_default=False)] = None,
    device: Annotated[str | None, typer.Option("--device", help=_passed("device"), show_default=False)] = None,
    precision: Annotated[
        str | None,
        typer.Option("--precision", help=_passed("precision"), show_default="the --config file's, else the plan's"),
    ] = None,
    rdzv_timeout_s: Annotated[
        float | None, typer.Option("--rdzv-timeout", help=_passed("rdzv_timeout_s"), show_default=False)
    ] = None,
    grace_s: Annotated[
        float | None,
        typer.Option(
            "--grace-s",
            help=f"{_passed('grace_s')} With --slurm, Slurm warns the job (SIGUSR1) this long, one predicted step and "
            f"{cluster.STOP_MARGIN_S} s before --time.",
            show_default=f"the --config file's, else {_DOCS['grace_s'].shown_default}",
        ),
    ] = None,
    time: Annotated[
        str | None,
        typer.Option(
            "--time", help="Slurm's time limit of the job: minutes (90), HH:MM:SS or D-HH:MM:SS.", show_default=False
        ),
    ] = None,
    partition: Annotated[str | None, typer.Option("--partition", help="Slurm partition.", show_default=False)] = None,
    account: Annotated[str | None, typer.Option("--account", help="Slurm account charged.", show_default=False)] = None,
    cpus_per_task: Annotated[
        int | None,
        typer.Option(
            "--cpus-per-task",
            help="Slurm CPUs per node: each worker's compute threads and one for its communication.",
            show_default="G × (threads + 1)",
        ),
    ] = None,
    terapipe: Annotated[
        str,
        typer.Option("--terapipe", help="The command that runs terapipe on the nodes, e.g. 'python -m terapipe_cli'."),
    ] = "terapipe",
    force: Annotated[bool, typer.Option("--force", help="Replace the scripts in --out written earlier.")] = False,
) -> None:
    # Everything is checked before anything is written.
    program = cluster.parse_program(terapipe)
    endpoint = None if rdzv_endpoint is None else cluster.parse_endpoint(rdzv_endpoint)
    if endpoint is None and not slurm:
        raise UserError(
            "required without --slurm: HOST:PORT of node 0, as the other nodes reach it", where="--rdzv-endpoint"
        )
    passed = RunConfig(steps=steps, device=device, rdzv_timeout_s=rdzv_timeout_s, precision=precision, grace_s=grace_s)
    _check_settings(passed)
    if cpus_per_task is not None and cpus_per_task < 1:
        raise UserError(f"must be at least 1, got {cpus_per_task}", where="--cpus-per-task")
    time = None if time is None else cluster.parse_time(time)
    partition = None if partition is None else cluster.parse_slurm_name(partition, "--partition")
    account = None if account is None else cluster.parse_slurm_name(account, "--account")
    if not slurm and (time, partition, account) != (None, None, None):
        given = next(f for f, v in (("--time", time), ("--partition", partition), ("--account", account)) if v)
        raise UserError("is for the sbatch file: add --slurm", where=given)
    from_file = load_run_config(config) if config is not None else RunConfig()
    the_plan = read_plan(plan)
    layout = cluster.run_layout(the_plan, from_file, nodes=nodes, where=str(config))
    passed = replace(passed, precision=_node_precision(the_plan, passed, from_file, config))
    cluster.check_layout(layout, nodes, gpus_per_node)
    out = out if out is not None else Path(f"launch-{plan.stem}")
    cluster.check_out_folder(out, force=force)

    settings = [("--config", str(config.resolve()))] if config is not None else []
    settings += [(flag(name), str(value)) for name, value in passed.given().items()]
    command = cluster.TrainCommand(
        program=program,
        plan=str(plan.resolve()),
        nnodes=nodes,
        rdzv_endpoint=endpoint,
        out=str((run_out if run_out is not None else Path("runs") / plan.stem).absolute()),
        settings=tuple(settings),
    )
    job = None
    if slurm:
        on_gpus = cluster.runs_on_gpus(the_plan, passed.device or from_file.value("device"))
        job = cluster.SlurmJob(
            name=f"terapipe-{plan.stem}",
            cpus_per_task=cpus_per_task or gpus_per_node * (from_file.value("threads") + 1),
            gpus_per_node=gpus_per_node if on_gpus else 0,
            warn_s=cluster.warn_seconds(the_plan, passed.grace_s or from_file.value("grace_s")),
            time=time,
            partition=partition,
            account=account,
        )
    files = cluster.launch_files(command, layout, gpus_per_node=gpus_per_node, slurm=job)
    written = cluster.write_launch_folder(out, files)
    _render(command, layout, gpus_per_node, out, written, slurm)


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


def register(app: typer.Typer) -> None:
    app.command("launch-script", help=HELP)(launch_script)
