"""The demo's settings: the file in configs/ and the embedded default agree; bad settings fail in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from terapipe_cli.cli.run import DemoPaths, demo_stages
from terapipe_cli.config.demo import load_demo_config, model_toml
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "experiments" / "demo.toml"


@pytest.mark.parametrize("quick", [False, True])
def test_file_and_embedded_default_agree(quick):
    a, b = load_demo_config(DEMO, quick=quick), load_demo_config(None, quick=quick)
    assert {**a.__dict__, "source": None} == {**b.__dict__, "source": None}
    assert a.model == load_model_config(ROOT / "configs" / "models" / "tiny.toml")


def test_the_demo_is_the_tiny_model_on_two_stages_with_one_sequence():
    cfg = load_demo_config(None)
    assert (cfg.model.name, cfg.stages, cfg.batch_size) == ("tiny", 2, 1)
    quick = load_demo_config(None, quick=True)
    assert quick.steps < cfg.steps and quick.profile_quick and not cfg.profile_quick
    assert quick.warmup < quick.steps


def test_model_toml_round_trips(tmp_path):
    cfg = load_demo_config(None)
    (tmp_path / "m.toml").write_text(model_toml(cfg.model))
    assert load_model_config(tmp_path / "m.toml") == cfg.model


def test_model_toml_round_trips_a_llama_model_with_its_boolean(tmp_path):
    """scripts/gpu_bringup.py writes its llama cuts with it: tie_embeddings must come out as TOML's false."""
    model = load_model_config(ROOT / "configs" / "models" / "llama3-8b.toml")
    (tmp_path / "m.toml").write_text(model_toml(model, "a comment"))
    assert load_model_config(tmp_path / "m.toml") == model


def test_fresh_folders_never_collide(tmp_path):
    a = DemoPaths.fresh(tmp_path)
    a.root.mkdir()
    b = DemoPaths.fresh(tmp_path)
    assert a.root != b.root and b.report == b.root / "run" / "report"


def test_the_stages_are_the_four_commands_on_the_demos_files(tmp_path):
    cfg = load_demo_config(None, quick=True)
    paths = DemoPaths.at(tmp_path)
    stages = demo_stages(cfg, paths)
    names = ["profile", "plan", "train", "report", "sample"]
    assert [s.name for s in stages] == [s.argv[0] for s in stages] == names
    assert "--quick" in stages[0].argv and stages[1].argv[stages[1].argv.index("--profile") + 1] == str(paths.profile)
    assert stages[2].argv[stages[2].argv.index("--plan") + 1] == str(paths.plan)
    assert stages[3].argv[1] == str(paths.run) and paths.report == paths.run / "report"
    assert stages[4].argv[1] == str(paths.run)


def test_the_demo_profiles_and_trains_on_the_cpu_unless_asked(tmp_path):
    """On a machine with a GPU, --device auto would pick it; the demo pins its device on both commands."""
    cfg, paths = load_demo_config(None, quick=True), DemoPaths.at(tmp_path)
    for device, stages in (("cpu", demo_stages(cfg, paths)), ("cuda", demo_stages(cfg, paths, device="cuda"))):
        pinned = {s.name: s.argv[s.argv.index("--device") + 1] for s in stages if "--device" in s.argv}
        assert pinned == {"profile": device, "train": device}


@pytest.mark.parametrize(
    "text, words",
    [
        ("[demo]\nstages = 2\n", "demo.model"),
        ('[demo]\nmodel = "../models/tiny.toml"\nstages = 5\nbatch_size = 1\nsteps = 4\n', "stages"),
        ('[demo]\nmodel = "../models/tiny.toml"\nstages = 2\nbatch_size = 1\nsteps = 4\nwarmup = 4\n', "warmup"),
        ('[demo]\nmodel = "../models/tiny.toml"\nstages = 2\nbatch_size = 1\nsteps = 4\nspeed = 1\n', "demo.speed"),
        (
            '[demo]\nmodel = "../models/tiny.toml"\nstages = 2\nbatch_size = 1\nsteps = 4\n[demo.quick]\nname = "x"\n',
            "demo.quick.name",
        ),
        ('[demo]\nmodel = "../models/none.toml"\nstages = 2\nbatch_size = 1\nsteps = 4\n', "none.toml"),
        ("[demo\n", "malformed TOML"),
        ("[other]\n", "[demo]"),
    ],
)
def test_bad_config(tmp_path, text, words):
    folder = tmp_path / "experiments"
    folder.mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.toml").write_text((ROOT / "configs" / "models" / "tiny.toml").read_text())
    path = folder / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_demo_config(path)
    assert words in str(e.value) and "\n" not in str(e.value)
