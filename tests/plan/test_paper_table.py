"""scripts/paper_table.py: plans settings from analytic profiles within the device memory (or --memory-limit) and
prints one row each, a setting that no scheme fits flagged with its smallest peak; bad input exits 2.

The table's rows are checked through the script's own `main` in this process; its command line as a real process
(arguments parsed, the exit code of `SystemExit(main())`) by the bad-input test. A setting planned at the same limit
by two tests is planned once (`_planned`): the row is a function of the experiment and the limit alone."""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "paper_table.py"
EXP = ROOT / "configs" / "experiments"
sys.path.insert(0, str(ROOT / "scripts"))

import paper_table  # noqa: E402
from paper_table import calibrated_sibling, compact_form, stage_ranges  # noqa: E402

from terapipe_cli.config.experiment import load_experiment  # noqa: E402

_ROWS: dict = {}


def _planned(exp, memory_limit_gib=None):
    """`paper_table.plan_experiment`, once per experiment and limit in this process (a copy each time: the script
    sets a row's ``calibrated``)."""
    key = (exp, memory_limit_gib)
    if key not in _ROWS:
        _ROWS[key] = _plan_experiment(exp, memory_limit_gib)
    return copy.copy(_ROWS[key])


_plan_experiment = paper_table.plan_experiment
plan_experiment = _planned


def test_a_row_is_a_real_plan_better_than_both_baselines():
    row = plan_experiment(load_experiment(EXP / "paper-05-gpt3-13b-L8192.toml"))
    # The exact DP is never worse than the best uniform slicing, nor than GPipe.
    assert row.terapipe_s <= row.uniform_s * (1 + 1e-12)
    assert row.terapipe_s <= row.gpipe_s * (1 + 1e-12)
    # GPT3-13B with 2 sequences of 8192 tokens on 40 stages: token slicing is what lets the pipeline fill at all.
    assert row.speedup > 2
    # The data-parallel-free setting still pays the optimizer step once.
    assert 0 < row.step_s < row.terapipe_s
    # Planned within the V100's 16 GiB.
    assert row.fits and row.peak_memory_bytes <= 16 * 2**30
    # The schedule-aware choice is never slower in the simulator than the optimum of the objective.
    assert row.chosen_sim_s <= row.terapipe_sim_s


def test_a_setting_no_scheme_fits_is_planned_without_the_limit_and_flagged():
    # GPT3-175B fits the V100's 16 GiB since the runtime splits the vocabulary over the tensor ranks; in 8 GiB nothing
    # does.
    exp = load_experiment(EXP / "paper-10-gpt3-175b.toml")
    assert plan_experiment(exp).fits
    row = plan_experiment(exp, memory_limit_gib=8)
    assert not row.fits
    assert row.smallest_peak_bytes > 8 * 2**30
    assert row.peak_memory_bytes >= row.smallest_peak_bytes * (1 - 1e-12)
    # Its times still compare TeraPipe with GPipe.
    assert row.terapipe_s <= row.gpipe_s * (1 + 1e-12) and row.speedup > 2


def test_a_smaller_memory_limit_changes_the_order_or_recomputes():
    exp = load_experiment(EXP / "paper-08-gpt3-44b.toml")
    free = plan_experiment(exp, memory_limit_gib=80)
    tight = plan_experiment(exp, memory_limit_gib=5)
    assert free.fits and tight.fits
    assert (free.order, any(free.recompute)) == ("gpipe", False)  # the fastest scheme overall
    assert tight.order == "1f1b" or any(tight.recompute)
    assert tight.peak_memory_bytes <= 5 * 2**30 < free.peak_memory_bytes
    # Fitting costs time, never gains it.
    assert tight.terapipe_s >= free.terapipe_s * (1 - 1e-12)


def test_stage_ranges_are_compact():
    assert stage_ranges((False,) * 4) == "—"
    assert stage_ranges((True,) * 4) == "all"
    assert stage_ranges((True, True, True, True, False, False, False, True)) == "0–3, 7"
    assert stage_ranges((False, True, False, True)) == "1, 3"


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


def _markdown(capsys, monkeypatch, *args: str) -> tuple[list[str], str]:
    """The script's Markdown rows (cells) of the settings, and its whole output: its `main` in this process, each
    setting planned through `_planned`."""
    monkeypatch.setattr(paper_table, "plan_experiment", _planned)
    capsys.readouterr()
    code = paper_table.main(["--markdown", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [line for line in out.out.splitlines() if line.startswith("| ") and "gpt3" in line]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows], out.out


def test_script_prints_all_rows_given_and_flags_what_does_not_fit(capsys, monkeypatch):
    """Within 12 GiB no scheme of setting 6 (GPT3-44B, no tensor parallelism) fits; setting 9 (GPT3-175B, its
    vocabulary split over 4 tensor ranks) does. Planned on their own hardware only (``--no-calibrated``): the
    calibrated rows are planned by `test_script_memory_limit_plans_within_it`."""
    settings = (str(EXP / "paper-06-gpt3-44b.toml"), str(EXP / "paper-09-gpt3-175b.toml"))
    rows, text = _markdown(capsys, monkeypatch, "--no-calibrated", "--memory-limit", "12", *settings)
    assert len(rows) == 2 and rows[0][1] == "gpt3-44b" and rows[1][1] == "gpt3-175b"
    big, fits = rows
    # order, recompute, peak GiB are the last three columns.
    assert big[-3] in {"GPipe", "1F1B"} and fits[-3] in {"GPipe", "1F1B"}
    assert "(!)" in big[-1] and "(!)" not in fits[-1]
    peak, least = big[-1].split(" (!) min ")
    assert float(least) > 12 and float(peak) >= float(least)
    assert "(!) no scheme fits 12 GiB per device" in text and "min = the smallest peak" in text


def test_script_memory_limit_plans_within_it(capsys, monkeypatch):
    """Setting 8 within 5 GiB, and again on its calibrated hardware file (v100-dispatch.toml), as the table prints it
    by default."""
    rows, text = _markdown(capsys, monkeypatch, "--memory-limit", "5", str(EXP / "paper-08-gpt3-44b.toml"))
    (row,) = rows
    assert row[-3] == "1F1B" or row[-2] != "—"  # the fastest scheme (GPipe order, 6.1 GiB) does not fit
    assert float(row[-1]) <= 5
    assert "within 5 GiB per device" in text and "(!)" not in text
    assert "calibrated: planned again on v100-dispatch.toml" in text


def test_script_bad_experiment_is_one_line_exit_2(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[experiment]\nname = 'x'\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and str(bad) in out.stderr and "Traceback" not in out.stderr


def test_the_calibrated_counterpart_is_found_beside_the_hardware_file():
    hw = ROOT / "configs" / "hardware"
    assert calibrated_sibling(hw / "v100.toml") == hw / "v100-dispatch.toml"  # an estimate carried over
    assert calibrated_sibling(hw / "h100-bf16.toml") == hw / "h100-bf16-calibrated.toml"  # fitted to measurements
    assert calibrated_sibling(hw / "h100.toml") is None
