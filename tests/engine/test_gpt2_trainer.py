"""The gpt2 architecture (GPT-2 exactly: biases, tanh GELU, tied embeddings) through the runtime: scheme families of
tests/engine/test_trainer.py verify against single-device training, one process with every rank a thread; the biases
split over two tensor ranks (column-parallel ones cut, row-parallel ones added once); bf16 too; tied embeddings on one
device, refused across stages."""

from __future__ import annotations

import pytest
import torch
from conftest import TWO_STEPS, local_setup, verify_locally
from local_world import LocalWorld
from test_tensor_parallel import shard_and_gather
from test_trainer import FAMILIES

from terapipe_cli.engine.tensor import ColumnParallelLinear, RowParallelLinear, TensorGroup, shard_module, split_of
from terapipe_cli.models import Gpt2Config, ModelConfig, build_model
from terapipe_cli.models.gpt.module import GPT2


def gpt2_model(layers: int = 6, **fields) -> ModelConfig:
    """6 layers (the families' partitions), H = 32, 2 heads; the head untied unless asked (pipelines need that)."""
    base = dict(name="test-gpt2", layers=layers, hidden=32, heads=2, vocab=256, seq_len=32)
    return Gpt2Config(**{**base, "tie_embeddings": False, **fields})


def gpt2_setup(name: str, **changes):
    """The family ``name`` on `gpt2_model`, two steps (conftest.TWO_STEPS) unless ``changes`` say."""
    slices, stages, args, fields = FAMILIES[name]
    args = {**TWO_STEPS, **args, **changes}
    return local_setup(slices, stages=stages, model=gpt2_model(args.pop("layers", 6)), plan_fields=fields, **args)


def checks(result):
    return [(c.what, c.max_rel, c.tolerance) for c in result.checks]


def test_the_gpt2_module_has_biases_the_tanh_gelu_and_a_tied_head_by_default():
    cfg = ModelConfig.from_dict(
        {"name": "m", "layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16, "arch": "gpt2"}, "t", ""
    )
    model = build_model(cfg)
    assert type(model) is GPT2 and cfg.tie_embeddings and model.lm_head.weight is model.wte.weight
    block = model.blocks["0"]
    assert all(lin.bias is not None for lin in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj))
    assert block.mlp.gelu == "tanh" and block.ln_1.eps == 1e-5
    assert sum(p.numel() for p in block.parameters()) == cfg.params_per_layer()
    assert cfg.end_params(cfg.vocab) == (sum(p.numel() for p in (model.wte.weight, model.wpe.weight)), 2 * 32)
    assert cfg.to_dict()["arch"] == "gpt2" and ModelConfig.from_dict(cfg.to_dict(), "round trip", prefix="") == cfg


def test_the_biases_split_over_the_tensor_ranks():
    """q/k/v's bias cut as its weight (each rank its heads' rows of q, k and v), the MLP's first bias cut with its
    columns; the two output projections' biases whole on every rank; gathered, the whole tensors again."""
    cfg = gpt2_model(layers=1, hidden=48, heads=6)
    whole = build_model(cfg, seed=1)
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))  # nonzero biases
    state = whole.state_dict()
    for T in (2, 3):
        ranks = shard_and_gather(state, T)
        for name, full in state.items():
            assert all(torch.equal(w[name], full) for _, w in ranks), name
        qkv = state["blocks.0.attn.qkv.bias"].view(3, T, -1)
        assert torch.equal(ranks[1][0]["blocks.0.attn.qkv.bias"], qkv[:, 1].reshape(-1))
    assert split_of("blocks.0.mlp.fc.bias") and split_of("blocks.0.attn.proj.bias") is None

    # The sharded layer computes the whole one's output (ranks as threads).
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = whole(tokens)
    world = LocalWorld(2)

    def rank(r):
        part = build_model(cfg, seed=1)
        part.load_state_dict(state)
        shard_module(part, TensorGroup(r, 2, world.group("tensor", range(2), r)))
        attn = part.blocks["0"].attn
        assert isinstance(attn.qkv, ColumnParallelLinear) and isinstance(attn.proj, RowParallelLinear)
        assert attn.qkv.bias.shape == (3 * 48 // 2,) and attn.proj.bias.shape == (48,)
        with torch.no_grad():
            return part(tokens)

    got = torch.cat(world.run(rank), dim=-1)  # each rank's rows of the vocabulary, in order
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name",
    ["K=2", "K=3", "uneven token slices", "T=2, K=1", "T=2, K=2", "1F1B, 4 batch slices", "recomputed",
     "2 virtual stages, 1F1B order, batch slices of different sizes", "2 virtual stages, T=2"],
)  # fmt: skip
def test_scheme_families_verify_for_gpt2(name):
    result, run = verify_locally(gpt2_setup(name))
    assert result.ok, checks(result)
    assert len(run.losses) == 2 and run.grads_step == 1


@pytest.mark.parametrize("name", ["K=3", "T=2, K=2"])
def test_gpt2_in_bf16_verifies_within_the_measured_spread(name):
    result, _ = verify_locally(gpt2_setup(name, precision="bf16"))
    assert result.ok and result.precision == "bf16", checks(result)


def test_dropping_the_kv_handback_fails_verification_for_gpt2():
    result, _ = verify_locally(gpt2_setup("K=2", kv_handback=False))
    assert not result.ok
    grads = next(c for c in result.checks if c.what.startswith("gradients"))
    assert grads.max_rel > 10 * grads.tolerance


def test_a_row_parallel_bias_added_on_every_rank_fails_verification(monkeypatch):
    """Negative control: each rank adding the output projections' bias before the sum (T times the bias) must fail
    (after the first update: the biases start at zero)."""
    import torch.nn.functional as F

    from terapipe_cli.engine import tensor

    def biased_before_the_sum(self, x):
        return tensor._SumOverRanks.apply(F.linear(x, self.weight, self.bias), self.tp)

    monkeypatch.setattr(RowParallelLinear, "forward", biased_before_the_sum)
    result, _ = verify_locally(gpt2_setup("T=2, K=2"))
    assert not result.ok
    weights = next(c for c in result.checks if c.what.startswith("weights"))
    assert weights.max_rel > 10 * weights.tolerance, checks(result)
