"""The same plans as before the layout of the code changed (issue 23): a dozen plans of the shipped profiles and
experiments, recorded by `terapipe plan ARGS` at the commit named in tests/data/plans_before_move.json, planned again
now through the same command; their schemes, predicted and simulated times, orders and memory must be the same."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, run_cli

RECORDED = json.loads((ROOT / "tests" / "data" / "plans_before_move.json").read_text())


@pytest.mark.parametrize("record", RECORDED["plans"], ids=[r["name"] for r in RECORDED["plans"]])
def test_the_plan_is_the_one_recorded_before_the_move(record, tmp_path, capsys):
    out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", *record["args"], "--out", out, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    plan = json.loads(out.read_text())
    for key in ("short_form", "order", "recompute", "stages", "batch_size", "seq_len", "token_step", "precision",
                "data_parallel", "tensor_parallel"):  # fmt: skip
        assert plan[key] == record[key], key
    for key in ("predicted_s", "simulated_s", "t_max_s"):
        assert plan[key] == pytest.approx(record[key], rel=1e-12), key
    for name, baseline in record["baselines"].items():
        assert plan["baselines"][name]["short_form"] == baseline["short_form"]
        assert plan["baselines"][name]["predicted_s"] == pytest.approx(baseline["predicted_s"], rel=1e-12)
    if "per_stage_bytes" in record:
        assert plan["memory"]["per_stage_bytes"] == pytest.approx(record["per_stage_bytes"], rel=1e-12)
