"""`terapipe train` with the optimizer step of docs/design.md §6a: precision, lr schedule, clipping, and their
options; --verify on a larger model at default settings (CPU, gloo)."""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error, terapipe, write_plan_file

from terapipe_cli.config.model import load_model_config
from terapipe_cli.config.run import DEFAULT_LR
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan.file import make_plan_dict
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_metrics, read_summary

ISSUE_MODEL = """\
[model]
name = "issue-example"
layers = 6
hidden = 192
heads = 6
vocab = 256
seq_len = 512
"""


STEPS = {"fp32": 5, "bf16": 3}  # bf16 matrix products are slow on a CPU: 3 steps keep it to the fp32 run's time


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_default_settings_verify_on_a_larger_model(tmp_path, precision):
    """The issue's example: 6 layers, H = 192, 6 heads, L = 512, K = 3, B = 1, every setting at its default (lr,
    warm-up, cosine decay, clipping at 1.0) — --verify passes in fp32 and in bf16. Fewer steps than the example's
    10 (`STEPS`): the same checks in less of the suite's time; the drift over 10 steps was measured when the
    tolerance was set (docs/design.md §6a)."""
    (tmp_path / "model.toml").write_text(ISSUE_MODEL)
    model = load_model_config(tmp_path / "model.toml")
    slices = [(1, [192, 160, 96, 64])]  # TeraPipe's shape: longer slices first
    plan = make_plan_dict(
        model=model, stages=3, batch_size=1, seq_len=512, token_step=1, slices=slices, precision=precision
    )
    write_json_atomic(tmp_path / "plan.json", plan)
    out = tmp_path / "run"
    p = terapipe(
        "train",
        *("--plan", str(tmp_path / "plan.json"), "--steps", str(STEPS[precision]), "--out", str(out), "--verify"),
        *("--device", "cpu", "--precision", precision),
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    verify = read_summary(out)["verify"]
    assert verify["ok"] is True and verify["precision"] == precision
    records = read_metrics(out)
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert any(r["grad_norm"] > 1.0 for r in records)  # the default clip at 1.0 was active


def test_fp16_trains_verifies_and_records_the_loss_scale(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(2, [8, 8, 16])], stages=2)
    out = tmp_path / "run"
    p = terapipe(
        "train",
        *("--plan", str(plan), "--steps", "3", "--out", str(out), "--verify", "--device", "cpu"),
        *("--precision", "fp16", "--accept-precision"),  # the hand-made plan is fp32's
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "scale 65536" in p.stdout
    assert read_summary(out)["verify"]["ok"] is True
    assert read_summary(out)["verify"]["precision"] == "fp16"
    records = read_metrics(out)
    assert [r["loss_scale"] for r in records] == [2.0**16] * 3 and not any(r["skipped"] for r in records)
    state = checkpoint.load_stage(out, 3, 1)["optimizer"]["loss_scale"]
    assert state == {"scale": 2.0**16, "clean_steps": 3}
    arguments = json.loads((out / "config.json").read_text())["arguments"]
    assert arguments["precision"] == "fp16" and arguments["accept_precision"] is True
    assert (arguments["warmup_steps"], arguments["min_lr"], arguments["decay_steps"], arguments["grad_clip"]) == (
        1,
        pytest.approx(0.1 * DEFAULT_LR),
        3,
        1.0,
    )


def test_fp16_resume_reproduces_the_losses_and_keeps_the_settings(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    common = ["--plan", str(plan), "--steps", "5", "--checkpoint-every", "2", "--device", "cpu"]
    common += ["--precision", "fp16", "--accept-precision", "--warmup-steps", "2", "--grad-clip", "0.5"]
    whole = tmp_path / "whole"
    assert terapipe("train", *common, "--out", str(whole)).returncode == 0
    broken = tmp_path / "broken"
    p = terapipe("train", *common, "--out", str(broken), env={"TERAPIPE_TEST_FAULT": "raise:1:4"})
    assert p.returncode == 1 and checkpoint.latest_complete(broken) == 2

    # A resumed run keeps its precision, schedule and clipping: another value given again is refused.
    for flag, value in [("--precision", "fp32"), ("--grad-clip", "1.0"), ("--warmup-steps", "1"), ("--lr", "1e-3")]:
        p = terapipe("train", "--resume", "--out", str(broken), "--steps", "5", flag, value)
        assert_one_line_error(p, flag, "resumed")
    p = terapipe("train", "--resume", "--out", str(broken), "--steps", "5", "--precision", "fp16")
    assert p.returncode == 0, p.stderr
    expected = read_metrics(whole)
    resumed = read_metrics(broken)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in expected], rel=1e-6)
    assert [r["lr"] for r in resumed] == pytest.approx([r["lr"] for r in expected])
    # The loss scale's count of clean steps went on from the checkpoint (5, not 3).
    assert checkpoint.load_stage(broken, 5, 0)["optimizer"]["loss_scale"]["clean_steps"] == 5


def test_a_plan_priced_at_another_precision_is_refused_unless_accepted(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    obj = json.loads(plan.read_text())
    write_json_atomic(plan, {**obj, "precision": "bf16"})
    base = ["train", "--plan", str(plan), "--out", str(tmp_path / "run"), "--dry-run", "--device", "cpu"]
    p = terapipe(*base)  # fp32, the CPU's default
    assert_one_line_error(p, "bf16", "fp32", "terapipe profile --precision fp32", "--accept-precision")
    assert terapipe(*base, "--accept-precision").returncode == 0
    assert terapipe(*base, "--precision", "bf16").returncode == 0


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--grad-clip", "-1", ["--grad-clip", "0 (no clipping) or a positive number"]),
        ("--min-lr", "0.01", ["--min-lr", "between 0 and --lr"]),
        ("--warmup-steps", "-1", ["--warmup-steps", "0 or more"]),
        ("--lr", "0", ["--lr", "positive"]),
        ("--precision", "fp8", ["--precision", "fp8"]),
    ],
)
def test_bad_step_options_are_one_line_errors(tmp_path, option, value, words):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    p = terapipe("train", "--plan", str(plan), "--out", str(tmp_path / "run"), "--dry-run", option, value)
    assert_one_line_error(p, *words)


def test_help_shows_the_step_options():
    p = terapipe("train", "--help")
    for option in ("--warmup-steps", "--min-lr", "--grad-clip", "--precision", "--accept-precision"):
        assert option in p.stdout
