"""Tensor parallelism inside a stage (T processes per stage): the split, the mesh, and `terapipe train -t 2`
checked against single-device training, with a negative control that proves the check can fail."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_one_line_error, terapipe, tiny_model, write_plan_file

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.model import GPT
from terapipe_cli.engine.tensor import SPLITS, TensorGroup, shard_module, shard_tensor, split_of
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_config, read_metrics, read_summary
from terapipe_cli.train.worker import FAULT_ENV

CPU = ("--device", "cpu")


def test_layout_puts_the_tensor_dimension_innermost():
    layout = Layout(data=2, stages=3, tensor=2)
    assert layout.world == 12
    coords = [(layout.replica(r), layout.stage(r), layout.tensor_rank(r)) for r in range(12)]
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert coords[6] == (1, 0, 0)
    assert all(layout.rank(*c) == r for r, c in enumerate(coords))
    # Messages go to the same tensor rank of the neighbouring stage of the same replica.
    assert layout.neighbours(1) == (None, 3)
    assert layout.neighbours(3) == (1, 5)
    assert layout.neighbours(11) == (9, None)


def test_shards_put_together_are_the_whole_tensor():
    """Each rank's slice of q, k and v holds its own heads; concatenating the slices per part gives the whole."""
    model = GPT(tiny_model(layers=1, hidden=32, heads=4))
    for name, full in model.state_dict().items():
        split = split_of(name)
        shards = [shard_tensor(name, full, TensorGroup(r, 2)) for r in range(2)]
        if split is None:
            assert all(s is full for s in shards)
            continue
        dim, parts = split
        assert all(s.shape[dim] * 2 == full.shape[dim] for s in shards)
        whole = torch.cat([s.unflatten(dim, (parts, -1)) for s in shards], dim=dim + 1).flatten(dim, dim + 1)
        assert torch.equal(whole, full)
    assert {n.split(".", 2)[2] for n in model.state_dict() if split_of(n)} == set(SPLITS)


def test_shard_module_keeps_the_names_and_a_share_of_each_layer():
    cfg = tiny_model(layers=2, hidden=32, heads=2)
    whole, part = GPT(cfg, seed=3), GPT(cfg, seed=3)
    shard_module(part, TensorGroup(1, 2))
    assert list(whole.state_dict()) == list(part.state_dict())
    expected = sum(p.numel() // 2 if split_of(n) else p.numel() for n, p in whole.named_parameters())
    assert sum(p.numel() for p in part.parameters()) == expected < sum(p.numel() for p in whole.parameters())
    qkv = part.blocks["0"].attn.qkv.weight
    assert torch.equal(
        qkv, shard_tensor("blocks.0.attn.qkv.weight", whole.blocks["0"].attn.qkv.weight, TensorGroup(1, 2))
    )


def _verified(tmp_path, slices, stages, *extra, env=None):
    plan = write_plan_file(tmp_path / "plan.json", slices, stages=stages, layers=4)
    out = tmp_path / "run"
    p = terapipe(
        "train",
        *("--plan", str(plan), "--steps", "2", "--out", str(out), "--verify", "--grad-clip", "0.05", *CPU, *extra),
        env=env,
    )
    return p, out


@pytest.mark.parametrize(
    "name, slices, stages, extra",
    [
        ("T=2, K=1", [(2, [8, 24])], 1, ()),
        ("T=2, K=2", [(1, [12, 20])] * 2, 2, ()),
        ("T=2, K=2, D=2", [(1, [12, 20])], 2, ("--data-parallel", "2")),
    ],
)
def test_verify_passes_with_tensor_parallelism(tmp_path, name, slices, stages, extra):
    """fp32 tolerances, clipping by the global norm active (counted once per parameter across tensor ranks)."""
    p, out = _verified(tmp_path, slices, stages, "--tensor-parallel", "2", *extra)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "T=2" in p.stdout and "verified" in p.stdout
    assert read_summary(out)["verify"]["ok"] is True
    config, args = read_config(out)
    assert args.tensor_parallel == 2 and config["world_size"] == stages * 2 * (2 if extra else 1)
    # Checkpoints hold each stage whole: the full single-device shapes, whatever T was.
    state = checkpoint.load_stage(out, 2, 0)["model"]
    assert state["blocks.0.attn.qkv.weight"].shape == (3 * 32, 32)


def test_skipping_one_tensor_parallel_allreduce_fails_verification(tmp_path):
    """The negative control: the backward all-reduce of the column-parallel inputs left out."""
    p, out = _verified(
        tmp_path, [(2, [8, 24])], 1, "--tensor-parallel", "2", env={"TERAPIPE_TEST_SKIP_TP_ALLREDUCE": "1"}
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verification failed" in p.stderr
    checks = {c["what"]: c for c in read_summary(out)["verify"]["checks"]}
    grads = checks["gradients at step 1"]
    assert grads["ok"] is False and grads["max_rel"] > 10 * grads["tolerance"]


def test_resume_with_tensor_parallelism_reproduces_the_losses(tmp_path):
    """A failure after the step-2 checkpoint, then --resume: the whole stages saved, each rank's share reloaded."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [12, 20])] * 2, stages=1, layers=4)
    common = ("--plan", str(plan), "--steps", "4", "--checkpoint-every", "2", "-t", "2", *CPU)
    whole = tmp_path / "whole"
    assert terapipe("train", *common, "--out", str(whole)).returncode == 0
    broken = tmp_path / "broken"
    p = terapipe("train", *common, "--out", str(broken), env={FAULT_ENV: "raise:1:3"})
    assert p.returncode == 1 and "rank 1" in p.stderr
    p = terapipe("train", "--resume", "--steps", "4", "--out", str(broken), *CPU)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r["loss"] for r in read_metrics(broken)] == [r["loss"] for r in read_metrics(whole)]
    assert terapipe("train", "--resume", "--steps", "5", "-t", "1", "--out", str(broken), *CPU).returncode == 2


def test_dry_run_shows_the_mesh(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2, layers=4)
    p = terapipe("train", "--plan", str(plan), "-t", "2", "-d", "2", "--dry-run", *CPU, "--out", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr
    assert "D × K × T = 2 × 2 × 2 = 8 workers" in p.stdout
    assert "--nproc-per-node 8" in p.stdout
    assert not (tmp_path / "r").exists()


def test_a_degree_that_does_not_split_the_heads_is_one_line(tmp_path):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2, layers=4)
    p = terapipe("train", "--plan", str(plan), "-t", "3", "--dry-run", *CPU)
    assert_one_line_error(p, "--tensor-parallel", "heads")
