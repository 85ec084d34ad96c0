"""`terapipe train` end to end: torchrun workers on CPU (gloo), tiny models, checked by --verify."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import terapipe, write_plan_file

from terapipe_cli.config.run import DEFAULT_LR
from terapipe_cli.plan.schedule import plan_tiles
from terapipe_cli.plan.timeline import read_timeline
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_metrics, read_summary, timeline_path

SCHEMES = {
    # name: (slices, stages, data_parallel)
    "K=2": ([(2, [8, 8, 8, 8])], 2, 1),
    "K=3": ([(1, [16, 8, 8])] * 2, 3, 1),
    "uneven token slices": ([(2, [13, 1, 11, 7])], 2, 1),
    "a different token slicing per batch slice": ([(1, [20, 12]), (1, [5, 5, 22])], 2, 1),
    "batch slices of different sizes": ([(2, [16, 16]), (1, [32])], 2, 1),
    "GPipe": ([(1, [32])] * 3, 2, 1),
    "D=2, K=2": ([(1, [12, 20])], 2, 2),
}


CLIP = 0.05  # below the tiny model's gradient norm (about 1.5) at every step: clipping is active


# Through the workers: stages that both receive and send (K=3), uneven and mixed message shapes, replicas. The other
# families' arithmetic (batch slices of different sizes, GPipe's single slices) is checked in one process by
# test_runtime_stage.py and, GPipe's, by every report's baseline. bf16 where rounding differs most from fp32's.
CASES = [
    (name, "fp32")
    for name in ("K=2", "K=3", "uneven token slices", "a different token slicing per batch slice", "D=2, K=2")
] + [(name, "bf16") for name in ("uneven token slices", "D=2, K=2")]


@pytest.mark.parametrize("name, precision", CASES)
def test_verify_passes(tmp_path, name, precision):
    """Every scheme family matches single-device training with the whole optimizer step active: warm-up, cosine
    decay, clipping by the global norm (equal to single-device clipping only if the norm is the whole model's)."""
    slices, stages, replicas = SCHEMES[name]
    plan = write_plan_file(tmp_path / "plan.json", slices, stages=stages)
    out = tmp_path / "run"
    p = terapipe(
        "train",
        *("--plan", str(plan), "--steps", "3", "--out", str(out), "--verify", "--data-parallel", str(replicas)),
        *("--device", "cpu", "--precision", precision, "--grad-clip", str(CLIP)),
        "--accept-precision",  # the hand-made plans are fp32's
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verified" in p.stdout
    summary = read_summary(out)
    assert summary["verify"]["ok"] is True and summary["verify"]["precision"] == precision
    checks = summary["verify"]["checks"]
    assert [c["what"] for c in checks] == ["loss, 3 steps", "gradients at step 1", "weights after step 3"]
    assert all(0 < c["spread"] and c["max_rel"] <= c["tolerance"] for c in checks)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    # Warm-up (1 step, the default for 3) to the peak, cosine down to 0.1 x lr at the last step; clipped throughout.
    assert [r["lr"] for r in records] == pytest.approx([DEFAULT_LR * f for f in (1, 0.55, 0.1)])
    assert all(r["grad_norm"] > CLIP and r["skipped"] is False for r in records)
    # One timeline per rank with every tile's forward and backward of every step, on the right stage.
    tiles = len(plan_tiles(slices))
    for rank in range(stages * replicas):
        meta, events = read_timeline(timeline_path(out, rank))
        assert meta["stage"] == rank % stages
        assert len(events) == 3 * 2 * tiles
        assert {e.stage for e in events} == {rank % stages}
        assert all(0 <= e.start_s <= e.end_s for e in events)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_negative_control_without_kv_handback_fails_verification(tmp_path, precision):
    """The check can fail: drop the earlier slices' K/V gradients and --verify must say so, in fp32 and under
    bf16's looser, measured tolerances alike."""
    plan = write_plan_file(tmp_path / "plan.json", [(2, [8, 8, 16])], stages=2)
    p = terapipe(
        "train",
        *("--plan", str(plan), "--steps", "2", "--out", str(tmp_path / "run"), "--verify"),
        *("--device", "cpu", "--precision", precision, "--accept-precision"),
        env={"TERAPIPE_TEST_DROP_KV_GRADS": "1"},
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verification failed" in p.stderr
    checks = {c["what"]: c for c in read_summary(tmp_path / "run")["verify"]["checks"]}
    grads = checks["gradients at step 1"]
    assert grads["ok"] is False
    assert grads["max_rel"] > 1e-2 and grads["max_rel"] > 10 * grads["tolerance"]


def test_killed_worker_ends_the_job_and_resume_reproduces_the_losses(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [10, 22]), (1, [32])], stages=2)
    common = ["--plan", str(plan), "--steps", "8", "--checkpoint-every", "3"]

    whole = tmp_path / "whole"
    p = terapipe("train", *common, "--out", str(whole))
    assert p.returncode == 0, p.stderr
    expected = [r["loss"] for r in read_metrics(whole)]
    assert len(expected) == 8

    broken = tmp_path / "broken"
    start = time.monotonic()
    p = terapipe("train", *common, "--out", str(broken), env={"TERAPIPE_TEST_FAULT": "kill:1:5"})
    assert time.monotonic() - start < 90  # includes start-up; the failure itself is noticed in well under 60 s
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "worker rank 1 (stage 1, replica 0) failed" in last and "SIGKILL" in last, p.stderr
    # Step 3's checkpoint is complete and loads; step 6 was never reached.
    assert checkpoint.complete_steps(broken) == [3]
    for stage in range(2):
        assert checkpoint.load_stage(broken, 3, stage)["step"] == 3
    assert [r["step"] for r in read_metrics(broken)] == [1, 2, 3, 4]

    p = terapipe("train", "--resume", "--out", str(broken), "--steps", "8")
    assert p.returncode == 0, p.stderr
    resumed = read_metrics(broken)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed] == pytest.approx(expected, rel=1e-6)


def _worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the torchrun worker with RANK=rank among the launcher's children (Linux /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker through /proc")
def test_worker_killed_from_outside(tmp_path):
    """kill -9 of one worker from outside, mid-run: the job ends quickly, names the rank, keeps its checkpoint."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "terapipe_cli",
            "train",
            "--plan",
            str(plan),
            "--steps",
            "100000",
            "--checkpoint-every",
            "2",
            "--out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while checkpoint.latest_complete(out) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach a checkpoint"
            time.sleep(0.1)
        pid = _worker_pid(proc.pid, rank=1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - killed < 60
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert "worker rank 1 (stage 1, replica 0) failed: killed by signal SIGKILL" in last, err
    step = checkpoint.latest_complete(out)
    assert step is not None and step % 2 == 0
    for stage in range(2):
        assert checkpoint.load_stage(out, step, stage)["step"] == step


def train_with_fault(tmp_path, fault: str, *options: str) -> subprocess.CompletedProcess:
    """4 steps of a two-stage plan into tmp_path/run, with the test-only fault ``fault`` injected."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    return terapipe(
        "train",
        *("--plan", str(plan), "--steps", "4", "--out", str(tmp_path / "run"), *options),
        env={"TERAPIPE_TEST_FAULT": fault},
    )


def test_worker_exception_is_named_in_one_line(tmp_path):
    p = train_with_fault(tmp_path, "raise:0:2")
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("terapipe: error: worker rank 0 (stage 0, replica 0) failed: RuntimeError: injected failure")
    assert (tmp_path / "run" / "errors" / "rank_00000.txt").exists()


def test_hung_worker_ends_the_job_by_timeout(tmp_path):
    """A rank that stops responding: its neighbour's wait times out and the job ends, naming both."""
    start = time.monotonic()
    p = train_with_fault(tmp_path, "hang:1:2", "--timeout-s", "3")
    assert time.monotonic() - start < 60
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert "worker rank 0 (stage 0, replica 0) failed: PeerLost: lost rank 1" in last and "Timed out" in last, last


def test_dry_run_prints_the_torchrun_command(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    p = terapipe("train", "--plan", str(plan), "--out", str(tmp_path / "run"), "--dry-run", "--data-parallel", "2")
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    assert "-m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 4" in line
    assert "--module terapipe_cli.train.worker --run-dir" in line
    assert "OMP_NUM_THREADS=1" in line
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    p = terapipe(
        "train",
        "--plan",
        str(plan),
        "--out",
        str(tmp_path / "run"),
        "--dry-run",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        "host0:29400",
    )
    assert "--nnodes 2 --node-rank 1 --rdzv-endpoint host0:29400 --nproc-per-node 1" in p.stdout


def test_run_directory_files(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    out = tmp_path / "run"
    p = terapipe("train", "--plan", str(plan), "--steps", "2", "--out", str(out), "--seed", "3")
    assert p.returncode == 0, p.stderr
    assert "step     2/2  loss" in p.stdout  # one grep-able metrics line per step
    config = json.loads((out / "config.json").read_text())
    assert config["schema"] == "terapipe.run/1" and config["backend"] == "gloo"
    assert config["arguments"]["seed"] == 3 and "torch" in config["versions"]
    assert json.loads((out / "plan.json").read_text())["schema"] == "terapipe.plan/1"
    rec = read_metrics(out)[-1]
    assert set(rec) >= {"schema", "step", "loss", "iteration_s", "tokens_per_s", "memory_bytes"}
    assert read_summary(out)["status"] == "complete"
    assert checkpoint.latest_complete(out) == 2
