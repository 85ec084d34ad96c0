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

from dataclasses import MISSING, dataclass
from pathlib import Path

from terapipe_cli.config.bundled import find_config, load_toml
from terapipe_cli.config.fields import read_fields, setting
from terapipe_cli.config.hardware import Hardware, load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields
from terapipe_cli.models import ModelConfig


@dataclass(frozen=True)
class ExperimentFile:
    """The keys of an ``[experiment]`` table (paths relative to the file)."""

    name: str = setting("The experiment's name.", MISSING)
    model: str = setting("The model TOML.", MISSING, path=True)
    hardware: str = setting("The hardware TOML its profile is estimated for.", MISSING, path=True)
    gpus: int = setting("GPUs in all: data_parallel · stages · tensor_parallel.", MISSING, minimum=1)
    batch_size: int = setting("The global batch B: sequences per step over all replicas.", MISSING, minimum=1)
    data_parallel: int = setting("Data-parallel replicas D.", MISSING, minimum=1)
    stages: int = setting("Pipeline stages K.", MISSING, minimum=1)
    tensor_parallel: int = setting("Tensor-parallel degree T.", MISSING, minimum=1)
    token_step: int = setting("Token slices are multiples of this.", 8, minimum=1)
    description: str = setting("What it is, in words.", "")
    # (last: the field's name shadows the function in the class body)
    setting: str = setting("The row of docs/design.md §7 it reproduces (free text).", "")


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
    if isinstance(table.get("setting"), int) and not isinstance(table.get("setting"), bool):
        table = {**table, "setting": str(table["setting"])}  # a setting's number, written without quotes
    base = path.resolve().parent
    v = read_fields(ExperimentFile, table, where, prefix="experiment.", what="experiment setting", base=base)
    f = Fields(table, where, "experiment.")
    model_path, hardware_path = Path(v["model"]), Path(v["hardware"])
    if not (model_path.is_file() or (model_path / "config.json").is_file()):
        raise f.fail("model", f"names {model_path}, which is neither a file nor a transformers folder")
    if not hardware_path.is_file():
        raise f.fail("hardware", f"names {hardware_path}, which is not a file")
    model = load_model_config(model_path)
    hardware = load_hardware(hardware_path)
    gpus, batch_size, stages, token_step = v["gpus"], v["batch_size"], v["stages"], v.get("token_step", 8)
    dp, tp = v["data_parallel"], v["tensor_parallel"]
    if dp * stages * tp != gpus:
        raise f.fail(
            "gpus", f"is {gpus}, but data_parallel·stages·tensor_parallel = {dp}·{stages}·{tp} = {dp * stages * tp}"
        )
    if batch_size % dp:
        raise f.fail("batch_size", f"{batch_size} is not divisible by data_parallel {dp}")
    try:
        model.check_stages(stages)
    except UserError as e:
        raise f.fail("stages", e.message) from None
    try:
        hardware.check_tensor_parallel(model, tp)
    except UserError as e:
        raise f.fail("tensor_parallel", e.message) from None
    if token_step > model.seq_len:
        raise f.fail("token_step", f"is {token_step}, longer than the sequence length {model.seq_len}")
    return Experiment(
        name=v["name"],
        setting=v.get("setting", ""),
        description=v.get("description", ""),
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
