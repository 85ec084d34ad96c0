"""Data parallelism with any profile: the all-reduce's fit, planning where it is unknown, and the report's checks
before it trains a baseline (docs/design.md §3, §8). The all-reduce measured through torchrun: the demo's profile
(cli/test_e2e_demo.py); D = 2 trained: train/test_torchrun.py and engine/test_trainer.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, run_cli
from fake_runs import make_run

from terapipe_cli.plan.costmodel import CostModel, profile_from_dict, ring_allreduce_seconds, ring_link_from_allreduce
from terapipe_cli.profile.comm import allreduce_from_samples, message_sizes
from terapipe_cli.report.runs import baseline_dir

MEASURED = ROOT / "tests/data/tiny-cpu-measured-schema1.json"
EXAMPLE = ROOT / "configs/profiles/example-tiny-cpu.json"


# ------------------------------------------------------------------------------------------------ the fit


def test_ring_link_from_allreduce_inverts_the_ring_formula() -> None:
    sizes = np.array([1e3, 1e5, 1e7])
    for ranks in (2, 3, 8):
        latency, bandwidth = ring_link_from_allreduce(3e-4, 2e9, ranks)
        whole = ring_allreduce_seconds(sizes, ranks, latency_s=latency, bytes_per_s=bandwidth)
        np.testing.assert_allclose(whole, 3e-4 + sizes / 2e9, rtol=1e-12)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        ring_link_from_allreduce(3e-4, 2e9, 1)


@pytest.mark.parametrize("replicas", [2, 4])
def test_allreduce_fit_recovers_the_ring_link(replicas: int) -> None:
    """All-reduce times made by a known ring link, with 1% noise: the fit gives that link back."""
    latency, bandwidth = 2e-5, 5e9
    sizes = message_sizes(4096, 64 << 20, 8)
    exact = ring_allreduce_seconds(sizes, replicas, latency_s=latency, bytes_per_s=bandwidth)
    noise = 1 + 0.01 * np.random.default_rng(replicas).standard_normal((5, len(sizes)))
    m = allreduce_from_samples("synthetic", replicas, sizes, exact * noise)
    assert m.replicas == replicas and m.sizes_bytes == sizes
    assert m.latency_s == pytest.approx(latency, rel=0.05)
    assert m.bytes_per_s == pytest.approx(bandwidth, rel=0.05)
    assert m.fitted.rel_err_max < 0.05
    # The whole operation's fit is what was timed; the ring link priced over the same ranks reproduces it.
    steps = 2 * (replicas - 1)
    assert m.fitted.fit.latency_s == pytest.approx(steps * latency, rel=0.05)
    d = m.to_dict()
    assert (d["latency_s"], d["bytes_per_s"], d["replicas"]) == (m.latency_s, m.bytes_per_s, replicas)


# ------------------------------------------------------------------------------------------------ unknown


def test_a_profile_without_the_allreduce_plans_replicas_without_it(tmp_path: Path, capsys) -> None:
    """The tiny model's earlier measured profile predates the all-reduce measurement: it plans with one warning line,
    the same scheme and price as one replica, and the plan records that the all-reduce is not priced."""
    raw = json.loads(MEASURED.read_text())
    assert "params_per_layer" in raw and "data_parallel_link" not in raw
    common = ("plan", "--profile", MEASURED, "-k", "2", "-b", "2", "--seq-len", "256")
    two = run_cli(capsys, *common, "-d", "2", "--out", tmp_path / "two.json")
    assert two.returncode == 0, two.stderr
    warnings = [ln for ln in two.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), two.stderr
    assert "'data_parallel_link'" in warnings[0] and "2 replicas" in warnings[0]
    one = run_cli(capsys, *common, "--out", tmp_path / "one.json")
    assert one.returncode == 0 and "warning" not in one.stderr, one.stderr
    p2, p1 = (json.loads((tmp_path / n).read_text()) for n in ("two.json", "one.json"))
    assert p2["data_parallel"] == 2 and "data_parallel_allreduce" not in p1
    record = p2["data_parallel_allreduce"]
    assert record["priced"] is False and record["seconds"] is None
    assert record["why"].startswith("unknown — not priced") and "data_parallel_link" in record["why"]
    assert p2["slices"] == p1["slices"] and p2["predicted_s"] == pytest.approx(p1["predicted_s"], rel=1e-12)
    # With the link added, the same profile prices the all-reduce into the step.
    obj = copy.deepcopy(raw)
    obj["data_parallel_link"] = {"latency_s": 1e-4, "bytes_per_s": 1e9}
    priced = CostModel(profile_from_dict(obj, "p.json"), stages=2, data_parallel=2)
    assert priced.allreduce_unpriced is None and priced.allreduce_s > 1e-3


# ------------------------------------------------------------------------------------------------ report


def test_report_checks_everything_before_it_trains_a_baseline(tmp_path: Path, capsys) -> None:
    """A D = 2 run whose report cannot be written, or whose baseline cannot be trained, fails at once: no
    baseline folder appears (before this, the baseline was trained first)."""
    run = make_run(tmp_path / "run", [(1, [32])] * 2, replicas=2)
    sibling = baseline_dir(run)
    (tmp_path / "file").write_text("x")
    proc = run_cli(capsys, "report", run, "--out", tmp_path / "file")
    assert_one_line_error(proc, "file", "folder")
    proc = run_cli(capsys, "report", run, "--out", tmp_path / "file" / "sub")
    assert_one_line_error(proc, "cannot be created")
    proc = run_cli(capsys, "report", run, "--profile", EXAMPLE)
    assert_one_line_error(proc, "profile of model 'tiny'")
    # The run's data file is gone: its baseline could not train on the same data.
    config = json.loads((run / "config.json").read_text())
    config["arguments"]["data"] = str(tmp_path / "gone.txt")
    (run / "config.json").write_text(json.dumps(config))
    proc = run_cli(capsys, "report", run)
    assert_one_line_error(proc, "gone.txt")
    assert not sibling.exists() and not (run / "report").exists()
