"""The 1F1B order across batch slices and recomputation per tile: planned, priced, and trained exactly."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, assert_one_line_error, terapipe, write_plan_file

from terapipe_cli.plan.file import read_plan
from terapipe_cli.train.rundir import read_summary

PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"


def _plan_file(tmp_path, slices, stages, **keys):
    path = write_plan_file(tmp_path / "plan.json", slices, stages=stages, layers=4)
    obj = json.loads(path.read_text())
    obj.update(keys)
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize(
    "name, slices, stages, keys",
    [
        ("1F1B, K=2, 4 batch slices", [(1, [12, 20])] * 4, 2, {"order": "1f1b"}),
        ("recompute, K=2", [(2, [8, 8, 16])], 2, {"recompute": [True, True]}),
        # Batch slices of different sizes, each sliced its own way: what the memory-aware search may return.
        (
            "1F1B and recompute on one stage, unequal batch slices",
            [(2, [20, 12]), (1, [8, 24]), (1, [32])],
            2,
            {"order": "1f1b", "recompute": [False, True]},
        ),
    ],
)
def test_verify_passes(tmp_path, name, slices, stages, keys):
    plan = _plan_file(tmp_path, slices, stages, **keys)
    out = tmp_path / "run"
    p = terapipe("train", "--plan", plan, "--steps", "2", "--out", out, "--verify", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    assert read_summary(out)["verify"]["ok"] is True


def test_plan_prices_the_order_and_recomputation(tmp_path):
    """Recomputation costs a forward per tile and keeps less; 1F1B keeps fewer batch slices alive."""
    runs = {}
    for name, flags in {
        "gpipe": (),
        "1f1b": ("--order", "1f1b"),
        "recompute": ("--recompute",),
    }.items():
        out = tmp_path / f"{name}.json"
        p = terapipe("plan", "--profile", PROFILE, "-k", "2", "-b", "8", "--out", out, *flags)
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


def test_bad_order_is_one_line(tmp_path):
    p = terapipe("plan", "--profile", PROFILE, "-k", "2", "-b", "1", "--order", "zigzag", "--out", tmp_path / "p.json")
    assert_one_line_error(p, "--order", "1f1b")
    plan = _plan_file(tmp_path, [(1, [32])], 2, recompute=[True])
    p = terapipe("train", "--plan", plan, "--dry-run", "--device", "cpu")
    assert_one_line_error(p, "recompute", "2 booleans")


def test_the_report_shows_the_order_and_recomputation(tmp_path):
    plan = _plan_file(tmp_path, [(1, [20, 12])] * 2, 2, order="1f1b", recompute=[True, False])
    out = tmp_path / "run"
    assert terapipe("train", "--plan", plan, "--steps", "3", "--out", out, "--device", "cpu").returncode == 0
    p = terapipe("report", out, "--no-baseline", "--warmup", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1F1B order, recomputed on stage 0" in p.stdout
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["run"]["order"] == "1f1b" and report["run"]["recompute"] == [True, False]


def test_a_memory_limit_chooses_the_order_and_recomputation_that_fit(tmp_path):
    """The fastest scheme does not fit: the planner returns the fastest that does, and says so; an order fixed by the
    user is kept (and the rest chosen around it). Nothing fits: one line with the smallest peak, no plan written."""
    base = ("plan", "--profile", PROFILE, "-k", "2", "-b", "8", "-g", "64")
    free = tmp_path / "free.json"
    assert terapipe(*base, "--out", free).returncode == 0
    unconstrained = json.loads(free.read_text())["memory"]["per_stage_bytes"]
    limit_gib = 0.8 * max(unconstrained) / 2**30
    out = tmp_path / "fit.json"
    p = terapipe(*base, "--memory-limit", f"{limit_gib:.4f}", "--out", out)
    assert p.returncode == 0, p.stderr
    plan = read_plan(out)
    assert (plan.order, plan.recompute) != ("gpipe", (False, False))
    assert max(json.loads(out.read_text())["memory"]["per_stage_bytes"]) <= limit_gib * 2**30
    assert "planned within" in p.stdout and "fastest scheme overall would need" in p.stdout
    fixed = tmp_path / "fixed.json"
    p = terapipe(*base, "--memory-limit", f"{limit_gib:.4f}", "--order", "gpipe", "--out", fixed)
    assert p.returncode == 0 and read_plan(fixed).order == "gpipe", p.stderr
    assert max(json.loads(fixed.read_text())["memory"]["per_stage_bytes"]) <= limit_gib * 2**30
    p = terapipe(*base, "--memory-limit", "0.001", "--out", tmp_path / "none.json")
    assert_one_line_error(p, "--memory-limit", "no scheme fits", "smallest possible peak")
    assert not (tmp_path / "none.json").exists()
