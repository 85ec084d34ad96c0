"""scripts/paper_table.py: plans settings from analytic profiles and prints one row each; bad input exits 2."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "paper_table.py"
EXP = ROOT / "configs" / "experiments"
sys.path.insert(0, str(ROOT / "scripts"))

from paper_table import compact_form, plan_experiment  # noqa: E402

from terapipe_cli.experiments import load_experiment  # noqa: E402


def test_a_row_is_a_real_plan_better_than_both_baselines():
    row = plan_experiment(load_experiment(EXP / "paper-10-gpt3-175b.toml"))
    # The exact DP is never worse than the best uniform slicing, nor than GPipe.
    assert row.terapipe_s <= row.uniform_s * (1 + 1e-12)
    assert row.terapipe_s <= row.gpipe_s * (1 + 1e-12)
    # GPT3-175B with 2 sequences on 48 stages: token slicing is what lets the pipeline fill at all.
    assert row.speedup > 2
    # The data-parallel-free setting still pays the optimizer step once.
    assert 0 < row.step_s < row.terapipe_s


def test_data_parallel_all_reduce_shrinks_the_speed_up():
    exp = load_experiment(EXP / "paper-04-gpt3-13b.toml")  # 2-way data parallel
    with_dp = plan_experiment(exp)
    # The same pipeline alone (same B per replica), without the all-reduce:
    alone = plan_experiment(replace(exp, data_parallel=1, batch_size=exp.batch_per_replica, gpus=exp.gpus // 2))
    assert with_dp.step_s > alone.step_s
    assert with_dp.gpipe_s - with_dp.terapipe_s == pytest.approx(alone.gpipe_s - alone.terapipe_s)
    assert with_dp.speedup < alone.speedup


def test_compact_form_is_an_exact_python_expression():
    slices = [(1, [72] * 12 + [64] * 20)] * 2 + [(2, [100, 90, 8, 8, 8, 8])]
    text = compact_form(slices)
    assert text == "[(1, [72]*12 + [64]*20)] * 2 + [(2, [100, 90] + [8]*4)]"
    assert eval(text) == slices


def test_script_prints_all_rows_given(tmp_path: Path):
    files = [EXP / "paper-09-gpt3-175b.toml", EXP / "paper-06-gpt3-44b.toml"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--markdown", *map(str, files)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "gpt3" in line]
    assert len(rows) == 2 and "gpt3-175b" in rows[0] and "gpt3-44b" in rows[1]


def test_script_bad_experiment_is_one_line_exit_2(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[experiment]\nname = 'x'\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and str(bad) in out.stderr and "Traceback" not in out.stderr
