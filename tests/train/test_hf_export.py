"""`terapipe export --format hf`: `transformers` loads the folder with no missing or unexpected keys and computes the
single-device model's logits; the folder is written whole or not at all; `terapipe_cli.load_exported` for both
architectures; the optional packages named in one line when they are missing."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
import transformers  # an optional extra that the test set-up installs (pip install -e '.[test]')
from conftest import assert_one_line_error, run_cli, tiny_model
from fake_runs import checkpointed_run

import terapipe_cli
from terapipe_cli.models import Gpt2Config, LlamaConfig, ModelConfig, build_model


def llama(**changes) -> ModelConfig:
    """A tiny Llama-family model with grouped-query attention (4 query heads, 2 key/value heads) and a base other
    than the default (so the exported rope_theta is checked)."""
    base = dict(name="test-llama", layers=2, hidden=32, heads=4, vocab=256, seq_len=32, kv_heads=2, ffn_hidden=48,
                rope_theta=500000.0, norm_eps=1e-5)  # fmt: skip
    return LlamaConfig(**{**base, **changes})


def exported(tmp_path, capsys, cfg: ModelConfig, *, stages: int = 2):
    run = checkpointed_run(tmp_path / "run", cfg, stages=stages)
    out = tmp_path / "hf"
    p = run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temporary folder left
    return out


def loaded(cls, folder):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    return model.eval()


def assert_same_logits(theirs, cfg: ModelConfig) -> torch.Tensor:
    """Logits of every position of two sequences of the whole length L (RoPE at positions up to L − 1)."""
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    ours = build_model(cfg, seed=1).eval()
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    return tokens


@pytest.mark.parametrize("cfg", [llama(), llama(kv_heads=4, tie_embeddings=True)], ids=["gqa", "tied"])
def test_llama_for_causal_lm_loads_the_folder_and_computes_the_same_logits(tmp_path, capsys, cfg):
    folder = exported(tmp_path, capsys, cfg, stages=1 if cfg.tie_embeddings else 2)
    theirs = loaded(transformers.LlamaForCausalLM, folder)
    assert theirs.config.num_key_value_heads == cfg.kv_heads and theirs.config.tie_word_embeddings == cfg.tie_embeddings
    tokens = assert_same_logits(theirs, cfg)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(folder)).__name__ == "LlamaForCausalLM"

    # Negative control: the interleaved RoPE pairing (features 2k, 2k + 1; Meta's original checkpoints) instead of
    # rotate-half (k, k + d/2) — the q/k permutation a converter needs between the two — changes the logits beyond
    # the test's tolerance.
    d = cfg.head_dim
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    with torch.no_grad():
        for layer in theirs.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight.view(-1, d, cfg.hidden)
                proj.weight.copy_(w[:, perm].reshape(-1, cfg.hidden))
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            torch.testing.assert_close(theirs(tokens).logits, build_model(cfg, seed=1)(tokens), rtol=1e-4, atol=1e-5)


def test_gpt2_lm_head_model_loads_a_gpt_run_and_computes_the_same_logits(tmp_path, capsys):
    cfg = tiny_model(layers=2, seq_len=32)
    folder = exported(tmp_path, capsys, cfg)
    theirs = loaded(transformers.GPT2LMHeadModel, folder)
    assert theirs.config.activation_function == "gelu" and not theirs.config.tie_word_embeddings
    assert_same_logits(theirs, cfg)


@pytest.mark.parametrize("cfg", [tiny_model(layers=2, seq_len=32), llama()], ids=["gpt", "llama"])
def test_load_exported_from_the_package_top_level(tmp_path, capsys, cfg):
    run = checkpointed_run(tmp_path / "run", cfg)
    assert run_cli(capsys, "export", str(run), "--out", str(tmp_path / "m.pt")).returncode == 0
    model, info = terapipe_cli.load_exported(tmp_path / "m.pt")
    assert (info["step"], model.cfg, type(model), model.training) == (3, cfg, type(build_model(cfg)), False)
    tokens = torch.randint(0, cfg.vocab, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), build_model(cfg, seed=1)(tokens), rtol=0, atol=0)
    (tmp_path / "junk.pt").write_bytes(b"not torch")
    for path, words in ((tmp_path / "none.pt", "no such export file"), (tmp_path / "junk.pt", "not a terapipe export")):
        with pytest.raises(ValueError, match=words):
            terapipe_cli.load_exported(path)


def test_the_folder_is_new_and_written_whole(tmp_path, capsys, monkeypatch):
    run = checkpointed_run(tmp_path / "run", llama())
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    assert_one_line_error(run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(full)), "not empty")
    assert [f.name for f in full.iterdir()] == ["mine.txt"]
    assert_one_line_error(
        run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(full / "mine.txt")), "is a file"
    )
    assert_one_line_error(run_cli(capsys, "export", str(run), "--format", "onnx"), "--format", "pt or hf")
    assert_one_line_error(run_cli(capsys, "export", str(run), "--format", "hf", "--force", "--out", "x"), "--force")

    # A failure while writing (here: the disk fills at the weights) leaves no folder and no temporary one.
    import safetensors.torch

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "out" / "hf"  # its folder is made, as for the .pt export (and removed again here)
    p = run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(out))
    assert_one_line_error(p, "--out", "No space left on device", "nothing was written")
    assert not (tmp_path / "out").exists()
    deeper = tmp_path / "a" / "b" / "hf"
    assert_one_line_error(run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(deeper)), "does not exist")
    monkeypatch.undo()
    assert run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(out)).returncode == 0
    assert (out / "model.safetensors").is_file()
    # An empty folder is accepted, and filled.
    (tmp_path / "empty").mkdir()
    assert run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(tmp_path / "empty")).returncode == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


@pytest.mark.parametrize("missing", ["transformers", "safetensors"])
def test_a_missing_extra_is_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch, missing):
    run = checkpointed_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, missing, None)  # as in a Python without it
    out = tmp_path / "hf"
    p = run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(out))
    assert_one_line_error(p, "--format hf", repr(missing), "pip install 'terapipe-cli[hf]'", "pip install -e '.[hf]'")
    assert not out.exists()
    assert run_cli(capsys, "export", str(run), "--out", str(tmp_path / "m.pt")).returncode == 0  # pt needs neither


def gpt2(**changes) -> ModelConfig:
    base = dict(name="test-gpt2", layers=2, hidden=32, heads=4, vocab=256, seq_len=32)
    return Gpt2Config(**{**base, **changes})


@pytest.mark.parametrize("cfg", [gpt2(tie_embeddings=False), gpt2()], ids=["untied", "tied"])
def test_gpt2_lm_head_model_loads_a_gpt2_run_and_computes_the_same_logits(tmp_path, capsys, cfg):
    """arch = "gpt2" is GPT-2 itself: the tanh GELU (gelu_new), its biases, the head tied unless the model says."""
    folder = exported(tmp_path, capsys, cfg, stages=1 if cfg.tie_embeddings else 2)
    theirs = loaded(transformers.GPT2LMHeadModel, folder)
    assert theirs.config.activation_function == "gelu_new"
    assert theirs.config.tie_word_embeddings == cfg.tie_embeddings
    assert_same_logits(theirs, cfg)


TINY_GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        ("GPT2LMHeadModel", TINY_GPT2),
        ("GPT2LMHeadModel", {**TINY_GPT2, "tie_word_embeddings": False}),
        ("LlamaForCausalLM", dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  rope_theta=500000.0, tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    ],
    ids=["gpt2", "gpt2-untied", "llama3.1-tied"],
)  # fmt: skip
def test_a_transformers_model_computes_here_and_exports_back_to_the_same_tensors(tmp_path, cls, config):
    """docs/design.md §6c: a model read from a transformers folder computes transformers' logits (fp32, 1e-4), and
    exported again without training (`train.hf.write_hf`) the folder holds the same tensors, and reads back as the same
    model. Biases and norms are made nonzero first (`hf_models.saved`), so a wrong mapping of them shows."""
    import safetensors.torch
    from hf_models import saved, terapipe_model

    from terapipe_cli.config.model import load_model_config
    from terapipe_cli.train.hf import write_hf

    theirs = saved(tmp_path / "theirs", cls, **config)
    cfg = load_model_config(tmp_path / "theirs")
    ours = terapipe_model(theirs, cfg)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-5)
    write_hf(tmp_path / "again", cfg, ours.state_dict(), step=0, run=tmp_path)
    before = safetensors.torch.load_file(tmp_path / "theirs" / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert load_model_config(tmp_path / "again") == replace(cfg, name="again")
