"""A checkpoint is the model, not the layout (docs/design.md §6e): a run checkpointed under one plan continues under
another — K, partition, virtual stages, D, T — from the same step with the same optimizer state, and its losses are
those of the run continued under its old plan. In one process (every rank a thread, the checkpoint files written
and read by the workers' own functions), then once through `terapipe train --resume --plan` with real workers: that
run starts from a `transformers` folder, and is also --init-from's one run through real workers."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import LocalSetup, local_setup, run_cli, tiny_model, train_locally, write_plan_file
from local_world import LocalWorld, local_comms

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.trainer import Trainer
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan.file import read_plan
from terapipe_cli.schedule.schedule import Schedule
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_metrics
from terapipe_cli.train.saving import layout_of
from terapipe_cli.train.worker import load_checkpoint

STEPS, SAVED = 6, 3
SLICES = [(1, [8, 24])] * 2  # B = 2


def _trainers(setup: LocalSetup, world: LocalWorld):
    layout = Layout(setup.args.data_parallel, setup.plan.stages, setup.args.tensor_parallel)
    schedule = Schedule.of_plan(setup.plan)
    return layout, lambda rank: Trainer(
        setup.plan, schedule, setup.args, layout=layout, rank=rank, device=torch.device("cpu"),
        comms=local_comms(world, layout, rank), data=setup.data, held_out=setup.held_out,
    )  # fmt: skip


def checkpoint_at_step(setup: LocalSetup, run_dir) -> None:
    """Train ``setup`` for SAVED steps and write its checkpoint as the workers do: one file per stage (tensor rank
    0 of replica 0 writes it), then the manifest."""
    world = LocalWorld(setup.args.data_parallel * setup.plan.stages * setup.args.tensor_parallel)
    layout, make = _trainers(setup, world)

    def body(rank):
        t = make(rank)
        for step in range(1, SAVED + 1):
            t.step(step)
        model, optimizer = t.full_state()
        if layout.replica(rank) == 0 and t.tensor.rank == 0:
            origin = checkpoint.Origin(t.plan.model.to_dict(), layout_of(t))
            return t.stage, checkpoint.save_stage(
                run_dir, SAVED, t.stage, t.plan.stages, model, optimizer, origin=origin
            )
        return None

    entries = dict(e for e in world.run(body) if e is not None)
    checkpoint.mark_complete(run_dir, SAVED, setup.plan.stages, entries=entries)


def continue_from(setup: LocalSetup, run_dir, *, weights_only: bool = False) -> list[float]:
    """The losses of steps SAVED + 1 … STEPS of ``setup`` continued from the checkpoint in ``run_dir``
    (``weights_only``: the negative control, the optimizer state dropped)."""
    world = LocalWorld(setup.args.data_parallel * setup.plan.stages * setup.args.tensor_parallel)
    _, make = _trainers(setup, world)

    def body(rank):
        t = make(rank)
        if weights_only:
            stored = checkpoint.read_state(run_dir, SAVED, set(t.state_names()))
            t.runner.module.load_state_dict({n: stored.model[n] for n in t.state_names()} if t.tensor.size == 1 else {})
        else:
            load_checkpoint(run_dir, SAVED, t)
        return [t.step(step).loss for step in range(SAVED + 1, STEPS + 1)]

    return world.run(body)[0]


def _setup(slices, stages: int, **changes) -> LocalSetup:
    fields = changes.pop("plan_fields", {})
    return local_setup(slices, stages=stages, plan_fields=fields, steps=STEPS, eval_every=0, **changes)


OLD = {"slices": SLICES, "stages": 2}
NEW_LAYOUTS = {
    "K=3, T=2": ({"slices": [(1, [16, 16])] * 2, "stages": 3, "tensor_parallel": 2}),
    "another partition, 2 virtual stages": (
        {"slices": SLICES, "stages": 2, "plan_fields": {"virtual_stages": 2, "layers_per_stage": [2, 1, 2, 1]}}
    ),
    "D=2, the same global batch": ({"slices": [(1, [32])], "stages": 2, "data_parallel": 2}),
    "K=1, 1F1B": ({"slices": [(1, [8, 8, 16])] * 2, "stages": 1, "plan_fields": {"order": "1f1b"}}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The old plan's checkpoint of step 3, and its losses uninterrupted to step 6."""
    run_dir = tmp_path_factory.mktemp("run")
    old = _setup(**OLD)
    checkpoint_at_step(old, run_dir)
    return run_dir, train_locally(old).losses


@pytest.mark.parametrize("name", list(NEW_LAYOUTS))
def test_a_checkpoint_continues_under_another_layout_to_the_same_losses(saved, name):
    run_dir, whole = saved
    losses = continue_from(_setup(**NEW_LAYOUTS[name]), run_dir)
    assert losses == pytest.approx(whole[SAVED:], rel=1e-5)


def test_dropping_the_optimizer_state_fails_the_comparison(saved):
    """Negative control: the weights alone (AdamW's moments and step count start again) under the same plan."""
    run_dir, whole = saved
    losses = continue_from(_setup(**OLD), run_dir, weights_only=True)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, whole[SAVED:], strict=True)) > 10 * 1e-5


def test_resume_under_a_new_plan_through_the_workers(tmp_path, capfd):
    """`terapipe train --resume --plan NEW` with real torchrun workers, of a run that started from a sharded
    `transformers` folder (--init-from, test_init_from.py's one real run): K = 2 workers read their stages of the
    folder and --verify passes (its reference starts from the same weights); saved at step 3, continued as 2 stages
    of 2 virtual stages each with another partition, the losses of steps 1–6 those of the run uninterrupted from the
    folder's weights in one process. The run keeps SRC in config.json and run.toml; `terapipe export --format hf` of
    its last step computes the uninterrupted run's logits in `transformers`; `terapipe report RUN --no-baseline
    --warmup 1` reads it."""
    import transformers
    from test_init_from import LLAMA, source_folder, tokens_of

    from terapipe_cli.config.model import load_model_config
    from terapipe_cli.models import build_model
    from terapipe_cli.train.rundir import read_summary

    _, folder = source_folder(tmp_path, "LlamaForCausalLM", {**LLAMA, "num_hidden_layers": 6}, "20KB")
    cfg = load_model_config(folder)
    old = write_plan_file(tmp_path / "k2.json", SLICES, stages=2, model=cfg)
    new = write_plan_file(tmp_path / "v2.json", SLICES, stages=2, model=cfg, virtual_stages=2,
                          layers_per_stage=[2, 1, 2, 1])  # fmt: skip
    out = tmp_path / "run"
    first = ["train", "--plan", old, "--init-from", folder, "--steps", str(SAVED), "--decay-steps", str(STEPS)]
    first += ["--out", out, "--checkpoint-every", str(SAVED), "--val-fraction", "0", "--verify", "--device", "cpu"]
    p = run_cli(capfd, *first)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verified" in p.stdout and "starting from the weights of transformers folder" in p.stderr
    assert read_summary(out)["verify"]["ok"] is True
    assert json.loads((out / "config.json").read_text())["arguments"]["init_from"] == str(folder.resolve())
    assert "init_from = " in (out / "run.toml").read_text()

    p = run_cli(capfd, "train", "--resume", "--out", out, "--plan", new, "--steps", STEPS, "--no-verify")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (
        "resuming step 3 under a new layout: D × K × T 1 × 2 × 1 -> 1 × 2 × 1, virtual stages 1 -> 2, "
        "layers 3, 3 -> 2 1 | 2 1" in p.stderr
    )
    resumed = [r["loss"] for r in sorted(read_metrics(out), key=lambda r: r["step"])]
    args = dataclasses.replace(_setup(**OLD).args, **_run_args(out))
    whole = train_locally(LocalSetup(read_plan(old), args))
    assert resumed == pytest.approx(whole.losses, rel=1e-5)
    assert read_plan(out / "plan.json").virtual_stages == 2  # the run's plan is the new one from now on

    p = run_cli(capfd, "export", out, "--format", "hf", "--out", tmp_path / "hf")
    assert p.returncode == 0, p.stderr
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = build_model(cfg).eval()
    ours.load_state_dict(whole.weights)
    tokens = tokens_of(cfg)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-5)

    # The report reads each plan's steps under that plan: steps 1–3 from the old ranks' timelines, kept aside.
    p = run_cli(capfd, "report", out, "--no-baseline", "--warmup", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Resumed under another plan: steps 1–3 under D × K × T 1 × 2 × 1" in p.stdout


def _run_args(out) -> dict:
    from terapipe_cli.train.rundir import read_config

    _, args = read_config(out)
    names = ("lr", "warmup_steps", "min_lr", "decay_steps", "grad_clip", "val_fraction", "init_from")
    return {k: getattr(args, k) for k in names}


@pytest.mark.parametrize(
    ("model", "refused"),
    [
        ({"layers": 2}, "field 'model.layers' (2, the run's 4)"),
        ({"tie_embeddings": False}, "field 'model.tie_embeddings' (False, the run's True)"),
        ({"name": "another-folder"}, None),  # the same model under another name (a transformers folder's is its own)
    ],
)
def test_a_plan_of_another_model_is_one_line_naming_the_field(tmp_path, capsys, model, refused):
    """`terapipe train --resume --plan OTHER`: a plan of another model is refused naming the field that differs (a
    GPT-2 whose head is tied to its embedding, and one whose is not, differ); one of the same model is not."""
    from fake_runs import SEQ, checkpointed_run

    from terapipe_cli.models import Gpt2Config

    gpt2 = Gpt2Config(**tiny_model(seq_len=SEQ).to_dict(), tie_embeddings=True)
    run = checkpointed_run(tmp_path / "run", gpt2, step=3)
    plan = json.loads((run / "plan.json").read_text())
    plan["model"].update(model)
    other = write_json_atomic(tmp_path / "other.json", plan)
    p = run_cli(capsys, "train", "--resume", "--out", run, "--plan", other, "--steps", "5", "--dry-run")
    if refused is None:
        assert p.returncode == 0, p.stderr
        return
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert refused in p.stderr and "--init-from" in p.stderr


def test_another_precision_on_resume_is_said_and_checked_against_the_plan(tmp_path, capsys):
    """--precision may change on --resume: one line says the numbers from there differ; a precision the plan was
    not made for needs --accept-precision, as for a new run."""
    from fake_runs import checkpointed_run

    run = checkpointed_run(tmp_path / "run", step=3)
    p = run_cli(capsys, "train", "--resume", "--out", run, "--steps", "5", "--precision", "bf16", "--dry-run")
    assert p.returncode == 2 and "--accept-precision" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    args = ["--precision", "bf16", "--accept-precision", "--dry-run"]
    p = run_cli(capsys, "train", "--resume", "--out", run, "--steps", "5", *args)
    assert p.returncode == 0, p.stderr
    assert "the run continues in bf16 from step 3 (it trained in fp32)" in p.stderr
