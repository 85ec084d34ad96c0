"""The one-command demo (`terapipe run`): its settings, loaded and validated once, and where it writes.

Settings come from a TOML file (``configs/experiments/demo.toml``) or, without one, from the embedded default
below — the tiny model on CPU with K = 2 stages and B = 1 — so the demo works from an installed package too.
The demo profiles and trains on the CPU even where a GPU is present (`DEMO_DEVICE`), so it does what it says on
any machine; ``--device cuda`` moves it to the GPU, where on a machine with fewer GPUs than stages the stages
share one (docs/design.md §6, Launch).

    [demo]
    name = "demo"
    model = "../models/tiny.toml"   # relative to the file; or an inline [demo.model] table
    stages = 2
    batch_size = 1
    token_step = 8
    steps = 30                      # of the run and of its GPipe baseline
    warmup = 3                      # leading steps left out of the timings
    seed = 0
    lr = 3e-4
    profile_quick = false

    [demo.quick]                    # overrides for `terapipe run --quick` (CI)
    steps = 8
    warmup = 2
    profile_quick = true
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.config.bundled import load_toml
from terapipe_cli.config.model import ModelConfig, load_model_config
from terapipe_cli.config.run import DEFAULT_LR  # `terapipe train`'s default, the demo's too
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields
from terapipe_cli.units import folder_stamp

# Kept equal to configs/experiments/demo.toml with configs/models/tiny.toml inlined (a test checks it).
DEFAULT_TOML = """
[demo]
name = "demo"
stages = 2
batch_size = 1
token_step = 8
steps = 30
warmup = 3
seed = 0
lr = 3e-4
profile_quick = false

[demo.model]
name = "tiny"
layers = 4
hidden = 256
heads = 4
vocab = 256
seq_len = 1024

[demo.quick]
steps = 8
warmup = 2
profile_quick = true
"""

DEMO_DEVICE = "cpu"  # what the demo profiles and trains on unless asked for another device
SETTINGS = ("steps", "warmup", "seed", "lr", "profile_quick", "stages", "batch_size", "token_step")
KNOWN = ("name", "model", "quick", *SETTINGS)


@dataclass(frozen=True)
class DemoConfig:
    name: str
    model: ModelConfig
    stages: int
    batch_size: int
    token_step: int
    steps: int
    warmup: int
    seed: int
    lr: float
    profile_quick: bool
    source: str  # the file, or "embedded default"


def load_demo_config(path: str | Path | None = None, *, quick: bool = False) -> DemoConfig:
    """The demo's settings from ``path`` (or the embedded default), with ``[demo.quick]`` applied if ``quick``."""
    if path is None:
        where, data, base = "embedded default demo config", tomllib.loads(DEFAULT_TOML), None
    else:
        where, data, base = str(path), load_toml(path, "demo config"), Path(path).parent
    table = data.get("demo")
    if not isinstance(table, dict):
        raise UserError("missing the [demo] table", where=where)
    unknown = sorted(set(table) - set(KNOWN))
    if unknown:
        raise UserError(f"field 'demo.{unknown[0]}' is not a demo setting (known: {', '.join(KNOWN)})", where=where)
    settings = dict(table)
    overrides = settings.pop("quick", {})
    if not isinstance(overrides, dict):
        raise UserError("field 'demo.quick' must be a table of settings", where=where)
    bad = sorted(set(overrides) - set(SETTINGS))
    if bad:
        raise UserError(
            f"field 'demo.quick.{bad[0]}' cannot be changed by --quick (only: {', '.join(SETTINGS)})", where=where
        )
    if quick:
        settings.update(overrides)
    f = Fields(settings, where, "demo.")
    model = _model(f, base, where)
    stages = f.int("stages", minimum=1)
    model.stage_layers(stages, where=f"{where}: field 'demo.stages'")
    cfg = DemoConfig(
        name=f.str("name", default="demo"),
        model=model,
        stages=stages,
        batch_size=f.int("batch_size", minimum=1),
        token_step=f.int("token_step", minimum=1, default=8),
        steps=f.int("steps", minimum=1),
        warmup=f.int("warmup", minimum=0, default=2),
        seed=f.int("seed", default=0),
        lr=f.number("lr", positive=True, default=DEFAULT_LR),
        profile_quick=_bool(f, "profile_quick", False),
        source=where,
    )
    if cfg.warmup >= cfg.steps:
        raise UserError(f"field 'demo.warmup' ({cfg.warmup}) leaves none of the {cfg.steps} steps to time", where=where)
    if model.seq_len % cfg.token_step:
        raise UserError(
            f"field 'demo.token_step' ({cfg.token_step}) does not divide the model's seq_len {model.seq_len}",
            where=where,
        )
    return cfg


def _bool(f: Fields, key: str, default: bool) -> bool:
    v = f.get(key, default)
    if not isinstance(v, bool):
        raise f.fail(key, f"must be true or false, got {v!r}")
    return v


def _model(f: Fields, base: Path | None, where: str) -> ModelConfig:
    v = f.get("model")
    if isinstance(v, dict):
        return ModelConfig.from_dict(v, where, prefix="demo.model.")
    if isinstance(v, str):
        if base is None:
            raise f.fail("model", "must be an inline table in the embedded default")
        p = Path(v).expanduser()
        return load_model_config(p if p.is_absolute() else base / p)
    raise f.fail("model", f"must be a model TOML path or an inline table, got {v!r}")


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
    """The four commands of the demo, in order, each with every argument it runs with.

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
    ]


def _powers_of_two(limit: int) -> list[int]:
    """Batch-slice sizes to profile for B > 1: 1, 2, 4, … up to B (the planner interpolates between them)."""
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return sizes + [limit]


def model_toml(model: ModelConfig) -> str:
    """The model as a TOML file (what `terapipe profile --model` reads)."""
    lines = ["# written by `terapipe run`", "[model]"]
    for key, value in model.to_dict().items():
        lines.append(f"{key} = {value!r}" if not isinstance(value, str) else f'{key} = "{value}"')
    return "\n".join(lines) + "\n"
