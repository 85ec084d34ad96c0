"""`terapipe report --no-baseline`, the stale-baseline message, D/K/T in the header, and tables when piped.

Run directories are hand-made with the runtime's writers (`test_report.make_run`): no training, seconds in all.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from conftest import assert_one_line_error, run_cli
from fake_runs import GPIPE, SEQ, TERAPIPE, assert_chrome_trace, assert_nontrivial_png, make_run

from terapipe_cli.cli.console import PIPED_WIDTH, make_console
from terapipe_cli.report.build import FILES
from terapipe_cli.report.text import NO_BASELINE


@pytest.fixture
def run_dir(tmp_path):
    gpipe = {"slices": [[1, [SEQ]]], "predicted_s": 0.09, "microbatch": 1}
    return make_run(tmp_path / "run", TERAPIPE, plan_extra={"baselines": {"gpipe": gpipe}})


def test_no_baseline_writes_every_file_about_the_run_alone(run_dir, tmp_path, capsys):
    p = run_cli(capsys, "report", run_dir, "--no-baseline")
    assert p.returncode == 0, p.stdout + p.stderr
    assert NO_BASELINE in p.stdout and "training the GPipe baseline" not in p.stdout
    assert not (tmp_path / "run-gpipe").exists()  # nothing trained
    out = run_dir / "report"
    assert sorted(f.name for f in out.iterdir()) == sorted(FILES)
    report = json.loads((out / "report.json").read_text())
    assert report["baseline"] is None and report["speedup"] is None and report["loss"] is None
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert report["run"]["losses"] == [x["loss"] for x in lines]
    assert report["run"]["latency_s"]["n"] == len(lines) - 2  # after the default 2 warm-up steps
    md = (out / "report.md").read_text()
    assert NO_BASELINE in md and "| iteration, median |" in md and "GPipe" not in md
    for name in ("timeline.png", "loss.png"):
        assert_nontrivial_png(out / name)
    assert_chrome_trace(json.loads((out / "trace.json").read_text()), {"TeraPipe": 2})


def test_no_baseline_and_a_baseline_exclude_each_other(run_dir, tmp_path, capsys):
    base = make_run(tmp_path / "base", GPIPE)
    assert_one_line_error(run_cli(capsys, "report", run_dir, "--no-baseline", "--baseline", base), "--no-baseline")
    assert not (run_dir / "report").exists()


def test_a_stale_baseline_names_the_folder_to_delete(run_dir, tmp_path, capsys):
    """A sibling baseline an earlier report trained for other settings: the one line says what to do."""
    sibling = make_run(tmp_path / "run-gpipe", GPIPE, seed=1)
    p = run_cli(capsys, "report", run_dir)
    assert_one_line_error(p, "seed", "not comparable", f"delete {sibling}", "--no-baseline", "--baseline")
    assert not (run_dir / "report").exists()
    (sibling / "summary.json").unlink()  # an unfinished one: the same advice
    assert_one_line_error(run_cli(capsys, "report", run_dir), "unfinished", f"delete {sibling}", "--no-baseline")
    # The advice works: without a baseline the report is written.
    assert run_cli(capsys, "report", run_dir, "--no-baseline").returncode == 0


def test_the_header_shows_d_k_and_t(tmp_path, capsys):
    """T = 2: the header says so, and a stage's two tensor ranks count as one stage (they run the same tiles)."""
    single = make_run(tmp_path / "t1", TERAPIPE)
    run_dir = make_run(tmp_path / "t2", TERAPIPE, tensor=2)
    p = run_cli(capsys, "report", run_dir, "--no-baseline")
    assert p.returncode == 0, p.stdout + p.stderr
    header = "D=1, K=2, T=2, B=1, L=32"
    assert header in p.stdout.splitlines()[0]
    assert header in (run_dir / "report" / "report.md").read_text().splitlines()[0]
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert report["run"]["tensor_parallel"] == 2
    assert run_cli(capsys, "report", single, "--no-baseline").returncode == 0
    alone = json.loads((single / "report" / "report.json").read_text())
    assert report["run"]["stage_times"] == alone["run"]["stage_times"]
    trace = json.loads((run_dir / "report" / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert "TeraPipe · rank 3 (stage 1, replica 0, tensor rank 1)" in names and len(names) == 4


def test_a_run_from_before_tensor_parallelism_is_t_1(run_dir, capsys):
    config = json.loads((run_dir / "config.json").read_text())
    config["arguments"].pop("tensor_parallel", None)
    (run_dir / "config.json").write_text(json.dumps(config))
    p = run_cli(capsys, "report", run_dir, "--no-baseline")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "D=1, K=2, T=1," in p.stdout.splitlines()[0]


def test_tables_stay_whole_when_piped(run_dir, tmp_path, capsys, monkeypatch):
    """stdout a pipe (here pytest's capture, not a terminal) and COLUMNS unset, as in `terapipe report RUN | less`:
    no 80-column wrapping."""
    from terapipe_cli.cli import main

    base = make_run(tmp_path / "base", GPIPE)
    capsys.readouterr()
    with monkeypatch.context() as mp:
        mp.delenv("COLUMNS", raising=False)
        mp.setenv("NO_COLOR", "1")
        with pytest.raises(SystemExit) as ended:
            main(["report", str(run_dir), "--baseline", str(base)])
    out = capsys.readouterr()
    p = subprocess.CompletedProcess([], ended.value.code or 0, out.out, out.err)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert max(len(line) for line in lines) > 80  # wider than rich's default for a pipe
    rows = [line for line in lines if line.startswith("│")]
    assert rows and all(line.endswith("│") for line in rows)
    row = next(line for line in rows if "iteration, mean ± std" in line)
    assert row.count("±") == 3  # the label and both runs' values, on one line


def test_make_console_is_wide_when_not_a_terminal(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a terminal
    assert make_console().width >= PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "100")  # the user's choice wins
    assert make_console().width == 100


def test_a_tensor_parallel_runs_baseline_trains_at_the_same_t(tmp_path):
    """The baseline of a run at T = 2 (one stage, two tensor ranks) is prepared with the run's own settings: the same
    T, the same two-worker mesh, the GPipe scheme."""
    from terapipe_cli.train.baseline import _prepare

    run_dir = make_run(tmp_path / "run", [(1, [16, 16])], stages=1, tensor=2)
    prepared = _prepare(run_dir, tmp_path / "plan.json", tmp_path / "run-gpipe", write=False)
    assert prepared.args.tensor_parallel == 2 and prepared.layout.world == 2
    assert prepared.plan.slices == [(1, [SEQ])] and prepared.args.seed == 0 and prepared.args.steps == 6
    assert not (tmp_path / "run-gpipe").exists()


def test_the_report_shows_the_order_and_recomputation(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", [(1, [20, 12])] * 2, plan_extra={"order": "1f1b", "recompute": [True, False]})
    p = run_cli(capsys, "report", run_dir, "--no-baseline", "--warmup", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1F1B order, recomputed on stage 0" in p.stdout
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert report["run"]["order"] == "1f1b" and report["run"]["recompute"] == [True, False]


@pytest.mark.parametrize(("signum", "code"), [(15, 143), (None, 130)], ids=["SIGTERM", "Ctrl-C"])
def test_a_stopped_baseline_training_exits_as_train_would(run_dir, capsys, monkeypatch, signum, code):
    """The report's baseline training stopped by a scheduler's SIGTERM exits 143 (and by Ctrl-C 130), as `terapipe
    train` does, with the one line saying how to finish the baseline and then the report."""
    from terapipe_cli.errors import Interrupted, Stopped
    from terapipe_cli.train import baseline

    def stopped(*_args):
        raise Stopped("stopped by SIGTERM", signum) if signum else Interrupted("interrupted")

    monkeypatch.setattr(baseline, "train_baseline", stopped)
    p = run_cli(capsys, "report", run_dir)
    assert p.returncode == code, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("terapipe: the GPipe baseline was "), p.stderr
