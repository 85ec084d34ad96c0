"""The schedule: for every stage, its ordered actions, built once from a plan — and the one object the workers
walk (`engine.executor`), the simulator replays with a cost model (`plan.simulate`), the memory estimate walks
(`plan.memory`) and the report draws.

An action (`schedule.actions`: its kind a `Phase` — F, B, or a split backward's I and W) is written as
torch.distributed.pipelining writes it, stage, kind and batch slice (``0F3``: stage 0 runs the forward of batch slice
3), with the token slice after a dot: ``0F3.2`` is token slice 2 of it, ``1B0.0`` the backward of the first token
slice of batch slice 0 on stage 1, ``0I3.2`` / ``0W3.2`` the two halves of a split backward. (Where every batch slice
is one token slice, GPipe's case, the dot is left out: torch's own CSV form, ``0F0,0I0,0W0``.) `Schedule.to_csv`
writes one row of actions per stage, and `parse_schedule` reads such a file back — a hand-written schedule too —
checking that it is legal (`Schedule.check`):

* each stage's row holds every tile of the plan exactly once forward and once backward (a B, or an I and a W), and
  only its own stage's actions;
* within a batch slice, forwards in token order and backwards (B or I) in reverse token order, the first backward
  after the last forward: a later token slice's backward produces the key/value gradients the earlier one's needs
  (docs/design.md §6); a W after its own I;
* no deadlock: walking every stage's row in order under the one dependency rule (`actions.waits_for`) reaches the
  end.

The orders (`schedule.orders`, one module each, `Schedule.build`): ``gpipe``, every forward then every backward (last
batch slice first), the same on every stage; ``1f1b``, where stage k of K runs the forwards of at most K − k batch
slices ahead of their backwards, then alternates a backward (the oldest open batch slice) with a forward; ``zb1p``
(ZB-H1), 1F1B with each backward split into I and W and the W's held back to fill the bubble; ``zbv`` (ZB-V), two
chunks per device on the V placement. `Schedule.grid` prints a rank × time grid of the actions, each taking one time
step. The timelines that walking a schedule produces are `schedule.timeline`'s.

Interleaved chunks (``partition`` with v > 1, `schedule.partition`): an action's number is its chunk c (a virtual
stage, as torch.distributed.pipelining numbers them), run by the partition's placement (`Schedule.device`: device
c mod K, or on the V device k holding chunks k and 2K − 1 − k); a schedule has one row per device, and a forward of
chunk c waits for chunk c − 1's, a backward for chunk c + 1's. ``gpipe`` order then runs the tiles in groups of K
(Megatron-LM's interleaving), every forward before every backward, the backwards in the exact reverse; ``1f1b`` is
Megatron-LM's interleaved 1F1B on tiles (`orders.one_f_one_b.alternating_1f1b`). Within a batch slice every chunk
runs its forwards in token order and its backwards in reverse token order (docs/design.md §6). Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from terapipe_cli.errors import UserError
from terapipe_cli.schedule import memo
from terapipe_cli.schedule.actions import PHASES, Action, Phase, Tile, completes, plan_tiles, waits_for, walk_rows
from terapipe_cli.schedule.orders import ALL_ORDERS, ORDERS, Order, order_of
from terapipe_cli.schedule.partition import Partition

__all__ = [
    "ALL_ORDERS",
    "CUSTOM",
    "Layout",
    "ORDERS",
    "PHASES",
    "Action",
    "Phase",
    "Schedule",
    "Tile",
    "layout",
    "parse_schedule",
    "plan_tiles",
]

CUSTOM = "custom"  # the order of a schedule read from a file


@dataclass(frozen=True)
class Schedule:
    """Per device, its actions in order, for a scheme ``slices`` on ``stages`` devices (K); with a ``partition`` of
    v > 1 chunks per device (`schedule.partition`) an action names its chunk. ``recompute[c]``: chunk c runs each tile's
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
        if partition is not None and partition.devices != stages:
            raise ValueError(f"the partition is for {partition.devices} devices, not {stages}")
        tiles = plan_tiles(slices)
        virtual = 1 if partition is None else partition.virtual
        kind = order_of(order)
        if partition is not None and partition.placement != kind.placement:
            partition = replace(partition, placement=kind.placement)  # the order's placement (ZB-V: the V)
        rows = [[Action(p, tiles[n], c) for p, c, n in row] for row in layout(slices, stages, kind.name, virtual).rows]
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
        """The device that runs chunk ``chunk``: the partition's placement (`Partition.device`), else c mod K."""
        return chunk % self.stages if self.partition is None else self.partition.device(chunk)

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

    @property
    def token_slice_counts(self) -> dict[int, int]:
        """Batch slice -> its number of token slices."""
        return {d: len(lengths) for d, (_, lengths) in enumerate(self.slices)}

    @property
    def split(self) -> bool:
        """Whether some backward runs as I and W (a zero-bubble order)."""
        return any(a.phase is Phase.I for row in self.actions for a in row)

    # ---------------------------------------------------------------------------------------- checking

    def check(self, where: str = "schedule") -> None:
        """Raise a one-line `UserError` naming the first action that makes the schedule illegal (module docstring)."""
        if len(self.actions) != self.stages:
            raise UserError(f"has {len(self.actions)} rows, one per stage is needed: {self.stages}", where=where)
        for k, row in enumerate(self.actions):
            chunks = [c for c in range(self.chunks) if self.device(c) == k]
            # Every tile of every chunk once forward and once backward, whole (B) or split (I, then W).
            every = {(p, c, t) for p in (Phase.F, Phase.I, Phase.W) for c in chunks for t in self.tiles}
            seen: set[tuple[Phase, int, Tile]] = set()
            # (chunk, batch slice) -> the token slice whose forward (backward: I or B) is next
            next_forward: dict[tuple[int, int], int] = {}
            next_backward: dict[tuple[int, int], int] = {}
            for n, a in enumerate(row):
                t, at = a.tile, f"row {k + 1} (stage {k}), action {n + 1} {self.label(a)!r}"
                count = len(self.slices[t.batch_slice][1])
                if a.stage >= self.chunks or self.device(a.stage) != k:
                    what = "stage" if self.virtual == 1 else "chunk"
                    raise UserError(f"{at}: an action of {what} {a.stage} in the row of stage {k}", where=where)
                parts = {(p, a.stage, t) for p in a.phase.parts}
                if parts & seen:
                    raise UserError(f"{at}: runs twice", where=where)
                seen.update(parts)
                key = (a.stage, t.batch_slice)
                if a.phase is Phase.F:
                    expected = next_forward.get(key, 0)
                    if t.token_slice != expected:
                        raise UserError(
                            f"{at}: forward of token slice {t.token_slice} before token slice {expected}'s (a batch "
                            "slice's forwards go in token order)",
                            where=where,
                        )
                    next_forward[key] = expected + 1
                    continue
                if a.phase is Phase.W:
                    if (Phase.I, a.stage, t) not in seen:
                        raise UserError(f"{at}: the weights' backward before its own I", where=where)
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
                if phase is Phase.I and (Phase.W, c, t) in every - seen:
                    phase = Phase.B  # neither half: the backward is missing
                first = self.label(Action(phase, t, c))
                raise UserError(
                    f"row {k + 1} (stage {k}) lacks {first!r} ({len(missing)} actions missing)", where=where
                )
        self.walk(where=where)

    def walk(self, where: str = "schedule") -> list[Action]:
        """Every action in an order the dependencies allow (`actions.waits_for`); a one-line `UserError` when the
        schedule deadlocks."""
        out, stuck = walk_rows(self.actions, self.chunks, self.token_slice_counts)
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
        slot: dict = {}  # an action's keys (`actions.completes`) -> its step
        free = [0] * self.stages
        cells: list[dict[int, str]] = [{} for _ in range(self.stages)]
        counts = self.token_slice_counts
        for a in self.walk():
            k = self.device(a.stage)
            start = max([free[k]] + [slot[key] + 1 for key in waits_for(a, self.chunks, counts[a.tile.batch_slice])])
            for key in completes(a):
                slot[key] = start
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


@dataclass(frozen=True)
class Layout:
    """A built-in order's rows for batch slices of ``counts`` token slices each: per device, its actions as (kind,
    chunk, tile number), the tile's place in pipeline order (`plan_tiles`). What an order runs when depends only on
    how many token slices each batch slice has, not on their sizes (`Order.rows` reads nothing else of a tile), so one
    layout serves every scheme of those counts (`layout`)."""

    counts: tuple[int, ...]
    rows: tuple[tuple[tuple[Phase, int, int], ...], ...]

    @property
    def nbytes(self) -> int:
        """About what its tuples take (`memo`'s budget)."""
        return 100 * sum(len(row) for row in self.rows)


def layout(slices: Sequence, stages: int, order: str, virtual: int = 1) -> Layout:
    """The `Layout` of a built-in order for a scheme ``slices`` on ``stages`` devices of ``virtual`` chunks each:
    the order's rows of a scheme of one-token tiles with as many token slices per batch slice, shared within one plan
    (`memo`) by every scheme of those counts (`Schedule.build`, and the simulator's and the memory estimate's walks of
    the schemes a plan compares, which need no `Action` of their own)."""
    counts = tuple(len(lengths) for _, lengths in slices)
    kind = order_of(order)

    def make() -> Layout:
        places = kind.places(counts, stages, virtual)
        if places is not None:
            return Layout(counts, tuple(tuple(row) for row in places))
        tiles = plan_tiles([(1, [1] * n) for n in counts])
        number = {t: n for n, t in enumerate(tiles)}
        rows = kind.rows(tiles, len(counts), stages, virtual)
        return Layout(counts, tuple(tuple((a.phase, a.stage, number[a.tile]) for a in row) for row in rows))

    return memo.remembered(("layout", kind.name, stages, virtual, counts), make)


@dataclass(frozen=True)
class SchemeShape:
    """What `Schedule.build(slices, stages, order, recompute, partition)` runs, read without building it: the order,
    the partition with the order's placement, the chunks, every chunk's recomputation and the order's `Layout`."""

    order: Order
    partition: Partition | None
    chunks: int
    recompute: tuple[bool, ...]
    layout: Layout


def scheme_shape(
    slices: Sequence,
    stages: int,
    order: str,
    recompute: Sequence[bool] | None = None,
    partition: Partition | None = None,
) -> SchemeShape:
    """`SchemeShape` of a scheme (the simulator's and the memory estimate's walks of the schemes a plan compares)."""
    kind = order_of(order)
    virtual = 1 if partition is None else partition.virtual
    if partition is not None and partition.placement != kind.placement:
        partition = replace(partition, placement=kind.placement)  # the order's placement, as `Schedule.build`'s
    chunks = stages * virtual
    flags = tuple(bool(x) for x in recompute) if recompute is not None else (False,) * chunks
    return SchemeShape(kind, partition, chunks, flags, layout(slices, stages, kind.name, virtual))


_ACTION = re.compile(r"(\d+)([FBIW])(\d+)(?:\.(\d+))?")


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
                    f"{at}: not an action such as 0F3.2 (stage, F, B, I or W, batch slice, .token slice)", where=where
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
