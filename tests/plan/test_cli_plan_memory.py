"""`terapipe plan`: simulated latencies, the memory estimate and its warning."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.files import write_json_atomic
from terapipe_cli.profile.analytic import analytic_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt3_1b_profile(tmp_path_factory) -> Path:
    """GPT-3 1B on the V100 nodes with 8-way tensor parallelism, as `terapipe profile --analytic` writes it."""
    out = tmp_path_factory.mktemp("profile") / "gpt3-1b-v100.json"
    model = load_model_config(ROOT / "configs/models/gpt3-1b.toml")
    hardware = load_hardware(str(ROOT / "configs/hardware/v100.toml"))
    write_json_atomic(out, analytic_profile(model, hardware, tensor_parallel=8))
    return out


def plan_12_stages(capsys, profile: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ("plan", "--profile", profile, "--stages", "12", "--batch", "4", *extra, "--out", "p.json")
    return run_cli(capsys, *args, cwd=cwd)


def test_plan_carries_simulated_latency_and_memory(gpt3_1b_profile: Path, tmp_path: Path, capsys) -> None:
    proc = plan_12_stages(capsys, gpt3_1b_profile, tmp_path)
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


def test_nothing_within_the_memory_limit_is_one_line(gpt3_1b_profile: Path, tmp_path: Path, capsys) -> None:
    """The limit constrains the plan, also with the order fixed by the user; when no scheme fits, one line gives the
    smallest peak any could reach, and no plan is written."""
    proc = plan_12_stages(capsys, gpt3_1b_profile, tmp_path, "--memory-limit", "0.2", "--order", "gpipe")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no scheme fits the 204.8 MiB" in proc.stderr and "smallest possible peak" in proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_bad_memory_limit_is_one_line(gpt3_1b_profile: Path, tmp_path: Path, capsys) -> None:
    proc = plan_12_stages(capsys, gpt3_1b_profile, tmp_path, "--memory-limit", "-1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--memory-limit" in proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_cpu_profile_warns_against_the_machine_all_workers_share(tmp_path: Path, capsys) -> None:
    """On a CPU every worker shares the machine's memory: the check adds up all of them (D x T x K)."""
    obj = json.loads((ROOT / "tests" / "data" / "tiny-cpu-measured-schema1.json").read_text())
    profile = tmp_path / "profile.json"
    plan = [str(x) for x in ("plan", "--profile", profile, "-k", "2", "-b", "8", "--out", tmp_path / "p.json")]
    write_json_atomic(profile, obj)
    assert run_cli(capsys, *plan).returncode == 0
    needed = sum(json.loads((tmp_path / "p.json").read_text())["memory"]["per_stage_bytes"])
    obj["device"]["memory_bytes"] = machine = int(1.5 * needed)  # a machine where one replica fits and two do not
    write_json_atomic(profile, obj)
    fits = run_cli(capsys, *plan)
    assert fits.returncode == 0 and "warning" not in fits.stderr, fits.stderr
    p = run_cli(capsys, *plan, "-d", "2", "--force")
    assert p.returncode == 0, p.stderr
    warning = [line for line in p.stderr.splitlines() if "workers need" in line]
    assert len(warning) == 1 and "the 4 workers need about" in warning[0], p.stderr
    assert f"{machine / 2**30:.1f} GiB" in warning[0] or f"{machine / 2**20:.1f} MiB" in warning[0], warning[0]
