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
from torch.nn.attention.bias import causal_lower_right

from terapipe_cli.config.model import ModelConfig
from terapipe_cli.plan.partition import Partition

# Per-component seed offsets: the embedding, layer l (l + _LAYER), and the final norm + head.
_EMBED, _HEAD, _LAYER = 1, 2, 16


class KVCache:
    """The keys and values of one batch slice at one layer, for the whole sequence; its slices fill it in order.

    A slice of ``i`` tokens starting at ``start`` writes its own k, v into rows ``[start, start + i)`` and attends
    over rows ``[0, start + i)`` — the earlier slices' keys/values are never copied again (docs/design.md §6).

    The K/V gradient hand-back: a slice's backward produces gradients for every row it read. Rows of earlier
    slices go into ``grad`` (summed over the later slices); the slice's own rows, plus what later slices left
    there, flow into its own graph. Backward runs in reverse token order, so when an earlier slice's turn comes
    every later slice has already handed its share back: each slice's graph is walked once, O(slices).
    ``handback=False`` drops the earlier rows' gradients: a test-only negative control.
    """

    def __init__(self, rows: int, *, handback: bool = True) -> None:
        self.rows = rows
        self.handback = handback
        self.keys: torch.Tensor | None = None  # (b, heads, rows, head_dim), allocated by the first slice
        self.values: torch.Tensor | None = None
        self.grad: tuple[torch.Tensor, torch.Tensor] | None = None  # gradients handed back to earlier rows

    def window(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this slice's (k, v) at ``start``; return rows [0, start + i) of keys and values, differentiable."""
        return _Window.apply(k, v, self, start)

    def _write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if self.keys is None:
            shape = (*k.shape[:2], max(self.rows, end), k.shape[3])
            self.keys, self.values = k.new_empty(shape), v.new_empty(shape)
        elif end > self.keys.shape[2] or k.shape[:2] != self.keys.shape[:2] or k.dtype != self.keys.dtype:
            raise RuntimeError(f"a slice of shape {tuple(k.shape)} at {start} does not fit this K/V cache")
        with torch.no_grad():
            self.keys[:, :, start:end].copy_(k)
            self.values[:, :, start:end].copy_(v)
        # Tensors of their own over the cache's storage: later slices' writes to rows past `end` must not bump
        # the version counter of what attention saved for its backward (those rows are not part of it).
        return _rows(self.keys, end), _rows(self.values, end)

    def _hand_back(self, grad_k: torch.Tensor, grad_v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of this slice's own k, v: its rows of the window's gradient plus what later slices left."""
        end = grad_k.shape[2]
        own = [grad_k[:, :, start:end], grad_v[:, :, start:end]]
        if self.grad is not None and self.grad[0].shape[2] >= end:
            own = [g + acc[:, :, start:end] for g, acc in zip(own, self.grad, strict=True)]
        if start and self.handback:
            if self.grad is None:
                self.grad = (
                    grad_k.new_zeros(grad_k.shape[:2] + (start, grad_k.shape[3])),
                    grad_v.new_zeros(grad_v.shape[:2] + (start, grad_v.shape[3])),
                )
            self.grad[0][:, :, :start] += grad_k[:, :, :start]
            self.grad[1][:, :, :start] += grad_v[:, :, :start]
        return own[0], own[1]


def _rows(cache: torch.Tensor, end: int) -> torch.Tensor:
    """Rows [0, end) of a (b, heads, rows, d) cache as a new tensor on the same storage (its own version counter)."""
    return cache.new_empty(0).set_(
        cache.untyped_storage(), cache.storage_offset(), (*cache.shape[:2], end, cache.shape[3]), cache.stride()
    )


class _Window(torch.autograd.Function):
    """Autograd for `KVCache.window`: forward writes into the cache, backward hands gradients back (above)."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, cache: KVCache, start: int):
        ctx.cache, ctx.start = cache, start
        return cache._write(k, v, start)

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor, grad_v: torch.Tensor):
        gk, gv = ctx.cache._hand_back(grad_k, grad_v, ctx.start)
        return gk, gv, None, None


def reversed_causal_mask(i: int, start: int, dtype: torch.dtype) -> torch.Tensor:
    """The CPU's additive mask for a slice of ``i`` queries after ``start`` context keys, the queries reversed.

    PyTorch's CPU attention needs an explicit mask for the bottom-right causal alignment and keeps it for the
    backward: a full (i, start + i) mask would hold 4 bytes per (query, key) pair for every tile until its
    backward, more than the tile's activations at long context. With the queries in reverse order, row r'
    (query i − 1 − r') blocks key c exactly when r' + c > start + i − 1: a function of r' + c, so the mask is a
    stride-(1, 1) view of one vector of start + 2i − 1 values, O(L) memory.
    """
    line = torch.zeros(start + 2 * i - 1, dtype=dtype)
    line[start + i :] = float("-inf")
    return line.as_strided((i, start + i), (1, 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.hidden = cfg.heads, cfg.hidden
        # No biases in the linear layers (nanoGPT's bias=False). A key bias has an exactly zero gradient
        # (softmax ignores a shift shared by all keys), so AdamW would turn its rounding noise into updates.
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """x: (b, i, H), the tokens [start, start + i) of a slice; ``cache`` holds the keys/values of the same
        sequences' earlier tokens [0, start) and receives this slice's (None: the whole sequence, no cache)."""
        b, i, _ = x.shape
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q, k, v = (t.view(b, i, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v, cache, start)
        y = y.transpose(1, 2).reshape(b, i, self.hidden)
        return self.proj(y)

    def split_heads(self, tensor_parallel: int) -> None:
        """Keep 1/T of the heads (tensor parallelism, `tensor.shard_module`)."""
        self.heads //= tensor_parallel
        self.hidden //= tensor_parallel


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, start: int, *, gqa: bool = False
) -> torch.Tensor:
    """Causal attention of a slice's queries q (b, heads, i, d) over the keys/values of [0, start + i): its own
    k, v (b, kv_heads, i, d) and, in ``cache``, the earlier slices' (None: the whole sequence, no cache).

    ``gqa``: fewer key/value heads than query heads (grouped-query attention); the kernels read each key/value head
    for its group of query heads (``enable_gqa``) without expanding the cache, and sum the group's gradients."""
    if cache is None:
        k, v, gqa = expand_for_kernel(q, k, v, gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    i = q.shape[2]
    # q on its own storage (a copy), so the projection's output (q, k, v together) is not kept for the
    # backward: attention saves q and the cache's rows, no more than the whole-sequence path keeps.
    keys, values = cache.window(k, v, start)
    if q.device.type != "cpu":
        keys, values, gqa = expand_for_kernel(q, keys, values, gqa)
    if not start:
        return F.scaled_dot_product_attention(q.contiguous(), keys, values, is_causal=True, enable_gqa=gqa)
    if q.device.type == "cpu":
        # Queries reversed, output back in order: the same forward; the key and value gradients sum the
        # queries' shares in another order (rounding-level differences).
        mask = reversed_causal_mask(i, start, q.dtype)
        return F.scaled_dot_product_attention(q.flip(2), keys, values, attn_mask=mask, enable_gqa=gqa).flip(2)
    # Causal aligned to the bottom-right corner: the slice's first query sees all `start` earlier keys;
    # the fused kernels apply it without building a mask.
    mask = causal_lower_right(i, start + i)
    return F.scaled_dot_product_attention(q.contiguous(), keys, values, attn_mask=mask, enable_gqa=gqa)


def expand_for_kernel(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Grouped-query keys/values as the fused kernels can take them: as they are, except on CUDA in fp32, where
    the flash kernel does not run and the memory-efficient one has no grouped-query mode (PyTorch would fall back
    to the unfused kernel, which builds every score matrix). There each key/value head is repeated for its group of
    query heads (``repeat_interleave``, as ``transformers``' ``repeat_kv``; its backward sums the group's gradients):
    a copy of the slice's window per tile, still far smaller than the scores."""
    if gqa and q.device.type == "cuda" and q.dtype == torch.float32:
        group = q.shape[1] // keys.shape[1]
        return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1), False
    return keys, values, gqa


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

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, start)
        return x + self.mlp(self.ln_2(x))


def stage_layer_range(cfg: ModelConfig, stage: int, stages: int, partition: Partition | None = None) -> range:
    """Stage (chunk) k owns layers [k·N/K, (k+1)·N/K), or the ones ``partition`` gives it (docs/design.md §6, §11)."""
    if partition is not None:
        if not 0 <= stage < partition.chunks:
            raise ValueError(f"chunk {stage} out of range for {partition.chunks} chunks")
        return partition.layer_ids(stage)
    per = cfg.stage_layers(stages)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")
    return range(stage * per, (stage + 1) * per)


class GPT(nn.Module):
    """The part of the model that pipeline stage ``stage`` of ``stages`` owns (the whole model by default): with a
    ``partition`` (`plan.partition`), chunk ``stage`` of its chunks, its own layers — or, with ``chunks``, several
    chunks of it (one device's, interleaved), each run on its own by ``forward(..., chunk=c)``.

    Chunk 0 also holds the token and position embeddings; the last chunk the final LayerNorm and LM head.
    Layers are kept under their global index (``blocks.5...``) so parameter names match the whole model's.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        stage: int = 0,
        stages: int = 1,
        *,
        seed: int = 0,
        partition: Partition | None = None,
        chunks: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        stages = stages if partition is None else partition.chunks
        chunks = (stage,) if chunks is None else tuple(chunks)
        self.stage, self.stages, self.chunks = stage, stages, chunks
        self.first, self.last = 0 in chunks, stages - 1 in chunks
        # Each chunk's layers, in model order; the module holds them all.
        self.chunk_layers = {c: list(stage_layer_range(cfg, c, stages, partition)) for c in chunks}
        self.layer_ids = [n for c in chunks for n in self.chunk_layers[c]]
        self.make_parts(cfg)
        self.init_weights(seed)

    def make_parts(self, cfg: ModelConfig) -> None:
        """Chunk 0's embeddings, the layers (``self.blocks``), the last chunk's final norm and LM head."""
        if self.first:
            self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleDict({str(n): Block(cfg) for n in self.layer_ids})
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """nanoGPT's init (normal 0.02, residual projections scaled by 1/sqrt(2N)), seeded per component."""
        if self.first:
            g = seeded(seed, _EMBED)
            normal_(self.wte.weight, g)
            normal_(self.wpe.weight, g)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for n in self.layer_ids:
            g = seeded(seed, _LAYER + n)
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
            normal_(self.lm_head.weight, seeded(seed, _HEAD))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last chunk's final norm and LM head: the logits."""
        return self.lm_head(self.ln_f(h))

    def embed(self, tokens: torch.Tensor, token_start: int = 0) -> torch.Tensor:
        """Token + position embedding; a slice's positions are absolute (token_start + arange(i))."""
        pos = torch.arange(token_start, token_start + tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)

    def forward(
        self, x: torch.Tensor, token_start: int = 0, caches: list[KVCache] | None = None, chunk: int | None = None
    ) -> torch.Tensor:
        """Run this stage's part (or chunk ``chunk`` of it) on one slice: tokens [token_start, token_start + i).

        x: (b, i) token ids on chunk 0, else the (b, i, H) activation from the previous chunk.
        caches: one `KVCache` per layer of the chunk, holding the earlier slices' keys/values of the same
        sequences (None: x is the whole sequence). Returns (b, i, H), or the logits (b, i, vocab) on the last chunk.
        """
        chunk = self.chunks[0] if chunk is None else chunk
        if len(self.chunks) > 1 and chunk not in self.chunk_layers:
            raise ValueError(f"chunk {chunk} is not one of this module's {self.chunks}")
        layers = self.layer_ids if len(self.chunks) == 1 else self.chunk_layers[chunk]
        h = self.embed(x, token_start) if chunk == 0 else x
        for idx, n in enumerate(layers):
            h = self.blocks[str(n)](h, caches[idx] if caches is not None else None, token_start)
        if chunk == self.stages - 1:
            h = self.head(h)
        return h


def seeded(seed: int, offset: int) -> torch.Generator:
    """The generator of one component (embedding, layer, head) of the model with ``seed``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + offset)


def normal_(t: torch.Tensor, g: torch.Generator, std: float = 0.02) -> None:
    t.copy_(torch.randn(t.shape, generator=g) * std)


def build_model(cfg: ModelConfig, stage: int = 0, stages: int = 1, **kwargs) -> GPT:
    """The architecture ``cfg.arch`` names: `GPT` or `llama.Llama` (same arguments, same stage layout)."""
    if cfg.llama:
        from terapipe_cli.engine.llama import Llama  # llama.py builds on this module

        return Llama(cfg, stage, stages, **kwargs)
    return GPT(cfg, stage, stages, **kwargs)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy: the step divides by all predicted tokens of the step (docs/design.md §6)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
