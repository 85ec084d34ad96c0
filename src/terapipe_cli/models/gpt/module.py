"""A plain GPT decoder (nanoGPT-style) whose attention can read the keys/values of earlier token slices.

The only idea beyond nanoGPT: a token slice of ``i`` tokens that starts after ``j`` earlier tokens attends over
``[keys/values of the j earlier tokens] + [its own i tokens, causally]``. Causality means position t needs
only positions <= t, so a sequence can be cut into slices and run slice by slice with exactly the result of
running it whole (TeraPipe, docs/design.md §1 and §6). The model knows nothing else about pipelining: `GPT(cfg, stage,
stages)` simply builds the part of the model that one pipeline stage owns; `GPT(cfg)` is the whole model.
`GPT2` (``arch = "gpt2"``) is the same decoder as GPT-2 has it: biases, the tanh GELU, the head tied to the embedding.

Weights are initialised per component from the seed (models/init.py), so stage k of a K-stage split holds exactly
the weights of the same layers of the one-stage model, for any K. `terapipe_cli.models.build_model` builds the
architecture the config names (its spec's ``module``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from terapipe_cli.models.attention import DocumentMask, KVCache, attend
from terapipe_cli.models.init import EMBED_SEED, HEAD_SEED, LAYER_SEED, normal_, seeded
from terapipe_cli.models.spec import ModelConfig
from terapipe_cli.schedule.partition import Partition


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
    ``partition`` (`schedule.partition`), chunk ``stage`` of its chunks, its own layers — or, with ``chunks``, several
    chunks of it (one device's, interleaved), each run on its own by ``forward(..., chunk=c)``.

    Chunk 0 also holds the token and position embeddings; the last chunk the final LayerNorm and LM head (with
    ``tie_embeddings``, the embedding's matrix when both ends are on this stage; on different stages each holds a
    copy, kept equal by summing their gradients, `tied_copy`). Layers are kept under their global
    index (``blocks.5...``) so parameter names match the whole model's.
    """

    bias = False  # biases in the linear layers
    gelu = "none"  # the MLP's GELU (F.gelu's approximate)

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
        if cfg.tie_embeddings and self.first and self.last:
            self.lm_head.weight = self.wte.weight  # one matrix, one gradient: the sum of the two uses
        self.init_weights(seed)

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

    @property
    def tied_copy(self) -> str | None:
        """With tied embeddings whose two ends are on different stages (Megatron-LM's embedding group): the name of
        this stage's copy of the tied matrix (``wte.weight`` first, ``lm_head.weight`` last), whose gradient is
        summed with the other copy's every step; None otherwise."""
        if not self.cfg.tie_embeddings or self.first == self.last:
            return None
        return "wte.weight" if self.first else "lm_head.weight"

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last chunk's final norm: the LM head's input."""
        return self.ln_f(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last chunk's final norm and LM head: the logits."""
        return self.lm_head(self.final_norm(h))

    def embed(self, tokens: torch.Tensor, token_start: int = 0, docs: DocumentMask | None = None) -> torch.Tensor:
        """Token + position embedding; a slice's positions are absolute (token_start + arange(i)), or with packed
        documents each token's place in its own document."""
        pos = torch.arange(token_start, token_start + tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos if docs is None else docs.positions)

    def forward(
        self,
        x: torch.Tensor,
        token_start: int = 0,
        caches: list[KVCache] | None = None,
        chunk: int | None = None,
        docs: DocumentMask | None = None,
        *,
        logits: bool = True,
    ) -> torch.Tensor:
        """Run this stage's part (or chunk ``chunk`` of it) on one slice: tokens [token_start, token_start + i).

        x: (b, i) token ids on chunk 0, else the (b, i, H) activation from the previous chunk.
        caches: one `KVCache` per layer of the chunk, holding the earlier slices' keys/values of the same
        sequences (None: x is the whole sequence). docs: packed documents (`attention.DocumentMask`; None: one
        sequence, causal). Returns (b, i, H), or on the last chunk the logits (b, i, vocab) — with ``logits=False`` the
        final norm's output (b, i, H), for a loss that makes the logits itself a chunk at a time (`engine.loss`).
        """
        chunk = self.chunks[0] if chunk is None else chunk
        if len(self.chunks) > 1 and chunk not in self.chunk_layers:
            raise ValueError(f"chunk {chunk} is not one of this module's {self.chunks}")
        layers = self.layer_ids if len(self.chunks) == 1 else self.chunk_layers[chunk]
        h = self.embed(x, token_start, docs) if chunk == 0 else x
        for idx, n in enumerate(layers):
            h = self.blocks[str(n)](h, caches[idx] if caches is not None else None, token_start, docs)
        if chunk == self.stages - 1:
            h = self.head(h) if logits else self.final_norm(h)
        return h


class GPT2(GPT):
    """GPT-2 exactly (``arch = "gpt2"``, `transformers`' GPT2LMHeadModel): `GPT` with a bias in every linear layer
    (zero at initialisation), the tanh GELU, and by default the head tied to the token embedding."""

    bias = True
    gelu = "tanh"
