"""Tensor parallelism inside a stage (T processes per stage): the split, the mesh, and `terapipe train -t 2`'s checks.
Trained against single-device training, with the negative control: engine/test_trainer.py (in one process) and
train/test_torchrun.py (two processes)."""

from __future__ import annotations

import torch
from conftest import assert_one_line_error, run_cli, tiny_model, write_plan_file

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.model import GPT
from terapipe_cli.engine.tensor import SPLITS, TensorGroup, shard_module, shard_tensor, split_of

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


def test_dry_run_shows_the_mesh(tmp_path, capsys):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2, layers=4)
    p = run_cli(capsys, "train", "--plan", plan, "-t", "2", "-d", "2", "--dry-run", *CPU, "--out", tmp_path / "r")
    assert p.returncode == 0, p.stderr
    assert "D × K × T = 2 × 2 × 2 = 8 workers" in p.stdout
    assert "--nproc-per-node 8" in p.stdout
    assert not (tmp_path / "r").exists()


def test_a_degree_that_does_not_split_the_heads_is_one_line(tmp_path, capsys):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2, layers=4)
    p = run_cli(capsys, "train", "--plan", plan, "-t", "3", "--dry-run", *CPU)
    assert_one_line_error(p, "--tensor-parallel", "heads")
