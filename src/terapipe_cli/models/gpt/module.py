"""A plain GPT decoder (nanoGPT-style) whose attention can read the keys/values of earlier token slices.

The only idea beyond nanoGPT: a token slice of ``i`` tokens that starts after ``j`` earlier tokens attends over
``[keys/values of the j earlier tokens] + [its own i tokens, causally]``. Causality means position t needs
only positions <= t, so a sequence can be cut into slices and run slice by slice with exactly the result of
running it whole (TeraPipe, docs/design.md §1 and §6). The model knows nothing else about pipelining: `GPT(cfg, stage,
stages)` simply builds the part of the model that one pipeline stage owns (the layout every family shares,
`decoder.Decoder`); `GPT(cfg)` is the whole model.
`GPT2` (``arch = "gpt2"``) is the same decoder as GPT-2 has it: biases, the tanh GELU, the head tied to the embedding.

Weights are initialised per component from the seed (models/init.py), so stage k of a K-stage split holds exactly
the weights of the same layers of the one-stage model, for any K. `terapipe_cli.models.build_model` builds the
architecture the config names (its arch spec's ``module``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from terapipe_cli.models.attention import DocumentMask, KVCache, attend
from terapipe_cli.models.decoder import Decoder
from terapipe_cli.models.init import EMBED_SEED, HEAD_SEED, LAYER_SEED, normal_, seeded
from terapipe_cli.models.spec import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool = False) -> None:
        super().__init__()
        self.heads, self.hidden = cfg.heads, cfg.hidden
        # GPT: no biases in the linear layers (nanoGPT's bias=False). A key bias has an exactly zero gradient
        # (softmax ignores a shift shared by all keys), so AdamW would turn its rounding noise into updates.
        # GPT-2 has them all (`GPT2`).
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0, docs: DocumentMask | None = None
    ) -> torch.Tensor:
        """x: (b, i, H), the tokens [start, start + i) of a slice; ``cache`` holds the keys/values of the same
        sequences' earlier tokens [0, start) and receives this slice's (None: the whole sequence, no cache);
        ``docs``: packed documents, attended block-causally (`attention.DocumentMask`)."""
        b, i, _ = x.shape
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q, k, v = (t.view(b, i, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v, cache, start, docs=docs)
        y = y.transpose(1, 2).reshape(b, i, self.hidden)
        return self.proj(y)

    def split_heads(self, tensor_parallel: int) -> None:
        """Keep 1/T of the heads (tensor parallelism, `engine.tensor.shard_module`)."""
        self.heads //= tensor_parallel
        self.hidden //= tensor_parallel


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool = False, gelu: str = "none") -> None:
        super().__init__()
        self.gelu = gelu  # F.gelu's approximate: "none" (erf, GPT's) or "tanh" (GPT-2's gelu_new)
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=bias)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.gelu))


class Block(nn.Module):
    """Pre-LN decoder layer."""

    def __init__(self, cfg: ModelConfig, bias: bool = False, gelu: str = "none") -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, bias)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, bias, gelu)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0, docs: DocumentMask | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, start, docs)
        return x + self.mlp(self.ln_2(x))


class GPT(Decoder):
    """The GPT decoder in the stage layout of `decoder.Decoder` (same arguments): chunk 0 holds the token and position
    embeddings, the last chunk the final LayerNorm and the LM head."""

    bias = False  # biases in the linear layers
    gelu = "none"  # the MLP's GELU (F.gelu's approximate)

    def make_parts(self, cfg: ModelConfig) -> None:
        """Chunk 0's embeddings, the layers (``self.blocks``), the last chunk's final norm and LM head."""
        if self.first:
            self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleDict({str(n): Block(cfg, self.bias, self.gelu) for n in self.layer_ids})
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """nanoGPT's init (normal 0.02, residual projections scaled by 1/sqrt(2N)), seeded per component."""
        if self.first:
            g = seeded(seed, EMBED_SEED)
            normal_(self.wte.weight, g)
            normal_(self.wpe.weight, g)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for n in self.layer_ids:
            g = seeded(seed, LAYER_SEED + n)
            for name, p in self.blocks[str(n)].named_parameters():
                if name.startswith("ln_"):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    normal_(p, g, residual_std if name.endswith("proj.weight") else 0.02)
        if self.last:
            self.ln_f.weight.fill_(1.0)
            self.ln_f.bias.zero_()
            if not self.cfg.tie_embeddings:
                normal_(self.lm_head.weight, seeded(seed, HEAD_SEED))
            elif not self.first:  # the tied matrix's copy on the last stage: the embedding's values (drawn first)
                normal_(self.lm_head.weight, seeded(seed, EMBED_SEED))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last chunk's final norm: the LM head's input."""
        return self.ln_f(h)

    def embed(self, tokens: torch.Tensor, token_start: int = 0, docs: DocumentMask | None = None) -> torch.Tensor:
        """Token + position embedding; a slice's positions are absolute (token_start + arange(i)), or with packed
        documents each token's place in its own document."""
        pos = torch.arange(token_start, token_start + tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos if docs is None else docs.positions)


class GPT2(GPT):
    """GPT-2 exactly (``arch = "gpt2"``, `transformers`' GPT2LMHeadModel): `GPT` with a bias in every linear layer
    (zero at initialisation), the tanh GELU, and by default the head tied to the token embedding."""

    bias = True
    gelu = "tanh"
