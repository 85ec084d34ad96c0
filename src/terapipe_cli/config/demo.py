"""The one-command demo (`terapipe run`): its settings, loaded and validated once (cli/run.py runs it).

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
    steps = 5
    warmup = 2
    profile_quick = true
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass
from pathlib import Path

from terapipe_cli.config.bundled import load_toml
from terapipe_cli.config.fields import known_keys, read_fields, setting
from terapipe_cli.config.model import load_model_config
from terapipe_cli.config.run import DEFAULT_LR  # `terapipe train`'s default, the demo's too
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields
from terapipe_cli.models import ModelConfig

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
steps = 5
warmup = 2
profile_quick = true
"""

DEMO_DEVICE = "cpu"  # what the demo profiles and trains on unless asked for another device


@dataclass(frozen=True)
class DemoSettings:
    """The demo's numbers: what ``[demo]`` sets besides its name and model, and what ``[demo.quick]`` may change."""

    stages: int = setting("Pipeline stages K.", MISSING, minimum=1)
    batch_size: int = setting("Sequences per step B.", MISSING, minimum=1)
    steps: int = setting("Steps of the run and of its GPipe baseline.", MISSING, minimum=1)
    token_step: int = setting("Token slices are multiples of this.", 8, minimum=1)
    warmup: int = setting("Leading steps the report leaves out of the timings.", 2, minimum=0)
    seed: int = setting("Seed of the weights and of the batches.", 0)
    lr: float = setting("Peak learning rate (`terapipe train`'s default).", DEFAULT_LR, positive=True)
    profile_quick: bool = setting("Profile with `terapipe profile --quick`.", False)


@dataclass(frozen=True)
class DemoConfig(DemoSettings):
    name: str = "demo"
    model: ModelConfig | None = None
    source: str = ""  # the file, or "embedded default"


def load_demo_config(path: str | Path | None = None, *, quick: bool = False) -> DemoConfig:
    """The demo's settings from ``path`` (or the embedded default), with ``[demo.quick]`` applied if ``quick``."""
    if path is None:
        where, data, base = "embedded default demo config", tomllib.loads(DEFAULT_TOML), None
    else:
        where, data, base = str(path), load_toml(path, "demo config"), Path(path).parent
    table = data.get("demo")
    if not isinstance(table, dict):
        raise UserError("missing the [demo] table", where=where)
    table = dict(table)
    own = {key: table.pop(key) for key in ("name", "model", "quick") if key in table}
    known = ("name", "model", "quick", *known_keys(DemoSettings))
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise UserError(f"field 'demo.{unknown[0]}' is not a demo setting (known: {', '.join(known)})", where=where)
    f = Fields(own, where, "demo.")
    model = _model(f, base, where)
    values = read_fields(DemoSettings, table, where, prefix="demo.", what="demo setting")
    overrides = own.get("quick", {})
    if not isinstance(overrides, dict):
        raise UserError("field 'demo.quick' must be a table of settings", where=where)
    changes = read_fields(
        DemoSettings, overrides, where, prefix="demo.quick.", what="setting --quick can change", partial=True
    )
    if quick:
        values.update(changes)
    model.check_stages(values["stages"], where=f"{where}: field 'demo.stages'")
    cfg = DemoConfig(**values, name=f.str("name", default="demo"), model=model, source=where)
    if cfg.warmup >= cfg.steps:
        raise UserError(f"field 'demo.warmup' ({cfg.warmup}) leaves none of the {cfg.steps} steps to time", where=where)
    if model.seq_len % cfg.token_step:
        raise UserError(
            f"field 'demo.token_step' ({cfg.token_step}) does not divide the model's seq_len {model.seq_len}",
            where=where,
        )
    return cfg


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


def model_toml(model: ModelConfig, comment: str = "written by `terapipe run`") -> str:
    """The model as a TOML file (what `terapipe profile --model` reads), under a ``comment`` line."""
    lines = [f"# {comment}", "[model]"]
    for key, value in model.to_dict().items():
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, dict):  # an inline table (a llama model's rope_scaling)
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):  # TOML's booleans are lower case (a llama model's tie_embeddings); repr's are not
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)
