"""A plain GPT decoder (nanoGPT-style) whose attention can read the keys/values of earlier token slices.

The only idea beyond nanoGPT: a token slice of ``i`` tokens that starts after ``j`` earlier tokens attends over
``[keys/values of the j earlier tokens] + [its own i tokens, causally]``. Causality means position t needs
only positions <= t, so a sequence can be cut into slices and run slice by slice with exactly the result of
running it whole (TeraPipe, docs/design.md §1 and §6). The model knows nothing else about pipelining: `GPT(cfg, stage,
stages)` simply builds the part of the model that one pipeline stage owns; `GPT(cfg)` is the whole model.

Weights are initialised per component from the seed (embedding, each layer by its global index, head), so
stage k of a K-stage split holds exactly the weights of the same layers of the one-stage model, for any K.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from terapipe_cli.config import ModelConfig

# Per-component seed offsets: the embedding, layer l (l + _LAYER), and the final norm + head.
_EMBED, _HEAD, _LAYER = 1, 2, 16

KV = tuple[torch.Tensor, torch.Tensor]

_MASKS: dict[tuple[int, int, str], torch.Tensor] = {}


def context_mask(i: int, j: int, device: torch.device) -> torch.Tensor:
    """Boolean (i, j + i) mask: every one of the j context columns, then causal within the slice.

    SDPA's ``is_causal`` aligns the triangle to the top-left corner, which is wrong once there is context
    (the slice's first token must see all j earlier ones), so the mask is explicit — and cached, because
    every layer of every tile of the same shape asks for the same one.
    """
    key = (i, j, str(device))
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) > 256:
            _MASKS.clear()
        mask = _MASKS[key] = torch.ones(i, j + i, dtype=torch.bool, device=device).tril(j)
    return mask


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.hidden = cfg.heads, cfg.hidden
        # No biases in the linear layers (nanoGPT's bias=False). A key bias has an exactly zero gradient
        # (softmax ignores a shift shared by all keys), so AdamW would turn its rounding noise into updates.
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, context: list[KV] | None = None) -> tuple[torch.Tensor, ...]:
        """x: (b, i, H); context: the (k, v) of earlier slices, each (b, heads, j_s, head_dim).

        Returns the output and this slice's own k, v so that later slices can use them as context.
        """
        b, i, _ = x.shape
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q, k, v = (t.view(b, i, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if context:
            # Attend over the earlier slices' keys/values followed by our own (causal within the slice).
            keys = torch.cat([c[0] for c in context] + [k], dim=2)
            values = torch.cat([c[1] for c in context] + [v], dim=2)
            j = keys.shape[2] - i
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=context_mask(i, j, x.device))
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, i, self.hidden)
        return self.proj(y), k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN decoder layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, context: list[KV] | None = None) -> tuple[torch.Tensor, ...]:
        a, k, v = self.attn(self.ln_1(x), context)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, k, v


def stage_layer_range(cfg: ModelConfig, stage: int, stages: int) -> range:
    """Stage k owns layers [k·N/K, (k+1)·N/K) (docs/design.md §6)."""
    per = cfg.stage_layers(stages)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")
    return range(stage * per, (stage + 1) * per)


class GPT(nn.Module):
    """The part of the model that pipeline stage ``stage`` of ``stages`` owns (the whole model by default).

    Stage 0 also holds the token and position embeddings; the last stage the final LayerNorm and LM head.
    Layers are kept under their global index (``blocks.5...``) so parameter names match the whole model's.
    """

    def __init__(self, cfg: ModelConfig, stage: int = 0, stages: int = 1, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.layer_ids = list(stage_layer_range(cfg, stage, stages))
        if self.first:
            self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleDict({str(n): Block(cfg) for n in self.layer_ids})
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """nanoGPT's init (normal 0.02, residual projections scaled by 1/sqrt(2N)), seeded per component."""

        def gen(offset: int) -> torch.Generator:
            return torch.Generator().manual_seed(seed * 1_000_003 + offset)

        def normal_(t: torch.Tensor, g: torch.Generator, std: float = 0.02) -> None:
            t.copy_(torch.randn(t.shape, generator=g) * std)

        if self.first:
            g = gen(_EMBED)
            normal_(self.wte.weight, g)
            normal_(self.wpe.weight, g)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for n in self.layer_ids:
            g = gen(_LAYER + n)
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
            normal_(self.lm_head.weight, gen(_HEAD))

    def embed(self, tokens: torch.Tensor, token_start: int = 0) -> torch.Tensor:
        """Token + position embedding; a slice's positions are absolute (token_start + arange(i))."""
        pos = torch.arange(token_start, token_start + tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)

    def forward(
        self,
        x: torch.Tensor,
        token_start: int = 0,
        context: list[list[KV]] | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Run this stage's part on one slice.

        x: (b, i) token ids on stage 0, else the (b, i, H) activation from the previous stage.
        context: per layer of this stage, the (k, v) of the earlier slices of the same sequences.
        Returns the output — (b, i, H), or logits (b, i, vocab) on the last stage — and this slice's (k, v)
        per layer.
        """
        h = self.embed(x, token_start) if self.first else x
        kvs: list[KV] = []
        for idx, n in enumerate(self.layer_ids):
            h, k, v = self.blocks[str(n)](h, context[idx] if context else None)
            kvs.append((k, v))
        if self.last:
            h = self.lm_head(self.ln_f(h))
        return h, kvs


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy: the step divides by all predicted tokens of the step (docs/design.md §6)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
