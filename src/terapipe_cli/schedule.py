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

Timeline file (schema ``terapipe.timeline/1``), one per rank or one per simulation::

    {"schema": "terapipe.timeline/1",
     "meta": {...free-form: rank, stage, replica, source ("measured" | "simulated"), device, ...},
     "events": [{"stage": 0, "phase": "F", "batch_slice": 0, "token_slice": 2,
                 "start_s": 0.0123, "end_s": 0.0190, "rank": 0, "replica": 0, "step": 3}, ...]}

``start_s``/``end_s`` are seconds from the start of that step (all ranks start a step together, after a
collective), so events of different ranks can be laid on one time axis. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from terapipe_cli.files import Fields, read_json, write_json_atomic

TIMELINE_SCHEMA = "terapipe.timeline/1"
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


@dataclass
class Event:
    """One action as it ran (measured) or would run (simulated); times in seconds from the step's start."""

    stage: int
    phase: str
    batch_slice: int
    token_slice: int
    start_s: float
    end_s: float
    rank: int = 0
    replica: int = 0
    step: int = 0


@dataclass(frozen=True)
class StageTimes:
    """Busy and idle time per stage (mean per step) and the bubble fraction of a set of steps."""

    busy_s: list[float]
    idle_s: list[float]
    span_s: float  # mean pipelined span per step
    bubble_fraction: float

    @property
    def busy_fractions(self) -> list[float]:
        """Share of the span each stage spends computing."""
        return [b / (b + i) if b + i > 0 else 0.0 for b, i in zip(self.busy_s, self.idle_s, strict=True)]

    def to_dict(self) -> dict:
        return {
            "span_s": self.span_s,
            "bubble_fraction": self.bubble_fraction,
            "stage_times": [
                {"stage": k, "busy_s": b, "idle_s": i, "busy_fraction": f}
                for k, (b, i, f) in enumerate(zip(self.busy_s, self.idle_s, self.busy_fractions, strict=True))
            ],
        }


def stage_times(steps: Iterable[Sequence[Event]], stages: int) -> StageTimes:
    """Busy and idle per stage over ``steps``, each the events of one step of one pipeline (measured or simulated).

    A step's pipelined *span* runs from its start (time 0) to the end of its last action on any stage; a stage is
    busy for the sum of its actions' durations and idle for the rest of the span. The bubble fraction is
    ``1 − Σ busy / (K · Σ span)``: the share of stage-time spent waiting while the pipeline runs (the per-step
    constant after the span — optimizer, all-reduce — is left out, as in the formula ``(K−1)/(M+K−1)``).
    """
    busy = [0.0] * stages
    idle = [0.0] * stages
    total_span = 0.0
    count = 0
    for events in steps:
        span = max((e.end_s for e in events), default=0.0)
        per_stage = [0.0] * stages
        for e in events:
            per_stage[e.stage] += e.end_s - e.start_s
        for k in range(stages):
            busy[k] += per_stage[k]
            idle[k] += span - per_stage[k]
        total_span += span
        count += 1
    n = max(count, 1)
    bubble = 1.0 - sum(busy) / (stages * total_span) if total_span > 0 else 0.0
    return StageTimes([b / n for b in busy], [i / n for i in idle], total_span / n, bubble)


def write_timeline(path: str | Path, events: Iterable[Event], **meta) -> Path:
    """Write a ``terapipe.timeline/1`` file atomically; ``meta`` is free-form (JSON-serialisable)."""
    return write_json_atomic(path, {"schema": TIMELINE_SCHEMA, "meta": meta, "events": [asdict(e) for e in events]})


def read_timeline(path: str | Path) -> tuple[dict, list[Event]]:
    """Read and validate a timeline file; returns (meta, events)."""
    where = str(path)
    obj = read_json(path, schema=TIMELINE_SCHEMA, what="timeline")
    f = Fields(obj, where)
    meta = f.get("meta", {})
    if not isinstance(meta, dict):
        raise f.fail("meta", "must be an object")
    events: list[Event] = []
    for n, e in enumerate(f.list("events")):
        if not isinstance(e, dict):
            raise f.fail(f"events[{n}]", "must be an object")
        ef = Fields(e, where, f"events[{n}].")
        phase = ef.str("phase")
        if phase not in PHASES:
            raise ef.fail("phase", f"must be 'F' or 'B', got {phase!r}")
        start, end = ef.number("start_s"), ef.number("end_s")
        if end < start:
            raise ef.fail("end_s", f"is before start_s ({end} < {start})")
        events.append(
            Event(
                stage=ef.int("stage", minimum=0),
                phase=phase,
                batch_slice=ef.int("batch_slice", minimum=0),
                token_slice=ef.int("token_slice", minimum=0),
                start_s=start,
                end_s=end,
                rank=ef.int("rank", minimum=0, default=0),
                replica=ef.int("replica", minimum=0, default=0),
                step=ef.int("step", minimum=0, default=0),
            )
        )
    return meta, events
