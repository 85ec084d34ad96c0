"""The llama architecture downstream of the model: its parameter counts are the runtime module's, the analytic profile
counts SwiGLU's and grouped-query attention's FLOPs and what the layer keeps (equal to what the runtime keeps on a
CPU), and the memory estimate's K/V cache term is kv_heads/heads of the equivalent multi-head model's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.models import LlamaConfig, build_model, vocab_share
from terapipe_cli.plan.costmodel import profile_from_dict
from terapipe_cli.plan.memory import stage_sizes
from terapipe_cli.profile.analytic import (
    activation_bytes_per_token,
    analytic_profile,
    ends_params,
    kernels_per_tile,
    layer_flops,
)
from terapipe_cli.profile.timer import TileTimer

LLAMA_8B = load_model_config("llama3-8b")


def test_params_per_layer_and_of_the_ends_are_the_modules():
    cfg = load_model_config("llama-tiny")
    whole = build_model(cfg)
    assert sum(p.numel() for p in whole.blocks["0"].parameters()) == cfg.params_per_layer()
    assert ends_params(cfg) == (whole.wte.weight.numel(), whole.lm_head.weight.numel() + cfg.hidden)
    # Tensor parallelism: each of T ranks holds 1/T of the projections; the two RMSNorm weights whole.
    H, kv, F = cfg.hidden, cfg.kv_width, cfg.ffn_hidden
    assert cfg.params_per_layer(2) == (2 * H * H + 2 * H * kv + 3 * H * F) // 2 + 2 * H
    tied = replace(cfg, tie_embeddings=True)
    assert ends_params(tied) == (cfg.vocab * H, H)  # the head's matrix is the embedding's


@pytest.mark.parametrize("t", [1, 2, 8])
def test_llama_flops_count_swiglu_and_grouped_query_attention(t):
    m = LLAMA_8B
    H, kv, F, d = m.hidden, m.kv_width, m.ffn_hidden, m.head_dim
    b, i, j = np.meshgrid([1, 4], [1, 128, 8192], [0, 1000], indexing="ij")
    fwd, bwd = layer_flops(m, b, i, j, t)
    # q and o (H × H), k and v (H × kv_heads·d), gate, up and down (H × ffn_hidden); scores and values per query head.
    weights = 2 * b * i * (2 * H * H + 2 * H * kv + 3 * H * F) / t
    attention = 4 * b * i * (i + j) * (m.heads / t) * d
    assert np.allclose(fwd, weights + attention) and np.allclose(bwd, 2 * fwd)
    # Grouped-query attention changes only the K/V projections: the attention's FLOPs are the multi-head model's.
    mha_fwd, _ = layer_flops(replace(m, kv_heads=m.heads), b, i, j, t)
    assert np.allclose(mha_fwd - fwd, 2 * b * i * 2 * H * (H - kv) / t)


def test_llama_layer_launches_its_own_kernels():
    llama = load_model_config("llama-tiny")
    assert kernels_per_tile("bf16", model=llama) > kernels_per_tile("bf16")  # separate projections, rotations
    scaled = replace(llama, rope_scaling=load_model_config("llama3.1-8b").rope_scaling)
    assert kernels_per_tile("bf16", model=scaled) > kernels_per_tile("bf16", model=llama)  # the frequencies rescaled


@pytest.mark.parametrize("precision, dtype_bytes", [("fp32", 4), ("bf16", 2)])
def test_the_analytic_activation_bytes_are_what_the_runtime_keeps(precision, dtype_bytes):
    """The count of analytic.activation_bytes_per_token against `SavedBytes` through the runtime's StageRunner (the
    measured profile's method on a CPU): equal but for RMSNorm's per-token statistic and attention's log-sum-exp
    (a few floats per token, left out)."""
    cfg = LlamaConfig(name="m", layers=1, hidden=128, heads=4, vocab=64, seq_len=256, kv_heads=2, ffn_hidden=320)
    timer = TileTimer(cfg, torch.device("cpu"), precision=precision)
    with timer.runner.step():
        measured, _ = timer.activation_bytes_per_token(1, 64)
    estimate = activation_bytes_per_token(cfg, dtype_bytes)
    assert 0 <= measured - estimate <= 4 * (2 + cfg.heads)


def test_the_kv_cache_term_is_kv_heads_over_heads_of_the_multi_head_models():
    """Llama 3 8B (8 key/value heads for 32 query heads) on the analytic H100 bf16 profile: the memory estimate's
    K/V caches per token are a quarter of the same model's with one key/value head per query head."""
    hardware = load_hardware("h100-bf16")
    small = replace(LLAMA_8B, seq_len=1024)  # the cache term is per token: a short grid suffices
    sizes = {}
    for kv_heads in (8, 32):
        model = replace(small, kv_heads=kv_heads)
        profile = profile_from_dict(analytic_profile(model, hardware, token_step=256), "analytic")
        sizes[kv_heads] = stage_sizes(profile, 8)
    for gqa, mha in zip(sizes[8], sizes[32], strict=True):
        assert gqa.cache == pytest.approx(mha.cache * 8 / 32)
        assert gqa.cache == 4 * 2 * 1024 * 2  # 4 layers × keys and values × 8·128 features × 2 bytes
    assert vocab_share(LLAMA_8B.vocab, 1) * LLAMA_8B.hidden == ends_params(LLAMA_8B)[0]  # no position table


def test_a_measured_profile_times_the_llama_layer(tmp_path, capsys):
    """`terapipe profile` of a micro llama model: the layer, the embedding and the head timed through the runtime's
    llama code (its parameters, no position table, what it keeps per token as counted above), and the plan reads it."""
    from conftest import run_cli

    from terapipe_cli.plan.costmodel import read_profile

    model = tmp_path / "micro-llama.toml"
    model.write_text(
        '[model]\nname = "micro-llama"\narch = "llama"\nlayers = 2\nhidden = 32\nheads = 4\nkv_heads = 2\n'
        "ffn_hidden = 64\nvocab = 16\nseq_len = 64\n"
    )
    out = tmp_path / "profile.json"
    args = ["--quick", "--no-comm", "--no-allreduce", "--batch-sizes", "2,1", "--device", "cpu", "--precision", "fp32"]
    p = run_cli(capsys, "profile", "--model", model, *args, "--out", out)
    assert p.returncode == 0, p.stderr
    prof = read_profile(out)
    cfg = prof.model
    assert cfg.arch == "llama" and cfg.kv_heads == 2 and prof.params_per_layer == cfg.params_per_layer()
    assert (prof.raw["ends"]["embed_params"], prof.raw["ends"]["head_params"]) == ends_params(cfg)
    measured = prof.activation_bytes_per_token_per_layer
    assert 0 <= measured - activation_bytes_per_token(cfg, 4) <= 4 * (2 + cfg.heads)
    p = run_cli(capsys, "plan", "--profile", out, "--stages", "2", "--batch", "1", "--out", tmp_path / "plan.json")
    assert p.returncode == 0, p.stderr
