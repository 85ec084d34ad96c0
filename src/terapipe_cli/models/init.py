"""Seeded initialisation shared by every architecture's module: one generator per component of the model (the
embedding, each layer by its global index, the head), so stage k of a K-stage split holds exactly the weights of the
same layers of the one-stage model, for any K."""

from __future__ import annotations

import torch

# Per-component seed offsets: the embedding, layer l (l + LAYER_SEED), and the final norm + head.
EMBED_SEED, HEAD_SEED, LAYER_SEED = 1, 2, 16


def seeded(seed: int, offset: int) -> torch.Generator:
    """The generator of one component (embedding, layer, head) of the model with ``seed``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + offset)


def normal_(t: torch.Tensor, g: torch.Generator, std: float = 0.02) -> None:
    t.copy_(torch.randn(t.shape, generator=g) * std)
