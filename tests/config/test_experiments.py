"""Experiment files: the published settings load and agree with docs/design.md §7; bad files fail in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from file_errors import assert_file_error

from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
EXP = ROOT / "configs" / "experiments"

# docs/design.md §7: model, GPUs, global batch, data-parallel, stages, tensor-parallel.
PUBLISHED = {
    "1": ("gpt3-1b", 192, 128, 8, 24, 1),
    "2": ("gpt3-1b", 192, 72, 2, 12, 8),
    "3": ("gpt3-1b", 192, 72, 1, 24, 8),
    "4": ("gpt3-13b", 320, 32, 2, 20, 8),
    "5": ("gpt3-13b", 320, 32, 1, 40, 8),
    "6": ("gpt3-44b", 384, 8, 4, 96, 1),
    "7": ("gpt3-44b", 384, 8, 2, 24, 8),
    "8": ("gpt3-44b", 384, 8, 1, 48, 8),
    "9": ("gpt3-175b", 384, 2, 1, 96, 4),
    "10": ("gpt3-175b", 384, 2, 1, 48, 8),
    "5, L=4096": ("gpt3-13b-L4096", 320, 8, 1, 40, 8),
    "5, L=6144": ("gpt3-13b-L6144", 320, 4, 1, 40, 8),
    "5, L=8192": ("gpt3-13b-L8192", 320, 2, 1, 40, 8),
}


def test_all_published_settings_are_there_and_match_the_design():
    found = {}
    for path in sorted(EXP.glob("paper-*.toml")):
        e = load_experiment(path)
        found[e.setting] = (e.model.name, e.gpus, e.batch_size, e.data_parallel, e.stages, e.tensor_parallel)
        assert e.hardware.name == "aws-p3.16xlarge"
        assert e.batch_per_replica * e.data_parallel == e.batch_size
    assert found == PUBLISHED


def test_long_sequence_runs_use_their_sequence_length():
    for L in (4096, 6144, 8192):
        assert load_experiment(EXP / f"paper-05-gpt3-13b-L{L}.toml").seq_len == L


GOOD = (EXP / "paper-04-gpt3-13b.toml").read_text()


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda s: s.replace("gpus = 320", "gpus = 300"), "experiment.gpus"),
        (lambda s: s.replace("batch_size = 32", "batch_size = 33"), "experiment.batch_size"),
        (lambda s: s.replace("stages = 20", "stages = 41").replace("gpus = 320", "gpus = 656"), "experiment.stages"),
        (
            lambda s: s.replace("tensor_parallel = 8", "tensor_parallel = 16").replace("gpus = 320", "gpus = 640"),
            "experiment.tensor_parallel",
        ),
        (lambda s: s.replace("../models/gpt3-13b.toml", "../models/nope.toml"), "experiment.model"),
        (lambda s: s.replace("../hardware/v100.toml", "../hardware/nope.toml"), "experiment.hardware"),
        (lambda s: s.replace("token_step = 8", "token_stpe = 8"), "experiment.token_stpe"),
        (lambda s: s.replace("data_parallel = 2", 'data_parallel = "two"'), "experiment.data_parallel"),
        (lambda s: s.replace("[experiment]", "[experimnt]"), "[experiment]"),
    ],
)
def test_bad_file_is_one_line_naming_the_field(tmp_path: Path, edit, field: str):
    # Written beside the real ones so that the relative model/hardware paths resolve.
    path = tmp_path / "configs" / "experiments" / "bad.toml"
    path.parent.mkdir(parents=True)
    for sub in ("models", "hardware"):
        (tmp_path / "configs" / sub).symlink_to(ROOT / "configs" / sub)
    path.write_text(edit(GOOD))
    assert_file_error(load_experiment, path, field)


def test_bad_model_file_inside_is_reported_with_its_own_path(tmp_path: Path):
    model = tmp_path / "m.toml"
    model.write_text("[model]\nname = 'x'\nlayers = 4\nhidden = 64\nheads = 5\nvocab = 10\nseq_len = 64\n")
    path = tmp_path / "e.toml"
    hardware = ROOT / "configs" / "hardware" / "v100.toml"
    path.write_text(GOOD.replace("../models/gpt3-13b.toml", str(model)).replace("../hardware/v100.toml", str(hardware)))
    with pytest.raises(UserError, match=r"m\.toml.*heads"):
        load_experiment(path)
