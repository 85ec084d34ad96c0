"""Tensor parallelism inside a stage (T processes per stage): the split (the layers', and the vocabulary's: embedding,
head and the exact loss over the whole vocabulary), the mesh, and `terapipe train -t 2`'s checks.
Trained against single-device training, with the negative control: engine/test_trainer.py (in one process) and
train/test_torchrun.py (two processes)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_one_line_error, run_cli, tiny_model, write_plan_file
from local_world import LocalWorld

from terapipe_cli.engine.comm import DistGroup
from terapipe_cli.engine.loss import token_loss_sum
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.tensor import (
    SPLITS,
    TensorGroup,
    VocabParallelEmbedding,
    VocabParallelHead,
    gather_tensor,
    shard_module,
    shard_tensor,
    split_of,
    vocab_parallel_loss_sum,
)
from terapipe_cli.models import vocab_rows
from terapipe_cli.models.gpt.module import GPT

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


def shard_and_gather(state: dict, T: int) -> list[tuple[dict, dict]]:
    """Per tensor rank (threads): its shards of ``state`` and the whole tensors `gather_tensor` puts back together."""
    world = LocalWorld(T)

    def rank(r):
        tp = TensorGroup(r, T, world.group("tensor", range(T), r))
        shards = {name: shard_tensor(name, full, tp) for name, full in state.items()}
        return shards, {name: gather_tensor(name, part, tp) for name, part in shards.items()}

    return world.run(rank)


@pytest.mark.parametrize("T", [2, 3])
def test_gathered_shards_are_the_whole_tensor(T):
    """Each rank's slice of q, k and v holds its own heads, each rank's slice of the token embedding and the LM head
    its own rows of the vocabulary (253 rows, divisible by neither T: the shares differ by a row); the slices
    gathered over the tensor ranks (`gather_tensor`, ranks as threads) are the whole tensors again."""
    cfg = tiny_model(layers=1, hidden=48, heads=6, vocab=253)
    state = GPT(cfg).state_dict()
    ranks = shard_and_gather(state, T)
    for name, full in state.items():
        assert all(torch.equal(whole[name], full) for _, whole in ranks), name
        if split_of(name) is None:
            assert all(shards[name] is full for shards, _ in ranks)
    for name in ("wte.weight", "lm_head.weight"):
        rows = [shards[name].shape[0] for shards, _ in ranks]
        assert rows == [len(vocab_rows(253, T, r)) for r in range(T)] and sum(rows) == 253 and len(set(rows)) == 2
        assert torch.equal(ranks[1][0][name], state[name][vocab_rows(253, T, 1).start : vocab_rows(253, T, 1).stop])
    assert {n for n in state if split_of(n)} == {n for n in state for suffix in SPLITS if n.endswith(suffix)}
    # Every cut GPT parameter is named in SPLITS; the rest of SPLITS is the llama layer's (tests/engine/test_llama.py).
    assert {n.removeprefix("blocks.0.") for n in state if split_of(n)} <= set(SPLITS)


def _uneven_gather(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    part = torch.full((3 + rank, 2), float(rank))
    whole = DistGroup(None, 2).all_gather(part, 0, [3, 4])
    if rank == 1:
        torch.save(whole, out)
    dist.destroy_process_group()


def test_an_uneven_all_gather_between_processes_pads_and_trims(tmp_path):
    """`comm.DistGroup.all_gather` of parts of different lengths (two gloo processes): pad, gather, cut back."""
    import torch.multiprocessing as mp

    out = tmp_path / "whole.pt"
    mp.start_processes(_uneven_gather, args=(f"file://{tmp_path / 'store'}", str(out)), nprocs=2, start_method="fork")
    whole = torch.load(out)
    assert torch.equal(whole, torch.cat([torch.zeros(3, 2), torch.ones(4, 2)]))


def test_shard_module_keeps_the_names_and_a_share_of_each_layer():
    cfg = tiny_model(layers=2, hidden=32, heads=2, vocab=255)
    whole, part = GPT(cfg, seed=3), GPT(cfg, seed=3)
    shard_module(part, TensorGroup(1, 2))
    assert list(whole.state_dict()) == list(part.state_dict())
    rows = vocab_rows(255, 2, 1)  # 128 of the 255 rows: the larger share

    def share(name, p):
        if split_of(name) is None:
            return p.numel()
        return len(rows) * p.shape[1] if split_of(name).vocab else p.numel() // 2

    expected = sum(share(n, p) for n, p in whole.named_parameters())
    assert sum(p.numel() for p in part.parameters()) == expected < sum(p.numel() for p in whole.parameters())
    qkv = part.blocks["0"].attn.qkv.weight
    assert torch.equal(
        qkv, shard_tensor("blocks.0.attn.qkv.weight", whole.blocks["0"].attn.qkv.weight, TensorGroup(1, 2))
    )
    # The vocabulary's rows of the embedding and the head; the position embedding and the final norm stay whole.
    assert isinstance(part.wte, VocabParallelEmbedding) and isinstance(part.lm_head, VocabParallelHead)
    assert (part.wte.lo, part.wte.hi) == (part.lm_head.lo, part.lm_head.hi) == (rows.start, rows.stop) == (127, 255)
    assert torch.equal(part.lm_head.weight, whole.lm_head.weight[127:])
    assert torch.equal(part.wpe.weight, whole.wpe.weight) and torch.equal(part.ln_f.weight, whole.ln_f.weight)


def _tensor_ranks(T: int, fn):
    """``fn(tp)`` on T tensor ranks, each a thread with its `TensorGroup`; the results by rank."""
    world = LocalWorld(T)
    return world.run(lambda r: fn(TensorGroup(r, T, world.group("tensor", range(T), r))))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [2, 3])
def test_the_vocab_parallel_loss_is_the_whole_cross_entropy(T, dtype):
    """Every rank's loss is the summed cross-entropy over the whole vocabulary (in fp32 from 16-bit logits, as
    ``F.cross_entropy`` under autocast), and the gradients of its logits are the whole gradient's columns."""
    V = 253
    g = torch.Generator().manual_seed(T)
    logits = (torch.randn(2, 7, V, generator=g) * 4).to(dtype)
    targets = torch.randint(0, V, (2, 7), generator=g)
    ref = logits.detach().clone().requires_grad_()
    expected = token_loss_sum(ref.float() if dtype == torch.bfloat16 else ref, targets)
    (expected * 0.3).backward()

    def rank(tp):
        rows = vocab_rows(V, tp.size, tp.rank)
        local = logits[..., rows.start : rows.stop].detach().clone().requires_grad_()
        loss = vocab_parallel_loss_sum(local, targets, tp, rows.start, rows.stop)
        (loss * 0.3).backward()
        return loss.detach(), local.grad

    ranks = _tensor_ranks(T, rank)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-6}[dtype]
    for loss, _ in ranks:
        assert loss.dtype == expected.dtype and loss.item() == pytest.approx(expected.item(), rel=tol)
    grad = torch.cat([grad for _, grad in ranks], dim=-1)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref.grad, rtol=tol if dtype != torch.bfloat16 else 1e-2, atol=1e-7)


def test_the_vocab_parallel_loss_without_its_all_reduces_is_wrong():
    """The negative control's fault: each rank's loss over its own rows only."""
    V, targets = 253, torch.randint(0, 253, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(1, 16, V, generator=torch.Generator().manual_seed(1))

    def rank(tp):
        rows = vocab_rows(V, tp.size, tp.rank)
        faulty = TensorGroup(tp.rank, tp.size, tp.group, skip_vocab_allreduce=True)
        return float(
            vocab_parallel_loss_sum(logits[..., rows.start : rows.stop], targets, faulty, rows.start, rows.stop)
        )

    expected = float(token_loss_sum(logits, targets))
    assert all(abs(loss - expected) > 0.1 * expected for loss in _tensor_ranks(2, rank))


def test_the_vocab_parallel_embedding_is_the_whole_one():
    """The ranks' looked-up rows summed are the whole embedding, and each rank's gradient is the whole table's
    gradient at its rows (every token of a row's id adds to it, whichever rank embeds the others)."""
    cfg = tiny_model(layers=1, vocab=253)
    whole = GPT(cfg)
    tokens = torch.randint(0, 253, (2, 16), generator=torch.Generator().manual_seed(0))
    grad_out = torch.randn(2, 16, cfg.hidden, generator=torch.Generator().manual_seed(1))
    whole.wte(tokens).backward(grad_out)

    def rank(tp):
        rows = vocab_rows(253, tp.size, tp.rank)
        emb = VocabParallelEmbedding(whole.wte.weight[rows.start : rows.stop], tp, rows)
        out = emb(tokens)
        out.backward(grad_out)
        return out, emb.weight.grad

    ranks = _tensor_ranks(2, rank)
    assert all(torch.equal(out, whole.wte(tokens)) for out, _ in ranks)  # exact: one row plus zeros
    assert torch.equal(torch.cat([grad for _, grad in ranks]), whole.wte.weight.grad)


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
