"""What a cluster does to a run, with real torchrun workers on the tiny model: SIGTERM to the launcher or to one
worker saves the step in progress and exits 143, and the resumed run's losses are an uninterrupted run's; a worker
killed mid-step under --max-restarts 1 is healed with the same losses; a full disk during a save leaves the previous
checkpoint and a resumable run. Each signal reaches a known step: the worker it is aimed at waits there for it
(the fault hook "wait", train/worker.py), so nothing depends on the machine's speed. Checkpoints that prove
themselves (the manifest, falling back past a damaged one) are tested in one process, test_checkpoint.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import LocalSetup, run_cli, train_locally, write_plan_file
from test_interrupt import start_train, wait_for_steps

from terapipe_cli.config.controls import CONTROLS_ENV
from terapipe_cli.plan.file import read_plan
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_config, read_events, read_metrics
from terapipe_cli.train.worker import PROCESS_NAME

STEPS = 6
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers through /proc")


def worker_pid(launcher: int, rank: int) -> int:
    """The process of worker ``rank`` of the launcher in process ``launcher``: its child named for the rank
    (`worker.name_process`; Linux /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
            name = Path(f"/proc/{entry}/comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and name == f"{PROCESS_NAME}{rank}":
            return int(entry)
    raise AssertionError(f"no worker of rank {rank} found")


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def uninterrupted_losses(plan: Path, out: Path) -> list[float]:
    """The losses of the whole run uninterrupted, trained through the workers' own code in this process."""
    _, args = read_config(out)
    return train_locally(LocalSetup(read_plan(plan), replace(args, steps=STEPS))).losses


def train_with_fault(capfd, plan: Path, out: Path, fault: str, *flags: str):
    """`terapipe train` in this process (its workers real torchrun processes), checkpointing every 2 steps."""
    argv = ["--plan", plan, "--steps", STEPS, "--out", out, "--val-fraction", "0", "--checkpoint-every", "2", *flags]
    return run_cli(capfd, "train", *argv, env={CONTROLS_ENV: f"fault={fault}"})


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def stop_the_launcher_by_sigterm(plan: Path, out: Path, step: int, *flags: str) -> None:
    """`terapipe train ... FLAGS` as a process of its own until SIGTERM, sent to it while worker rank 0 waits in
    ``step``: the step in progress is saved (FLAGS put the periodic checkpoints elsewhere), exit 143, one line."""
    proc = start_train(plan, out, *flags, steps=STEPS, env={CONTROLS_ENV: f"fault=wait:0:{step}"})
    wait_for_steps(proc, out, step - 1)
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = finish(proc)
    assert proc.returncode == 143, stdout + stderr
    assert_stopped_at(out, step, stderr)


def stop_a_worker_by_sigterm(capfd, plan: Path, out: Path, step: int, *flags: str) -> None:
    """`terapipe train ... FLAGS` with the launcher in this process (a worker's SIGTERM reaches only the worker, as a
    cluster's per-process kill does) until SIGTERM, sent to worker rank 1 while it waits in ``step``: the same save,
    exit code and line as a SIGTERM to the launcher."""
    sent: list[BaseException] = []

    def send() -> None:
        try:
            deadline = time.monotonic() + 120
            while len(read_metrics(out)) < step - 1:
                assert time.monotonic() < deadline, f"the run did not reach step {step - 1}"
                time.sleep(0.02)
            os.kill(worker_pid(os.getpid(), 1), signal.SIGTERM)
        except BaseException as e:  # the run then waits out its fault hook: its failure names this
            sent.append(e)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    argv = ["--plan", plan, "--steps", STEPS, "--out", out, *flags, "--val-fraction", "0"]
    p = run_cli(capfd, "train", *argv, env={CONTROLS_ENV: f"fault=wait:1:{step}"})
    sender.join(timeout=10)
    assert not sent, sent
    assert p.returncode == 143, p.stdout + p.stderr
    assert_stopped_at(out, step, p.stderr)


def assert_stopped_at(out: Path, step: int, stderr: str) -> None:
    assert stderr.strip().splitlines() == [
        f"terapipe: stopped by SIGTERM after step {step}; the last complete checkpoint is step {step}; "
        f"continue with: terapipe train --resume --out {out} --steps {STEPS}"
    ]
    assert checkpoint.latest_complete(out) == step and [r["step"] for r in read_metrics(out)] == [*range(1, step + 1)]
    assert not (out / "stop.request").exists()


def test_sigterm_to_the_launcher_or_a_worker_saves_the_step_in_progress_and_the_resumed_run_matches(tmp_path, capfd):
    """SIGTERM to the launcher in step 3; the run resumed, SIGTERM to a worker in step 5; resumed again, the run ends
    with an uninterrupted run's losses."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    out = (tmp_path / "run").resolve()
    stop_the_launcher_by_sigterm(plan, out, 3, "--checkpoint-every", "4")
    stop_a_worker_by_sigterm(capfd, plan, out, 5, "--resume", "--checkpoint-every", "6")
    assert checkpoint.complete_steps(out) == [3, 5]

    p = run_cli(capfd, "train", "--resume", "--out", out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert losses(out) == pytest.approx(uninterrupted_losses(plan, out), rel=1e-6)


def test_a_full_disk_keeps_the_previous_checkpoint_and_the_resumed_run_heals_a_killed_worker(tmp_path, capfd):
    """A full disk during step 4's save: one line naming the cause, step 2's checkpoint kept. Resumed under
    --max-restarts 1, a worker killed mid-step 6 is restarted from step 4's checkpoint (written in the background
    during step 5, complete at its end), and the run ends with an uninterrupted run's losses."""
    plan, out = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2), tmp_path / "run"
    p = train_with_fault(capfd, plan, out, "nospace:1:4")
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("terapipe: error: worker rank 1 "), p.stderr
    assert "the checkpoint of step 4 was not saved" in lines[0] and "disk full (No space left on device)" in lines[0]
    assert "the last complete checkpoint, step 2, is kept" in lines[0]
    assert checkpoint.complete_steps(out) == [2] and not checkpoint.step_dir(out, 4).exists()

    p = run_cli(capfd, "train", "--resume", "--out", out, "--max-restarts", "1", env={CONTROLS_ENV: "fault=kill:1:6"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "restart 1 of 1: a worker failed; all workers continue from the checkpoint of step 4" in p.stdout
    assert [(e["event"], e["restart"], e["resumed_from"]) for e in read_events(out)] == [("restart", 1, 4)]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    assert losses(out) == pytest.approx(uninterrupted_losses(plan, out), rel=1e-6)
    assert not (out / "errors").exists()  # the failed attempts' error files are cleared once the run succeeds
