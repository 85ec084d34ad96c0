"""Progress bars over the long waits with nothing else to show: ``--verify``'s single-process runs and the report's
training of its GPipe baseline (the bar itself is cli/console.py's `ProgressBar`, as `terapipe profile` draws it).
In process: what each tells its bar."""

from __future__ import annotations

import os

from conftest import local_setup, train_locally

from terapipe_cli.train.baseline import following
from terapipe_cli.train.rundir import append_metrics
from terapipe_cli.train.verify import verify_trajectory
from terapipe_cli.train.worker import STEP_LINES_ENV


def test_verify_tells_its_bar_every_step_of_both_single_process_runs():
    setup = local_setup([(1, [16, 16])], stages=2, steps=3)
    run = train_locally(setup)
    seen = []
    result = verify_trajectory(run, setup, lambda phase, done, total: seen.append((phase, done, total)))
    assert result.ok
    assert seen == [
        (phase, step, 3) for phase in ("reference (one process)", "spread run (one process)") for step in (1, 2, 3)
    ]


def test_the_baselines_bar_follows_its_metrics_and_the_workers_print_no_step_lines(tmp_path, monkeypatch):
    monkeypatch.delenv(STEP_LINES_ENV, raising=False)
    seen = []
    with following(tmp_path, 5, lambda phase, done, total: seen.append((phase, done, total))):
        assert os.environ[STEP_LINES_ENV] == "0"  # what the workers the launch starts inherit
        for step in (1, 2):
            append_metrics(tmp_path, {"step": step, "loss": 5.0})
    assert seen[0] == ("GPipe baseline (steps)", 0, 5) and seen[-1] == ("GPipe baseline (steps)", 2, 5)
    assert STEP_LINES_ENV not in os.environ
