"""``terapipe plan``: run the planner on a profile and write the plan JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from terapipe_cli.units import format_seconds

if TYPE_CHECKING:
    from terapipe_cli.planning import Planned

HELP = """Choose token and batch slicing for a profile with the exact dynamic program (docs/design.md §5).

Prints the TeraPipe scheme next to the GPipe baseline and the best uniform slicing, all priced by the same
cost model, and writes the plan JSON that `terapipe train` runs. The plan records the profile's precision
(fp32, bf16 or fp16): its times hold only at that precision, so `terapipe train` runs it.

Example:

    terapipe plan --profile configs/profiles/example-tiny-cpu.json --stages 2 --batch 1 --out plan.json
"""


def plan(
    profile: Annotated[
        Path, typer.Option("--profile", help="Profile JSON (terapipe.profile/1) from `terapipe profile`.")
    ],
    stages: Annotated[int, typer.Option("--stages", "-k", help="Pipeline stages K; must divide the model's layers.")],
    batch: Annotated[int, typer.Option("--batch", "-b", help="Sequences per pipeline replica per step (B).")],
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Sequence length L [default: the model's].")] = None,
    token_step: Annotated[
        int | None,
        typer.Option("--token-step", "-g", help="Token slices are multiples of this [default: the profile's]."),
    ] = None,
    epsilon: Annotated[
        float, typer.Option("--epsilon", help="Seconds; > 0 allows an answer within stages × epsilon of the optimum.")
    ] = 0.0,
    method: Annotated[
        str, typer.Option("--method", help="exact (default) or enumerate (the published ε-enumeration, slower).")
    ] = "exact",
    data_parallel: Annotated[
        int,
        typer.Option(
            "--data-parallel",
            "-d",
            help="Pipeline replicas; adds their gradient all-reduce per step (left out, with a warning, when the "
            "profile has no data_parallel_link).",
        ),
    ] = 1,
    memory_limit: Annotated[
        float | None,
        typer.Option(
            "--memory-limit",
            help="GiB per device; warn when a stage's estimated peak exceeds it "
            "[default: the profile's device memory, if known].",
        ),
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the plan JSON.")] = Path("plan.json"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out even if it is not a plan.")] = False,
) -> None:
    from terapipe_cli.costmodel import read_profile
    from terapipe_cli.files import check_output_file
    from terapipe_cli.plan import PLAN_SCHEMA, write_plan
    from terapipe_cli.planning import plan_for_profile, plan_request

    console = Console()
    check_output_file(out, kind="plan", schema=PLAN_SCHEMA, force=force, example="plan.json")
    prof = read_profile(profile)
    request = plan_request(
        prof,
        stages=stages,
        batch_size=batch,
        seq_len=seq_len,
        token_step=token_step,
        epsilon=epsilon,
        method=method,
        data_parallel=data_parallel,
        memory_limit_gib=memory_limit,
    )
    L, g = request.seq_len, request.token_step
    with console.status(f"Planning {prof.model.name}: L={L}, B={batch}, K={stages}, token step {g} …"):
        planned = plan_for_profile(prof, request)
    write_plan(out, planned.to_plan_dict(str(profile)))

    console.print(_table(planned))
    best = planned.terapipe
    console.print(
        f"solver: {method}, ε = {epsilon:g} s, {best.candidates} t_max candidates in {best.seconds:.3f} s · "
        f"profile: {profile} ({prof.source})"
    )
    warnings = [planned.allreduce_warning()]
    if planned.memory is not None:
        console.print(planned.memory.summary())
        warnings.append(planned.memory.warning())
    for warning in filter(None, warnings):
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True, highlight=False)
    console.print(f"wrote [bold]{out}[/bold]")


_NAMES = {"terapipe": "TeraPipe (DP)", "gpipe": "GPipe", "uniform": "uniform (best)"}


def _table(planned: Planned) -> Table:
    """The three schemes side by side: formula and simulated latency, speed-up, tiles, largest tile; the title
    names the shape and the precision the profile timed (which the plan records and `terapipe train` runs)."""
    r = planned.request
    title = f"{planned.profile.model.name}: L={r.seq_len}, B={r.batch_size}, K={r.stages}"
    title += (f", D={r.data_parallel}" if r.data_parallel > 1 else "") + f", {planned.profile.precision}"
    table = Table(title=title)
    table.add_column("scheme")
    table.add_column("slicing (short form)", overflow="fold", max_width=70)
    for column in ("predicted iteration", "simulated", "speed-up vs GPipe", "tiles", "largest tile"):
        table.add_column(column, justify="right")
    for key, res in planned.schemes():
        table.add_row(
            _NAMES[key],
            res.short_form(fold=True),
            format_seconds(res.predicted_s),
            format_seconds(planned.simulated_s[key]),
            f"{planned.speedup_vs_gpipe(res):.2f}×",
            str(res.tiles),
            format_seconds(res.t_max_s),
        )
    return table


def register(app: typer.Typer) -> None:
    app.command("plan", help=HELP)(plan)
