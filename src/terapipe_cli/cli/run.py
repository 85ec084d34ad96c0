"""``terapipe run``: the whole flow in one command — profile -> plan -> train -> report -> sample — on the demo.

Each stage is the very command a user would type (`demo_stages` builds its argument list once):
the command line is printed whole, then run through the same parser, so the demo also teaches the commands.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from terapipe_cli.cli.console import make_console
from terapipe_cli.config.demo import DEMO_DEVICE, DemoConfig, load_demo_config, model_toml
from terapipe_cli.config.device import resolve_device
from terapipe_cli.files import write_text_atomic
from terapipe_cli.report.build import FILES
from terapipe_cli.units import folder_stamp

HELP = """Run all four stages in order on the tiny model (K = 2 stages, B = 1), on the CPU whatever the machine \
(--device cuda: on the GPU, the stages sharing it): measure a profile, plan the token slicing, train with the \
plan, then report against the GPipe baseline (trained by the report), and sample a line of text from the trained \
run. Ends with the paths of the pictures. Each stage prints the command that does it alone.

Everything goes into a fresh folder OUT/TIMESTAMP/: model.toml, profile.json, plan.json, run/ (with \
run/report/) and run-gpipe/. About a minute on a 2-core machine; --quick (for CI) about 40 s.

Examples:

    terapipe run

    terapipe run --quick

    terapipe run --device cuda

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
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help="cpu (default: the demo runs on the CPU on any machine) or cuda (its stages share the GPU).",
        ),
    ] = "cpu",
) -> None:
    console = make_console(highlight=False)
    cfg = load_demo_config(config, quick=quick)
    device = resolve_device(device)
    paths = DemoPaths.fresh(out)
    started = time.perf_counter()
    console.print(
        f"[bold]terapipe run[/] ({cfg.source}{', quick' if quick else ''}): model {cfg.model.name}, "
        f"K={cfg.stages}, B={cfg.batch_size}, {cfg.steps} steps, on {device} -> {paths.root}"
    )
    write_text_atomic(paths.model, model_toml(cfg.model))
    stages = demo_stages(cfg, paths, device)
    for n, stage in enumerate(stages, 1):
        console.rule(f"[bold]{n}/{len(stages)} {stage.name}[/]", align="left")
        # Whole and unwrapped, so that it pastes into a shell as it is.
        console.print(shlex.join(["terapipe", *stage.argv]), style="dim", markup=False, soft_wrap=True)
        _run_command(stage.argv)

    console.rule(f"[bold]done[/] in {time.perf_counter() - started:.0f} s", align="left")
    console.print("pictures:")
    for name in FILES:
        if name.endswith(".png") or name == "trace.json":
            console.print(f"  {paths.report / name}", markup=False, soft_wrap=True)
    console.print(f"report: {paths.report / 'report.md'}  ·  trace.json opens in https://ui.perfetto.dev")


def _run_command(argv: list[str]) -> None:
    """Run ``terapipe ARGV`` in this process through the parser a typed command line goes through; its errors
    propagate exactly as they would from the command itself."""
    from terapipe_cli.cli import app

    code = typer.main.get_command(app).main(args=argv, prog_name="terapipe", standalone_mode=False)
    if isinstance(code, int) and code:  # a command that ended through typer.Exit(code): stop the demo there
        raise SystemExit(code)


@dataclass(frozen=True)
class DemoPaths:
    """Where one demo writes: a fresh folder per invocation, so the demo can always be run again."""

    root: Path
    model: Path
    profile: Path
    plan: Path
    run: Path
    report: Path  # the report command's default, RUN_DIR/report

    @classmethod
    def at(cls, root: Path) -> DemoPaths:
        run = root / "run"
        return cls(root, root / "model.toml", root / "profile.json", root / "plan.json", run, run / "report")

    @classmethod
    def fresh(cls, out: Path) -> DemoPaths:
        stamp = folder_stamp()
        root, n = out / stamp, 1
        while root.exists():
            n += 1
            root = out / f"{stamp}-{n}"
        return cls.at(root)


@dataclass(frozen=True)
class DemoStage:
    """One stage of the demo: the command line a user would type, ``terapipe`` + ``argv``."""

    name: str
    argv: list[str]


def demo_stages(cfg: DemoConfig, paths: DemoPaths, device: str = DEMO_DEVICE) -> list[DemoStage]:
    """The five commands of the demo, in order, each with every argument it runs with.

    ``device`` is pinned on the profile and the train commands (the plan follows the profile; the report's
    GPipe baseline trains on the run's device), so ``--device auto`` never moves the demo without being asked.
    """
    profile = ["--model", str(paths.model), "--batch-sizes", ",".join(map(str, _powers_of_two(cfg.batch_size)))]
    profile += ["--token-step", str(cfg.token_step), "--seed", str(cfg.seed), "--device", device]
    profile += ["--out", str(paths.profile)]
    plan = ["--profile", str(paths.profile), "--stages", str(cfg.stages), "--batch", str(cfg.batch_size)]
    plan += ["--token-step", str(cfg.token_step), "--out", str(paths.plan)]
    train = ["--plan", str(paths.plan), "--steps", str(cfg.steps), "--seed", str(cfg.seed), "--lr", str(cfg.lr)]
    train += ["--device", device, "--out", str(paths.run)]
    return [
        DemoStage("profile", ["profile", *profile, *(["--quick"] if cfg.profile_quick else [])]),
        DemoStage("plan", ["plan", *plan]),
        DemoStage("train", ["train", *train]),
        DemoStage("report", ["report", str(paths.run), "--warmup", str(cfg.warmup)]),
        DemoStage("sample", ["sample", str(paths.run), *SAMPLE, "--seed", str(cfg.seed)]),
    ]


# The demo's last word: a few dozen bytes the trained run writes after a name from the embedded text's grammar,
# drawn among the 10 most likely (with `sample`'s default top-k of 200, the demo's run, trained 30 steps, printed 6
# replacement characters in its 48 bytes: bytes that make no UTF-8 character).
SAMPLE = ["--prompt", "Ada sees", "--tokens", "48", "--top-k", "10"]


def _powers_of_two(limit: int) -> list[int]:
    """Batch-slice sizes to profile for B > 1: 1, 2, 4, … up to B (the planner interpolates between them)."""
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return sizes + [limit]


def register(app: typer.Typer) -> None:
    app.command("run", help=HELP)(run)
