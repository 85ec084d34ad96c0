"""The architecture registry downstream of the model: every spec's parameter counts are its runtime module's, the
FLOPs per token (the MFU numerator) are Megatron-LM's closed form for GPT-3 with and without recomputation, and the
gpt2 layer's analytic profile prices its bias adds as element-wise streams over gpt's products."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.models import ARCHS, Gpt2Config, GptConfig, LlamaConfig, flops_per_token
from terapipe_cli.plan.costmodel import profile_from_dict
from terapipe_cli.profile.analytic import (
    analytic_profile,
    ends_params,
    kernels_per_tile,
    layer_flops,
    layer_seconds,
)

TINY = dict(name="m", layers=2, hidden=32, heads=4, vocab=64, seq_len=64)
CONFIGS = {
    "gpt": GptConfig(**TINY),
    "gpt2": Gpt2Config(**TINY, tie_embeddings=False),
    "llama": LlamaConfig(**TINY, kv_heads=2, ffn_hidden=48),
}


def test_every_architecture_has_a_tested_config():
    assert set(CONFIGS) == set(ARCHS)


TIES = [(a, t) for a in sorted(CONFIGS) for t in (False, True) if not t or "tie_embeddings" in ARCHS[a].fields]


@pytest.mark.parametrize(("arch", "tied"), TIES)
def test_the_parameter_counts_are_the_modules(arch, tied):
    from terapipe_cli.models import build_model

    cfg = replace(CONFIGS[arch], tie_embeddings=tied) if "tie_embeddings" in ARCHS[arch].fields else CONFIGS[arch]
    whole = build_model(cfg)
    bias = arch != "gpt"  # gpt's count has GPT-3's biases, its module none
    assert sum(p.numel() for p in whole.blocks["0"].parameters()) == cfg.params_per_layer(bias=bias)
    embed = sum(p.numel() for n, p in whole.named_parameters() if n.startswith(("wte", "wpe")))
    head = sum(p.numel() for n, p in whole.named_parameters() if not n.startswith(("wte", "wpe", "blocks")))
    assert ends_params(cfg) == (embed, head)  # tied: the head's matrix is the embedding's, counted there


@pytest.mark.parametrize("name", ["gpt3-1b", "gpt3-175b"])
def test_flops_per_token_are_megatrons_closed_form(name):
    """Narayanan et al. 2021 (eq. 3): 72·l·h²·(1 + s/6h + V/12lh) per token without recomputation, 96·l·h²·(1 + s/6h
    + V/16lh) with every layer recomputed."""
    m = load_model_config(name)
    n, h, s, V = m.layers, m.hidden, m.seq_len, m.vocab
    assert flops_per_token(m) == pytest.approx(72 * n * h * h * (1 + s / (6 * h) + V / (12 * n * h)), rel=1e-12)
    full = 96 * n * h * h * (1 + s / (6 * h) + V / (16 * n * h))
    assert flops_per_token(m, recompute=True) == pytest.approx(full, rel=1e-12)
    # The same as 6·N + 12·l·h·s with N the layers' matrices and the head.
    assert flops_per_token(m) == pytest.approx(6 * (12 * n * h * h + V * h) + 12 * n * h * s, rel=1e-12)


def test_flops_per_token_of_llama_count_swiglu_and_grouped_query_attention():
    m = load_model_config("llama3.1-8b")
    H, kv, F, n = m.hidden, m.kv_width, m.ffn_hidden, m.layers
    N = n * (2 * H * H + 2 * H * kv + 3 * H * F) + m.vocab * H
    assert flops_per_token(m) == pytest.approx(6 * N + 12 * n * H * m.seq_len, rel=1e-12)
    assert 7.4e9 < N < 7.6e9  # Llama 3.1 8B: 8.0B parameters less the 0.5B embedding (the head is counted)


def test_gpt2_prices_its_bias_adds_on_gpts_products():
    gpt, gpt2 = load_model_config("gpt3-1b"), Gpt2Config(**load_model_config("gpt3-1b").to_dict(), tie_embeddings=False)
    b, i, j = np.meshgrid([1, 4], [8, 512], [0, 1024], indexing="ij")
    for t in (1, 2):
        same = zip(layer_flops(gpt, b, i, j, t), layer_flops(gpt2, b, i, j, t), strict=True)
        assert all(np.array_equal(x, y) for x, y in same)
    hardware = load_hardware("h100")
    fwd, bwd = layer_seconds(gpt2, hardware, b, i, j, 2)
    assert np.all(fwd > 0) and np.all(bwd > fwd)
    assert kernels_per_tile("bf16", model=gpt2) > kernels_per_tile("bf16", model=gpt)  # the biases' gradients
    small = replace(gpt2, seq_len=256)
    profile = profile_from_dict(analytic_profile(small, hardware, token_step=64), "analytic")
    assert profile.model == small and profile.params_per_layer == small.params_per_layer()
    assert profile.raw["ends"]["head_params"] == small.vocab * small.hidden + 2 * small.hidden
