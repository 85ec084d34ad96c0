"""The one schedule form: a plan's slicing scheme -> per-stage ordered actions, and the timeline they produce.

A schedule is data (as in torch.distributed.pipelining): for every stage, an ordered list of
``Action("F" | "B", tile)``. The workers walk it (and record a measured timeline), the simulator walks it
with a cost model (a predicted timeline), and the report draws both — so predicted and measured line up.
`stage_times` is the one reading of a timeline into busy and idle time per stage and the bubble fraction.

Order (docs/design.md §6): forward over batch slices in order and, within one, token slices in order; a batch
slice's backward in exactly the reverse token order, because a later token slice's backward produces the
key/value gradients that the earlier slice's backward needs. Two orders of the batch slices (`ORDERS`):
``gpipe``, every forward then every backward (last batch slice first), the same on every stage; and ``1f1b``,
where stage k of K runs the forwards of at most K − k batch slices ahead of their backwards, then alternates a
backward (the oldest open batch slice) with a forward — the activations of fewer batch slices are alive at once.

The timelines that walking a schedule produces are `plan.timeline`'s. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PHASES = ("F", "B")
ORDERS = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Tile:
    """One batch slice × one token slice: ``batch_size`` sequences from ``batch_start``, ``tokens`` new
    tokens from ``token_start`` (= the context length j)."""

    batch_slice: int
    token_slice: int
    batch_start: int
    batch_size: int
    token_start: int
    tokens: int


@dataclass(frozen=True)
class Action:
    phase: str  # "F" (forward) or "B" (backward)
    tile: Tile


def plan_tiles(slices: Sequence) -> list[Tile]:
    """All tiles of a scheme ``[(b, [l, ...]), ...]`` in pipeline (forward) order."""
    tiles: list[Tile] = []
    batch_start = 0
    for d, (b, lengths) in enumerate(slices):
        token_start = 0
        for m, n in enumerate(lengths):
            tiles.append(Tile(d, m, batch_start, int(b), token_start, int(n)))
            token_start += int(n)
        batch_start += int(b)
    return tiles


def build_schedule(slices: Sequence, stages: int, order: str = "gpipe") -> list[list[Action]]:
    """Per stage, its actions in order (see the module's docstring for the two orders).

    ``gpipe``: every tile forward in pipeline order, then every tile backward in reverse order, on every stage.
    ``1f1b``: stage k first runs the forwards of min(K − k, D) batch slices (D batch slices in all); then, while
    forwards remain, the backward of the oldest open batch slice and the forward of the next; then the remaining
    backwards. A batch slice's tiles always go forward in token order and backward in reverse. Either way the
    gradients are the same sums (docs/design.md §6): only when, not what.
    """
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    tiles = plan_tiles(slices)
    if order == "gpipe":
        actions = [Action("F", t) for t in tiles] + [Action("B", t) for t in reversed(tiles)]
        return [list(actions) for _ in range(stages)]
    by_slice = [[t for t in tiles if t.batch_slice == d] for d in range(len(slices))]
    return [_one_f_one_b(by_slice, warmup=min(stages - k, len(by_slice))) for k in range(stages)]


def _one_f_one_b(by_slice: list[list[Tile]], warmup: int) -> list[Action]:
    """One stage's 1F1B order over batch slices, ``warmup`` forwards ahead."""
    forward = [[Action("F", t) for t in ts] for ts in by_slice]
    backward = [[Action("B", t) for t in reversed(ts)] for ts in by_slice]
    out = [a for d in range(warmup) for a in forward[d]]
    for d in range(warmup, len(by_slice)):
        out += backward[d - warmup] + forward[d]
    for d in range(len(by_slice) - warmup, len(by_slice)):
        out += backward[d]
    return out
