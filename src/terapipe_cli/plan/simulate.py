"""The schedule simulator: walk the one schedule form with a cost model -> predicted timeline. No torch, no I/O.

The planner's objective (docs/design.md §4) is a closed formula, ``Σ t + (K−1)·max t``. This module instead replays the
step the way the runtime executes it (`terapipe_cli.train.worker`):

* every stage runs its actions (a `schedule.Schedule`) strictly in order, one at a time;
* an action waits for what the one dependency rule says (`actions.waits_for`): a forward on stage k for the
  activation of the same tile from stage k−1; a backward (B, or a split backward's I) for the gradient of the same
  tile from stage k+1 (the last stage starts a tile's backward as soon as it reaches it in its order: its loss is
  computed in the forward); a W for its own I. The gradient is sent after B or I; I and W cost what the profile
  says of the tile (`TileParts.split`: timed apart in a profile of schema /2, a /1 profile's backward split by the
  architecture's analytic ratio), a recomputing chunk's re-run forward in I;
* chunks sit on the devices the schedule's placement says (`Schedule.device`): a transfer between two chunks of one
  device is free;
* sends are asynchronous (the runtime's ``isend``): the sender moves on at once, the message travels over the
  link between the two stages, which carries one message at a time per direction, in the order sent;
* after its last backward a stage pays the per-step constant (optimizer update and data-parallel all-reduce).

Each action costs its own forward or backward time, so unequal tiles, the uneven fill and drain of the pipeline,
and transfers that overlap with compute are all visible; on equal tiles with free transfers the result is
exactly the formula. Events come out in the runtime's timeline form (`timeline.Event`), times from the step's
start, so predicted and measured timelines can be drawn and compared side by side.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from terapipe_cli.plan.costmodel import CostModel
from terapipe_cli.schedule import memo
from terapipe_cli.schedule.actions import COMPLETES, WAITS, Action, Phase, Tile, plan_tiles
from terapipe_cli.schedule.partition import Partition
from terapipe_cli.schedule.schedule import Schedule, scheme_shape
from terapipe_cli.schedule.timeline import Event, StageTimes, stage_times

# parts(b, i, j, chunk) -> (forward_s, backward_s, send_forward_s, send_backward_s), arrays over tiles: one chunk's
# compute of the tile's forward and backward, and the transfer of its activation / gradient to the neighbour. Its
# ``split`` attribute, split(b, i, j, chunk) -> (input_s, weight_s), prices a split backward's I and W.
TileParts = Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class SimResult:
    """A simulated step: its latency, per-action events, and what the latency is made of."""

    latency_s: float
    events: list[Event]
    compute_end_s: float  # when the last stage action ends, before the per-step constant
    step_s: float  # per-step constant (optimizer, data-parallel all-reduce) paid after each stage's last action
    stages: int

    def stage_times(self) -> StageTimes:
        """Busy and idle per stage and the bubble fraction of the simulated step (`timeline.stage_times`)."""
        return stage_times([self.events], self.stages)


def cost_model_parts(cost: CostModel) -> TileParts:
    """Split a `CostModel` into forward, backward and one-way transfer times per tile, for any of its chunks
    (``chunk``, default 0; its layers and, on the first and last chunks, the embedding and the head), and a split
    backward's I and W (``parts.split``).

    Built from copies of the cost model that keep one part of the profile each (`Profile.only`: the forward, the
    backward, its I, its W), so the interpolation is the cost model's own; forward and backward plus the two
    transfers is exactly the chunk's time (`CostModel.chunk_time`) of a cost model without recomputation. A
    recomputing chunk's backward (or I) holds the forward a second time (`simulate`).
    """
    p, keep = cost.profile, {"partition": cost.partition}
    only: dict[str, CostModel] = {}  # by part, made when first asked for (I and W only for a split schedule)
    part, last = cost.partition, cost.partition.chunks - 1

    def kind(chunk: int) -> tuple[int, bool, bool]:
        """Chunks of one kind cost alike: the same layers, and the same ends."""
        return part.layers[chunk], chunk == 0, chunk == last

    def priced(which: str, b, i, j, chunk: int) -> np.ndarray:
        """One chunk's seconds of ``which`` part of tiles (b, i, j) (already broadcast)."""
        model = only.get(which)
        if model is None:
            model = only[which] = CostModel(p.only(which), cost.stages, **keep)
        t = part.layers[chunk] * (model.no_context(b, i) + model.context(b, i, j))
        if chunk == 0:
            t = t + model.embedding(b, i)
        if chunk == last:
            t = t + model.head(b, i)
        return np.broadcast_to(t, b.shape)

    def tiles(b, i, j) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (b, i, j)))

    def parts(b, i, j, chunk: int = 0):
        b, i, j = tiles(b, i, j)
        # comm() is the round trip (activation forward + gradient back), each one latency + bytes/bandwidth.
        one_way = np.broadcast_to(cost.comm(b, i) / 2.0, b.shape)
        return priced("forward", b, i, j, chunk), priced("backward", b, i, j, chunk), one_way, one_way

    def split(b, i, j, chunk: int = 0):
        b, i, j = tiles(b, i, j)
        return priced("input", b, i, j, chunk), priced("weight", b, i, j, chunk)

    parts.kind = kind
    parts.split = split
    return parts


def uniform_parts(forward_s: float, backward_s: float, send_s: float = 0.0, input_share: float = 0.5) -> TileParts:
    """Every tile costs the same on every stage (for checks against the closed formula); a split backward's I is
    ``input_share`` of the backward, W the rest."""

    def parts(b, i, j, chunk: int = 0):
        shape = np.broadcast(np.asarray(b), np.asarray(i), np.asarray(j)).shape
        return (np.full(shape, forward_s), np.full(shape, backward_s), np.full(shape, send_s), np.full(shape, send_s))

    def split(b, i, j, chunk: int = 0):
        shape = np.broadcast(np.asarray(b), np.asarray(i), np.asarray(j)).shape
        return np.full(shape, input_share * backward_s), np.full(shape, (1.0 - input_share) * backward_s)

    parts.split = split
    return parts


def simulate(
    schedule: Schedule,
    cost_parts: CostModel | TileParts,
    *,
    step_s: float | None = None,
    replica: int = 0,
    step: int = 0,
) -> SimResult:
    """Simulate one training step of ``schedule`` (any per-stage order the runtime could walk; one that can never
    finish raises ValueError). Its stages recompute as ``schedule.recompute`` says.

    ``cost_parts``: a `CostModel` (its forward/backward split and its transfers are used; its ``step_s`` is the
    per-step constant unless ``step_s`` is given) or a `TileParts` callable. Ranks in the events are the stage
    numbers of this replica.
    """
    stages = schedule.stages
    pipeline, step_s = _pipeline(schedule, cost_parts, step_s)
    events = pipeline.walk(schedule.actions, replica=replica, step=step)
    compute_end = max(pipeline.stage_free) if stages else 0.0
    return SimResult(
        latency_s=compute_end + step_s, events=events, compute_end_s=compute_end, step_s=step_s, stages=stages
    )


def simulated_latency(schedule: Schedule, cost_parts: CostModel | TileParts, *, step_s: float | None = None) -> float:
    """`simulate`'s ``latency_s`` alone: the planner compares only that, and making and sorting the events took
    half of each simulation."""
    pipeline, step_s = _pipeline(schedule, cost_parts, step_s)
    pipeline.walk(schedule.actions, replica=0, step=0, record=False)
    return (max(pipeline.stage_free) if schedule.stages else 0.0) + step_s


def scheme_latency(
    cost: CostModel,
    slices: Sequence,
    stages: int,
    order: str,
    recompute: Sequence[bool] | None = None,
    partition: Partition | None = None,
) -> float:
    """`simulated_latency` of ``Schedule.build(slices, stages, order, recompute, partition)`` priced by ``cost``, the
    same number, without building the schedule: the walk's rows in slot form (`_Pipeline.compile`) depend only on
    the order's `Layout`, and are made once per layout within a plan (`memo`) — the planner simulates many schemes of
    a few layouts, where building each schedule's actions and compiling them took most of the simulation."""
    scheme = scheme_shape(slices, stages, order, recompute, partition)
    chunks, shape = scheme.chunks, scheme.layout
    split = scheme.order.split  # a split order's rows hold I and W, the others' neither
    parts, step_s = _resolve_parts(cost, stages, None)
    refused = len(scheme.recompute) != chunks or cost.partition.chunks != chunks
    if refused or (split and getattr(parts, "split", None) is None):
        # What `Schedule.build` and `_pipeline` refuse, refused as they say it.
        return simulated_latency(Schedule.build(slices, stages, order, recompute, partition), cost)
    device = (lambda c: c % stages) if scheme.partition is None else scheme.partition.device
    pipeline = _Pipeline(plan_tiles(slices), parts, stages, chunks, scheme.recompute, device, split)

    def make() -> _Compiled:
        return _Compiled([pipeline.compile_places(row) for row in shape.rows])

    compiled = memo.remembered(("compiled", scheme.order.name, stages, chunks // stages, shape.counts), make)
    pos = pipeline.play(compiled.rows)
    if any(p < len(row) for p, row in zip(pos, compiled.rows, strict=True)):  # a deadlock: said as `walk` says it
        return simulated_latency(Schedule.build(slices, stages, order, recompute, partition), cost)
    return (max(pipeline.stage_free) if stages else 0.0) + step_s


@dataclass(frozen=True)
class _Compiled:
    """A layout's rows in slot form (`_Pipeline.compile`), kept within a plan (`memo`)."""

    rows: list[list[tuple]]

    @property
    def nbytes(self) -> int:
        return 200 * sum(len(row) for row in self.rows)


def _pipeline(schedule: Schedule, cost_parts: CostModel | TileParts, step_s: float | None) -> tuple[_Pipeline, float]:
    """The pipeline that walks ``schedule`` priced by ``cost_parts``, and the per-step constant (`simulate`)."""
    parts, step_s = _resolve_parts(cost_parts, schedule.stages, step_s)
    if isinstance(cost_parts, CostModel) and cost_parts.partition.chunks != schedule.chunks:
        raise ValueError(f"the cost model has {cost_parts.partition.chunks} chunks, the schedule {schedule.chunks}")
    if schedule.split and getattr(parts, "split", None) is None:
        raise ValueError("the schedule splits its backward into I and W, and the tile costs do not price them")
    pipeline = _Pipeline(
        list(schedule.tiles),
        parts,
        schedule.stages,
        schedule.chunks,
        schedule.recompute,
        schedule.device,
        schedule.split,
    )
    return pipeline, step_s


def _resolve_parts(cost_parts: CostModel | TileParts, stages: int, step_s: float | None) -> tuple[TileParts, float]:
    """The tile-cost callable and the per-step constant (a cost model's own unless ``step_s`` is given)."""
    if not isinstance(cost_parts, CostModel):
        return cost_parts, float(step_s or 0.0)
    if cost_parts.stages != stages:
        raise ValueError(f"the cost model is for {cost_parts.stages} stages, simulating {stages}")
    if step_s is None:
        step_s = cost_parts.step_s
    parts = _PARTS.get(cost_parts)
    if parts is None:
        parts = _PARTS[cost_parts] = cost_model_parts(cost_parts)
    return parts, float(step_s or 0.0)


# `actions.WAITS` and `actions.COMPLETES` with each kind an index (the kinds an action completes: F, I, W).
_PHASE_INDEX = {Phase.F: 0, Phase.I: 1, Phase.W: 2}
_WAITS = {p: tuple((dc, _PHASE_INDEX[q], dm) for dc, q, dm in WAITS[p]) for p in Phase}
_COMPLETES = {p: tuple(_PHASE_INDEX[q] for q in COMPLETES[p]) for p in Phase}
_KIND = {Phase.F: 0, Phase.B: 1, Phase.I: 2, Phase.W: 3}  # how `_Pipeline.run` prices and sends an action
_LETTER = {p: p.value for p in Phase}

# Each cost model's split into parts, made once: the planner simulates one cost model many times.
_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Pipeline:
    """The state of the devices and links while a schedule is walked: when each action ended, and when what it sends
    arrived at the chunk that waits for it (`actions.waits_for` says who waits for what).

    A tile's activation goes from chunk c to c + 1 over the link between their devices (free within one device), its
    gradient back after its I (or B). A split backward costs its I (plus the re-run forward of a recomputed chunk)
    and its W as ``parts.split`` prices them (`TileParts`); a schedule without I and W needs no ``split``.

    Plain Python lists and floats: the walk touches one element at a time, where numpy's scalar access costs more
    than the arithmetic."""

    def __init__(
        self,
        tiles: list[Tile],
        parts: TileParts,
        stages: int,
        chunks: int,
        recompute: Sequence[bool],
        device: Callable[[int], int],
        split: bool = False,
    ) -> None:
        self.tiles = len(tiles)
        b = np.array([t.batch_size for t in tiles], dtype=float)
        i = np.array([t.tokens for t in tiles], dtype=float)
        j = np.array([t.token_start for t in tiles], dtype=float)
        self.fwd, self.bwd, self.send_f, self.send_b, self.inp, self.wgt = [], [], [], [], [], []
        kind = getattr(parts, "kind", lambda c: c)  # chunks of one kind cost alike: priced once
        split = parts.split if split else None  # I and W priced only for a schedule that runs them
        priced: dict = {}
        for c in range(chunks):
            if kind(c) not in priced:
                every = [*parts(b, i, j, chunk=c), *(split(b, i, j, chunk=c) if split is not None else (0.0, 0.0))]
                priced[kind(c)] = [np.broadcast_to(np.asarray(x, dtype=float), b.shape).tolist() for x in every]
            stores = (self.fwd, self.bwd, self.send_f, self.send_b, self.inp, self.wgt)
            for store, x in zip(stores, priced[kind(c)], strict=True):
                store.append(x)
        self.stages, self.chunks = stages, chunks
        self.recompute = list(recompute)
        self.device = [device(c) for c in range(chunks)]
        self.counts: dict[int, int] = {}  # batch slice -> its token slices
        self.first_tile: dict[int, int] = {}  # batch slice -> the number of its first tile (the rest follow it)
        for n, t in enumerate(tiles):
            self.counts[t.batch_slice] = max(self.counts.get(t.batch_slice, 0), t.token_slice + 1)
            self.first_tile.setdefault(t.batch_slice, n)
        # Per tile number: whether it is its batch slice's last token slice.
        self.last_of_slice = [t.token_slice + 1 >= self.counts[t.batch_slice] for t in tiles]
        size = chunks * 3 * len(tiles)
        self.end: list[float | None] = [None] * size  # when the action of a key ended
        self.arrive: list[float | None] = [None] * size  # when what it sent arrived at the next (previous) chunk
        self.link_fwd_free = [0.0] * stages  # device k's link for activations, free from this time
        self.link_bwd_free = [0.0] * stages  # device k's link for gradients
        self.stage_free = [0.0] * stages

    def compile(self, row: Sequence[Action]) -> list[tuple]:
        """Each action as (chunk, kind, its letter, tile number, base slot, the offsets of the slots it completes,
        what it waits for as (offset, sent)): `actions.WAITS` in slot arithmetic. A slot is (chunk, kind, tile),
        base + offset; a batch slice's token slices are consecutive tiles."""
        first = self.first_tile
        return self.compile_places((a.phase, a.stage, first[a.tile.batch_slice] + a.tile.token_slice) for a in row)

    def compile_places(self, row) -> list[tuple]:
        """`compile` of actions given as (kind, chunk, tile number) (a `Layout`'s). The offsets depend only on the
        kind and where the action sits (first or last chunk, last token slice): made once per row."""
        out = []
        tiles, chunks, last = self.tiles, self.chunks, self.last_of_slice
        offsets_at: dict = {}
        for phase, c, n in row:
            later = not last[n]  # a later token slice exists
            where = (phase, c == 0, c == chunks - 1, later)
            offsets = offsets_at.get(where)
            if offsets is None:
                deps = tuple(
                    ((dc * 3 + kind) * tiles + dm, dc != 0)
                    for dc, kind, dm in _WAITS[phase]
                    if 0 <= c + dc < chunks and (dm == 0 or later)
                )
                offsets = offsets_at[where] = (tuple(kind * tiles for kind in _COMPLETES[phase]), deps)
            out.append((c, _KIND[phase], _LETTER[phase], n, c * 3 * tiles + n, *offsets))
        return out

    def walk(
        self, schedule: Sequence[Sequence[Action]], *, replica: int, step: int, record: bool = True
    ) -> list[Event]:
        """Run every device's actions in order, each as soon as its input is there; events sorted by start (none
        without ``record``).

        A device whose next action waits is woken when what it waits for is done (`actions.walk_codes`' walk): a
        pass over every device until none moves looked at each stuck device's next action once per pass, most of
        Megatron-LM's 1008B plan on 64 devices. The times do not depend on the order the devices are walked in
        (an action reads only its own device's state and what it waits for), nor do the sorted events (ties on one
        device keep its row's order)."""
        ran: list[tuple[int, int, float, float]] | None = [] if record else None
        pos = self.play([self.compile(actions) for actions in schedule], ran)
        stuck = {k: schedule[k][pos[k]] for k in range(self.stages) if pos[k] < len(schedule[k])}
        if stuck:
            raise ValueError(f"the schedule deadlocks: stages waiting forever at {stuck}")
        if ran is None:
            return []
        interleaved = self.chunks > self.stages
        events: list[Event] = []
        for k, p, start, finish in ran:
            a = schedule[k][p]
            tile, chunk = a.tile, a.stage if interleaved else None
            events.append(
                Event(k, _LETTER[a.phase], tile.batch_slice, tile.token_slice, start, finish, k, replica, step, chunk)
            )
        events.sort(key=lambda e: (e.start_s, e.stage))
        return events

    def play(self, rows: Sequence[Sequence[tuple]], ran: list | None = None) -> list[int]:
        """`walk` on compiled rows (`compile`): each device's position where it stopped (its row's length when it
        ran to the end); every action run is added to ``ran`` as (device, position, start, end), in the order run.

        An action that can run is computed in place (its tile's time on its chunk, the re-run forward of a recomputed
        chunk in its backward or I, and its output sent on over the device's link when the next chunk is on another
        device): the hottest loop of a plan, written without a call per action."""
        pos = [0] * self.stages
        end, arrive = self.end, self.arrive
        fwd, bwd, inp, wgt, recompute = self.fwd, self.bwd, self.inp, self.wgt, self.recompute
        device, chunks, send_f, send_b = self.device, self.chunks, self.send_f, self.send_b
        link_fwd, link_bwd, stage_free = self.link_fwd_free, self.link_bwd_free, self.stage_free
        waiting: dict[int, list[int]] = {}  # a slot not yet done -> the devices whose next action waits for it
        ready = deque(range(self.stages))
        while ready:
            k = ready.popleft()
            row, p = rows[k], pos[k]
            length = len(row)
            while p < length:
                c, kind, _, n, base, done, deps = row[p]
                t_ready = 0.0
                for offset, sent in deps:
                    t = arrive[base + offset] if sent else end[base + offset]
                    if t is None:
                        waiting.setdefault(base + offset, []).append(k)
                        break
                    if t > t_ready:
                        t_ready = t
                else:
                    start = stage_free[k]
                    if t_ready > start:
                        start = t_ready
                    if kind == 0:  # F
                        finish = start + fwd[c][n]
                    elif kind == 3:  # W
                        finish = start + wgt[c][n]
                    else:  # B, or I (with the re-run forward of a recomputed chunk either way)
                        own = bwd[c][n] if kind == 1 else inp[c][n]
                        finish = start + own + (fwd[c][n] if recompute[c] else 0.0)
                    arrival = finish
                    if kind == 0:
                        if c + 1 < chunks and device[c + 1] != k:
                            depart = max(finish, link_fwd[k])
                            link_fwd[k] = arrival = depart + send_f[c][n]
                    elif kind != 3 and c > 0 and device[c - 1] != k:
                        depart = max(finish, link_bwd[k])
                        link_bwd[k] = arrival = depart + send_b[c][n]
                    stage_free[k] = finish
                    for offset in done:
                        end[base + offset] = finish
                        arrive[base + offset] = arrival
                        woken = waiting.pop(base + offset, None)
                        if woken:
                            ready.extend(woken)
                    if ran is not None:
                        ran.append((k, p, start, finish))
                    p += 1
                    continue
                break
            pos[k] = p
        return pos


@dataclass(frozen=True)
class TimelineError:
    """How far a predicted timeline is from a measured one (one step, one replica)."""

    predicted_s: float
    measured_s: float
    rel_err: float  # (predicted − measured) / measured of the step's span
    action_rel_err_mean: float  # mean |predicted − measured| / measured duration, matched action by action
    matched: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _span(events: Sequence[Event]) -> float:
    return max(e.end_s for e in events) - min(e.start_s for e in events) if events else 0.0


def compare_timelines(predicted: Sequence[Event], measured: Sequence[Event]) -> TimelineError:
    """Compare a simulated timeline with a measured one of the same plan (span and per-action durations).

    The span runs from the first action's start to the last one's end in each, so the per-step constant
    (optimizer, all-reduce) and any start-up offset are left out of both.
    """
    if not predicted or not measured:
        raise ValueError("both timelines need events")
    key = lambda e: (e.stage, e.phase, e.batch_slice, e.token_slice)  # noqa: E731
    pred = {key(e): e.end_s - e.start_s for e in predicted}
    errs = []
    for e in measured:
        d = e.end_s - e.start_s
        if key(e) in pred and d > 0:
            errs.append(abs(pred[key(e)] - d) / d)
    p, m = _span(predicted), _span(measured)
    return TimelineError(
        predicted_s=p,
        measured_s=m,
        rel_err=(p - m) / m if m > 0 else float("nan"),
        action_rel_err_mean=float(np.mean(errs)) if errs else float("nan"),
        matched=len(errs),
    )
