"""`terapipe train` through real torchrun workers (gloo on the CPU): the smoke tier. Each scheme family, order,
precision and parallelism is verified in one process through the same code (engine/test_trainer.py); here each
kind of process layout runs once as a user runs it, with --verify: K = 2 stages walking a hand-written schedule,
D = 2 replicas in bf16 (then trained again from the run's run.toml), T = 2 tensor ranks in fp16 (one stage each:
stages' messages are the K = 2 test's); then the negative control through --verify, a worker that hangs (its
neighbour, the worker that fails, is named in one line) and a run that diverges. Ctrl-C is in test_interrupt.py,
resume and two nodes on loopback in test_multinode.py, resume under a new plan in test_replan.py. The command
itself runs in this process, as `terapipe run` runs it (test_interrupt.py and test_multinode.py start `terapipe
train` processes); its workers are real torchrun processes."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, write_plan_file

from terapipe_cli.config.controls import CONTROLS_ENV
from terapipe_cli.config.run import DEFAULT_LR
from terapipe_cli.schedule.schedule import plan_tiles
from terapipe_cli.schedule.timeline import read_timeline
from terapipe_cli.train import checkpoint, launch
from terapipe_cli.train.rundir import read_metrics, read_summary, timeline_path

CLIP = 0.05  # below the tiny model's gradient norm (about 1.5) at every step: clipping is active

# K = 2, batch slice 1 first on every stage, its backward as early as the pipeline allows (no built-in order).
SCHEDULE = """\
# a hand-written schedule: one row of actions per stage
0F1, 0F0.0, 0F0.1, 0B1, 0B0.1, 0B0.0
1F1, 1B1, 1F0.0, 1F0.1, 1B0.1, 1B0.0
"""


def _verified(p, out, precision: str) -> dict:
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verified" in p.stdout
    verify = read_summary(out)["verify"]
    assert verify["ok"] is True and verify["precision"] == precision
    assert [c["what"] for c in verify["checks"]] == ["loss, 3 steps", "gradients at step 1", "weights after step 3"]
    return verify


def test_two_stages_walk_a_hand_written_schedule_verified(tmp_path, capfd, monkeypatch):
    # Its workers started as with CUDA, each a fresh interpreter (`launch.start_method`); the other launches of the
    # suite fork theirs from the launcher, as the CPU does.
    methods = []
    monkeypatch.setattr(launch, "start_method", lambda spec: "spawn")
    monkeypatch.setattr(launch, "run_workers", lambda *a, run=launch.run_workers: methods.append(a[1]) or run(*a))
    slices = [(1, [16, 16]), (1, [32])]
    plan = write_plan_file(tmp_path / "plan.json", slices, stages=2)
    (tmp_path / "order.csv").write_text(SCHEDULE)
    out = tmp_path / "run"
    p = run_cli(
        capfd,
        "train", "--plan", plan, "--schedule", tmp_path / "order.csv", "--steps", "3", "--out", out, "--verify",
        "--grad-clip", CLIP, "--seed", "3", "--device", "cpu", "--track-memory",
    )  # fmt: skip
    _verified(p, out, "fp32")  # the tracked first step trains as the others (tests/engine/test_live.py)
    assert methods == ["spawn"]
    assert "step     3/3  loss" in p.stdout  # one grep-able metrics line per step

    # The run folder: its config, plan, resolved settings, schedule, metrics, timelines, checkpoint and summary.
    config = json.loads((out / "config.json").read_text())
    assert config["schema"] == "terapipe.run/1" and config["backend"] == "gloo" and "torch" in config["versions"]
    assert config["arguments"]["seed"] == 3 and config["arguments"]["schedule"] == (out / "schedule.csv").read_text()
    assert json.loads((out / "plan.json").read_text())["schema"] == "terapipe.plan/1"
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(records[-1]) >= {"schema", "step", "loss", "iteration_s", "tokens_per_s", "memory_bytes", "val_loss"}
    # --track-memory: each worker's first step, tracked for the bytes live at once.
    assert [("live_bytes_per_rank" in r) for r in records] == [True, False, False]
    assert len(records[0]["live_bytes_per_rank"]) == 2 and min(records[0]["live_bytes_per_rank"]) > 0
    # Warm-up (1 step, the default for 3) to the peak, cosine down to 0.1 x lr at the last step; clipped throughout.
    assert [r["lr"] for r in records] == pytest.approx([DEFAULT_LR * f for f in (1, 0.55, 0.1)])
    assert all(r["grad_norm"] > CLIP and r["skipped"] is False for r in records)
    assert checkpoint.latest_complete(out) == 3 and read_summary(out)["status"] == "complete"
    for rank in range(2):  # every tile's forward and backward of every step, in the schedule's order, per rank
        meta, events = read_timeline(timeline_path(out, rank))
        assert meta["stage"] == rank and {e.stage for e in events} == {rank}
        assert len(events) == 3 * 2 * len(plan_tiles(slices))
        first = [f"{e.stage}{e.phase}{e.batch_slice}" for e in events if e.step == 1][:2]
        assert first == [f"{rank}F1", f"{rank}F0" if rank == 0 else f"{rank}B1"]


def test_two_replicas_in_bf16_verify_and_the_run_trains_again_from_its_run_toml(tmp_path, capfd):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [12, 20])], stages=1, data_parallel=2)
    out = tmp_path / "run"
    p = run_cli(
        capfd,
        "train", "--plan", plan, "--steps", "3", "--out", out, "--verify", "--precision", "bf16", "--accept-precision",
        "--device", "cpu",
    )  # fmt: skip
    _verified(p, out, "bf16")
    assert len(list((out / "timelines").iterdir())) == 2  # D x K ranks

    # run.toml holds the resolved settings: trained again from it, the run takes the same steps.
    p = run_cli(capfd, "train", "--config", out / "run.toml", "--out", tmp_path / "again", "--no-verify")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r["loss"] for r in read_metrics(tmp_path / "again")] == [r["loss"] for r in read_metrics(out)]


def test_two_tensor_ranks_in_fp16_verify_and_keep_one_loss_scale(tmp_path, capfd):
    plan = write_plan_file(tmp_path / "plan.json", [(2, [8, 8, 16])], stages=1, tensor_parallel=2)
    out = tmp_path / "run"
    p = run_cli(
        capfd,
        "train", "--plan", plan, "--steps", "3", "--out", out, "--verify", "--precision", "fp16", "--accept-precision",
        "--device", "cpu",
    )  # fmt: skip
    _verified(p, out, "fp16")
    assert "scale 65536" in p.stdout
    records = read_metrics(out)
    assert [r["loss_scale"] for r in records] == [2.0**16] * 3 and not any(r["skipped"] for r in records)
    state = checkpoint.load_stage(out, 3, 0)
    assert state["optimizer"]["loss_scale"] == {"scale": 2.0**16, "clean_steps": 3}
    assert state["model"]["blocks.3.attn.qkv.weight"].shape == (3 * 32, 32)  # whole, gathered from both ranks
    assert state["model"]["wte.weight"].shape == state["model"]["lm_head.weight"].shape == (256, 32)  # their rows too


def test_the_negative_control_fails_verify(tmp_path, capfd):
    """The check can fail: drop the earlier slices' K/V gradients and --verify must say so (exit 1)."""
    plan = write_plan_file(tmp_path / "plan.json", [(2, [8, 8, 16])], stages=1)
    p = run_cli(
        capfd,
        "train", "--plan", plan, "--steps", "2", "--out", tmp_path / "run", "--verify", "--device", "cpu",
        env={CONTROLS_ENV: "kv_handback=off"},
    )  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verification failed" in p.stderr and "MISMATCH" in p.stdout
    checks = {c["what"]: c for c in read_summary(tmp_path / "run")["verify"]["checks"]}
    grads = checks["gradients at step 1"]
    assert grads["ok"] is False and grads["max_rel"] > 10 * grads["tolerance"]


def train_with_fault(tmp_path, capfd, fault: str, *options: str):
    """4 steps of a plan of 2 stages into tmp_path/run, with the test-only fault ``fault`` injected."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    return run_cli(
        capfd,
        "train",
        "--plan",
        plan,
        "--steps",
        "4",
        "--out",
        tmp_path / "run",
        *options,
        env={CONTROLS_ENV: f"fault={fault}"},
    )


def test_a_hung_worker_ends_the_job_by_its_neighbours_timeout_and_the_failed_worker_is_named(tmp_path, capfd):
    """A rank that stops responding: its neighbour's wait times out (--timeout-s) and the job ends, naming both. The
    neighbour is the worker that failed: its exception is the one line (not the hung rank, which torchrun stopped),
    exit 1, its traceback kept in the run folder. How the line picks the root cause among failed ranks (a raised
    exception before a lost peer before a stopped rank) is test_launch.py's, in this process."""
    p = train_with_fault(tmp_path, capfd, "hang:1:1", "--timeout-s", "2")
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("terapipe: error: worker rank 0 (stage 0, replica 0) failed: PeerLost: lost rank 1"), last
    assert "Timed out" in last, last
    assert (tmp_path / "run" / "errors" / "rank_00000.txt").exists()


def test_a_diverging_run_stops_at_its_first_non_finite_step_and_keeps_the_last_finite_checkpoint(tmp_path, capfd):
    """--lr 1e6: step 1's update blows the weights up and step 2's loss is nan. Both stages stop at step 2 together
    (none waits for the other), before its checkpoint: one line naming the step, exit 3, step 1's finite checkpoint
    the last. --max-restarts' restart (torchrun restarts after any failure) stops at once with the same cause instead
    of training step 2 into the same divergence again (one restart shows it: without that stop, it trains and says
    "restart 1 of 1")."""
    import torch
    from test_metrics_log import same_as_jsonl

    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    out = tmp_path / "run"
    p = run_cli(
        capfd, "train", "--plan", plan, "--steps", "4", "--out", out, "--lr", "1e6", "--warmup-steps", "1",
        "--checkpoint-every", "1", "--device", "cpu", "--log", "csv,tensorboard", "--max-restarts", "1",
    )  # fmt: skip
    assert p.returncode == 3, p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert errors[0].startswith("terapipe: error: training diverged at step 2 (loss nan"), errors[0]
    assert "the last checkpoint (step 1) is kept" in errors[0] and "--lr" in errors[0]
    assert checkpoint.latest_complete(out) == 1 and not checkpoint.step_dir(out, 2).exists()
    for stage in (0, 1):
        weights = checkpoint.load_stage(out, 1, stage)["model"]
        assert all(torch.isfinite(w).all() for w in weights.values())
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert '"restart"' not in (out / "metrics.jsonl").read_text() and "restart 1 of 1" not in p.stdout  # none trained
    same_as_jsonl(out)  # --log: the workers wrote the CSV and TensorBoard's events of both steps
