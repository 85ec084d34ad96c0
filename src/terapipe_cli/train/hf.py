"""``terapipe export --format hf``: a run's model as a Hugging Face ``transformers`` folder.

    OUT/config.json          the model's `transformers` config (LlamaConfig or GPT2Config), by ``save_pretrained``
    OUT/model.safetensors    its weights under `transformers`' names, fp32 (metadata: terapipe's step and run)

``AutoModelForCausalLM.from_pretrained(OUT)`` loads it — a ``LlamaForCausalLM`` for ``arch = "llama"``, a
``GPT2LMHeadModel`` for ``arch = "gpt"`` — with no missing or unexpected keys, and its logits equal the single-device
model's (tests/train/test_hf_export.py). The names are one table per architecture (``{n}``: a layer's global index),
also in docs/design.md (§6c):

- llama (`LLAMA_KEYS`): the same tensors under `transformers`' names. No permutation: terapipe's RoPE is the
  rotate-half convention of `transformers`' Llama (`engine.llama`). A tied head (``tie_embeddings``) is written
  once, as the embedding (``tie_word_embeddings = true``).
- gpt (`GPT2_KEYS`): GPT-2's computation with three differences the folder absorbs exactly: no biases in terapipe's
  linear layers (GPT-2 has them: written as zeros, `GPT2_ZERO_BIASES`), the exact erf GELU
  (``activation_function = "gelu"``, not GPT-2's tanh approximation ``gelu_new``), and an LM head of its own
  (``tie_word_embeddings = false``). GPT-2's ``Conv1D`` stores a linear layer's weight as (in, out): transposed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from terapipe_cli.config.model import ModelConfig
from terapipe_cli.errors import UserError
from terapipe_cli.extras import require

GPT2_EOT = 50256  # GPT-2 BPE's <|endoftext|>: the configs' bos/eos id, kept only where the vocabulary holds it

# (terapipe name, transformers name, transposed): every weight of the model, once.
LLAMA_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("wte.weight", "model.embed_tokens.weight", False),
    ("blocks.{n}.attn_norm.weight", "model.layers.{n}.input_layernorm.weight", False),
    ("blocks.{n}.attn.q_proj.weight", "model.layers.{n}.self_attn.q_proj.weight", False),
    ("blocks.{n}.attn.k_proj.weight", "model.layers.{n}.self_attn.k_proj.weight", False),
    ("blocks.{n}.attn.v_proj.weight", "model.layers.{n}.self_attn.v_proj.weight", False),
    ("blocks.{n}.attn.o_proj.weight", "model.layers.{n}.self_attn.o_proj.weight", False),
    ("blocks.{n}.mlp_norm.weight", "model.layers.{n}.post_attention_layernorm.weight", False),
    ("blocks.{n}.mlp.gate_proj.weight", "model.layers.{n}.mlp.gate_proj.weight", False),
    ("blocks.{n}.mlp.up_proj.weight", "model.layers.{n}.mlp.up_proj.weight", False),
    ("blocks.{n}.mlp.down_proj.weight", "model.layers.{n}.mlp.down_proj.weight", False),
    ("norm.weight", "model.norm.weight", False),
    ("lm_head.weight", "lm_head.weight", False),  # left out when tied to the embedding
)
GPT2_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("wte.weight", "transformer.wte.weight", False),
    ("wpe.weight", "transformer.wpe.weight", False),
    ("blocks.{n}.ln_1.weight", "transformer.h.{n}.ln_1.weight", False),
    ("blocks.{n}.ln_1.bias", "transformer.h.{n}.ln_1.bias", False),
    ("blocks.{n}.attn.qkv.weight", "transformer.h.{n}.attn.c_attn.weight", True),  # q, k, v in the same order
    ("blocks.{n}.attn.proj.weight", "transformer.h.{n}.attn.c_proj.weight", True),
    ("blocks.{n}.ln_2.weight", "transformer.h.{n}.ln_2.weight", False),
    ("blocks.{n}.ln_2.bias", "transformer.h.{n}.ln_2.bias", False),
    ("blocks.{n}.mlp.fc.weight", "transformer.h.{n}.mlp.c_fc.weight", True),
    ("blocks.{n}.mlp.proj.weight", "transformer.h.{n}.mlp.c_proj.weight", True),
    ("ln_f.weight", "transformer.ln_f.weight", False),
    ("ln_f.bias", "transformer.ln_f.bias", False),
    ("lm_head.weight", "lm_head.weight", False),
)
# GPT-2's linear biases, which terapipe's model does not have, written as zeros: (name, width in units of the
# hidden size H, or None for the MLP's inner width).
GPT2_ZERO_BIASES: tuple[tuple[str, int | None], ...] = (
    ("transformer.h.{n}.attn.c_attn.bias", 3),
    ("transformer.h.{n}.attn.c_proj.bias", 1),
    ("transformer.h.{n}.mlp.c_fc.bias", None),
    ("transformer.h.{n}.mlp.c_proj.bias", 1),
)

WHERE = "--format hf"


def require_hf() -> None:
    """Both packages the folder needs, checked before anything is read or written."""
    require("transformers", where=WHERE)
    require("safetensors", where=WHERE)


def _names(pattern: str, layers: int) -> list[tuple[int | None, str]]:
    return [(n, pattern.format(n=n)) for n in range(layers)] if "{n}" in pattern else [(None, pattern)]


def hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the single-device model's) under `transformers`' names, fp32, each tensor its own storage."""
    table = LLAMA_KEYS if cfg.llama else GPT2_KEYS
    tied = cfg.llama and cfg.tie_embeddings
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for ours, theirs, transposed in table:
        for n, name in _names(ours, cfg.layers):
            used.add(name)
            if tied and name == "lm_head.weight":
                continue
            t = state[name].detach().float()
            out[theirs.format(n=n)] = (t.t() if transposed else t).contiguous().clone()
    if used != set(state):
        raise ValueError(f"weights the {cfg.arch} table does not name: {sorted(set(state) - used)[:3]}")
    if not cfg.llama:
        for pattern, width in GPT2_ZERO_BIASES:
            for _, name in _names(pattern, cfg.layers):
                out[name] = torch.zeros(cfg.mlp_ratio * cfg.hidden if width is None else width * cfg.hidden)
    return out


def hf_config(cfg: ModelConfig):
    """The `transformers` config of ``cfg``: a LlamaConfig, or a GPT2Config made terapipe's GPT (module docstring)."""
    transformers = require("transformers", where=WHERE)
    eot = GPT2_EOT if cfg.vocab > GPT2_EOT else None
    if cfg.llama:
        return transformers.LlamaConfig(
            vocab_size=cfg.vocab,
            hidden_size=cfg.hidden,
            intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=eot,
            eos_token_id=eot,
            architectures=["LlamaForCausalLM"],
        )
    return transformers.GPT2Config(
        vocab_size=cfg.vocab,
        n_positions=cfg.seq_len,
        n_embd=cfg.hidden,
        n_layer=cfg.layers,
        n_head=cfg.heads,
        n_inner=cfg.mlp_ratio * cfg.hidden,
        activation_function="gelu",
        layer_norm_epsilon=1e-5,  # torch.nn.LayerNorm's default, which terapipe's LayerNorms use
        resid_pdrop=0.0,  # terapipe trains without dropout
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=eot,
        eos_token_id=eot,
        architectures=["GPT2LMHeadModel"],
    )


def check_output_folder(out: Path) -> None:
    """``--out`` must be a new folder (or an empty one) whose parent exists and is writable: one line otherwise,
    before anything is read."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; --format hf writes a folder (config.json, model.safetensors)", where="--out")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"folder {out} is not empty; give a new or an empty folder", where="--out")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise UserError(f"folder {parent} does not exist", where="--out")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write into folder {parent}", where="--out")


def write_hf(out: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], *, step: int, run: Path) -> None:
    """Write the folder: into a hidden temporary folder beside ``out``, renamed to ``out`` once whole, so a
    failure at any point leaves nothing behind (the temporary folder is removed)."""
    require_hf()
    safetensors_torch = require("safetensors.torch", where=WHERE)
    config, tensors = hf_config(cfg), hf_state(cfg, state)
    out = out.resolve()
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir()
        config.save_pretrained(tmp)
        metadata = {"format": "pt", "terapipe_step": str(step), "terapipe_run": str(run.resolve())}
        safetensors_torch.save_file(tensors, tmp / "model.safetensors", metadata=metadata)
        if out.is_dir():
            out.rmdir()  # empty (checked); a folder that filled since makes this fail, and tmp goes
        tmp.rename(out)
    except OSError as e:  # a full disk, a folder made meanwhile: one line, nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write {out} ({e.strerror or e}); nothing was written", where="--out") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
