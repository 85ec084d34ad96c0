"""Experiment files: one training setting (model, cluster, parallelism, batch) as a TOML under ``configs/experiments/``.

    [experiment]
    name = "paper-04-gpt3-13b"
    setting = "4"                          # the row of docs/design.md §7 it reproduces (free text)
    description = "..."                    # optional
    model = "../models/gpt3-13b.toml"      # paths are relative to this file
    hardware = "../hardware/v100.toml"
    gpus = 320                             # = data_parallel · stages · tensor_parallel
    batch_size = 32                        # global batch B: sequences per step over all replicas
    data_parallel = 2
    stages = 20
    tensor_parallel = 8
    token_step = 8                         # optional, default 8

Loaded once into a validated dataclass (torchtitan style); every mistake is one `UserError` naming the file and
the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.config.bundled import find_config, load_toml
from terapipe_cli.config.hardware import Hardware, load_hardware
from terapipe_cli.config.model import ModelConfig, load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields

KNOWN = (
    "name",
    "setting",
    "description",
    "model",
    "hardware",
    "gpus",
    "batch_size",
    "data_parallel",
    "stages",
    "tensor_parallel",
    "token_step",
)


@dataclass(frozen=True)
class Experiment:
    name: str
    setting: str
    description: str
    model: ModelConfig
    hardware: Hardware
    model_path: str
    hardware_path: str
    gpus: int
    batch_size: int  # global
    data_parallel: int
    stages: int
    tensor_parallel: int
    token_step: int
    path: str

    @property
    def seq_len(self) -> int:
        return self.model.seq_len

    @property
    def batch_per_replica(self) -> int:
        """B of the planner: the sequences one pipeline replica runs per step."""
        return self.batch_size // self.data_parallel


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def load_experiment(path: str | Path, flag: str = "experiment") -> Experiment:
    """Load and validate one experiment file, or a bundled one by name (``paper-01-gpt3-1b``) or by the start of
    exactly one bundled name (``paper-01``); paths inside it are relative to the file. ``flag`` names the option
    that gave it, in the error for a name that is neither."""
    path = find_config(path, "experiments", flag, prefix=True)
    where = str(path)
    data = load_toml(path, "experiment")
    table = data.get("experiment")
    if not isinstance(table, dict):
        raise UserError("missing the [experiment] table", where=where)
    extra = sorted(set(data) - {"experiment"})
    if extra:
        raise UserError(f"unknown table [{extra[0]}] (only [experiment] is read)", where=where)
    f = Fields(table, where, "experiment.")
    unknown = sorted(set(table) - set(KNOWN))
    if unknown:
        raise f.fail(unknown[0], "is not an experiment setting (known: " + ", ".join(KNOWN) + ")")

    base = path.resolve().parent
    model_path = _resolve(base, f.str("model"))
    hardware_path = _resolve(base, f.str("hardware"))
    if not model_path.is_file():
        raise f.fail("model", f"names {model_path}, which is not a file")
    if not hardware_path.is_file():
        raise f.fail("hardware", f"names {hardware_path}, which is not a file")
    model = load_model_config(model_path)
    hardware = load_hardware(hardware_path)

    gpus = f.int("gpus", minimum=1)
    batch_size = f.int("batch_size", minimum=1)
    dp = f.int("data_parallel", minimum=1)
    stages = f.int("stages", minimum=1)
    tp = f.int("tensor_parallel", minimum=1)
    token_step = f.int("token_step", minimum=1, default=8)
    setting = table.get("setting", "")
    if not isinstance(setting, (str, int)) or isinstance(setting, bool):
        raise f.fail("setting", f"must be a string, got {setting!r}")

    if dp * stages * tp != gpus:
        raise f.fail(
            "gpus", f"is {gpus}, but data_parallel·stages·tensor_parallel = {dp}·{stages}·{tp} = {dp * stages * tp}"
        )
    if batch_size % dp:
        raise f.fail("batch_size", f"{batch_size} is not divisible by data_parallel {dp}")
    if model.layers % stages:
        raise f.fail("stages", f"{stages} stages do not divide the {model.layers} layers of model '{model.name}'")
    try:
        hardware.check_tensor_parallel(model, tp)
    except UserError as e:
        raise f.fail("tensor_parallel", e.message) from None
    if token_step > model.seq_len:
        raise f.fail("token_step", f"is {token_step}, longer than the sequence length {model.seq_len}")
    return Experiment(
        name=f.str("name"),
        setting=str(setting),
        description=f.str("description", default=""),
        model=model,
        hardware=hardware,
        model_path=str(model_path),
        hardware_path=str(hardware_path),
        gpus=gpus,
        batch_size=batch_size,
        data_parallel=dp,
        stages=stages,
        tensor_parallel=tp,
        token_step=token_step,
        path=where,
    )
