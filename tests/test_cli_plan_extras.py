"""`terapipe plan`: simulated latencies, the memory estimate and its warning (issue 6)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def terapipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "terapipe_cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")},
    )


@pytest.fixture(scope="module")
def analytic_profile(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "gpt3-1b-v100.json"
    proc = terapipe(
        "profile",
        "--analytic",
        "--hardware",
        str(ROOT / "configs/hardware/v100.toml"),
        "--model",
        str(ROOT / "configs/models/gpt3-1b.toml"),
        "--tensor-parallel",
        "8",
        "--out",
        str(out),
        cwd=out.parent,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def test_plan_carries_simulated_latency_and_memory(analytic_profile: Path, tmp_path: Path) -> None:
    proc = terapipe(
        "plan", "--profile", str(analytic_profile), "--stages", "12", "--batch", "4", "--out", "p.json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    for entry in (plan, plan["baselines"]["gpipe"], plan["baselines"]["uniform"]):
        assert entry["simulated_s"] > 0
        # The simulator overlaps transfers with compute; the formula counts them inside every tile.
        assert entry["simulated_s"] <= entry["predicted_s"] * 1.0001
    memory = plan["memory"]
    assert len(memory["per_stage_bytes"]) == 12
    assert memory["limit_bytes"] == pytest.approx(16 * 2**30, rel=0.05)  # the V100-16GB of the hardware file
    assert "warning" not in proc.stderr


def test_plan_warns_in_one_line_over_the_memory_limit(analytic_profile: Path, tmp_path: Path) -> None:
    proc = terapipe(
        "plan",
        "--profile",
        str(analytic_profile),
        "--stages",
        "12",
        "--batch",
        "4",
        "--memory-limit",
        "0.5",
        "--out",
        "p.json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(warning) == 1 and warning[0].startswith("warning:") and "0.5 GiB" in warning[0]
    assert json.loads((tmp_path / "p.json").read_text())["memory"]["limit_bytes"] == 0.5 * 2**30


def test_bad_memory_limit_is_one_line(analytic_profile: Path, tmp_path: Path) -> None:
    proc = terapipe(
        "plan",
        "--profile",
        str(analytic_profile),
        "--stages",
        "12",
        "--batch",
        "4",
        "--memory-limit",
        "-1",
        "--out",
        "p.json",
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--memory-limit" in proc.stderr
    assert not (tmp_path / "p.json").exists()
