"""`terapipe report`'s memory per stage: the plan's estimate next to what a real (tiny, CPU) run measured.

One run is trained for the module, the issue's long-sequence check in small: a memory limit under which the fastest
plan (GPipe order) does not fit, the plan made to fit it, trained 3 steps with `--verify` (K = 2, B = 2).
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ROOT, terapipe

from terapipe_cli.engine.mesh import Layout

PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
STAGES = 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")
    base = ("plan", "--profile", PROFILE, "-k", str(STAGES), "-b", "2", "-g", "64")
    assert terapipe(*base, "--out", tmp / "free.json").returncode == 0
    needed = max(json.loads((tmp / "free.json").read_text())["memory"]["per_stage_bytes"])
    plan = tmp / "plan.json"
    p = terapipe(*base, "--memory-limit", f"{0.8 * needed / 2**30:.6f}", "--out", plan)
    assert p.returncode == 0 and "planned within" in p.stdout, p.stdout + p.stderr
    obj = json.loads(plan.read_text())
    assert (obj["order"], any(obj["recompute"])) != ("gpipe", False)
    assert max(obj["memory"]["per_stage_bytes"]) <= 0.8 * needed
    run = tmp / "run"
    p = terapipe("train", "--plan", plan, "--steps", "3", "--verify", "--out", run, "--device", "cpu", timeout=180)
    assert p.returncode == 0 and "verified" in p.stdout, p.stdout + p.stderr
    return run


def _report(run_dir) -> tuple[dict, str]:
    p = terapipe("report", run_dir, "--no-baseline", "--warmup", "1", timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "memory per stage" in p.stdout  # the terminal shows the table too
    out = run_dir / "report"
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_estimated_and_measured_per_stage(run_dir):
    report, md = _report(run_dir)
    memory = report["run"]["memory_per_stage"]
    estimate = json.loads((run_dir / "plan.json").read_text())["memory"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]  # after warm-up
    layout = Layout(1, STAGES)
    assert [m["stage"] for m in memory] == list(range(STAGES))
    for k, m in enumerate(memory):
        assert m["estimated_activation_bytes"] == estimate["activation_bytes"][k] > 0
        assert m["estimated_total_bytes"] == estimate["per_stage_bytes"][k] > 0
        ranks = [r for r in range(layout.world) if layout.stage(r) == k]
        assert m["measured_saved_bytes"] == max(x["saved_bytes_per_rank"][r] for x in metrics for r in ranks) > 0
        assert m["measured_peak_bytes"] == max(x["memory_bytes_per_rank"][r] for x in metrics for r in ranks) > 0
        measured = m["measured_saved_bytes"]
        assert m["rel_err"] == pytest.approx((m["estimated_activation_bytes"] - measured) / measured)
        assert abs(m["rel_err"]) <= 0.10  # the estimate holds on a real run (docs/design.md §10)
    table = md.split("## Memory per stage")[1].split("## Loss")[0]
    for header in ("estimated kept for backward", "measured kept (saved tensors)", "measured peak (process RSS)"):
        assert header in table
    assert table.count("| TeraPipe | ") == STAGES  # one row per stage


def test_a_run_without_saved_bytes_still_reports(run_dir, tmp_path):
    """A run from before the runtime counted saved tensors: no measured column, the rest as before."""
    old = tmp_path / "old-run"
    shutil.copytree(run_dir, old, ignore=shutil.ignore_patterns("report"))
    lines = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        del line["saved_bytes_per_rank"]
    (old / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    report, md = _report(old)
    for m in report["run"]["memory_per_stage"]:
        assert m["measured_saved_bytes"] is None and m["rel_err"] is None
        assert m["estimated_activation_bytes"] > 0 and m["measured_peak_bytes"] > 0
    assert "estimated kept for backward" in md and "measured kept" not in md
