"""Model configuration TOML files: every shipped one loads and matches docs/design.md §7; bad ones fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli
from file_errors import assert_file_error

from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.models import GptConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILES = sorted((ROOT / "configs" / "models").glob("*.toml"))

# docs/design.md §7: (layers, hidden, heads, seq_len) of the GPT-3 family and the long-sequence variants of setting 5.
PUBLISHED_SHAPES = {
    "gpt3-1b": (24, 2048, 16, 2048),
    "gpt3-13b": (40, 5120, 40, 2048),
    "gpt3-44b": (96, 6144, 48, 2048),
    "gpt3-175b": (96, 12288, 96, 2048),
    "gpt3-13b-L4096": (40, 5120, 40, 4096),
    "gpt3-13b-L6144": (40, 5120, 40, 6144),
    "gpt3-13b-L8192": (40, 5120, 40, 8192),
}


def test_there_are_model_files() -> None:
    assert {p.stem for p in MODEL_FILES} >= set(PUBLISHED_SHAPES) | {"tiny"}


@pytest.mark.parametrize("path", MODEL_FILES, ids=[p.stem for p in MODEL_FILES])
def test_every_model_file_loads(path: Path) -> None:
    cfg = load_model_config(path)
    assert cfg.name == path.stem  # the name a user types matches the file
    assert cfg.hidden % cfg.heads == 0 and cfg.head_dim * cfg.heads == cfg.hidden
    assert ModelConfig.from_dict(cfg.to_dict(), "round trip", prefix="") == cfg
    if cfg.name in PUBLISHED_SHAPES:
        assert (cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len) == PUBLISHED_SHAPES[cfg.name]


def test_stage_layers() -> None:
    cfg = load_model_config(ROOT / "configs" / "models" / "gpt3-1b.toml")
    assert cfg.stage_layers(24) == 1 and cfg.stage_layers(12) == 2 and cfg.stage_layers(1) == 24
    with pytest.raises(UserError, match="do not divide the 24 layers"):
        cfg.stage_layers(5)
    with pytest.raises(UserError, match="at least 1"):
        cfg.stage_layers(0)


def test_a_stage_count_that_does_not_divide_the_layers_names_the_ones_that_do(tmp_path: Path, capsys) -> None:
    cfg = load_model_config("gpt3-13b")
    assert cfg.stage_counts() == [1, 2, 4, 5, 8, 10, 20, 40]
    assert load_model_config("gpt3-1b").stage_counts() == [1, 2, 3, 4, 6, 8, 12, 24]
    assert GptConfig("prime", 7, 8, 2, 16, 8).stage_counts() == [1, 7]
    assert GptConfig("one", 1, 8, 2, 16, 8).stage_counts() == [1]
    with pytest.raises(UserError) as err:
        cfg.stage_layers(16)
    assert str(err.value) == (
        "stages: 16 stages do not divide the 40 layers of model 'gpt3-13b' "
        "(stage counts that divide them: 1, 2, 4, 5, 8, 10, 20, 40)"
    )
    # Plans and experiment files need not divide the layers evenly (a plan may give stages different counts), but
    # cannot have more stages than layers.
    p = run_cli(capsys, "plan", "--experiment", "paper-04", "-k", "41", "--out", tmp_path / "plan.json")
    assert p.returncode == 2 and "--stages" in p.stderr and "41 stages are more than the 40 layers" in p.stderr
    assert not (tmp_path / "plan.json").exists()
    experiment = (ROOT / "configs" / "experiments" / "paper-04-gpt3-13b.toml").read_text()
    for rel in ("../models/gpt3-13b.toml", "../hardware/v100.toml"):
        experiment = experiment.replace(rel, str(ROOT / "configs" / "experiments" / rel))
    uneven = tmp_path / "uneven.toml"
    uneven.write_text(experiment.replace("stages = 20", "stages = 3").replace("gpus = 320", "gpus = 48"))
    assert load_experiment(uneven).stages == 3
    bad = tmp_path / "bad.toml"
    bad.write_text(experiment.replace("stages = 20", "stages = 41").replace("gpus = 320", "gpus = 656"))
    with pytest.raises(UserError) as err:
        load_experiment(bad)
    assert (
        str(err.value) == f"{bad}: field 'experiment.stages' 41 stages are more than the 40 layers of model 'gpt3-13b'"
    )


GOOD = '[model]\nname = "m"\nlayers = 4\nhidden = 64\nheads = 4\nvocab = 256\nseq_len = 128\n'

BAD = [
    ("heads not dividing hidden", GOOD.replace("heads = 4", "heads = 5"), "heads"),
    ("malformed TOML", GOOD.replace("layers = 4", "layers = = 4"), "malformed TOML"),
    ("no [model] table", GOOD.replace("[model]", "[modle]"), "[model]"),
    ("missing field", GOOD.replace("vocab = 256\n", ""), "vocab"),
    ("wrong type", GOOD.replace("layers = 4", 'layers = "4"'), "layers"),
    ("zero layers", GOOD.replace("layers = 4", "layers = 0"), "layers"),
    ("float hidden", GOOD.replace("hidden = 64", "hidden = 64.0"), "hidden"),
    ("unknown key", GOOD + "dropout = 0.1\n", "dropout"),
    ("bool seq_len", GOOD.replace("seq_len = 128", "seq_len = true"), "seq_len"),
]


@pytest.mark.parametrize("what, text, word", BAD, ids=[b[0] for b in BAD])
def test_bad_model_file(tmp_path: Path, what: str, text: str, word: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(text)
    assert_file_error(load_model_config, path, word)


def test_good_model_file(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(GOOD)
    assert load_model_config(path) == GptConfig("m", 4, 64, 4, 256, 128)


def test_missing_and_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found") as err:
        load_model_config(tmp_path / "absent.toml")
    assert "absent.toml" in str(err.value)
    with pytest.raises(UserError, match="folder"):
        load_model_config(tmp_path)


def test_bundled_configs_by_name_from_any_folder(tmp_path, monkeypatch):
    """--model tiny, --hardware h100, an experiment by name: they ship with the package, found from any folder."""
    from terapipe_cli.config.bundled import bundled_names
    from terapipe_cli.config.hardware import load_hardware

    monkeypatch.chdir(tmp_path)
    assert {"tiny", "gpt3-13b"} <= set(bundled_names("models"))
    assert load_model_config("tiny").name == "tiny"
    assert load_model_config("gpt3-13b").layers == 40
    assert "H100" in load_hardware("h100").device.name
    assert load_experiment("paper-01-gpt3-1b").model.name == load_model_config("gpt3-1b").name
    mine = '[model]\nname = "mine"\nlayers = 2\nhidden = 32\nheads = 2\nvocab = 256\nseq_len = 64\n'
    (tmp_path / "tiny").write_text(mine)
    assert load_model_config("tiny").name == "mine"  # a file that exists wins over a bundled name
    with pytest.raises(UserError, match=r"--model: no file 'nope' here .* \(bundled: .*tiny"):
        load_model_config("nope")


def test_profile_by_bundled_names_outside_the_repository(tmp_path, capsys):

    out = tmp_path / "p.json"
    p = run_cli(
        capsys, "profile", "--analytic", "--hardware", "h100", "--model", "gpt3-1b", "--out", str(out), cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr
    assert out.exists()
