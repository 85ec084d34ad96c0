"""The 1F1B order across batch slices and recomputation per tile, planned and priced (trained exactly:
engine/test_trainer.py)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import read_plan

PROFILE = ROOT / "tests" / "data" / "tiny-cpu-measured-schema1.json"


def _plan_file(tmp_path, slices, stages, **keys):
    path = write_plan_file(tmp_path / "plan.json", slices, stages=stages, layers=4)
    obj = json.loads(path.read_text())
    obj.update(keys)
    path.write_text(json.dumps(obj))
    return path


def test_plan_prices_the_order_and_recomputation(tmp_path, capsys):
    """Recomputation costs a forward per tile and keeps less; 1F1B keeps fewer batch slices alive."""
    runs = {}
    for name, flags in {
        "gpipe": ("--order", "gpipe"),
        "1f1b": ("--order", "1f1b"),
        "recompute": ("--order", "gpipe", "--recompute"),
    }.items():
        out = tmp_path / f"{name}.json"
        one = ("--virtual-stages", "1")  # one chunk per device: the orders' memory as design §10 states it
        p = run_cli(capsys, "plan", "--profile", PROFILE, "-k", "2", "-b", "8", "--out", out, *one, *flags)
        assert p.returncode == 0, p.stderr
        runs[name] = json.loads(out.read_text())
        plan = read_plan(out)
        assert plan.order == ("1f1b" if name == "1f1b" else "gpipe")
        assert plan.recompute == ((True, True) if name == "recompute" else (False, False))
    peak = {name: max(obj["memory"]["activation_bytes"]) for name, obj in runs.items()}
    assert peak["1f1b"] < peak["gpipe"] and peak["recompute"] < peak["gpipe"]
    # The same slicing costs more when recomputed (one more forward per tile).
    gpipe_baseline = {name: obj["baselines"]["gpipe"]["predicted_s"] for name, obj in runs.items()}
    assert gpipe_baseline["recompute"] > gpipe_baseline["gpipe"] == gpipe_baseline["1f1b"]


def test_bad_order_is_one_line(tmp_path, capsys):
    p = run_cli(
        capsys, "plan", "--profile", PROFILE, "-k", "2", "-b", "1", "--order", "zigzag", "--out", tmp_path / "p.json"
    )
    assert_one_line_error(p, "--order", "1f1b")
    plan = _plan_file(tmp_path, [(1, [32])], 2, recompute=[True])
    with pytest.raises(UserError, match="field 'recompute' must be a list of 2 booleans"):
        read_plan(plan)


def test_a_memory_limit_chooses_the_order_and_recomputation_that_fit(tmp_path, capsys):
    """The fastest scheme does not fit: the planner returns the fastest that does, and says so; an order fixed by the
    user is kept (and the rest chosen around it). Nothing fits: one line with the smallest peak, no plan written."""
    base = ("plan", "--profile", PROFILE, "-k", "2", "-b", "8", "-g", "64")
    free = tmp_path / "free.json"
    assert run_cli(capsys, *base, "--out", free).returncode == 0
    unconstrained = json.loads(free.read_text())["memory"]["per_stage_bytes"]
    limit_gib = 0.8 * max(unconstrained) / 2**30
    out = tmp_path / "fit.json"
    p = run_cli(capsys, *base, "--memory-limit", f"{limit_gib:.4f}", "--out", out)
    assert p.returncode == 0, p.stderr
    plan = read_plan(out)
    assert (plan.order, plan.recompute) != ("gpipe", (False, False))
    assert max(json.loads(out.read_text())["memory"]["per_stage_bytes"]) <= limit_gib * 2**30
    assert "planned within" in p.stdout and "fastest scheme overall would need" in p.stdout
    fixed = tmp_path / "fixed.json"
    p = run_cli(capsys, *base, "--memory-limit", f"{limit_gib:.4f}", "--order", "gpipe", "--out", fixed)
    assert p.returncode == 0 and read_plan(fixed).order == "gpipe", p.stderr
    assert max(json.loads(fixed.read_text())["memory"]["per_stage_bytes"]) <= limit_gib * 2**30
    p = run_cli(capsys, *base, "--memory-limit", "0.001", "--out", tmp_path / "none.json")
    assert_one_line_error(p, "--memory-limit", "no scheme fits", "smallest possible peak")
    assert not (tmp_path / "none.json").exists()
