"""The stage layout every family's torch module shares (`Decoder`): which layers a pipeline stage (chunk) owns, the
embedding on chunk 0 and the final norm and LM head on the last, tied embeddings across stages, and the forward of
one token slice through a chunk with its layers' K/V caches. A family's module (`gpt.module.GPT`,
`llama.module.Llama`) is a `Decoder` that says what its parts are (`make_parts`), how they start (`init_weights`),
how tokens enter (`embed`) and the final norm (`final_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from terapipe_cli.models.attention import DocumentMask, KVCache
from terapipe_cli.models.spec import ModelConfig
from terapipe_cli.schedule.partition import Partition


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


class Decoder(nn.Module):
    """The part of the model that pipeline stage ``stage`` of ``stages`` owns (the whole model by default): with a
    ``partition`` (`schedule.partition`), chunk ``stage`` of its chunks, its own layers — or, with ``chunks``, several
    chunks of it (one device's, interleaved), each run on its own by ``forward(..., chunk=c)``.

    Chunk 0 also holds the embeddings; the last chunk the final norm and LM head (with ``tie_embeddings``, the
    embedding's matrix when both ends are on this stage; on different stages each holds a copy, kept equal by summing
    their gradients, `tied_copy`). Layers are kept under their global index (``blocks.5...``) so parameter names match
    the whole model's. Weights are drawn per component from the seed (models/init.py), so stage k of a K-stage split
    holds exactly the weights of the same layers of the one-stage model, for any K.
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
        if cfg.tie_embeddings and self.first and self.last:
            self.lm_head.weight = self.wte.weight  # one matrix, one gradient: the sum of the two uses
        self.init_weights(seed)

    def make_parts(self, cfg: ModelConfig) -> None:
        """Chunk 0's embeddings (``self.wte``, ...), the layers (``self.blocks``, a ModuleDict by global index), the
        last chunk's final norm and ``self.lm_head``."""
        raise NotImplementedError

    def init_weights(self, seed: int) -> None:
        """Every part's initial values, drawn per component from ``seed`` (`models.init.seeded`)."""
        raise NotImplementedError

    def embed(self, tokens: torch.Tensor, token_start: int = 0, docs: DocumentMask | None = None) -> torch.Tensor:
        """Chunk 0: the tokens [token_start, token_start + i) as activations."""
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last chunk's final norm: the LM head's input."""
        raise NotImplementedError

    @property
    def tied_copy(self) -> str | None:
        """With tied embeddings whose two ends are on different stages (Megatron-LM's embedding group): the name of
        this stage's copy of the tied matrix (``wte.weight`` first, ``lm_head.weight`` last), whose gradient is
        summed with the other copy's every step; None otherwise."""
        if not self.cfg.tie_embeddings or self.first == self.last:
            return None
        return "wte.weight" if self.first else "lm_head.weight"

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last chunk's final norm and LM head: the logits."""
        return self.lm_head(self.final_norm(h))

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
