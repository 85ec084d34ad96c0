"""`terapipe report`'s memory per stage: the plan's estimate next to what training measured.

The issue's long-sequence check in small: a memory limit under which the fastest plan (GPipe order) does not fit,
the plan made to fit it (another order, or recomputation), trained 2 steps in one process through the workers' own
code, its stages' kept bytes counted as a run counts them, then reported from a run folder holding those counts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, LocalSetup, run_arguments, run_cli, train_locally
from fake_runs import make_run

from terapipe_cli.cli import main
from terapipe_cli.plan.file import plan_from_dict

PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
STAGES = 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")

    def plan(*extra):  # `terapipe plan` through its entry point (a module fixture has no capsys for run_cli)
        with pytest.raises(SystemExit) as e:
            main(["plan", "--profile", str(PROFILE), "-k", str(STAGES), "-b", "2", "-g", "128", *extra])
        assert e.value.code == 0

    plan("--out", str(tmp / "free.json"))
    needed = max(json.loads((tmp / "free.json").read_text())["memory"]["per_stage_bytes"])
    plan("--memory-limit", f"{0.8 * needed / 2**30:.6f}", "--out", str(tmp / "plan.json"))
    obj = json.loads((tmp / "plan.json").read_text())
    assert (obj["order"], any(obj["recompute"])) != ("gpipe", False)
    assert max(obj["memory"]["per_stage_bytes"]) <= 0.8 * needed
    run = train_locally(
        LocalSetup(plan_from_dict(obj, "plan.json"), run_arguments(steps=2, val_fraction=0.0, track_memory=True))
    )
    records = [
        {"saved_bytes_per_rank": saved, **({"live_bytes_per_rank": live} if live else {})}
        for saved, live in zip(run.saved, run.live, strict=True)
    ]
    return make_run(tmp / "run", obj["slices"], stages=STAGES, steps=2, plan=obj, records=records)


def _report(capsys, run_dir) -> tuple[dict, str]:
    p = run_cli(capsys, "report", run_dir, "--no-baseline", "--warmup", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "memory per stage" in p.stdout  # the terminal shows the table too
    out = run_dir / "report"
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_estimated_and_measured_per_stage(run_dir, capsys):
    report, md = _report(capsys, run_dir)
    memory = report["run"]["memory_per_stage"]
    estimate = json.loads((run_dir / "plan.json").read_text())["memory"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]  # after warm-up
    assert [m["stage"] for m in memory] == list(range(STAGES))
    for k, m in enumerate(memory):
        assert m["estimated_activation_bytes"] == estimate["activation_bytes"][k] > 0
        assert m["estimated_total_bytes"] == estimate["per_stage_bytes"][k] > 0
        assert m["measured_saved_bytes"] == max(x["saved_bytes_per_rank"][k] for x in metrics) > 0
        assert m["measured_peak_bytes"] == max(x["memory_bytes_per_rank"][k] for x in metrics) > 0
        measured = m["measured_saved_bytes"]
        assert m["rel_err"] == pytest.approx((m["estimated_activation_bytes"] - measured) / measured)
        assert abs(m["rel_err"]) <= 0.10  # the estimate holds for what training kept (docs/design.md §10)
        # The first step's tracked live bytes (the warm-up's), against the estimate less the state.
        assert (
            m["measured_live_bytes"]
            == json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["live_bytes_per_rank"][k]
        )
        assert m["estimated_live_bytes"] == estimate["per_stage_bytes"][k] - estimate["state_bytes"][k] > 0
        got = m["measured_live_bytes"]
        assert m["live_rel_err"] == pytest.approx((m["estimated_live_bytes"] - got) / got)
    # The line scripts/gpu_bringup.sh's memory step prints from such a report (its dry run skips the step).
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_bringup.py"), "memory", str(run_dir / "report" / "report.json")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("kept for backward est.") == STAGES and "(process RSS)" in p.stdout
    table = md.split("## Memory per stage")[1].split("## Loss")[0]
    headers = ("estimated kept for backward", "measured kept (saved tensors)", "measured peak (process RSS)")
    for header in (*headers, "estimated live (less state)", "measured live (tracked step)", "live error"):
        assert header in table
    assert table.count("| TeraPipe | ") == STAGES  # one row per stage


def test_a_run_without_saved_bytes_still_reports(run_dir, tmp_path, capsys):
    """A run from before the runtime counted saved tensors: no measured column, the rest as before."""
    old = tmp_path / "old-run"
    shutil.copytree(run_dir, old, ignore=shutil.ignore_patterns("report"))
    lines = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        del line["saved_bytes_per_rank"]
    (old / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    report, md = _report(capsys, old)
    for m in report["run"]["memory_per_stage"]:
        assert m["measured_saved_bytes"] is None and m["rel_err"] is None
        assert m["estimated_activation_bytes"] > 0 and m["measured_peak_bytes"] > 0
    assert "estimated kept for backward" in md and "measured kept" not in md


def test_an_estimate_more_than_ten_percent_off_gets_a_line():
    from terapipe_cli.report.text import memory_mismatch_lines

    def stage(k, est, got):
        rel = (est - got) / got
        return {"stage": k, "estimated_activation_bytes": est, "measured_saved_bytes": got, "rel_err": rel}

    run = {
        "label": "terapipe",
        "memory_per_stage": [stage(0, 105 * 2**20, 100 * 2**20), stage(1, 80 * 2**20, 100 * 2**20)],
    }
    lines = memory_mismatch_lines({"run": run, "baseline": None})
    assert len(lines) == 1 and lines[0].startswith("terapipe stage 1: the plan estimated 80") and "-20" in lines[0]
    assert memory_mismatch_lines({"run": {"label": "x", "memory_per_stage": [stage(0, 1.0, 1.0)]}}) == []
    live = {"stage": 0, "estimated_live_bytes": 50 * 2**20, "measured_live_bytes": 100 * 2**20, "live_rel_err": -0.5}
    (line,) = memory_mismatch_lines({"run": {"label": "x", "memory_per_stage": [live]}, "baseline": None})
    assert line.startswith("x stage 0: the plan estimated 50.0 MiB live beyond the state") and "-50" in line
