"""The llama architecture (models/llama/): its config fields, its state dict as documented, token slices with RoPE at
their absolute positions equal to the whole sequence, and the slice-local negative control that must differ."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig, build_model
from terapipe_cli.models.attention import KVCache
from terapipe_cli.models.gpt.module import GPT
from terapipe_cli.models.llama import module as llama

BASE = {"name": "m", "layers": 2, "hidden": 64, "heads": 4, "vocab": 50, "seq_len": 64}
LLAMA = {**BASE, "arch": "llama", "kv_heads": 2, "ffn_hidden": 96}


def small(**fields) -> ModelConfig:
    return ModelConfig.from_dict({**LLAMA, **fields}, "test", prefix="")


def test_a_gpt_config_is_unchanged_by_the_llama_fields():
    cfg = ModelConfig.from_dict(BASE, "test", prefix="")
    assert cfg.to_dict() == {**BASE, "mlp_ratio": 4}  # what plans and profiles record, as before
    assert (cfg.arch, cfg.kv_heads, cfg.ffn_hidden) == ("gpt", 4, 256)
    assert type(build_model(cfg)) is GPT


def test_llama_fields_round_trip_and_default():
    cfg = small()
    assert ModelConfig.from_dict(cfg.to_dict(), "round trip", prefix="") == cfg
    default = ModelConfig.from_dict({**BASE, "arch": "llama", "ffn_hidden": 96}, "test", prefix="")
    assert (default.kv_heads, default.rope_theta, default.norm_eps, default.tie_embeddings) == (4, 10000.0, 1e-5, False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_heads": 3}, "field 'kv_heads' must divide heads (4), got 3"),
        ({"kv_heads": 0}, "field 'kv_heads' must be at least 1"),
        ({"arch": "mamba"}, "field 'arch' must be one of gpt, gpt2, llama"),
        ({"ffn_hidden": None}, "field 'ffn_hidden' must be an integer"),
        ({"rope_theta": 0}, "field 'rope_theta' must be positive"),
        ({"tie_embeddings": "no"}, "field 'tie_embeddings' must be true or false"),
        ({"mlp_ratio": 4}, "field 'mlp_ratio' is not a setting of arch = 'llama'"),
        ({"heads": 64, "kv_heads": 64}, "field 'heads' must leave an even head_dim"),
    ],
)
def test_bad_llama_fields_fail_in_one_line_naming_the_field(fields, message):
    with pytest.raises(UserError) as err:
        small(**fields)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_llama_fields_are_refused_on_a_gpt_model():
    with pytest.raises(UserError, match="field 'kv_heads' is not a setting of arch = 'gpt'"):
        ModelConfig.from_dict({**BASE, "kv_heads": 2}, "test", prefix="")


def test_tensor_parallel_must_divide_the_kv_heads():
    cfg = small(heads=8, kv_heads=2, hidden=128)
    cfg.check_tensor_parallel(2)
    with pytest.raises(UserError, match="4 does not divide the 2 kv_heads"):
        cfg.check_tensor_parallel(4)


@pytest.mark.parametrize("name", ["llama-tiny", "llama3-8b", "llama3-70b", "llama3-8b-L128k"])
def test_bundled_llama_models(name):
    cfg = load_model_config(name)
    assert cfg.arch == "llama" and cfg.heads % cfg.kv_heads == 0
    shapes = {"llama3-8b": (32, 4096, 32, 8, 14336, 8192), "llama3-70b": (80, 8192, 64, 8, 28672, 8192)}
    shapes["llama3-8b-L128k"] = shapes["llama3-8b"][:5] + (131072,)
    if name in shapes:
        assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.seq_len) == shapes[name]
        assert (cfg.vocab, cfg.rope_theta) == (128256, 500000.0)


def test_the_state_dict_is_the_one_the_docstring_lists():
    """The module docstring is the contract the Hugging Face export maps from: every key, with its shape."""
    cfg = small(tie_embeddings=True)
    H, d, F, V = cfg.hidden, cfg.head_dim, cfg.ffn_hidden, cfg.vocab
    sizes = {"H": H, "d": d, "F": F, "V": V, "heads": cfg.heads, "kv_heads": cfg.kv_heads}
    listed = {}
    for key, shape in re.findall(r"^\s{4}(\S+\.weight)\s+\(([^)]*)\)", llama.__doc__, re.M):
        dims = [eval(dim.replace("·", "*"), {}, sizes) for dim in shape.split(",") if dim.strip()]
        for n in range(cfg.layers) if "{n}" in key else [None]:
            listed[key.replace("{n}", str(n))] = tuple(dims)
    model = build_model(cfg)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == listed
    assert model.lm_head.weight is model.wte.weight  # tied: one tensor under both names
    assert "lm_head.weight" not in dict(model.named_parameters())  # trained once


def test_stages_hold_the_whole_models_weights_under_its_names():
    cfg = small(layers=4)
    whole = build_model(cfg, seed=5).state_dict()
    joined = {}
    for stage in range(2):
        joined.update(build_model(cfg, stage, 2, seed=5).state_dict())
    assert joined.keys() == whole.keys() and all(torch.equal(joined[k], whole[k]) for k in whole)
    # Tied across two stages: each holds the matrix, with the same values (tests/engine/test_tied.py trains it).
    tied = small(layers=4, tie_embeddings=True)
    first, last = build_model(tied, 0, 2, seed=5), build_model(tied, 1, 2, seed=5)
    assert torch.equal(first.wte.weight, last.lm_head.weight)
    assert torch.equal(first.wte.weight, build_model(tied, seed=5).wte.weight)


def sliced(model, tokens, sizes):
    caches = [KVCache(tokens.shape[1]) for _ in model.layer_ids]
    outs, start = [], 0
    for i in sizes:
        outs.append(model(tokens[:, start : start + i], start, caches))
        start += i
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_token_slices_with_rope_at_their_positions_equal_the_whole_sequence(kv_heads, monkeypatch):
    model = build_model(small(kv_heads=kv_heads), seed=1).double()
    tokens = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(0))
    whole = model(tokens)
    assert torch.allclose(sliced(model, tokens, [13, 1, 26]), whole, rtol=0, atol=1e-12)
    for m in model.modules():  # the negative control (`Controls.rope_absolute` False on a stage): positions restart
        if isinstance(m, llama.LlamaAttention):
            m.rope_local = True
    assert not torch.allclose(sliced(model, tokens, [13, 1, 26]), whole, rtol=0, atol=1e-3)


def test_the_cache_holds_kv_heads_heads():
    model = build_model(small(kv_heads=1), seed=1)
    caches = [KVCache(16) for _ in model.layer_ids]
    model(torch.zeros(3, 16, dtype=torch.long), 0, caches)
    assert caches[0].keys.shape == (3, 1, 16, 16)


def test_rope_is_the_rotate_half_convention():
    """Position p rotates the pair (x_k, x_{k+d/2}) by p·θ^(−2k/d) (transformers' Llama), so q·k depends only on the
    positions' difference."""
    cos, sin = llama.rope_angles(3, 1, 4, 100.0, torch.device("cpu"))
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])
    angle = torch.tensor([3.0, 3.0 / 10.0])  # θ^0 and θ^(−2/4) = 1/10
    expected = torch.cat(
        [x[..., :2] * angle.cos() - x[..., 2:] * angle.sin(), x[..., 2:] * angle.cos() + x[..., :2] * angle.sin()], -1
    )
    assert torch.allclose(llama.rotate(x, cos, sin), expected)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(p, s):
        return (
            llama.rotate(q, *llama.rope_angles(p, 1, 8, 10000.0, q.device))
            * llama.rotate(k, *llama.rope_angles(s, 1, 8, 10000.0, q.device))
        ).sum()

    assert torch.allclose(score(7, 2), score(105, 100))


@pytest.mark.parametrize("T", [2])
def test_llama_shards_gather_into_the_whole_tensors(T):
    """Rank r keeps query heads and key/value heads [r·n/T, (r+1)·n/T): its query heads read exactly its key/value
    heads; the shards gathered are the whole tensors; SPLITS names the cut parameters of every architecture."""
    from test_tensor_parallel import shard_and_gather

    from terapipe_cli.engine.tensor import SPLITS, split_of

    cfg = small(layers=1)
    state = build_model(cfg).state_dict()
    ranks = shard_and_gather(state, T)
    for name, full in state.items():
        assert all(torch.equal(whole[name], full) for _, whole in ranks), name
    d = cfg.head_dim
    assert torch.equal(ranks[1][0]["blocks.0.attn.k_proj.weight"], state["blocks.0.attn.k_proj.weight"][d : 2 * d])
    assert ranks[1][0]["blocks.0.attn.q_proj.weight"].shape == (2 * d, cfg.hidden)  # query heads 2, 3 read kv head 1
    others = [
        build_model(ModelConfig.from_dict({**BASE, "layers": 1, "arch": a}, "t", prefix="")) for a in ("gpt", "gpt2")
    ]
    cut = {
        n.removeprefix("blocks.0.")
        for names in (state, *(m.state_dict() for m in others))
        for n in names
        if split_of(n)
    }
    assert cut == set(SPLITS)


def test_repeated_key_value_heads_equal_grouped_query_attention():
    """What `attention.expand_for_kernel` does on CUDA in fp32 (each key/value head repeated for its group) gives the
    same output and gradients as the kernels' grouped-query mode."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(y.square().sum(), (q, k, v))
    k2, v2 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    y2 = torch.nn.functional.scaled_dot_product_attention(q, k2, v2, is_causal=True)
    assert torch.allclose(y, y2) and all(
        torch.allclose(a, b) for a, b in zip(grads, torch.autograd.grad(y2.square().sum(), (q, k, v)), strict=True)
    )


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama31_rope_scaling_computes_transformers_logits_whole_and_in_token_slices(tmp_path, tied):
    """A tiny LlamaForCausalLM with Llama 3.1's rope_scaling, its original_max_position_embeddings (16) short enough
    that every band of the scaling bites at L = 64 (wavelengths 6.3: blended, 63, 628, 6283: slowed 8×): read from
    its folder (`load_model_config`) and given its weights, terapipe's Llama computes transformers' logits (fp32,
    1e-4) on the whole sequence and token slice by token slice through the K/V cache; without the scaling it does
    not (the negative control)."""
    from hf_models import saved, terapipe_model

    scaling = {**LLAMA31, "original_max_position_embeddings": 16}
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=tied, rope_scaling=scaling)  # fmt: skip
    theirs = saved(tmp_path, "LlamaForCausalLM", **config)
    cfg = load_model_config(tmp_path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position_embeddings == 16
    assert (cfg.seq_len, cfg.tie_embeddings, cfg.kv_heads) == (64, tied, 2)
    ours = terapipe_model(theirs, cfg)
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sliced(ours, tokens, [13, 1, 26, 24]), expected, rtol=1e-4, atol=1e-5)
        plain = terapipe_model(theirs, replace(cfg, rope_scaling=None))
        assert not torch.allclose(plain(tokens), expected, rtol=1e-4, atol=1e-5)


def test_the_scaled_frequencies_are_the_three_bands():
    """Llama 3.1 8B's frequencies (head_dim 128, θ = 500000, original 8192): wavelengths under 2048 kept, over 8192
    divided by 8, between them blended — monotone, from f/8 at the long end to f at the short one."""
    cfg = load_model_config("llama3.1-8b")
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, 128, 2).float() / 128)
    scaled = llama.scaled_frequencies(plain, cfg.rope_scaling)
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert torch.equal(scaled[short], plain[short]) and torch.allclose(scaled[long], plain[long] / 8)
    between = ~short & ~long
    ratio = scaled[between] / plain[between]
    assert between.sum() > 0 and ((ratio > 1 / 8) & (ratio < 1)).all() and (ratio.diff() < 0).all()


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        (
            {**LLAMA31, "rope_type": "yarn", "original_max_position_embeddings": 8},
            "rope_scaling.rope_type' must be 'llama3'",
        ),
        ({**LLAMA31, "factor": 0.5, "original_max_position_embeddings": 8}, "rope_scaling.factor' must be at least 1"),
        ({**LLAMA31, "high_freq_factor": 1.0, "original_max_position_embeddings": 8}, "high_freq_factor' must exceed"),
        (LLAMA31, "rope_scaling.original_max_position_embeddings' is missing"),
        ({**LLAMA31, "original_max_position_embeddings": 8, "beta": 1}, "rope_scaling.beta' is not a setting"),
        (8.0, "field 'rope_scaling' must be an object"),
    ],
)
def test_bad_rope_scaling_is_one_line_naming_the_field(scaling, message):
    with pytest.raises(UserError) as err:
        small(rope_scaling=scaling)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_rope_scaling_is_a_toml_table_and_round_trips(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(
        '[model]\nname = "m"\narch = "llama"\nlayers = 2\nhidden = 64\nheads = 4\nffn_hidden = 96\nvocab = 50\n'
        'seq_len = 64\nrope_scaling = {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0, '
        "high_freq_factor = 4.0, original_max_position_embeddings = 16}\n"
    )
    cfg = load_model_config(path)
    assert cfg.rope_scaling.factor == 8.0 and ModelConfig.from_dict(cfg.to_dict(), "round trip", prefix="") == cfg
    assert "rope_scaling" not in small().to_dict()  # a model without it records what it did before
    assert ModelConfig.from_dict(cfg.to_dict(), "model.pt") == cfg  # by hand, as `terapipe export`'s docstring shows
