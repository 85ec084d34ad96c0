"""``terapipe run``: the whole flow in one command — profile -> plan -> train -> report — on the demo settings.

Each stage is the very command a user would type (the same functions, so the same checks and output); the
equivalent command line is printed before it, so the demo also teaches the four commands.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

HELP = """Run all four stages in order on the tiny model on CPU (K = 2 stages, B = 1): measure a profile, plan \
the token slicing, train with the plan, then report against the GPipe baseline (trained by the report). Ends \
with the report's summary and the paths of the pictures. Each stage prints the command that does it alone.

Everything goes into a fresh folder OUT/TIMESTAMP/: model.toml, profile.json, plan.json, run/ (with \
run/report/) and run-gpipe/. About a minute on a 2-core machine; --quick (for CI) about 40 s.

Examples:

    terapipe run

    terapipe run --quick

    terapipe run --config configs/experiments/demo.toml --out runs/demo
"""


def run(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Demo TOML, e.g. configs/experiments/demo.toml (default: embedded)."),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="The short variant for CI: quick profile, fewer steps (demo.quick).")
    ] = False,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the demo's runs.")] = Path("runs/demo"),
) -> None:
    from terapipe_cli.cli.plan import plan as plan_command
    from terapipe_cli.cli.profile import profile as profile_command
    from terapipe_cli.cli.report import report as report_command
    from terapipe_cli.cli.train import train as train_command
    from terapipe_cli.demo import DemoPaths, load_demo_config, model_toml
    from terapipe_cli.files import write_text_atomic
    from terapipe_cli.report.build import FILES

    console = Console(highlight=False)
    cfg = load_demo_config(config, quick=quick)
    paths = DemoPaths.fresh(out)
    started = time.perf_counter()
    console.print(
        f"[bold]terapipe run[/] ({cfg.source}{', quick' if quick else ''}): model {cfg.model.name}, "
        f"K={cfg.stages}, B={cfg.batch_size}, {cfg.steps} steps -> {paths.root}"
    )
    write_text_atomic(paths.model, model_toml(cfg.model))

    def stage(n: int, name: str, argv: list[str]) -> None:
        console.rule(f"[bold]{n}/4 {name}[/]  [dim]{shlex.join(['terapipe', *argv])}[/]", align="left")

    batch_sizes = ",".join(str(b) for b in _powers_of_two(cfg.batch_size))
    stage(
        1,
        "profile",
        [
            "profile",
            "--model",
            str(paths.model),
            "--batch-sizes",
            batch_sizes,
            "--token-step",
            str(cfg.token_step),
            "--seed",
            str(cfg.seed),
            "--out",
            str(paths.profile),
        ]
        + (["--quick"] if cfg.profile_quick else []),
    )
    profile_command(
        model=paths.model,
        batch_sizes=batch_sizes,
        token_step=cfg.token_step,
        quick=cfg.profile_quick,
        seed=cfg.seed,
        out=paths.profile,
    )

    stage(
        2,
        "plan",
        [
            "plan",
            "--profile",
            str(paths.profile),
            "--stages",
            str(cfg.stages),
            "--batch",
            str(cfg.batch_size),
            "--out",
            str(paths.plan),
        ],
    )
    plan_command(
        profile=paths.profile, stages=cfg.stages, batch=cfg.batch_size, token_step=cfg.token_step, out=paths.plan
    )

    stage(
        3,
        "train",
        [
            "train",
            "--plan",
            str(paths.plan),
            "--steps",
            str(cfg.steps),
            "--seed",
            str(cfg.seed),
            "--lr",
            f"{cfg.lr:g}",
            "--out",
            str(paths.run),
        ],
    )
    train_command(plan=paths.plan, steps=cfg.steps, out=paths.run, seed=cfg.seed, lr=cfg.lr)

    stage(4, "report", ["report", str(paths.run), "--warmup", str(cfg.warmup)])
    report_command(run_dir=paths.run, warmup=cfg.warmup)

    console.rule(f"[bold]done[/] in {time.perf_counter() - started:.0f} s", align="left")
    console.print("pictures:")
    for name in FILES:
        if name.endswith(".png") or name == "trace.json":
            console.print(f"  {paths.report / name}")
    console.print(f"report: {paths.report / 'report.md'}  ·  trace.json opens in https://ui.perfetto.dev")


def _powers_of_two(limit: int) -> list[int]:
    """Batch-slice sizes to profile for B > 1: 1, 2, 4, … up to B (the planner interpolates between them)."""
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return sizes + [limit]


def register(app: typer.Typer) -> None:
    app.command("run", help=HELP)(run)
