"""``terapipe report``: compare a run with its GPipe baseline (trained here when not given); tables and pictures."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from terapipe_cli.cli.console import ProgressBar, make_console
from terapipe_cli.errors import Interrupted, UserError
from terapipe_cli.plan.file import short_form
from terapipe_cli.report.build import (
    check_report_dir,
    check_warmup,
    find_baseline,
    find_cost_model,
    load_baseline,
    loss_mismatch,
    report_dir,
    write_report,
)
from terapipe_cli.report.runs import load_run
from terapipe_cli.report.text import (
    MEMORY_TITLE,
    STAGE_HEADER,
    bubble_line,
    headline,
    latency_header,
    latency_rows,
    loss_line,
    memory_mismatch_lines,
    memory_table,
    segments_line,
    stage_rows,
    tile_speed_line,
    title,
)
from terapipe_cli.train.rundir import check_not_live

HELP = """Compare a training run with its GPipe baseline: latency, speed-up, predicted vs measured, idle time per \
stage, memory, and the loss of every step (which must match: both are the same synchronous training).

Without --baseline, trains the plan's GPipe scheme (same model, data, seed, steps, process layout, through the \
same runtime) into the sibling folder RUN_DIR-gpipe first, or reuses the one an earlier report trained there. \
Everything that can fail (the run, --warmup, --out, the profile, whether the baseline can train) is checked \
before that training starts. --no-baseline trains nothing: the report describes the run alone (loss curve, \
measured and predicted timeline, prediction error).

Writes report.json, report.md, timeline.png (one row per stage, F/B boxes per tile, the run above the baseline \
on one time axis, next to the simulator's prediction when the plan's profile is at hand), loss.png and \
trace.json (Chrome trace, one process per rank: open in https://ui.perfetto.dev) into --out (default \
RUN_DIR/report).

Examples:

    terapipe report runs/demo/run

    terapipe report runs/demo/run --no-baseline
"""


def report(
    run_dir: Annotated[
        Path, typer.Argument(help="Run directory written by `terapipe train`.", metavar="RUN_DIR", show_default=False)
    ],
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="Run directory of the baseline (default: train RUN_DIR-gpipe).")
    ] = None,
    no_baseline: Annotated[
        bool,
        typer.Option(
            "--no-baseline", help="Report on the run alone: no baseline is trained, no speed-up or loss comparison."
        ),
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Folder for the report (default: RUN_DIR/report).")
    ] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Leading steps left out of the timings.")] = 2,
    profile: Annotated[
        Path | None,
        typer.Option("--profile", help="Profile for the simulator's predicted timelines (default: the plan's)."),
    ] = None,
) -> None:
    console = make_console(highlight=False)
    if no_baseline and baseline is not None:
        raise UserError("a report has a baseline or not: pass --baseline RUN_DIR or --no-baseline", where="--baseline")
    # Everything that can fail is checked before a baseline is trained (minutes of work).
    check_not_live(run_dir, "report on it")
    run = load_run(run_dir)
    check_warmup(run, warmup)
    folder = report_dir(run, out)
    check_report_dir(folder)
    cost, cost_info = find_cost_model(run, profile)
    base = None if no_baseline else _baseline(console, run, baseline)
    with console.status("writing the report …") as status:
        result = write_report(
            run,
            base,
            folder,
            warmup=warmup,
            cost=cost,
            cost_info=cost_info,
            progress=lambda what: status.update(f"writing {what} …"),
        )
    render(console, result)
    mismatch = loss_mismatch(result)
    if mismatch:
        sys.stdout.flush()
        sys.stderr.write(f"terapipe: error: {mismatch}\n")
        raise SystemExit(1)


def _baseline(console: Console, run, given: Path | None):
    """The baseline: the one given, the sibling an earlier report trained, or one trained now (checked first)."""
    choice = find_baseline(run, given)
    if choice.exists:
        base = load_baseline(run, choice)
        if not choice.given:
            console.print(f"reusing the GPipe baseline in {choice.path}")
        return base
    from terapipe_cli.train.baseline import check_baseline  # PyTorch: loaded only when a baseline is trained

    check_baseline(run.path, choice.path)
    train_gpipe(console, run, choice.path)
    return load_baseline(run, choice)


def train_gpipe(console: Console, run, path: Path) -> None:
    """Train the run's GPipe baseline into ``path``; a failed worker is one line and exit code 1, as in train;
    Ctrl-C is one line saying how to finish the baseline and then the report."""
    from terapipe_cli.train import baseline, launch  # PyTorch: loaded only when a baseline is trained

    scheme = short_form(baseline.baseline_scheme(run.path))
    console.print(
        f"[bold]training the GPipe baseline[/] {scheme} ({run.args.steps} steps, same model, data, seed and layout) "
        f"-> {path}"
    )
    try:
        with ProgressBar(console) as progress:
            baseline.train_baseline(run.path, path, progress)
    except launch.WorkerFailed as e:
        sys.stdout.flush()
        sys.stderr.write(f"terapipe: error: the GPipe baseline failed: {e}\n")
        raise SystemExit(launch.WorkerFailed.exit_code) from None
    except Interrupted as e:
        again = shlex.join(["terapipe", "report", str(run.path)])
        line = launch.interrupted_message(
            path, restart=f"delete {shlex.quote(str(path))} and run {again}", then=f", then {again}"
        )
        stopped = Interrupted(f"the GPipe baseline was {line}")
        stopped.exit_code = e.exit_code  # 143 when a SIGTERM stopped it, as for `terapipe train`; 130 for Ctrl-C
        raise stopped from None


def render(console: Console, result: dict) -> None:
    """The report's summary in the terminal (the same tables as report.md)."""

    console.print(f"[bold]{title(result)}[/]", soft_wrap=True)  # whole, however narrow the table below
    t = Table()
    for n, col in enumerate(latency_header(result)):
        t.add_column(col, justify="left" if n == 0 else "right")
    for row in latency_rows(result):
        t.add_row(*row)
    console.print(t)
    s = Table(title="busy and idle time per stage (mean per step, pipelined span)")
    for n, col in enumerate(STAGE_HEADER):
        s.add_column(col, justify="left" if n == 0 else "right")
    for row in stage_rows(result):
        s.add_row(*row)
    console.print(s)
    memory = memory_table(result)
    if memory:
        m = Table(title=MEMORY_TITLE)
        for n, col in enumerate(memory[0]):
            m.add_column(col, justify="left" if n == 0 else "right")
        for row in memory[1]:
            m.add_row(*row)
        console.print(m)
        for line in memory_mismatch_lines(result):
            console.print(f"[yellow]{line}[/]", markup=True, highlight=False)
    console.print(f"[bold]{headline(result)}[/]")
    if segments_line(result):
        console.print(segments_line(result), markup=False)
    console.print(bubble_line(result))
    if tile_speed_line(result):
        console.print(tile_speed_line(result))
    loss = result["loss"]
    colour = "" if loss is None else "[green]" if loss["match"] else "[red]"
    console.print(colour + loss_line(result) + ("[/]" if colour else ""))
    cm = result.get("cost_model") or {}
    if not cm.get("used"):
        console.print(f"(no predicted timeline: {cm.get('why')})")
    console.print("wrote:")
    for name, path in result["files"].items():
        console.print(f"  {name:<13} {path}", markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("report", help=HELP)(report)
