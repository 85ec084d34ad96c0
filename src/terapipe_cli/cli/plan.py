"""``terapipe plan``: run the planner on a profile and write the plan JSON."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from terapipe_cli import __version__
from terapipe_cli.errors import UserError

HELP = """Choose token and batch slicing for a profile with the exact dynamic program (SPEC §5).

Prints the TeraPipe scheme next to the GPipe baseline and the best uniform slicing, all priced by the same
cost model, and writes the plan JSON that `terapipe train` runs.

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
        int, typer.Option("--data-parallel", "-d", help="Pipeline replicas; adds their gradient all-reduce per step.")
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
) -> None:
    from terapipe_cli.costmodel import CostModel, read_profile
    from terapipe_cli.plan import make_plan_dict, write_plan
    from terapipe_cli.planner import gpipe_baseline, solve, uniform_baseline
    from terapipe_cli.simulate import simulate, stage_memory

    console = Console()
    prof = read_profile(profile)
    model = prof.model
    if stages < 1:
        raise UserError(f"must be at least 1, got {stages}", where="--stages")
    if batch < 1:
        raise UserError(f"must be at least 1, got {batch}", where="--batch")
    if data_parallel < 1:
        raise UserError(f"must be at least 1, got {data_parallel}", where="--data-parallel")
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise UserError(f"must be a non-negative number of seconds, got {epsilon}", where="--epsilon")
    if memory_limit is not None and not (memory_limit > 0 and math.isfinite(memory_limit)):
        raise UserError(f"must be a positive number of GiB, got {memory_limit}", where="--memory-limit")
    if method not in ("exact", "enumerate"):
        raise UserError(f"must be 'exact' or 'enumerate', got {method!r}", where="--method")
    model.stage_layers(stages, where=f"--stages (model {model.name} in {profile})")
    L = model.seq_len if seq_len is None else seq_len
    g = prof.token_step if token_step is None else token_step
    if L < 1:
        raise UserError(f"must be at least 1, got {L}", where="--seq-len")
    if L > model.seq_len:
        raise UserError(f"{L} is longer than the model's seq_len {model.seq_len} (in {profile})", where="--seq-len")
    if g < 1:
        raise UserError(f"must be at least 1, got {g}", where="--token-step")
    if L % g:
        raise UserError(f"the sequence length {L} is not a multiple of the token step {g}", where="--token-step")

    cost = CostModel(prof, stages, data_parallel)
    with console.status(f"Planning {model.name}: L={L}, B={batch}, K={stages}, token step {g} …"):
        best = solve(cost, seq_len=L, batch_size=batch, stages=stages, token_step=g, epsilon=epsilon, method=method)
        gpipe = gpipe_baseline(cost, seq_len=L, batch_size=batch, stages=stages)
        uniform = uniform_baseline(cost, seq_len=L, batch_size=batch, stages=stages, token_step=g)
        # The formula prices every tile's transfers inside the tile; the simulator replays the schedule with
        # asynchronous sends, as the runtime runs it. Both are reported.
        simulated = {
            name: simulate(res.slices, cost, stages).latency_s
            for name, res in (("terapipe", best), ("gpipe", gpipe), ("uniform", uniform))
        }
    memory = _memory(stage_memory(best.slices, prof, stages), prof.device, memory_limit)

    obj = make_plan_dict(
        model=model,
        stages=stages,
        batch_size=batch,
        seq_len=L,
        token_step=g,
        slices=best.slices,
        predicted_s=best.predicted_s,
        data_parallel=data_parallel,
        simulated_s=simulated["terapipe"],
        t_max_s=best.t_max_s,
        sum_s=best.sum_s,
        tiles=best.tiles,
        step_s=cost.step_s,
        speedup_vs_gpipe=gpipe.predicted_s / best.predicted_s,
        baselines={
            "gpipe": {**gpipe.to_dict(), "microbatch": gpipe.extra["microbatch"], "simulated_s": simulated["gpipe"]},
            "uniform": {**uniform.to_dict(), **uniform.extra, "simulated_s": simulated["uniform"]},
        },
        memory=memory,
        solver={"method": method, "epsilon": epsilon, "seconds": best.seconds, "candidates": best.candidates},
        profile={
            "path": str(profile),
            "sha256": prof.sha256,
            "source": prof.source,
            "device": prof.device.get("name"),
        },
        created=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        terapipe_version=__version__,
    )
    write_plan(out, obj)

    title = f"{model.name}: L={L}, B={batch}, K={stages}" + (f", D={data_parallel}" if data_parallel > 1 else "")
    table = Table(title=title)
    table.add_column("scheme")
    table.add_column("slicing (short form)", overflow="fold", max_width=70)
    table.add_column("predicted iteration", justify="right")
    table.add_column("simulated", justify="right")
    table.add_column("speed-up vs GPipe", justify="right")
    table.add_column("tiles", justify="right")
    table.add_column("largest tile", justify="right")
    for name, key, res in (
        ("TeraPipe (DP)", "terapipe", best),
        ("GPipe", "gpipe", gpipe),
        ("uniform (best)", "uniform", uniform),
    ):
        table.add_row(
            name,
            res.short_form(fold=True),
            _seconds(res.predicted_s),
            _seconds(simulated[key]),
            f"{gpipe.predicted_s / res.predicted_s:.2f}×",
            str(res.tiles),
            _seconds(res.t_max_s),
        )
    console.print(table)
    console.print(
        f"solver: {method}, ε = {epsilon:g} s, {best.candidates} t_max candidates in {best.seconds:.3f} s · "
        f"profile: {profile} ({prof.source})"
    )
    if memory is not None:
        peak = max(memory["per_stage_bytes"])
        limit = memory.get("limit_bytes")
        console.print(
            f"estimated peak memory per stage: {_gib(peak)} (largest)" + (f", limit {_gib(limit)}" if limit else "")
        )
        if limit and peak > limit:
            stage = memory["per_stage_bytes"].index(peak)
            Console(stderr=True).print(
                f"[yellow]warning:[/yellow] stage {stage} needs about {_gib(peak)}, more than the {_gib(limit)} "
                f"{memory['limit_source']}; use more stages, a smaller batch, or tensor parallelism",
                soft_wrap=True,
            )
    console.print(f"wrote [bold]{out}[/bold]")


def _memory(per_stage, device: dict, limit_gib: float | None) -> dict | None:
    """Peak memory per stage (from the profile's sizes) and the limit it is checked against."""
    if per_stage is None:
        return None
    out = {
        "per_stage_bytes": [m.total_bytes for m in per_stage],
        "state_bytes": [m.state_bytes for m in per_stage],
        "activation_bytes": [m.activation_bytes for m in per_stage],
    }
    if limit_gib is not None:
        out.update(limit_bytes=limit_gib * 2**30, limit_source="GiB of --memory-limit")
    elif isinstance(device.get("memory_bytes"), (int, float)):
        out.update(
            limit_bytes=float(device["memory_bytes"]),
            limit_source=f"of the profile's device ({device.get('name', '?')})",
        )
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def register(app: typer.Typer) -> None:
    app.command("plan", help=HELP)(plan)
