"""What a new user meets first: a mistyped rendezvous, a launch that never trained, a run that diverges,
settings a resumed run keeps, a schedule that will not do what its numbers suggest. Each is one line, and nothing
is left behind that blocks the same command from running again. In process: no workers start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.config.run import LRSchedule, RunConfig
from terapipe_cli.train.launch import clear_errors
from terapipe_cli.train.prepare import prepare_run
from terapipe_cli.train.rundir import LOCK_FILE, append_metrics, has_trained, run_lock


@pytest.fixture
def plan(tmp_path):
    return write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)


@pytest.mark.parametrize("endpoint", ["localhost", "localhost:notaport", "localhost:", "localhost:70000"])
def test_a_rendezvous_endpoint_without_a_port_is_refused_before_anything_is_written(tmp_path, capsys, plan, endpoint):
    """torchrun would refuse it with a 42-line traceback after the run folder was written, leaving the folder that
    then blocked the same command ("already holds a run")."""
    out = tmp_path / "run"
    node0 = ("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint, "--device", "cpu")
    p = run_cli(capsys, "train", "--plan", plan, "--out", out, *node0)
    assert_one_line_error(p, "--rdzv-endpoint", "HOST:PORT", "localhost:29500", repr(endpoint))
    assert not out.exists()


def test_a_launch_that_never_trained_leaves_a_folder_the_same_command_uses_again(tmp_path, capsys, plan):
    """Node 0 alone, its partner never joined: the launch ends in the rendezvous and leaves the run's settings, the
    lock and torchrun's log, but no step. That folder is no run: the same command starts in it, --resume says why
    it cannot; once a step is done it is a run again."""
    out = tmp_path / "run"
    settings = RunConfig(plan=str(plan), out=str(out), steps=3, device="cpu")
    with run_lock(out):  # as the failed launch held it
        prepare_run(settings)
    (out / "errors").mkdir()
    (out / "errors" / "torchrun.log").write_text("... 1/2 clients joined\n")
    (out / "metrics.jsonl").write_text('{"schema": "terapipe.run-event/1", "event": "restart"}\n')  # no step
    first = json.loads((out / "config.json").read_text())["launch_id"]
    assert (out / LOCK_FILE).is_file() and not has_trained(out)
    p = run_cli(capsys, "train", "--plan", plan, "--out", out, "--steps", "3", "--device", "cpu", "--dry-run")
    assert p.returncode == 0, p.stderr
    p = run_cli(capsys, "train", "--resume", "--out", out, "--dry-run")
    assert_one_line_error(p, "never completed a step", "without --resume")
    again = prepare_run(settings)  # what the same command does before it launches
    assert json.loads((out / "config.json").read_text())["launch_id"] != first
    assert again.launch.resume_step is None
    clear_errors(out)  # a launch that succeeds clears the failed attempt's log
    assert not (out / "errors").exists()
    append_metrics(out, {"step": 1, "loss": 5.5})
    assert has_trained(out)
    p = run_cli(capsys, "train", "--plan", plan, "--out", out, "--device", "cpu", "--dry-run")
    assert_one_line_error(p, "already holds a run")


def test_a_worker_reports_its_own_peak_memory_not_its_launchers():
    """torchrun starts each worker by fork and exec; Linux carries ``ru_maxrss`` over the exec, so a worker that
    reported it showed its launcher's peak. A launcher that has touched 256 MiB starts a worker: the worker's
    `peak_rss_bytes` is its own (a bare Python: about 10 MB), while ``ru_maxrss`` there says 256 MiB."""
    worker = (
        "import resource; from terapipe_cli.engine import peak_rss_bytes; "
        "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    launcher = (
        "import subprocess, sys\n"
        "held = bytearray(1 << 28)\n"
        "held[::4096] = b'1' * (len(held) // 4096)\n"  # every page touched: resident
        f"subprocess.run([sys.executable, '-c', {worker!r}], check=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", launcher], env=env, capture_output=True, text=True, check=True)
    own, inherited = map(int, out.stdout.split())
    assert inherited >= 2**28  # what the step line and the report showed before
    assert 2**20 < own < 2**26, own


def test_every_setting_a_resumed_run_cannot_take_is_named_at_once(tmp_path, capsys, plan, monkeypatch):
    """--lr and --seed given again differently, and --steps no more than the run reached: one line names all three
    (before, the first alone, then the next on the next try). One alone keeps its own line."""
    from terapipe_cli.train import prepare

    out = tmp_path / "run"
    prepare_run(RunConfig(plan=str(plan), out=str(out), steps=20, device="cpu"))
    monkeypatch.setattr(prepare.checkpoint, "latest_complete", lambda run_dir: 20)  # the run finished its 20 steps
    p = run_cli(capsys, "train", "--resume", "--out", out, "--lr", "1e-3", "--seed", "7", "--steps", "20", "--dry-run")
    assert_one_line_error(
        p, "3 settings conflict", "--lr 0.001 (the run was trained with --lr 0.0003)", "--seed 7", "--steps 20 (the run"
    )
    p = run_cli(capsys, "train", "--resume", "--out", out, "--lr", "1e-3", "--dry-run")  # --steps: the run's own 20
    assert_one_line_error(p, "2 settings conflict", "--lr 0.001", "no --steps (the run's own 20)", "reached step 20")
    p = run_cli(capsys, "train", "--resume", "--out", out, "--dry-run")
    assert_one_line_error(p, "--steps: the run already reached step 20; ask for more steps")


def test_a_schedule_that_does_not_fit_the_run_is_said_in_one_line(tmp_path, capsys, plan):
    """A warm-up longer than the run; a resumed run's cosine that ends after (or before) its new last step."""
    p = run_cli(capsys, "train", "--plan", plan, "--steps", "3", "--warmup-steps", "1000", "--dry-run")
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stdout.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: the warm-up (1000 steps) is as long as the run (3 steps) or longer: the lr climbs to 9e-07 (0.3% of "
        "--lr 0.0003) and never decays"
    ]
    p = run_cli(capsys, "train", "--plan", plan, "--steps", "30", "--dry-run")
    assert "note: " not in p.stdout  # the defaults fit any run
    cosine = LRSchedule.default(3e-4, 300)  # a 300-step run resumed to stop at step 80, or to go on to 400
    assert cosine.note(80) == (
        "the cosine decay reaches --min-lr 3e-05 at step 300 (--decay-steps, which a resumed run keeps), after the "
        f"run's last step 80: the lr ends at {cosine(80):.3g}"
    )
    assert "the last 100 of the run's 400 steps stay at it" in cosine.note(400)
    assert cosine.note(300) is None and LRSchedule.default(3e-4, 300, min_lr=3e-4).note(80) is None
