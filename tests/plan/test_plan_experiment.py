"""`terapipe plan --experiment`: a published setting planned in one command, from the analytic profile of its
hardware at its T unless --profile is given; options given explicitly override the file's values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from terapipe_cli.cli.plan import setting_from_options
from terapipe_cli.config.bundled import bundled_names, find_config
from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan.choice import plan_for_profile
from terapipe_cli.plan.file import read_plan
from terapipe_cli.profile.analytic import experiment_profile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"
# Setting 8 (GPT3-44B, B = 8, D = 1, K = 48, T = 8): the options' tests. Setting 10 (GPT3-175B, B = 2, K = 48, T = 8)
# fits the V100's 16 GiB (the embedding and the head split over the tensor ranks) and plans fastest of those with T = 8
# (about 4 s; setting 8 about 12 s, with the zero-bubble orders tried).
QUICK = "paper-08-gpt3-44b"
PLANNED = "paper-10-gpt3-175b"


def options(**given) -> dict:
    base = dict(
        profile=None, experiment=QUICK, stages=None, batch_size=None, data_parallel=None, tensor_parallel=None,
        token_step=None,
    )  # fmt: skip
    return {**base, **given}


def test_plan_experiment_plans_the_files_setting(tmp_path: Path, capsys):
    exp = load_experiment(PLANNED)
    out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", "--experiment", PLANNED, "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    plan = read_plan(out)
    assert plan.model == exp.model
    assert (plan.stages, plan.data_parallel, plan.tensor_parallel) == (exp.stages, exp.data_parallel, 8)
    assert (plan.batch_size, plan.token_step) == (exp.batch_per_replica, exp.token_step)
    assert plan.raw["experiment"] == {"name": exp.name, "path": exp.path, "overridden": {}}
    assert plan.raw["profile"]["source"] == "analytic" and plan.raw["profile"]["path"] is None
    assert plan.precision == exp.hardware.training.dtype
    memory = plan.raw["memory"]  # planned within the V100's 16 GiB, the device memory of the experiment's hardware
    assert max(memory["per_stage_bytes"]) <= memory["limit_bytes"] == 16 * 2**30
    assert f"= {exp.gpus} processes" in p.stdout  # D × K × T is the experiment's GPU count
    assert exp.name in p.stdout


def test_options_given_override_the_file_and_are_recorded():
    exp = load_experiment("paper-04-gpt3-13b")  # D = 2, global batch 32
    setting = setting_from_options(**options(experiment="paper-04", data_parallel=4, stages=exp.stages // 2))
    assert (setting.data_parallel, setting.stages) == (4, exp.stages // 2)
    assert setting.batch_size == exp.batch_size // 4  # the global batch stays, split over more replicas
    assert setting.experiment["overridden"] == {"data_parallel": 4, "stages": exp.stages // 2}
    per_replica = setting_from_options(**options(experiment="paper-04", batch_size=3))
    assert (per_replica.batch_size, per_replica.data_parallel) == (3, exp.data_parallel)


def test_another_t_is_estimated_at_that_t():
    exp = load_experiment(QUICK)
    setting = setting_from_options(**options(tensor_parallel=4))
    assert setting.profile.tensor_parallel == 4 and setting.profile.params_per_layer == exp.model.params_per_layer(4)
    request = setting.request()
    assert request.tensor_parallel == 4
    assert plan_for_profile(setting.profile, request).to_plan_dict(None, setting.experiment)["tensor_parallel"] == 4


def test_a_profile_given_is_used_and_must_be_of_the_experiments_model(tmp_path: Path):
    exp = load_experiment(QUICK)
    obj = experiment_profile(exp, batch_size=exp.batch_per_replica, tensor_parallel=8, token_step=exp.token_step)
    path = write_json_atomic(tmp_path / "mine.json", obj)
    setting = setting_from_options(**options(profile=path))
    assert setting.profile_path == str(path) and setting.profile.path == str(path)
    with pytest.raises(UserError, match=f"{EXAMPLE}: is a profile of model 'tiny', but {QUICK} trains .*: its field"):
        setting_from_options(**options(profile=EXAMPLE))
    # The same model profiled from a folder of another name is the experiment's model.
    renamed = write_json_atomic(tmp_path / "renamed.json", {**obj, "model": {**obj["model"], "name": "elsewhere"}})
    assert setting_from_options(**options(profile=renamed)).profile.model.name == "elsewhere"


def test_a_unique_start_of_a_bundled_name_finds_it():
    assert find_config("paper-08", "experiments", "--experiment", prefix=True).name == f"{QUICK}.toml"
    assert load_experiment("paper-08").name == QUICK
    assert load_experiment("paper-10").name == "paper-10-gpt3-175b"
    starts = [n for n in bundled_names("experiments") if n.startswith("paper-05")]
    assert len(starts) > 1
    with pytest.raises(UserError, match=f"'paper-05' is the start of {len(starts)} bundled"):
        find_config("paper-05", "experiments", "--experiment", prefix=True)
    # Models keep exact names only.
    with pytest.raises(UserError, match="no file 'gpt3-17' here"):
        find_config("gpt3-17", "models", "--model")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--experiment", "no-such-setting"], ["--experiment", "no-such-setting", QUICK]),
        (["--experiment", "paper-05"], ["--experiment", "paper-05-gpt3-13b-L4096"]),
        (["--experiment", "paper-04", "-d", "3"], ["--data-parallel", "3 does not divide", "--batch"]),
        (["--experiment", QUICK, "-t", "5"], ["--tensor-parallel", "5 does not divide the 48 heads"]),
        (
            ["--experiment", QUICK, "--profile", str(EXAMPLE)],
            ["example-tiny-cpu.json", "trains 'gpt3-44b'", "field 'model.layers' is 4"],
        ),
        (["--stages", "2", "--batch", "1"], ["--profile", "is required", "--experiment"]),
        (
            ["--experiment", "paper-10", "--partition", "balanced", "--virtual-stages", "1", "--memory-limit", "8"],
            ["--memory-limit", "no scheme fits the 8.0 GiB", "smallest possible peak"],
        ),
    ],
)
def test_bad_requests_are_one_line_and_write_nothing(tmp_path: Path, args, words, capsys):
    out = tmp_path / "plan.json"
    assert_one_line_error(run_cli(capsys, "plan", *args, "--out", out), *words)
    assert not out.exists()


def test_help_shows_an_experiment_example(capsys):
    p = run_cli(capsys, "plan", "--help")
    assert p.returncode == 0
    assert "terapipe plan --experiment" in p.stdout


def test_the_experiment_record_survives_the_plan_file(tmp_path: Path, capsys):
    out = tmp_path / "plan.json"
    one = ("--virtual-stages", "1")  # the record is the point here, not the choice of v (under a second, not 13 s)
    assert run_cli(capsys, "plan", "-e", "paper-08", "-k", "24", *one, "--out", out).returncode == 0
    record = json.loads(out.read_text())["experiment"]
    assert record["name"] == QUICK and record["overridden"] == {"stages": 24}
