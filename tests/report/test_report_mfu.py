"""The report's model TFLOP/s per device and MFU: the plan's count (`plan.mfu`) over the measured median
step; ``mfu`` null where the device's peak is unknown (a CPU); the textbook bubble of interleaved plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fake_runs import TERAPIPE, make_run

from terapipe_cli.models import flops_per_token
from terapipe_cli.report.compare import bubble_formula, compare
from terapipe_cli.report.runs import load_run
from terapipe_cli.report.text import latency_rows


def test_the_report_gives_model_tflops_and_mfu_by_the_plans_count(tmp_path):
    run = load_run(make_run(tmp_path / "run", TERAPIPE))
    rep = compare(run, None, warmup=2)["run"]
    plan = run.plan
    flops = flops_per_token(replace(plan.model, seq_len=plan.seq_len)) * plan.batch_size * plan.seq_len
    devices = run.stages * run.args.tensor_parallel
    assert rep["model_tflops"] == pytest.approx(flops / devices / rep["latency_s"]["median"] / 1e12, rel=1e-12)
    assert rep["mfu"] is None  # a CPU: no known peak
    rows = {row[0]: row[1:] for row in latency_rows({"run": rep, "baseline": None})}
    assert rows["MFU"] == ["n/a"] and float(rows["model TFLOP/s per device"][0]) > 0


def test_the_bubble_formula_of_interleaved_plans_shrinks_by_v():
    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
    assert bubble_formula(4, 8, virtual=2) == pytest.approx(3 / 19)
    assert bubble_formula(4, 8, virtual=1) == bubble_formula(4, 8)
