"""Tensor parallelism on the plan side: the profile's T (``device.tensor_parallel``), `terapipe plan -t`, the
plan's ``tensor_parallel`` key, and T that does not divide the model's heads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan.choice import plan_for_profile
from terapipe_cli.plan.costmodel import profile_from_dict
from terapipe_cli.plan.file import make_plan_dict, plan_from_dict, read_plan
from terapipe_cli.plan.request import plan_request
from terapipe_cli.profile.analytic import analytic_profile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"
RAW = json.loads(EXAMPLE.read_text())
TINY = load_model_config("tiny")  # 4 heads


def analytic_tiny(tensor_parallel: int) -> dict:
    return analytic_profile(TINY, load_hardware("h100"), tensor_parallel=tensor_parallel, batch_sizes=(1, 2))


def with_tensor_parallel(value) -> dict:
    obj = copy.deepcopy(RAW)
    obj["device"]["tensor_parallel"] = value
    return obj


# --- the profile's T ----------------------------------------------------------------------------------


def test_a_profile_without_tensor_parallel_is_at_one_and_an_analytic_one_at_its_own():
    assert profile_from_dict(RAW, "example").tensor_parallel == 1
    assert profile_from_dict(with_tensor_parallel(2), "p").tensor_parallel == 2
    prof = profile_from_dict(analytic_tiny(4), "analytic")
    assert prof.tensor_parallel == 4
    # Per device: one rank's share of the layer's parameters.
    assert prof.params_per_layer == TINY.params_per_layer(4)


@pytest.mark.parametrize(
    ("value", "words"),
    [(0, "at least 1"), ("2", "integer"), (True, "integer"), (1.5, "integer"), (3, "does not divide the 4 heads")],
)
def test_a_bad_tensor_parallel_in_a_profile_names_the_field(value, words):
    with pytest.raises(UserError, match="device.tensor_parallel") as e:
        profile_from_dict(with_tensor_parallel(value), "p.json")
    assert words in str(e.value) and "p.json" in str(e.value)


def test_the_model_check_is_the_one_analytic_profiles_use():
    for t in (3, 5):
        with pytest.raises(UserError, match=f"{t} does not divide the 4 heads"):
            TINY.check_tensor_parallel(t)
        with pytest.raises(UserError, match=f"{t} does not divide the 4 heads"):
            analytic_tiny(t)
    TINY.check_tensor_parallel(2)


# --- the plan's key -----------------------------------------------------------------------------------


def test_the_plan_key_is_always_written_and_read_back():
    kw = dict(model=TINY, stages=2, batch_size=1, seq_len=TINY.seq_len, token_step=8, slices=[(1, [TINY.seq_len])])
    plain = make_plan_dict(**kw)
    assert plain["tensor_parallel"] == 1 and plan_from_dict(plain, "p").tensor_parallel == 1
    assert plan_from_dict(make_plan_dict(**kw, tensor_parallel=2), "p").tensor_parallel == 2
    older = dict(plain)
    del older["tensor_parallel"]  # a plan from before the key existed
    assert plan_from_dict(older, "p").tensor_parallel == 1
    for bad, words in ((3, "does not divide the 4 heads"), (0, "at least 1"), ("2", "integer")):
        with pytest.raises(UserError, match="field 'tensor_parallel'") as e:
            plan_from_dict(dict(plain, tensor_parallel=bad), "p.json")
        assert words in str(e.value)


def test_the_request_takes_the_profiles_t_and_refuses_another():
    prof = profile_from_dict(analytic_tiny(2), "analytic")
    assert plan_request(prof, stages=2, batch_size=1).tensor_parallel == 2
    assert plan_request(prof, stages=2, batch_size=1, tensor_parallel=2).tensor_parallel == 2
    with pytest.raises(UserError, match="--tensor-parallel: 1 asked for, but .* estimated at tensor parallelism 2"):
        plan_request(prof, stages=2, batch_size=1, tensor_parallel=1)
    # The advice names what `terapipe profile --model` takes: the model's file or folder as the profile records it.
    made = profile_from_dict({**analytic_tiny(2), "model_source": "/models/my gpt2"}, "analytic")
    with pytest.raises(UserError, match="`terapipe profile --model '/models/my gpt2' --tensor-parallel 1`"):
        plan_request(made, stages=2, batch_size=1, tensor_parallel=1)
    planned = plan_for_profile(prof, plan_request(prof, stages=2, batch_size=1))
    assert planned.to_plan_dict("p.json")["tensor_parallel"] == 2


# --- terapipe plan ------------------------------------------------------------------------------------


def test_plan_from_an_analytic_t2_profile_carries_t2(tmp_path: Path, capsys):
    profile = write_json_atomic(tmp_path / "tp2.json", analytic_tiny(2))
    out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", "--profile", profile, "-k", "2", "-b", "1", "--out", out)
    assert p.returncode == 0, p.stderr
    plan = read_plan(out)
    assert plan.tensor_parallel == 2 and plan.raw["tensor_parallel"] == 2
    assert "T=2" in p.stdout  # the table's title
    assert f"= {plan.data_parallel * plan.stages * 2} processes" in p.stdout  # D × K × T workers
    # Giving the profile's own T is the same plan.
    again = tmp_path / "again.json"
    assert (
        run_cli(capsys, "plan", "--profile", profile, "-k", "2", "-b", "1", "-t", "2", "--out", again).returncode == 0
    )
    assert read_plan(again).slices == plan.slices


def test_plan_with_another_t_than_the_profile_is_one_line_and_writes_nothing(tmp_path: Path, capsys):
    out = tmp_path / "plan.json"
    p = run_cli(
        capsys, "plan", "--profile", EXAMPLE, "--stages", "2", "--batch", "1", "--tensor-parallel", "2", "--out", out
    )
    assert_one_line_error(p, "--tensor-parallel", "tensor parallelism 1", "terapipe profile", "--analytic")
    assert not out.exists()


def test_plan_with_t_not_dividing_the_heads_is_one_line(tmp_path: Path, capsys):
    out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", "--profile", EXAMPLE, "-k", "2", "-b", "1", "-t", "3", "--out", out)
    assert_one_line_error(p, "--tensor-parallel", "3 does not divide the 4 heads")
    assert not out.exists()
