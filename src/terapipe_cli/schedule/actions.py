"""The schedule's vocabulary: tiles, the kinds of action, and the one rule saying what each action waits for.

torch.distributed.pipelining writes an action as stage, kind and microbatch (``0F3``); we add the token slice after
a dot (``0F3.2``). The kinds (`Phase`):

* ``F`` — a tile's forward;
* ``B`` — its whole backward (``I`` and ``W`` in one call);
* ``I`` — the backward for the tile's input and for the K/V cache rows it read (what the previous chunk and the
  earlier token slices wait for);
* ``W`` — the backward for the chunk's weights, which nobody waits for (zero-bubble schedules put it in the gaps).

`waits_for` is the dependency rule (docs/design.md §11b, the split backward): F after the previous chunk's F of the
tile; I (or B) after the tile's own F, after the next chunk's I of the tile (its output's gradient) and after this
chunk's I of the batch slice's next token slice (which leaves this tile's K/V gradients in the cache — every later
token slice transitively); W after its own I. A B counts as the I and the W it holds (`WAITS`, `COMPLETES`: the rule
as data). The legality check and the walk (`walk_rows`), the grid (`schedule.schedule`), the simulator
(`plan.simulate`), the executor's messages (`engine.executor`) and the memory walk (`plan.memory`, by
`Phase.opens`/`Phase.frees`) all ask this module. Imports no torch."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    """The kind of an action. A `StrEnum`: ``Phase.F == "F"``, and it prints as its letter."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 — torch.distributed.pipelining's letter
    W = "W"

    @property
    def sends_gradient(self) -> bool:
        """Whether it computes the input's gradient (handed to the previous chunk and to earlier token slices)."""
        return self in (Phase.B, Phase.I)

    @property
    def frees(self) -> bool:
        """Whether the tile's kept tensors go after it (the last backward action of the tile)."""
        return self in (Phase.B, Phase.W)

    @property
    def parts(self) -> tuple[Phase, ...]:
        """The kinds it completes: B completes I and W."""
        return (Phase.I, Phase.W) if self is Phase.B else (self,)


PHASES = tuple(p.value for p in Phase)
_BY_LETTER = {p.value: p for p in Phase}


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
    """Chunk (stage) ``stage`` runs ``phase`` (F, B, I or W; a letter is turned into its `Phase`) of ``tile``."""

    phase: Phase
    tile: Tile
    stage: int = 0

    def __post_init__(self) -> None:
        if type(self.phase) is not Phase:
            kind = _BY_LETTER.get(self.phase)
            object.__setattr__(self, "phase", kind if kind is not None else Phase(self.phase))

    def label(self, token_slices: bool = True) -> str:
        """``0F3.2`` (``0F3`` without ``token_slices``)."""
        text = f"{self.stage}{self.phase.value}{self.tile.batch_slice}"
        return f"{text}.{self.tile.token_slice}" if token_slices else text

    def __str__(self) -> str:
        return self.label()


# The rule as data: what each kind waits for, as (chunk offset, kind, token slice offset) from the action's own chunk
# and tile; an entry whose chunk falls outside the pipeline, or whose token slice outside the batch slice, is dropped.
# I (or B) waits for its own F, the next chunk's I (its output's gradient) and this chunk's I of the next token slice
# (the K/V gradients it leaves in the cache, and so every later token slice's, transitively).
_BACKWARD_WAITS = ((0, Phase.F, 0), (1, Phase.I, 0), (0, Phase.I, 1))
WAITS: dict[Phase, tuple[tuple[int, Phase, int], ...]] = {
    Phase.F: ((-1, Phase.F, 0),),
    Phase.B: _BACKWARD_WAITS,
    Phase.I: _BACKWARD_WAITS,
    Phase.W: ((0, Phase.I, 0),),
}
# What each kind completes (what others may wait for): a B its I and its W.
COMPLETES: dict[Phase, tuple[Phase, ...]] = {p: p.parts for p in Phase}

# What an action completes and waits for: (chunk, phase, batch slice, token slice).
Key = tuple[int, Phase, int, int]


def completes(a: Action) -> tuple[Key, ...]:
    """The keys an action completes (a B completes its I and its W)."""
    return tuple((a.stage, p, a.tile.batch_slice, a.tile.token_slice) for p in COMPLETES[a.phase])


def waits_for(a: Action, chunks: int, token_slices: int) -> tuple[Key, ...]:
    """The one dependency rule (`WAITS`): what ``a`` waits for, in a pipeline of ``chunks`` chunks whose batch slice
    ``a.tile.batch_slice`` has ``token_slices`` token slices."""
    c, d, m = a.stage, a.tile.batch_slice, a.tile.token_slice
    return tuple(
        (c + dc, p, d, m + dm) for dc, p, dm in WAITS[a.phase] if 0 <= c + dc < chunks and m + dm < token_slices
    )


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


def token_slice_counts(rows: Sequence[Sequence[Action]]) -> dict[int, int]:
    """Batch slice -> its token slices, from the tiles the rows name."""
    counts: dict[int, int] = {}
    for row in rows:
        for a in row:
            d = a.tile.batch_slice
            counts[d] = max(counts.get(d, 0), a.tile.token_slice + 1)
    return counts


class KeyCodes:
    """The keys an action completes and waits for (`completes`, `waits_for`) as small integers, for a pipeline of
    ``chunks`` chunks whose batch slices have ``token_slices`` token slices each: key (c, kind, d, m) is
    (3c + kind)·tiles + the tile's number (kinds F, I, W; a batch slice's tiles consecutive). A walk then marks keys in
    a `bytearray` instead of hashing tuples, several times faster (`walk_rows`; `least_extra` of 1F1B walks one set of
    actions in many orders). Every action's chunk must lie in the pipeline."""

    _KINDS = {Phase.F: 0, Phase.I: 1, Phase.W: 2}

    def __init__(self, chunks: int, token_slices: dict[int, int]) -> None:
        self.chunks, self.counts = chunks, token_slices
        self.first: dict[int, int] = {}  # batch slice -> the number of its first tile
        tiles = 0
        for d in sorted(token_slices):
            self.first[d] = tiles
            tiles += token_slices[d]
        self.tiles, self.size = tiles, 3 * chunks * tiles
        self._offsets: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def of(self, a: Action) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(what ``a`` waits for, what it completes), in `waits_for`'s and `completes`' order."""
        t, c = a.tile, a.stage
        later = t.token_slice + 1 < self.counts[t.batch_slice]
        where = (a.phase, c, later)
        offsets = self._offsets.get(where)
        if offsets is None:
            n = self.tiles
            waits = tuple(
                (dc * 3 + self._KINDS[p]) * n + dm
                for dc, p, dm in WAITS[a.phase]
                if 0 <= c + dc < self.chunks and (dm == 0 or later)
            )
            offsets = self._offsets[where] = (waits, tuple(self._KINDS[p] * n for p in COMPLETES[a.phase]))
        base = 3 * c * self.tiles + self.first[t.batch_slice] + t.token_slice
        return tuple(base + o for o in offsets[0]), tuple(base + o for o in offsets[1])


def walk_codes(rows: Sequence[Sequence[tuple[tuple[int, ...], tuple[int, ...]]]], size: int) -> tuple[list, list[int]]:
    """`walk_rows` on actions given as their `KeyCodes`: the (row, position) of every action in the order walked,
    and each row's position where it stuck (its length when it ran to the end)."""
    pos = [0] * len(rows)
    done = bytearray(size)
    out: list[tuple[int, int]] = []
    waiting: dict[int, list[int]] = {}  # a key not yet completed -> the rows whose next action waits for it
    ready = deque(range(len(rows)))
    while ready:
        k = ready.popleft()
        row, p, end = rows[k], pos[k], len(rows[k])
        while p < end:
            waits, completed = row[p]
            for key in waits:
                if not done[key]:
                    waiting.setdefault(key, []).append(k)
                    break
            else:
                for key in completed:
                    if not done[key]:
                        done[key] = 1
                        woken = waiting.pop(key, None)
                        if woken:
                            ready.extend(woken)
                out.append((k, p))
                p += 1
                continue
            break
        pos[k] = p
    return out, pos


def walk_rows(
    rows: Sequence[Sequence[Action]], chunks: int, token_slices: dict[int, int] | None = None
) -> tuple[list[Action], list[tuple[int, int]]]:
    """Walk the rows as far as `waits_for` allows: the actions in an order they can run, and where each row is
    stuck (device, position; empty when every action ran). A row whose next action waits is woken when what it waits
    for completes, so the walk looks at each action a bounded number of times (a pass over every row until none moves
    looked at each row's head once per action run: the square of the actions, minutes for Megatron-LM's largest
    plans). Where the rows end does not depend on the order they are walked in: what can run only grows."""
    codes = KeyCodes(chunks, token_slices if token_slices is not None else token_slice_counts(rows))
    order, pos = walk_codes([[codes.of(a) for a in row] for row in rows], codes.size)
    return [rows[k][p] for k, p in order], [(k, pos[k]) for k, r in enumerate(rows) if pos[k] < len(r)]
