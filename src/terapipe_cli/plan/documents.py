"""Document-aware pricing of attention: the context a tile really attends under block-causal masking,
from a corpus's measured document lengths. Pure numpy, no torch.

With packed documents masked (`models.attention.DocumentMask`), a tile of ``i`` tokens at offset ``j`` of its window
reads the K/V cache from ``lo``, the earliest document start among its b sequences' first tokens, so its attention
over the context costs what ``j − lo`` context tokens cost: t_ctx(b, i, j − lo) instead of t_ctx(b, i, j). Windows
start at random offsets in the corpus, so the first token of a slice lies in a document at a random place: its
*age* A (tokens of its document before it) follows the length-biased law P(A ≥ a) = Σ_d max(n_d − a, 0) / Σ_d n_d
over the documents' lengths n_d, and the context it attends is min(A, j) (a document begun before the window counts
from the window's start). A tile of b sequences attends the longest of its b contexts; the b ages are independent
(windows at independent offsets), so the expected attended context is

    E[j − lo] = Σ_{a=1..j} (1 − (1 − P(A ≥ a))^b),

and, t_ctx being linear in j (`plan.costmodel.context_seconds`), the expected price of the tile is t_ctx at that
expectation. With documents longer than L it is j (nothing saved); with short documents the later slices cost less.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class AttendedContext:
    """The expected attended context of a tile (b sequences, context j) over packed documents of ``lengths``."""

    at_least: np.ndarray  # P(A >= a) for a = 0 .. seq_len (float64, P(A >= 0) = 1)
    documents: int
    mean_tokens: float  # the documents' mean length
    source: str = ""  # the corpus it was measured on
    _tables: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of_lengths(cls, lengths: np.ndarray, seq_len: int, source: str = "") -> AttendedContext:
        """From the document lengths of a corpus (tokens, > 0), for windows of up to ``seq_len`` tokens."""
        n = np.asarray(lengths, dtype=np.int64)
        n = n[n > 0]
        if n.size == 0:
            raise ValueError("no documents")
        # Σ_d max(n_d − a, 0) for a = 0..seq_len: the documents longer than a, less a for each of them.
        n = np.sort(n)
        suffix = np.concatenate((np.cumsum(n[::-1])[::-1], [0]))  # suffix[k] = Σ of n[k:]
        ages = np.arange(seq_len + 1)
        first = np.searchsorted(n, ages, side="right")  # n[first:] > a
        at_least = (suffix[first] - ages * (n.size - first)) / float(n.sum())
        return cls(at_least, int(n.size), float(n.mean()), source)

    @classmethod
    def mixed(cls, parts: list[AttendedContext], weights: list[float], source: str = "") -> AttendedContext:
        """Over a mixture that draws each sequence's window from part k with probability ``weights[k]`` (normalised
        here): an age's law is the parts' laws so weighted, and the b sequences' ages stay independent."""
        w = np.asarray(weights, dtype=float) / float(np.sum(weights))
        at_least = np.sum([p * part.at_least for p, part in zip(w, parts, strict=True)], axis=0)
        documents = sum(part.documents for part in parts)
        mean = sum(part.documents * part.mean_tokens for part in parts) / documents
        return cls(at_least, documents, mean, source)

    def expected(self, b: int) -> np.ndarray:
        """E[attended context] for context j = 0 .. seq_len of a tile of ``b`` sequences (float64)."""
        table = self._tables.get(b)
        if table is None:
            longest = 1.0 - (1.0 - self.at_least[1:]) ** b
            table = np.concatenate(([0.0], np.cumsum(longest)))
            self._tables[b] = table
        return table

    def __call__(self, b, j) -> np.ndarray:
        """The expected attended context of tiles of ``b`` sequences at context ``j`` (broadcastable arrays)."""
        b, j = np.broadcast_arrays(np.asarray(b, dtype=float), np.asarray(j, dtype=float))
        out = np.empty(b.shape)
        top = self.at_least.shape[0] - 1
        for size in np.unique(b):
            where = b == size
            jj = np.clip(j[where], 0, top)
            table = self.expected(max(int(round(size)), 1))
            lo = np.floor(jj).astype(np.int64)
            hi = np.minimum(lo + 1, top)
            out[where] = table[lo] + (jj - lo) * (table[hi] - table[lo])
        return out

    def record(self) -> dict:
        """What a plan says of it (``attention`` in the plan file)."""
        return {
            "context": "documents",
            "corpus": self.source,
            "documents": self.documents,
            "mean_document_tokens": round(self.mean_tokens, 2),
        }
