"""A `transformers` folder as a model (`config.model.model_from_transformers`): the architectures terapipe computes are
read through the registry (Llama with Llama 3.1's rope_scaling, tied or not; Mistral without a sliding window in
effect; GPT-2), every other architecture or setting is refused in one line naming it; `--model DIR` works wherever
a model is named. The folders are tiny random models written by ``save_pretrained`` in the test, never downloaded."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from conftest import assert_one_line_error, run_cli
from hf_models import saved

from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.config.model import load_model_config, model_from_transformers
from terapipe_cli.errors import UserError
from terapipe_cli.models import Gpt2Config, LlamaConfig

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5)  # fmt: skip
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}  # fmt: skip
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=48)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_llama_folder_with_rope_scaling(tmp_path, tied):
    saved(tmp_path / "Tiny-Llama-3.1", "LlamaForCausalLM", **LLAMA, tie_word_embeddings=tied, rope_scaling=LLAMA31)
    cfg = load_model_config(tmp_path / "Tiny-Llama-3.1")
    assert cfg == LlamaConfig(
        name="Tiny-Llama-3.1", layers=2, hidden=32, heads=4, vocab=64, seq_len=64, kv_heads=2,
        ffn_hidden=48, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=tied, rope_scaling=cfg.rope_scaling,
    )  # fmt: skip
    assert cfg.to_dict()["rope_scaling"] == LLAMA31
    # Its config.json named directly; a TOML naming the folder, with its own name and a shorter seq_len.
    assert load_model_config(tmp_path / "Tiny-Llama-3.1" / "config.json") == cfg
    toml = tmp_path / "mine.toml"
    toml.write_text('[model]\ntransformers = "Tiny-Llama-3.1"\nname = "mine"\nseq_len = 32\n')
    short = load_model_config(toml)
    assert (short.name, short.seq_len, short.rope_scaling) == ("mine", 32, cfg.rope_scaling)


def test_transformers_4_config_json_rope_theta_and_rope_scaling(tmp_path):
    """Meta's Llama-3.1-8B config.json as transformers 4 wrote it (rope_theta and rope_scaling apart, not v5's
    rope_parameters): read as the bundled llama3.1-8b at its 128K context."""
    meta = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(meta))
    cfg = model_from_transformers(tmp_path / "config.json", name="llama3.1-8b-L128k")
    assert cfg == load_model_config("llama3.1-8b-L128k")
    assert model_from_transformers(tmp_path, seq_len=8192, name="llama3.1-8b") == load_model_config("llama3.1-8b")


def test_a_mistral_folder_without_a_sliding_window_in_effect(tmp_path):
    saved(tmp_path / "m", "MistralForCausalLM", **LLAMA, sliding_window=None)
    cfg = load_model_config(tmp_path / "m")
    assert (cfg.arch, cfg.kv_heads, cfg.rope_theta, cfg.rope_scaling) == ("llama", 2, 500000.0, None)
    saved(tmp_path / "w", "MistralForCausalLM", **LLAMA, sliding_window=64)  # as long as the sequence: no effect
    assert load_model_config(tmp_path / "w").seq_len == 64
    with pytest.raises(UserError) as err:
        model_from_transformers(tmp_path / "w", seq_len=65)
    assert "field 'sliding_window' is 64" in str(err.value) and "\n" not in str(err.value)


def test_a_gpt2_folder(tmp_path):
    saved(tmp_path / "gpt2-tiny", "GPT2LMHeadModel", **GPT2)
    cfg = load_model_config(tmp_path / "gpt2-tiny")
    assert cfg == Gpt2Config(name="gpt2-tiny", layers=2, hidden=32, heads=4, vocab=64, seq_len=48, tie_embeddings=True)
    assert model_from_transformers(tmp_path / "gpt2-tiny", seq_len=32).seq_len == 32
    # A model is its architecture and shapes, not its folder's name: a copy elsewhere is the same model.
    shutil.copytree(tmp_path / "gpt2-tiny", tmp_path / "copy")
    copy = load_model_config(tmp_path / "copy")
    assert copy.name == "copy" and copy == cfg and copy.difference(cfg) is None
    untied = replace(cfg, tie_embeddings=False)
    assert untied != cfg and cfg.difference(untied) == ("tie_embeddings", False, True)
    with pytest.raises(UserError, match="field 'n_positions' is 48: the position table holds no place for 64"):
        model_from_transformers(tmp_path / "gpt2-tiny", seq_len=64)


def _refused(folder, *words):
    with pytest.raises(UserError) as err:
        load_model_config(folder)
    message = str(err.value)
    assert "\n" not in message and str(folder) in message, message
    for word in words:
        assert word in message, message


def test_other_architectures_and_settings_are_refused_naming_them(tmp_path):
    import transformers

    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=4, intermediate_size=48))  # fmt: skip
    bert.save_pretrained(tmp_path / "bert")
    _refused(tmp_path / "bert", "field 'architectures'", "BertModel", "LlamaForCausalLM")
    saved(tmp_path / "g", "GPT2LMHeadModel", **GPT2, scale_attn_by_inverse_layer_idx=True)
    _refused(tmp_path / "g", "field 'scale_attn_by_inverse_layer_idx' is True", "cannot compute this model exactly")
    saved(tmp_path / "relu", "GPT2LMHeadModel", **GPT2, activation_function="relu")
    _refused(tmp_path / "relu", "field 'activation_function' is 'relu'")
    saved(tmp_path / "b", "LlamaForCausalLM", **LLAMA, attention_bias=True)
    _refused(tmp_path / "b", "field 'attention_bias' is True")
    saved(tmp_path / "y", "LlamaForCausalLM", **LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0})
    _refused(tmp_path / "y", "field 'rope_parameters' is 'linear'")
    saved(tmp_path / "d", "LlamaForCausalLM", **LLAMA, head_dim=16)
    _refused(tmp_path / "d", "field 'head_dim' is 16")
    saved(tmp_path / "gelu", "LlamaForCausalLM", **LLAMA, hidden_act="gelu")
    _refused(tmp_path / "gelu", "field 'hidden_act' is 'gelu'")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", "folder without a config.json")
    (tmp_path / "x.json").write_text("[1]")
    _refused(tmp_path / "x.json", "expected a JSON object")


def test_model_dir_wherever_a_model_is_named(tmp_path, capsys):
    """`terapipe profile --analytic --model DIR`, and an experiment whose model is a folder."""
    folder = tmp_path / "Tiny-Llama"
    saved(folder, "LlamaForCausalLM", **LLAMA, rope_scaling=LLAMA31)
    out = tmp_path / "p.json"
    p = run_cli(capsys, "profile", "--analytic", "--hardware", "h100", "--model", folder, "--token-step", "16",
                "--out", out)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["model"]["rope_scaling"] == LLAMA31
    experiment = tmp_path / "e.toml"
    experiment.write_text(
        '[experiment]\nname = "e"\nmodel = "Tiny-Llama"\nhardware = "h100.toml"\ngpus = 2\nbatch_size = 2\n'
        "stages = 2\ndata_parallel = 1\ntensor_parallel = 1\n"
    )
    from terapipe_cli.config.bundled import find_config

    (tmp_path / "h100.toml").write_text(find_config("h100", "hardware", "--hardware").read_text())
    assert load_experiment(experiment).model == load_model_config(folder)
    saved(tmp_path / "g", "GPT2LMHeadModel", **GPT2, reorder_and_upcast_attn=True)
    p = run_cli(capsys, "profile", "--analytic", "--hardware", "h100", "--model", tmp_path / "g", "--out", out)
    assert_one_line_error(p, "reorder_and_upcast_attn")
