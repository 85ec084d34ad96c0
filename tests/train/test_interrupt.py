"""Ctrl-C on `terapipe train`: exit 130, one line saying how to continue, no worker left, and the steps taken
those of an uninterrupted run. One stage: Ctrl-C reaches the launcher alone, which asks the workers to stop through
the run folder as it does for SIGTERM; that every rank of a pipeline stops at the same step boundary is
test_cluster.py's SIGTERM to the launcher of two stages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, LocalSetup, train_locally, write_plan_file

from terapipe_cli.config.controls import CONTROLS_ENV
from terapipe_cli.config.run import LRSchedule, RunArguments
from terapipe_cli.plan.file import read_plan
from terapipe_cli.train import checkpoint
from terapipe_cli.train.launch import interrupted_message
from terapipe_cli.train.rundir import append_metrics, read_config, read_metrics, write_config

STEPS = 6
WAIT = "fault=wait:0:3"  # the worker waits in step 3 for the signal (at most a minute): the run is still going then


def start_train(plan: Path, out: Path, *flags: str, steps: int = STEPS, env: dict | None = None) -> subprocess.Popen:
    """`terapipe train` as a terminal starts it: a process group of its own, the foreground one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    argv = ["train", "--plan", str(plan), "--steps", str(steps), "--out", str(out), *flags]
    argv += ["--val-fraction", "0"]  # not what this checks; 10 evaluations would lengthen the run
    return subprocess.Popen(
        [sys.executable, "-m", "terapipe_cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(read_metrics(out)) < steps:
        assert proc.poll() is None, "the run ended before it was interrupted"
        assert time.monotonic() < deadline, f"the run did not reach step {steps}"
        time.sleep(0.02)


def processes_naming(text: str) -> list[int]:
    """Processes (other than this one) whose command line holds ``text`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks for leftover workers through /proc")
def test_ctrl_c_stops_cleanly_after_the_steps_an_uninterrupted_run_takes(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=1)
    out = tmp_path / "run"
    proc = start_train(plan, out, "--checkpoint-every", "1", env={CONTROLS_ENV: WAIT})
    try:
        wait_for_steps(proc, out, 2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    done = [r["step"] for r in read_metrics(out)]
    saved = checkpoint.latest_complete(out)
    assert saved is not None and saved <= done[-1] < STEPS
    assert lines[0] == (
        f"terapipe: interrupted at step {done[-1] + 1}; the last complete checkpoint is step {saved}; "
        f"continue with: terapipe train --resume --out {out.resolve()} --steps {STEPS}"
    )
    for noise in ("Traceback", "KeyboardInterrupt", "death signal", "torch.distributed", "worker rank"):
        assert noise not in stdout + stderr
    time.sleep(0.5)
    assert processes_naming(str(out.resolve())) == []  # no worker left behind

    # The steps it took are those of the same run uninterrupted, trained through the workers' own code in one
    # process (that `--resume` then finishes it with the same losses is tested with two nodes, test_multinode.py).
    _, args = read_config(out)
    args = replace(args, steps=len(done), decay_steps=LRSchedule.of_run(args).total_steps)  # its first steps only
    whole = train_locally(LocalSetup(read_plan(plan), args)).losses
    assert [r["loss"] for r in read_metrics(out)] == pytest.approx(whole, rel=1e-6)


def test_the_line_without_a_checkpoint_says_to_start_again(tmp_path):
    out = tmp_path / "run"
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    args = RunArguments(
        steps=8, data=None, seed=0, lr=1e-3, data_parallel=1, checkpoint_every=4, threads=1, timeout_s=60, verify=False
    )
    write_config(
        out,
        plan=json.loads(plan.read_text()),
        args=args,
        world_size=2,
        device="cpu",
        backend="gloo",
        nnodes=1,
        versions={},
        created="2026-01-01T00:00:00+00:00",
    )
    assert interrupted_message(out).startswith("interrupted at step 1; no complete checkpoint yet")
    for step in (1, 2, 3):
        append_metrics(out, {"step": step, "loss": 5.0})
    line = interrupted_message(out)
    assert line.startswith("interrupted at step 4; no complete checkpoint yet, nothing to resume: start again")
    assert str(out) in line
