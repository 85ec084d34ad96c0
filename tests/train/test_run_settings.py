"""A run's settings (config/run.py's `RunConfig`): from flags or a TOML file, each checked with one line naming what
the user wrote (the flag, or the file's field), resolved once into the run folder's config.json and run.toml, and
kept by a resumed run. All in process: `terapipe train --dry-run` and `prepare_run` start no workers."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from conftest import assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.config.run import DEFAULT_LR, RunConfig, load_run_config
from terapipe_cli.files import write_json_atomic
from terapipe_cli.train.prepare import prepare_run
from terapipe_cli.train.rundir import read_config


@pytest.fixture
def plan(tmp_path):
    return write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)


def test_every_setting_is_an_option_with_its_doc(capsys):
    """The options of `terapipe train` are the fields of `RunConfig`, each with its one-line doc as help."""
    p = run_cli(capsys, "train", "--help")
    for f in fields(RunConfig):
        flag = f.metadata["doc"].flag or "--" + f.name.replace("_", "-")
        assert flag in p.stdout, flag
    for words in ("Peak AdamW learning rate", "Steps of linear lr warm-up", "--config", "--resume", "--dry-run"):
        assert words in p.stdout


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--grad-clip", "-1", ["--grad-clip", "0 (no clipping) or a positive number"]),
        ("--min-lr", "0.01", ["--min-lr", "between 0 and --lr"]),
        ("--warmup-steps", "-1", ["--warmup-steps", "0 or more"]),
        ("--lr", "0", ["--lr", "positive"]),
        ("--precision", "fp8", ["--precision", "fp8"]),
        ("--steps", "0", ["--steps", "at least 1"]),
        ("--device", "tpu", ["--device", "auto, cpu, cuda"]),
    ],
)
def test_bad_options_are_one_line_errors_naming_the_flag(tmp_path, capsys, plan, option, value, words):
    p = run_cli(capsys, "train", "--plan", plan, "--out", tmp_path / "run", "--dry-run", option, value)
    assert_one_line_error(p, *words)
    assert not (tmp_path / "run").exists()


def test_a_config_file_sets_the_run_and_flags_override_it(tmp_path, capsys, plan):
    (tmp_path / "run.toml").write_text(
        f'[train]\nplan = "{plan.name}"\nsteps = 7\nlr = 1e-3\nwarmup_steps = 2\nout = "from-file"\n'
    )
    config = load_run_config(tmp_path / "run.toml")
    assert config.plan == str(tmp_path / "plan.json")  # paths are relative to the file
    assert (config.steps, config.lr, config.warmup_steps, config.grad_clip) == (7, 1e-3, 2, None)
    p = run_cli(capsys, "train", "--config", tmp_path / "run.toml", "--steps", "9", "--dry-run")
    assert p.returncode == 0, p.stderr
    prepared = prepare_run(RunConfig(**{**config.given(), "steps": 9}), write=False)
    assert (prepared.args.steps, prepared.args.lr, prepared.args.warmup_steps) == (9, 1e-3, 2)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("lr = 0", ["run.toml: field 'train.lr'", "positive"]),  # a value checked by the run: named by its field
        ('lr = "fast"', ["field 'train.lr'", "must be a number"]),
        ("warmup_step = 3", ["field 'train.warmup_step'", "is not a run setting", "warmup_steps"]),
        ("steps = -1", ["field 'train.steps'", "at least 1"]),
    ],
)
def test_a_bad_config_file_is_one_line_naming_its_field(tmp_path, capsys, plan, line, words):
    (tmp_path / "run.toml").write_text(f'[train]\nplan = "{plan.name}"\n{line}\n')
    p = run_cli(capsys, "train", "--config", tmp_path / "run.toml", "--out", tmp_path / "run", "--dry-run")
    assert_one_line_error(p, *words)


def test_the_run_folder_keeps_the_resolved_settings_as_run_toml(tmp_path, plan):
    out = tmp_path / "run"
    prepare_run(RunConfig(plan=str(plan), out=str(out), steps=5, seed=3, device="cpu"))
    kept = load_run_config(out / "run.toml")
    _, args = read_config(out)
    assert kept.plan == str(out / "plan.json") and kept.out is None
    assert (kept.steps, kept.seed, kept.lr, kept.warmup_steps) == (5, 3, DEFAULT_LR, args.warmup_steps)
    assert (kept.min_lr, kept.decay_steps, kept.grad_clip, kept.precision) == (args.min_lr, 5, 1.0, "fp32")
    # The same settings, resolved again from the file, are the run's own.
    again = prepare_run(RunConfig(**{**kept.given(), "out": str(tmp_path / "again")}))
    assert again.args == args


def test_a_plan_priced_at_another_precision_is_refused_unless_accepted(tmp_path, capsys, plan):
    obj = json.loads(plan.read_text())
    write_json_atomic(plan, {**obj, "precision": "bf16"})
    base = ["train", "--plan", plan, "--out", tmp_path / "run", "--dry-run", "--device", "cpu"]
    p = run_cli(capsys, *base)  # fp32, the CPU's default
    assert_one_line_error(p, "bf16", "fp32", "terapipe profile --precision fp32", "--accept-precision")
    assert run_cli(capsys, *base, "--accept-precision").returncode == 0
    assert run_cli(capsys, *base, "--precision", "bf16").returncode == 0


def test_a_resumed_run_keeps_what_decides_its_numbers(tmp_path, capsys, plan):
    """Its data, seed, held-out part, precision, lr schedule and clipping: another value given again is refused in
    one line naming it and what the run used; the same values, or a new length and evaluation cadence, are fine."""
    out = tmp_path / "run"
    prepare_run(RunConfig(plan=str(plan), out=str(out), steps=2, device="cpu", grad_clip=0.5, warmup_steps=1))
    other = tmp_path / "other.txt"
    other.write_text("some other text, long enough for a window or two. " * 20)
    for flag, value, kept in (
        ("--seed", "7", "--seed 0"),
        ("--val-fraction", "0.2", "--val-fraction 0.1"),
        ("--data", str(other), "the embedded default data"),
        ("--precision", "bf16", "--precision fp32"),
        ("--grad-clip", "1.0", "--grad-clip 0.5"),
        ("--warmup-steps", "2", "--warmup-steps 1"),
        ("--lr", "1e-3", f"--lr {DEFAULT_LR}"),
        ("--data-parallel", "2", "--data-parallel 1"),
    ):
        p = run_cli(capsys, "train", "--resume", "--steps", "3", "--out", out, flag, value, "--dry-run")
        assert_one_line_error(p, flag, kept)
    # Past those checks: this run never trained, so there is nothing to continue.
    p = run_cli(capsys, "train", "--resume", "--out", out, "--seed", "0", "--eval-every", "1", "--dry-run")
    assert_one_line_error(p, "never completed a step", "without --resume")


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ("0F0.1, 0F0.0, 0B0.1, 0B0.0\n1F0.0, 1F0.1, 1B0.1, 1B0.0\n", ["action 1 '0F0.1'", "before token slice 0"]),
        ("0F0.0, 0F0.1, 0B0.1, 0B0.0\n1F0.0, 1B0.1, 1F0.1, 1B0.0\n", ["action 2 '1B0.1'", "before the last forward"]),
        ("0F0.0, 0F0.1, 0B0.1, 0B0.0\n1F0.0, 1F0.1, 1B0.1\n", ["lacks '1B0.0'"]),
        ("0F0.0, 0F0.1, 0B0.1, 0B0.0\n1F0.0, 1F0.1, 1B0.1, 1B0.0\n# a comment\n2F0.0\n", ["3 rows"]),
        ("0F0.0, 0X0.1\n", ["action 2 '0X0.1'", "not an action such as 0F3.2"]),
    ],
)
def test_an_illegal_schedule_file_is_refused_in_one_line_before_any_worker(tmp_path, capsys, plan, rows, words):
    """`terapipe train --schedule FILE` checks the file against the plan first: one line naming the file and the
    first bad action, nothing written."""
    (tmp_path / "order.csv").write_text(rows)
    p = run_cli(capsys, "train", "--plan", plan, "--schedule", tmp_path / "order.csv", "--out", tmp_path / "run")
    assert_one_line_error(p, "order.csv", *words)
    assert not (tmp_path / "run").exists()
