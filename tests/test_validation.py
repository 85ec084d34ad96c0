"""The held-out (validation) loss: a split of the data, evaluated through the same pipeline, forward only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, terapipe, write_plan_file

from terapipe_cli.engine.data import TokenData, load_data, split_data, validation_batch
from terapipe_cli.engine.model import GPT, token_loss_sum
from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import read_plan
from terapipe_cli.report.build import _held_out
from terapipe_cli.report.runs import load_run
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_config, read_metrics, read_summary

CPU = ("--device", "cpu")


def test_the_held_out_part_is_the_end_of_the_data():
    data = TokenData("x", "tokens", np.arange(1000) % 256, 255)
    train, held_out = split_data(data, 0.1, seq_len=32)
    assert len(train) == 900 and len(held_out) == 100
    assert held_out.tokens[0] == data.tokens[900]
    assert split_data(data, 0.0, seq_len=32) == (data, None)
    # The validation batch is the same at every evaluation, and drawn from the held-out part only.
    a = validation_batch(held_out, seed=0, sequences=3, seq_len=32)
    assert torch.equal(a, validation_batch(held_out, seed=0, sequences=3, seq_len=32))
    starts = [int(np.flatnonzero(held_out.tokens == row[0].item())[0]) for row in a]
    assert all(0 <= s <= 100 - 33 for s in starts)
    with pytest.raises(UserError, match="--val-fraction"):
        split_data(data, 0.99, seq_len=32)
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        split_data(data, 1.0, seq_len=32)


def test_validation_loss_is_the_single_device_loss_of_the_trained_weights(tmp_path):
    """Every --eval-every steps and after the last: the held-out loss through the pipeline (K = 2, token
    slices, forward only) equals the whole model's loss on the same windows, with the checkpoint's weights."""
    plan_path = write_plan_file(tmp_path / "plan.json", [(1, [12, 20]), (1, [32])], stages=2)
    out = tmp_path / "run"
    p = terapipe("train", "--plan", str(plan_path), "--steps", "3", "--eval-every", "2", "--out", str(out), *CPU)
    assert p.returncode == 0, p.stdout + p.stderr
    records = read_metrics(out)
    assert ["val_loss" in r for r in records] == [False, True, True]
    assert [line.count(" val ") for line in p.stdout.splitlines() if line.startswith("step")] == [0, 1, 1]
    assert read_summary(out)["final_val_loss"] == records[-1]["val_loss"]

    plan, (_, args) = read_plan(plan_path), read_config(out)
    assert args.val_fraction == 0.1 and args.eval_every == 2
    model = GPT(plan.model)
    for k in range(plan.stages):
        model.load_state_dict(checkpoint.load_stage(out, 3, k)["model"], strict=False)
    _, held_out = split_data(load_data(None), args.val_fraction, plan.seq_len)
    batch = validation_batch(held_out, seed=args.seed, sequences=plan.batch_size, seq_len=plan.seq_len)
    with torch.no_grad():
        expected = token_loss_sum(model(batch[:, :-1]), batch[:, 1:]).item() / batch[:, 1:].numel()
    assert records[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)

    # The report draws the held-out curve next to the training loss.
    p = terapipe("report", str(out), "--no-baseline", "--warmup", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (out / "report" / "loss.png").stat().st_size > 0
    assert _held_out(load_run(out)) == [(2, records[1]["val_loss"]), (3, records[2]["val_loss"])]


def test_no_held_out_data_means_no_validation(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2)
    out = tmp_path / "run"
    p = terapipe("train", "--plan", str(plan), "--steps", "2", "--val-fraction", "0", "--out", str(out), *CPU)
    assert p.returncode == 0, p.stderr
    assert not any("val_loss" in r for r in read_metrics(out))
    assert read_config(out)[1].eval_every == 0


def test_resume_refuses_other_data_seed_or_held_out_part(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2)
    out = tmp_path / "run"
    assert terapipe("train", "--plan", str(plan), "--steps", "2", "--out", str(out), *CPU).returncode == 0
    other = tmp_path / "other.txt"
    other.write_text("some other text, long enough for a window or two. " * 20)
    for flag, value, kept in (
        ("--seed", "7", "--seed 0"),
        ("--val-fraction", "0.2", "--val-fraction 0.1"),
        ("--data", str(other), "the embedded default data"),
    ):
        p = terapipe("train", "--resume", "--steps", "3", "--out", str(out), flag, value, "--dry-run", *CPU)
        assert_one_line_error(p, flag, kept)
    # The same values again, and a new evaluation cadence, are fine.
    p = terapipe("train", "--resume", "--steps", "3", "--out", str(out), "--seed", "0", "--eval-every", "1", *CPU)
    assert p.returncode == 0, p.stderr
    assert "val_loss" in read_metrics(out)[-1]
