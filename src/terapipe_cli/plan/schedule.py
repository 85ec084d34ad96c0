"""The schedule: for every stage, its ordered actions, built once from a plan — and the one object the workers
walk (`engine.executor`), the simulator replays with a cost model (`plan.simulate`), the memory estimate walks
(`plan.memory`) and the report draws.

An action is written as torch.distributed.pipelining writes it, stage, phase and batch slice (``0F3``: stage 0
runs the forward of batch slice 3), with the token slice after a dot: ``0F3.2`` is token slice 2 of it, ``1B0.0``
the backward of the first token slice of batch slice 0 on stage 1. (Where every batch slice is one token slice,
GPipe's case, the dot is left out.) `Schedule.to_csv` writes one row of actions per stage, and `parse_schedule` reads
such a file back — a hand-written schedule too — checking that it is legal (`Schedule.check`):

* each stage's row holds every tile of the plan exactly once forward and once backward, and only its own stage's
  actions;
* within a batch slice, forwards in token order and backwards in reverse token order, the first backward after the
  last forward: a later token slice's backward produces the key/value gradients the earlier one's needs
  (docs/design.md §6);
* no deadlock: a forward on stage k needs the tile's activation from stage k − 1, a backward its gradient from
  stage k + 1, and walking every stage's row in order with those dependencies reaches the end.

Two built-in orders of the batch slices (`ORDERS`, `Schedule.build`): ``gpipe``, every forward then every backward
(last batch slice first), the same on every stage; and ``1f1b``, where stage k of K runs the forwards of at most
K − k batch slices ahead of their backwards, then alternates a backward (the oldest open batch slice) with a
forward, so the activations of fewer batch slices are alive at once. `Schedule.grid` prints a rank × time grid of
the actions, each taking one time step. The timelines that walking a schedule produces are `plan.timeline`'s.

Interleaved chunks (``partition`` with v > 1, `plan.partition`): an action's number is its chunk c (a virtual
stage, as torch.distributed.pipelining numbers them), run by device c mod K; a schedule has one row per device, and
a forward of chunk c waits for chunk c − 1's (on the device before, or device K − 1 for the first chunk of a round),
a backward for chunk c + 1's. ``gpipe`` order then runs the tiles in groups of K (Megatron-LM's interleaving: the
group's tiles through the device's first chunk, then its second, …; a tile comes back round after K chunk-times,
just when the group is done), every forward before every backward, the backwards in the exact reverse; ``1f1b``
is Megatron-LM's interleaved 1F1B on tiles — a warm-up of forwards, then one forward and one backward in turn —
with the backwards in groups of batch slices of at least K tiles (`_alternating_1f1b`). Within a batch slice every
chunk runs its forwards in token order and its backwards in reverse token order (docs/design.md §6). Imports no
torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from terapipe_cli.errors import UserError
from terapipe_cli.plan.partition import Partition

PHASES = ("F", "B")
ORDERS = ("gpipe", "1f1b")
CUSTOM = "custom"  # the order of a schedule read from a file


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
    """Stage ``stage`` runs the forward ("F") or backward ("B") of ``tile``."""

    phase: str
    tile: Tile
    stage: int = 0

    def label(self, token_slices: bool = True) -> str:
        """``0F3.2`` (``0F3`` without ``token_slices``)."""
        text = f"{self.stage}{self.phase}{self.tile.batch_slice}"
        return f"{text}.{self.tile.token_slice}" if token_slices else text

    def __str__(self) -> str:
        return self.label()


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


@dataclass(frozen=True)
class Schedule:
    """Per device, its actions in order, for a scheme ``slices`` on ``stages`` devices (K); with a ``partition`` of
    v > 1 chunks per device (`plan.partition`) an action names its chunk. ``recompute[c]``: chunk c runs each tile's
    forward again inside its backward (docs/design.md §10); one entry per chunk, per stage when v = 1."""

    slices: tuple[tuple[int, tuple[int, ...]], ...]
    stages: int
    order: str  # one of ORDERS, or CUSTOM
    actions: tuple[tuple[Action, ...], ...]
    recompute: tuple[bool, ...]
    tiles: tuple[Tile, ...] = field(repr=False, compare=False, default=())
    partition: Partition | None = field(default=None, compare=False)  # None: one chunk per device, layers unknown

    @classmethod
    def build(
        cls,
        slices: Sequence,
        stages: int,
        order: str = "gpipe",
        recompute: Sequence[bool] | None = None,
        partition: Partition | None = None,
    ) -> Schedule:
        """The schedule of a built-in order (module docstring).

        ``gpipe``: every tile forward in pipeline order, then every tile backward in reverse order, on every stage.
        ``1f1b``: stage k first runs the forwards of min(K − k, D) batch slices (D in all); then, while forwards
        remain, the backward of the oldest open batch slice and the forward of the next; then the remaining
        backwards. Either way the gradients are the same sums (docs/design.md §6): only when, not what. With
        interleaved chunks (v > 1) see the module docstring.
        """
        if stages < 1:
            raise ValueError(f"stages must be at least 1, got {stages}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if partition is not None and partition.devices != stages:
            raise ValueError(f"the partition is for {partition.devices} devices, not {stages}")
        tiles = plan_tiles(slices)
        virtual = 1 if partition is None else partition.virtual
        if virtual > 1:
            rows = _interleaved_rows(tiles, len(slices), stages, virtual, order)
        elif order == "gpipe":
            rows = [
                [Action("F", t, k) for t in tiles] + [Action("B", t, k) for t in reversed(tiles)] for k in range(stages)
            ]
        else:
            by_slice = [[t for t in tiles if t.batch_slice == d] for d in range(len(slices))]
            rows = [_one_f_one_b(by_slice, k, warmup=min(stages - k, len(by_slice))) for k in range(stages)]
        return cls.of_rows(slices, stages, order, rows, recompute, partition)

    @classmethod
    def of_rows(
        cls,
        slices: Sequence,
        stages: int,
        order: str,
        rows: Sequence[Sequence[Action]],
        recompute=None,
        partition: Partition | None = None,
    ) -> Schedule:
        chunks = stages if partition is None else partition.chunks
        recompute = tuple(bool(r) for r in recompute) if recompute is not None else (False,) * chunks
        if len(recompute) != chunks:
            raise ValueError(f"recompute has {len(recompute)} entries for {chunks} stages")
        frozen = tuple((int(b), tuple(int(n) for n in lengths)) for b, lengths in slices)
        actions = tuple(tuple(r) for r in rows)
        return cls(frozen, stages, order, actions, recompute, tuple(plan_tiles(frozen)), partition)

    @classmethod
    def of_plan(cls, plan) -> Schedule:
        """The schedule a plan (`plan.file.Plan`) runs in: its slices, stages, order, recomputation and chunks."""
        return cls.build(plan.slices, plan.stages, plan.order, plan.recompute, plan.partition)

    @property
    def chunks(self) -> int:
        """Chunks (virtual stages) of the pipeline: K·v."""
        return self.stages if self.partition is None else self.partition.chunks

    @property
    def virtual(self) -> int:
        return self.chunks // self.stages

    def device(self, chunk: int) -> int:
        """The device that runs chunk ``chunk`` (c mod K)."""
        return chunk % self.stages

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.actions[stage]

    def __len__(self) -> int:
        return self.stages

    def __iter__(self):
        return iter(self.actions)

    @property
    def token_slices_shown(self) -> bool:
        """Whether actions are written with their token slice (not when every batch slice is one token slice)."""
        return any(len(lengths) > 1 for _, lengths in self.slices)

    def label(self, action: Action) -> str:
        return action.label(self.token_slices_shown)

    def forward_tiles(self, stage: int) -> list[Tile]:
        """The tiles stage ``stage`` runs forward, in its order (the order its activations arrive)."""
        return [a.tile for a in self.actions[stage] if a.phase == "F"]

    def with_partition(self, partition: Partition | None) -> Schedule:
        """The same actions, with the layers of each chunk known (for the memory estimate and the simulator)."""
        if partition is not None and partition.chunks != self.chunks:
            raise ValueError(f"a partition of {partition.chunks} chunks for a schedule of {self.chunks}")
        return replace(self, partition=partition)

    # ---------------------------------------------------------------------------------------- checking

    def check(self, where: str = "schedule") -> None:
        """Raise a one-line `UserError` naming the first action that makes the schedule illegal (module docstring)."""
        if len(self.actions) != self.stages:
            raise UserError(f"has {len(self.actions)} rows, one per stage is needed: {self.stages}", where=where)
        for k, row in enumerate(self.actions):
            chunks = [c for c in range(self.chunks) if self.device(c) == k]
            every = {(p, c, t) for p in PHASES for c in chunks for t in self.tiles}
            seen: set[tuple[str, int, Tile]] = set()
            next_forward: dict[
                tuple[int, int], int
            ] = {}  # (chunk, batch slice) -> the token slice whose forward is next
            next_backward: dict[tuple[int, int], int] = {}  # (chunk, batch slice) -> the next backward's token slice
            for n, a in enumerate(row):
                t, at = a.tile, f"row {k + 1} (stage {k}), action {n + 1} {self.label(a)!r}"
                count = len(self.slices[t.batch_slice][1])
                if a.stage >= self.chunks or self.device(a.stage) != k:
                    what = "stage" if self.virtual == 1 else "chunk"
                    raise UserError(f"{at}: an action of {what} {a.stage} in the row of stage {k}", where=where)
                if (a.phase, a.stage, t) in seen:
                    raise UserError(f"{at}: runs twice", where=where)
                seen.add((a.phase, a.stage, t))
                key = (a.stage, t.batch_slice)
                if a.phase == "F":
                    expected = next_forward.get(key, 0)
                    if t.token_slice != expected:
                        raise UserError(
                            f"{at}: forward of token slice {t.token_slice} before token slice {expected}'s (a batch "
                            "slice's forwards go in token order)",
                            where=where,
                        )
                    next_forward[key] = expected + 1
                    continue
                if next_forward.get(key, 0) < count:
                    raise UserError(
                        f"{at}: backward before the last forward of batch slice {t.batch_slice} (its last token "
                        "slice's backward starts the K/V gradients the earlier ones need)",
                        where=where,
                    )
                expected = next_backward.get(key, count - 1)
                if t.token_slice != expected:
                    raise UserError(
                        f"{at}: backward of token slice {t.token_slice} before token slice {expected}'s (a batch "
                        "slice's backwards go in reverse token order)",
                        where=where,
                    )
                next_backward[key] = expected - 1
            missing = sorted(every - seen, key=lambda pct: (pct[2].batch_slice, pct[2].token_slice, pct[1], pct[0]))
            if missing:
                phase, c, t = missing[0]
                first = self.label(Action(phase, t, c))
                raise UserError(
                    f"row {k + 1} (stage {k}) lacks {first!r} ({len(missing)} actions missing)", where=where
                )
        self.walk(where=where)

    def walk(self, where: str = "schedule") -> list[Action]:
        """Every action in an order the dependencies allow (forwards wait for the previous chunk's, backwards for
        the next chunk's and their own forward); a one-line `UserError` when the schedule deadlocks."""
        out, stuck = _walk(self.actions, self.chunks)
        if stuck:
            where_stuck = [f"stage {k} at {self.label(self.actions[k][n])!r}" for k, n in stuck]
            raise UserError(
                f"deadlocks: {' and '.join(where_stuck)} wait for actions that come later in each other's rows",
                where=where,
            )
        return out

    # ---------------------------------------------------------------------------------------- showing

    def grid(self, *, width: int | None = None) -> str:
        """A rank × time grid: one row per stage, one column per time step, every action one step long and as
        early as its dependencies allow (``width``: at most that many steps, then ``…``)."""
        slot: dict[tuple[int, str, Tile], int] = {}
        free = [0] * self.stages
        cells: list[dict[int, str]] = [{} for _ in range(self.stages)]
        for a in self.walk():
            c, t = a.stage, a.tile
            k = self.device(c)
            needs = [free[k]]
            if a.phase == "F" and c > 0:
                needs.append(slot[(c - 1, "F", t)] + 1)
            if a.phase == "B" and c < self.chunks - 1:
                needs.append(slot[(c + 1, "B", t)] + 1)
            start = max(needs)
            slot[(c, a.phase, t)] = start
            free[k] = start + 1
            cells[k][start] = self.label(a)
        steps = max(free)
        shown = steps if width is None else min(steps, width)
        cell = max((len(text) for row in cells for text in row.values()), default=3)
        header = " " * 9 + " ".join(f"{s:>{cell}}" for s in range(shown))
        lines = [header]
        for k, row in enumerate(cells):
            text = " ".join(f"{row.get(s, '·'):>{cell}}" for s in range(shown))
            lines.append(f"stage {k:<3}" + text + (" …" if shown < steps else ""))
        return "\n".join(lines)

    def to_csv(self) -> str:
        """One line of comma-separated actions per stage (`parse_schedule` reads it back)."""
        return "".join(",".join(self.label(a) for a in row) + "\n" for row in self.actions)


def _walk(rows: Sequence[Sequence[Action]], chunks: int) -> tuple[list[Action], list[tuple[int, int]]]:
    """Walk the rows as far as the dependencies allow: the actions in an order they can run, and where each row is
    stuck (device, position; empty when every action ran)."""
    pos = [0] * len(rows)
    done: set[tuple[int, str, Tile]] = set()
    out: list[Action] = []
    total = sum(len(r) for r in rows)
    while len(out) < total:
        progressed = False
        for k, row in enumerate(rows):
            while pos[k] < len(row) and _ready(row[pos[k]], done, chunks):
                a = row[pos[k]]
                done.add((a.stage, a.phase, a.tile))
                out.append(a)
                pos[k] += 1
                progressed = True
        if not progressed:
            return out, [(k, pos[k]) for k, r in enumerate(rows) if pos[k] < len(r)]
    return out, []


def _ready(a: Action, done: set, chunks: int) -> bool:
    c, t = a.stage, a.tile
    if a.phase == "F":
        return c == 0 or (c - 1, "F", t) in done
    return (c, "F", t) in done and (c == chunks - 1 or (c + 1, "B", t) in done)


def _interleaved_rows(tiles: list[Tile], slices: int, devices: int, virtual: int, order: str) -> list[list[Action]]:
    """Each device's row with v chunks per device (module docstring): forwards in groups of K tiles, each group
    through the device's chunks in turn; ``gpipe`` then every backward in the exact reverse; ``1f1b`` the order of
    `_alternating_1f1b`."""
    chunks = devices * virtual

    def forwards(k: int, ts: list[Tile]) -> list[Action]:
        out = []
        for g in range(0, len(ts), devices):
            group = ts[g : g + devices]
            out += [Action("F", t, c) for c in range(k, chunks, devices) for t in group]
        return out

    if order == "gpipe":
        return [(f := forwards(k, tiles)) + [Action("B", a.tile, a.stage) for a in reversed(f)] for k in range(devices)]
    # Backwards by groups of batch slices of at least K tiles (Megatron's groups of K microbatches when every batch
    # slice is one tile), oldest group first; within a group the device's chunks from the last, each running the
    # group's batch slices oldest first, every batch slice in reverse token order.
    by_slice = [[t for t in tiles if t.batch_slice == d] for d in range(slices)]
    groups: list[list[list[Tile]]] = []
    for ts in by_slice:
        if not groups or sum(len(x) for x in groups[-1]) >= devices:
            groups.append([])
        groups[-1].append(ts)
    backward = [
        [
            Action("B", t, c)
            for group in groups
            for c in reversed(range(k, chunks, devices))
            for ts in group
            for t in ts[::-1]
        ]
        for k in range(devices)
    ]
    return _alternating_1f1b([forwards(k, tiles) for k in range(devices)], backward, chunks, virtual)


def _alternating_1f1b(
    forward: list[list[Action]], backward: list[list[Action]], chunks: int, virtual: int
) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B over these forwards and backwards: device k first runs
    (K − k − 1)·2 + (v − 1)·K + e forwards (its warm-up, in tiles), then one forward and one backward in turn, then
    the backwards left; e is the smallest extra warm-up, the same on every device, that leaves no deadlock (0 when
    every batch slice is one tile and the groups are K of them — Megatron-LM's own case, whose order this then is
    exactly; with token slices a group can hold more than K tiles, and its first backward waits for more forwards).
    With e as large as the forwards every device runs all its forwards first, which is legal, so e exists.

    It replaced a greedy replay that took any ready backward before the next batch slice's forward: backwards then
    ran in bursts that starved the next device of forwards, and the simulator priced it 1–14% slower on every case
    compared (the tiny model's K = 2 plans; Megatron-LM's settings 5–8 on DGX A100, v = 2–4, whole sequences and
    token slices), 16% on the 310.1B setting (docs/results.md)."""
    devices = len(forward)

    def rows_with(extra: int) -> list[list[Action]]:
        rows = []
        for k in range(devices):
            f, b = forward[k], backward[k]
            warmup = min(len(f), base[k] + extra)
            row = f[:warmup]
            for n in range(len(f) - warmup):
                row += [f[warmup + n], b[n]]
            rows.append(row + b[len(f) - warmup :])
        return rows

    def legal(rows: list[list[Action]]) -> bool:
        return not _walk(rows, chunks)[1]

    # A backward placed before its own forward can never run: device k's n-th backward comes after its
    # (warm-up + n)-th forward, so the warm-up must reach the forward's position less n. The smallest extra meeting
    # that on every device is a lower bound; from it, the first extra whose rows walk to the end (one or two walks
    # in practice: a walk per extra from zero made paper-08's plan 9 s instead of 5 s).
    base = [(devices - k - 1) * 2 + (virtual - 1) * devices for k in range(devices)]
    low = 0
    for k in range(devices):
        at = {(a.tile, a.stage): i for i, a in enumerate(forward[k])}
        low = max([low] + [at[(b.tile, b.stage)] - n - base[k] for n, b in enumerate(backward[k])])
    for extra in range(low, max(len(f) for f in forward) + 1):
        rows = rows_with(extra)
        if legal(rows):
            return rows
    raise AssertionError("every forward first cannot deadlock")  # unreachable: the last extra is GPipe-like


def _one_f_one_b(by_slice: list[list[Tile]], stage: int, warmup: int) -> list[Action]:
    """One stage's 1F1B order over batch slices, ``warmup`` forwards ahead."""
    forward = [[Action("F", t, stage) for t in ts] for ts in by_slice]
    backward = [[Action("B", t, stage) for t in reversed(ts)] for ts in by_slice]
    out = [a for d in range(warmup) for a in forward[d]]
    for d in range(warmup, len(by_slice)):
        out += backward[d - warmup] + forward[d]
    for d in range(len(by_slice) - warmup, len(by_slice)):
        out += backward[d]
    return out


_ACTION = re.compile(r"(\d+)([FB])(\d+)(?:\.(\d+))?")


def parse_schedule(
    text: str,
    slices: Sequence,
    stages: int,
    recompute: Sequence[bool] | None = None,
    *,
    where: str = "schedule",
    partition: Partition | None = None,
) -> Schedule:
    """A schedule from CSV text (`Schedule.to_csv`; ``#`` starts a comment, empty cells are idle steps), for the
    plan's ``slices``, ``stages`` and chunks (``partition``), checked (`Schedule.check`); every mistake is one line
    naming the action."""
    tiles = {(t.batch_slice, t.token_slice): t for t in plan_tiles(slices)}
    rows: list[list[Action]] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        row: list[Action] = []
        for n, cell in enumerate(c.strip() for c in line.split(",")):
            if not cell:
                continue
            at = f"row {len(rows) + 1}, action {n + 1} {cell!r}"
            m = _ACTION.fullmatch(cell)
            if m is None:
                raise UserError(
                    f"{at}: not an action such as 0F3.2 (stage, F or B, batch slice, .token slice)", where=where
                )
            stage, phase, d = int(m.group(1)), m.group(2), int(m.group(3))
            token = int(m.group(4) or 0)
            if d >= len(slices):
                raise UserError(f"{at}: no batch slice {d} (the plan has {len(slices)})", where=where)
            if (d, token) not in tiles:
                count = len(slices[d][1])
                raise UserError(f"{at}: no token slice {token} in batch slice {d} (it has {count})", where=where)
            if m.group(4) is None and len(slices[d][1]) > 1:
                raise UserError(f"{at}: batch slice {d} has {len(slices[d][1])} token slices: name one (.0, .1, …)",
                                where=where)  # fmt: skip
            row.append(Action(phase, tiles[(d, token)], stage))
        rows.append(row)
    schedule = Schedule.of_rows(slices, stages, CUSTOM, rows, recompute, partition)
    schedule.check(where)
    return schedule
