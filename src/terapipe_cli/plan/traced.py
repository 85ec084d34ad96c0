"""A profile's traced memory (``"memory"``, schema /3; made by `terapipe_cli.profile.memtrace`): what a stage's
runtime code keeps and the transient peaks of its actions, as functions of a tile (b, i, j). No torch.

Each quantity is the largest of a few linear forms in ``1, b·i, b·j, b·i·(i + j)``, one list of forms for tiles
without context (j = 0) and one for tiles with: each form is the live bytes at one moment of the traced window.
Per stage kind: ``layer`` (one decoder layer: what it keeps), and ``middle``, ``first``, ``last``, ``only`` (a
stage's rest, by where it sits: the embedding, the head and loss, both, or neither, and the peaks over what is live
of a stage's actions). A stage of ℓ layers keeps ℓ·layer + its kind's rest; its transients are its kind's (the
backward meets one layer at a time), a recomputed tile's re-run holding ℓ − 1 more layers' saved tensors.

    "memory": {
      "allocator": "cpu" | "cuda",                    exact bytes, or the CUDA caching allocator's blocks
      "terms": ["1", "b*i", "b*j", "b*i*(i+j)"],
      "cache_bytes_per_token_per_layer": n,           K/V of one layer, per token of a batch slice's sequence
      "copies_bytes": {"layer": n, "middle": n, ...}, a 16-bit compute type's weight copies, one per step
      "layer": {"tile" | "kept" | "weight_grads": {"no_context": [[c0, c1, c2, c3], ...], "context": [...]}},
      "stages": {"middle" | "first" | "last" | "only": {QUANTITY: {"no_context": [...], "context": [...],
                 "pieces": [{"above_tokens": n, "no_context": [...], "context": [...]}, ...]}}},   pieces optional
      "loss_chunk_tokens": c,                          the head's chunk the trace ran with (optional)
      "heldout_rel_err_max": e                         the largest error on tiles the forms were not fitted on
    }

``pieces`` (the head's kinds' transients, `profile.memtrace`): the forms that hold for tiles of more than
``above_tokens`` tokens b·i (the last piece whose bound the tile exceeds); a tile of no more than the first bound takes
the quantity's own forms. The chunked head (engine/loss.py) holds at most a chunk's logits, so its transients stop
growing with b·i at the chunk: one list of linear forms over every tile would keep growing past it.

QUANTITY: ``tile`` (kept from F to B), ``kept`` (a recomputed tile's), ``weight_grads`` (kept from I to W),
``forward`` (F's peak over what is live after it), ``backward`` / ``input`` / ``weight`` (B's / I's / W's peak over
what was live before it), ``rerun`` (a recomputed tile's B, the re-run included, over what was live before it),
``handback`` (what a tile's B or I leaves for the batch slice's earlier tiles: the K/V gradients of their rows, kept
until the next earlier tile's backward), ``handback_split`` (the same under the split backward: left by a tile's W
until the batch slice's next W; in ``weight_grads``, which W frees but for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from terapipe_cli.errors import UserError

QUANTITIES = ("tile", "kept", "rerun", "forward", "backward", "weight_grads", "input", "weight", "handback",
              "handback_split")  # fmt: skip
LAYER_QUANTITIES = ("tile", "kept", "weight_grads", "handback", "handback_split")
_OPTIONAL = ("handback", "handback_split")
_ZERO = np.zeros((1, 4))
STAGE_KINDS = ("middle", "first", "last", "only")
GROUPS = ("no_context", "context")
ALLOCATORS = ("cpu", "cuda")


def terms(b, i, j) -> np.ndarray:
    """The feature columns ``1, b·i, b·j, b·i·(i + j)`` for tiles (b, i, j) (broadcast arrays), last axis."""
    b, i, j = (np.asarray(x, dtype=float) for x in (b, i, j))
    return np.stack(np.broadcast_arrays(np.ones_like(b * i * j), b * i, b * j, b * i * (i + j)), axis=-1)


@dataclass(frozen=True)
class Forms:
    """One quantity: its linear forms without context and with (each an (n, 4) array); its bytes are the largest.
    ``pieces``: (tokens, no_context, context), ascending: the forms of tiles of more than ``tokens`` tokens b·i."""

    no_context: np.ndarray
    context: np.ndarray
    pieces: tuple[tuple[float, np.ndarray, np.ndarray], ...] = ()

    def __call__(self, b, i, j) -> np.ndarray:
        x = terms(b, i, j)
        has_context = np.asarray(j) > 0
        out = np.where(has_context, np.max(x @ self.context.T, axis=-1), np.max(x @ self.no_context.T, axis=-1))
        n = np.asarray(b, dtype=float) * np.asarray(i, dtype=float)
        for tokens, plain, ctx in self.pieces:
            piece = np.where(has_context, np.max(x @ ctx.T, axis=-1), np.max(x @ plain.T, axis=-1))
            out = np.where(n > tokens, piece, out)
        return out


@dataclass(frozen=True)
class TracedMemory:
    allocator: str
    cache_per_token_per_layer: float
    copies: dict[str, float]
    layer: dict[str, Forms]
    stages: dict[str, dict[str, Forms]]
    heldout_rel_err_max: float | None = None
    loss_chunk_tokens: int | None = None  # the head's chunk the trace ran with (None: not recorded)

    def stage(self, layers: int, first: bool, last: bool) -> TracedStage:
        kind = "only" if first and last else "first" if first else "last" if last else "middle"
        return TracedStage(self, layers, kind)


@dataclass(frozen=True)
class TracedStage:
    """The traced sizes of one chunk of ``layers`` decoder layers of stage kind ``kind`` (bytes; tiles broadcast)."""

    traced: TracedMemory
    layers: int
    kind: str

    def _sum(self, quantity: str, b, i, j) -> np.ndarray:
        own = self.traced.stages[self.kind][quantity](b, i, j)
        return self.layers * self.traced.layer[quantity](b, i, j) + own

    def tile(self, b, i, j) -> np.ndarray:
        return self._sum("tile", b, i, j)

    def kept(self, b, i, j) -> np.ndarray:
        return self._sum("kept", b, i, j)

    def weight_grads(self, b, i, j) -> np.ndarray:
        return self._sum("weight_grads", b, i, j)

    def handback(self, b, i, j, *, split: bool = False) -> np.ndarray:
        return self._sum("handback_split" if split else "handback", b, i, j) * (np.asarray(j) > 0)

    def transient(self, quantity: str, b, i, j) -> np.ndarray:
        """``forward``, ``backward``, ``input`` or ``weight``: the action's peak over its reference."""
        return self.traced.stages[self.kind][quantity](b, i, j)

    def rerun(self, b, i, j) -> np.ndarray:
        """A recomputed tile's backward over what was live before it: the one-layer stage's, with ℓ − 1 more layers'
        saved tensors held by the re-run."""
        extra = (self.layers - 1) * self.traced.layer["tile"](b, i, j)
        return self.traced.stages[self.kind]["rerun"](b, i, j) + extra

    @property
    def cache(self) -> float:
        """K/V bytes per token of a batch slice's sequence."""
        return self.layers * self.traced.cache_per_token_per_layer

    @property
    def copies(self) -> float:
        return self.layers * self.traced.copies.get("layer", 0.0) + self.traced.copies.get(self.kind, 0.0)


def _groups(obj, where: str) -> list[np.ndarray]:
    out = []
    for group in GROUPS:
        rows = obj.get(group)
        try:
            arr = np.asarray(rows, dtype=float)
        except (TypeError, ValueError):
            arr = None
        if arr is None or arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != 4 or not np.all(np.isfinite(arr)):
            raise UserError(f"'{group}' must be a non-empty list of [c0, c1, c2, c3]", where=where)
        out.append(arr)
    return out


def _forms(obj, where: str, *, optional: bool = False) -> Forms:
    if obj is None and optional:  # a quantity traces made before it did not record: none
        return Forms(_ZERO, _ZERO)
    if not isinstance(obj, dict):
        raise UserError("must be an object with 'no_context' and 'context'", where=where)
    pieces, last = [], 0.0
    for k, piece in enumerate(obj.get("pieces") or []):
        tokens = piece.get("above_tokens") if isinstance(piece, dict) else None
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not tokens > last:
            raise UserError("'above_tokens' must be positive and ascending", where=f"{where}.pieces[{k}]")
        pieces.append((float(tokens), *_groups(piece, f"{where}.pieces[{k}]")))
        last = float(tokens)
    return Forms(*_groups(obj, where), tuple(pieces))


def traced_from_dict(obj, where: str) -> TracedMemory:
    """Validate a profile's ``memory`` entry; every error names ``where`` and the field."""
    if not isinstance(obj, dict):
        raise UserError("field 'memory' must be an object", where=where)
    field = lambda name: f"{where}: field 'memory.{name}'"  # noqa: E731
    allocator = obj.get("allocator")
    if allocator not in ALLOCATORS:
        raise UserError(f"must be one of {', '.join(ALLOCATORS)}, got {allocator!r}", where=field("allocator"))
    cache = obj.get("cache_bytes_per_token_per_layer")
    if isinstance(cache, bool) or not isinstance(cache, (int, float)) or cache < 0:
        raise UserError(f"must be a non-negative number, got {cache!r}", where=field("cache_bytes_per_token_per_layer"))
    copies = obj.get("copies_bytes", {})
    if not isinstance(copies, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in copies.values()
    ):
        raise UserError("must map stage kinds to bytes", where=field("copies_bytes"))
    layer_obj, stages_obj = obj.get("layer"), obj.get("stages")
    if not isinstance(layer_obj, dict) or not isinstance(stages_obj, dict):
        raise UserError("must hold 'layer' and 'stages' objects", where=field(""))
    layer = {q: _forms(layer_obj.get(q), field(f"layer.{q}"), optional=q in _OPTIONAL) for q in LAYER_QUANTITIES}
    stages = {}
    for kind in STAGE_KINDS:
        entry = stages_obj.get(kind)
        if not isinstance(entry, dict):
            raise UserError("must be an object of quantities", where=field(f"stages.{kind}"))
        stages[kind] = {
            q: _forms(entry.get(q), field(f"stages.{kind}.{q}"), optional=q in _OPTIONAL) for q in QUANTITIES
        }
    err = obj.get("heldout_rel_err_max")
    chunk = obj.get("loss_chunk_tokens")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UserError(f"must be a positive integer, got {chunk!r}", where=field("loss_chunk_tokens"))
    return TracedMemory(
        allocator,
        float(cache),
        {k: float(v) for k, v in copies.items()},
        layer,
        stages,
        float(err) if isinstance(err, (int, float)) and not isinstance(err, bool) else None,
        chunk,
    )
