"""A run's settings (config/run.py's `RunConfig`): from flags or a TOML file, each checked with one line naming what
the user wrote (the flag, or the file's field), resolved once into the run folder's config.json and run.toml, and
kept by a resumed run. All in process: `terapipe train --dry-run` and `prepare_run` start no workers."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import fields

import pytest
from conftest import assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.config.run import DEFAULT_LR, RunConfig, load_run_config
from terapipe_cli.errors import UserError
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
        ("--weight-decay", "-0.1", ["--weight-decay", "at least 0", "-0.1"]),
        ("--beta1", "1", ["--beta1", "in [0, 1)"]),
        ("--beta2", "-0.5", ["--beta2", "in [0, 1)"]),
        ("--eps", "0", ["--eps", "positive"]),
        ("--weight-decay", "inf", ["--weight-decay", "finite"]),
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
        ("beta2 = 1.0", ["field 'train.beta2'", "in [0, 1)"]),
        ("decay_embeddings = 0", ["field 'train.decay_embeddings'", "true or false"]),
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
    """A measured plan (or one that does not say): the advice is to measure again at the precision asked."""
    obj = json.loads(plan.read_text())
    write_json_atomic(plan, {**obj, "precision": "bf16", "profile": {"source": "measured"}})
    base = ["train", "--plan", plan, "--out", tmp_path / "run", "--dry-run", "--device", "cpu"]
    p = run_cli(capsys, *base, "--precision", "fp32")
    advice = "re-profile with `terapipe profile --precision fp32 --model test-tiny` and plan again"
    assert_one_line_error(p, "made for bf16", "trains in fp32", advice, "--accept-precision")
    assert run_cli(capsys, *base, "--precision", "fp32", "--accept-precision").returncode == 0
    assert run_cli(capsys, *base, "--precision", "bf16").returncode == 0
    assert run_cli(capsys, *base).returncode == 0  # the plan's own, bf16, by default: CPU autocast runs it


@pytest.fixture
def analytic_plan(tmp_path, capsys):
    """A plan of the tiny model from the bundled h100 hardware file (analytic, fp16)."""
    profile = tmp_path / "profile.json"
    for args in (
        ["profile", "--analytic", "--hardware", "h100", "--model", "tiny", "--out", profile],
        ["plan", "--profile", profile, "--stages", "2", "--batch", "2", "--out", tmp_path / "h100.json"],
    ):
        assert run_cli(capsys, *args).returncode == 0
    return tmp_path / "h100.json"


def test_a_run_trains_in_its_plans_precision_by_default(tmp_path, analytic_plan):
    """An analytic fp16 plan trains in fp16 on a CPU too (autocast runs it there): its schedule and memory are
    for fp16, and --verify checks the run against an fp16 reference. The run keeps it in run.toml."""
    out = tmp_path / "run"
    prepared = prepare_run(RunConfig(plan=str(analytic_plan), out=str(out), steps=2, device="cpu"))
    assert (prepared.plan.precision, prepared.args.precision) == ("fp16", "fp16")
    assert load_run_config(out / "run.toml").precision == "fp16"
    auto = prepare_run(RunConfig(plan=str(analytic_plan), precision="auto", device="cpu"), write=False)
    assert auto.args.precision == "fp16"


def test_another_precision_than_an_analytic_plans_says_how_to_plan_again(tmp_path, capsys, analytic_plan):
    """The advice fits the plan's profile: an analytic one is estimated again from a hardware file that prices the
    precision (the same GPU's, bundled), not measured again."""
    base = ["train", "--plan", analytic_plan, "--out", tmp_path / "run", "--dry-run", "--device", "cpu"]
    p = run_cli(capsys, *base, "--precision", "fp32")
    assert_one_line_error(
        p, "made for fp16", "trains in fp32", "terapipe profile --analytic --hardware h100-fp32 --model tiny",
        "terapipe plan", "--accept-precision",
    )  # fmt: skip
    assert "re-profile" not in p.stderr


def test_a_plan_in_bf16_on_a_gpu_without_it_says_to_pass_fp16(monkeypatch, analytic_plan):
    """A GPU older than Ampere has no native bf16: a bf16 plan's default precision is refused in one line naming
    --precision fp16 and how to get an fp16 plan (here: the h100 hardware file, which prices fp16)."""
    from terapipe_cli.config import device
    from terapipe_cli.plan.file import read_plan
    from terapipe_cli.train.prepare import _run_precision

    plan = read_plan(analytic_plan)
    bf16 = dataclasses.replace(plan, precision="bf16")
    monkeypatch.setattr(device, "_native_bf16", lambda: False)
    with pytest.raises(UserError) as e:
        _run_precision(None, "cuda", bf16)
    assert e.value.where == "precision"
    for words in ("made for bf16", "older than Ampere", "--precision fp16 --accept-precision", "--hardware h100 "):
        assert words in e.value.message, e.value.message
    assert _run_precision(None, "cuda", plan) == "fp16"  # an fp16 plan runs there as it is
    assert _run_precision(None, "cpu", bf16) == "bf16"


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
        ("--grad-clip", "1.0", "--grad-clip 0.5"),
        ("--warmup-steps", "2", "--warmup-steps 1"),
        ("--lr", "1e-3", f"--lr {DEFAULT_LR}"),
        ("--weight-decay", "0.2", "--weight-decay 0.1"),
        ("--beta2", "0.99", "--beta2 0.95"),
        ("--no-decay-embeddings", None, "--decay-embeddings"),
    ):  # (-d, -t and --plan may change: the run continues under another layout, tests/train/test_replan.py)
        given = [flag] if value is None else [flag, value]
        p = run_cli(capsys, "train", "--resume", "--steps", "3", "--out", out, *given, "--dry-run")
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


def test_the_optimizer_settings_are_kept_in_the_run_and_its_run_toml(tmp_path, capsys, plan):
    """--weight-decay, --beta1, --beta2, --eps and --no-decay-embeddings: resolved into config.json and run.toml, so
    that `terapipe train --config RUN/run.toml` trains with them again; left out, nanoGPT's defaults."""
    out = tmp_path / "run"
    flags = ["--weight-decay", "0.05", "--beta1", "0.8", "--beta2", "0.99", "--eps", "1e-6", "--no-decay-embeddings"]
    p = run_cli(capsys, "train", "--plan", plan, "--out", out, "--device", "cpu", *flags, "--dry-run")
    assert p.returncode == 0, p.stderr
    given = dict(weight_decay=0.05, beta1=0.8, beta2=0.99, eps=1e-6, decay_embeddings=False)
    prepare_run(RunConfig(plan=str(plan), out=str(out), device="cpu", **given))
    _, args = read_config(out)
    assert dataclasses.asdict(args.optimizer) == given
    kept = load_run_config(out / "run.toml")
    assert {name: getattr(kept, name) for name in given} == given
    again = prepare_run(RunConfig(**{**kept.given(), "out": str(tmp_path / "again")}))
    assert again.args == args
    default = prepare_run(RunConfig(plan=str(plan), device="cpu"), write=False).args.optimizer
    assert (default.weight_decay, default.betas, default.eps) == (0.1, (0.9, 0.95), 1e-8) and default.decay_embeddings
