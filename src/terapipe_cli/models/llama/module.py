"""A Llama-family decoder (``arch = "llama"``): RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention.

It is a `decoder.Decoder` as `gpt.module.GPT` is, with other layers: the same stage layout (`Llama(cfg, stage, stages)`
builds one stage's part), the same K/V cache per batch slice and layer (`models.attention.KVCache`, its gradient
hand-back), the same fused attention (`models.attention.attend`). Two things are new for token slices (docs/design.md
§6c):

- Rotary positions. A slice of ``i`` tokens after ``start`` earlier ones rotates its queries and keys by the
  angles of its absolute positions start … start + i − 1, so the keys in the cache carry the rotation of their own
  positions and every score is that of the whole sequence. The convention is ``transformers``' Llama (rotate-half:
  the first and second halves of each head's features are the pairs), so the q/k weights export unpermuted. Llama
  3.1's ``rope_scaling`` rescales the frequencies themselves (`scaled_frequencies`), before any position enters,
  so it holds at every slice's absolute positions alike.
- Grouped-query attention. ``kv_heads`` key/value heads, each read by ``heads / kv_heads`` query heads (query
  head h reads key/value head h // (heads / kv_heads), as ``transformers``' ``repeat_kv``). The cache holds only
  the kv_heads heads: kv_heads / heads of a multi-head model's bytes.

State dict of the single-device model (`Llama(cfg)`), H = hidden, d = head_dim = H / heads, F = ffn_hidden,
V = vocab, n = 0 … layers − 1. A stage's part holds the same keys for its own layers (layers keep their global
index), chunk 0 the embedding, the last chunk the final norm and head, so stages' state dicts join into this one:

    wte.weight                        (V, H)              token embedding
    blocks.{n}.attn_norm.weight       (H,)                RMSNorm before attention
    blocks.{n}.attn.q_proj.weight     (heads · d, H)      query heads, in order
    blocks.{n}.attn.k_proj.weight     (kv_heads · d, H)   key heads
    blocks.{n}.attn.v_proj.weight     (kv_heads · d, H)   value heads
    blocks.{n}.attn.o_proj.weight     (H, heads · d)
    blocks.{n}.mlp_norm.weight        (H,)                RMSNorm before the MLP
    blocks.{n}.mlp.gate_proj.weight   (F, H)
    blocks.{n}.mlp.up_proj.weight     (F, H)
    blocks.{n}.mlp.down_proj.weight   (H, F)              MLP: down(silu(gate(x)) · up(x))
    norm.weight                       (H,)                final RMSNorm
    lm_head.weight                    (V, H)              the same tensor as wte.weight when tie_embeddings

No biases anywhere. RMSNorm: x / sqrt(mean(x²) + norm_eps) · weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from terapipe_cli.models.attention import DocumentMask, KVCache, attend
from terapipe_cli.models.decoder import Decoder
from terapipe_cli.models.init import EMBED_SEED, HEAD_SEED, LAYER_SEED, normal_, seeded
from terapipe_cli.models.llama.spec import RopeScaling
from terapipe_cli.models.spec import ModelConfig


def rope_angles(
    start: int, i: int, head_dim: int, theta: float, device: torch.device, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (i, head_dim) of positions start … start + i − 1, in fp32 (``transformers``' Llama: frequency
    θ^(−2k/d) for the pair (k, k + d/2), rescaled by ``scaling`` when given, the angle position · frequency)."""
    positions = torch.arange(start, start + i, device=device, dtype=torch.int64)
    return rope_angles_at(positions, head_dim, theta, scaling)


def rope_angles_at(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., head_dim) of the int64 ``positions`` (...), as `rope_angles`: any positions, such as each
    token's place in its own document."""
    device = positions.device
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim)
    if scaling is not None:
        inv_freq = scaled_frequencies(inv_freq, scaling)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def scaled_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rescaled frequencies (``rope_type = "llama3"``; Meta's reference code, as `transformers` computes
    them, in fp32): a pair whose wavelength 2π/f exceeds original / low_freq_factor turns ``factor`` times slower; one
    shorter than original / high_freq_factor is kept; between the two, the frequency is blended linearly in
    original/wavelength from f/factor (at the long end) to f (at the short end)."""
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    between = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(between, blended, slowed)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, i, d) rotated: x · cos + rotate_half(x) · sin, rotate_half(x) = (−x₂, x₁) of its two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions over the slice's context.

    ``rope_local = True`` (set on a stage's layers by `config.controls.Controls`' ``rope_absolute = False``) rotates by
    the slice-local positions 0 … i − 1 instead: a test-only negative control (the scores then differ from the whole
    sequence's wherever start > 0)."""

    rope_local = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0, docs: DocumentMask | None = None
    ) -> torch.Tensor:
        """x: (b, i, H), the tokens [start, start + i); ``cache`` and ``docs`` as in `CausalSelfAttention`'s
        (gpt/module.py)."""
        b, i, _ = x.shape
        q = self.q_proj(x).view(b, i, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, i, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, i, self.kv_heads, self.head_dim).transpose(1, 2)
        # The slice's absolute positions: the keys it writes into the cache carry the rotation of their own place.
        position = 0 if self.rope_local else start
        if docs is None:
            cos, sin = rope_angles(position, i, self.head_dim, self.theta, x.device, self.rope_scaling)
        else:  # packed documents: each token at its place in its own document, (b, 1, i, d) over the heads
            angles = rope_angles_at(docs.positions, self.head_dim, self.theta, self.rope_scaling)
            cos, sin = (t[:, None] for t in angles)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = attend(q, k, v, cache, start, gqa=self.kv_heads != self.heads, docs=docs)
        return self.o_proj(y.transpose(1, 2).reshape(b, i, self.heads * self.head_dim))

    def split_heads(self, tensor_parallel: int) -> None:
        """Keep 1/T of the query heads and of the key/value heads (tensor parallelism, `engine.tensor.shard_module`):
        rank r's query heads read exactly rank r's key/value heads, so the groups stay whole."""
        self.heads //= tensor_parallel
        self.kv_heads //= tensor_parallel


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder layer with RMSNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0, docs: DocumentMask | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache, start, docs)
        return x + self.mlp(self.mlp_norm(x))


class Llama(Decoder):
    """The part of a Llama-family model that stage ``stage`` of ``stages`` owns (arguments as `decoder.Decoder`)."""

    def make_parts(self, cfg: ModelConfig) -> None:
        if self.first:
            self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleDict({str(n): LlamaBlock(cfg) for n in self.layer_ids})
        if self.last:
            self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)  # the embedding's when tied (`Decoder`)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """As `gpt.module.GPT`'s: normal 0.02, the residual outputs (o_proj, down_proj) by 1/sqrt(2N), norms 1."""
        if self.first:
            normal_(self.wte.weight, seeded(seed, EMBED_SEED))
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for n in self.layer_ids:
            g = seeded(seed, LAYER_SEED + n)
            for name, p in self.blocks[str(n)].named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    normal_(p, g, residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
        if self.last:
            self.norm.weight.fill_(1.0)
            if not self.cfg.tie_embeddings:
                normal_(self.lm_head.weight, seeded(seed, HEAD_SEED))
            elif not self.first:  # the tied matrix's copy on the last stage (`Decoder.tied_copy`)
                normal_(self.lm_head.weight, seeded(seed, EMBED_SEED))

    def embed(self, tokens: torch.Tensor, token_start: int = 0, docs: DocumentMask | None = None) -> torch.Tensor:
        """Token embedding only: positions enter as rotations inside attention."""
        return self.wte(tokens)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)
