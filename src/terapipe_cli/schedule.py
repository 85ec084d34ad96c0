"""The one schedule form: a plan's slicing scheme -> per-stage ordered actions, and the timeline they produce.

A schedule is data (as in torch.distributed.pipelining): for every stage, an ordered list of
``Action("F" | "B", tile)``. The workers walk it (and record a measured timeline), the simulator walks it
with a cost model (a predicted timeline), and the report draws both — so predicted and measured line up.

Order (SPEC §6): forward over batch slices in order and, within one, token slices in order; backward in
exactly the reverse order, because a later token slice's backward produces the key/value gradients that the
earlier slice's backward needs.

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


def build_schedule(slices: Sequence, stages: int) -> list[list[Action]]:
    """Per stage: every tile forward in pipeline order, then every tile backward in reverse order.

    Every stage gets the same order; the pipelining comes from stages waiting for their inputs, not from
    reordering — which is what makes the result identical to one device (SPEC §6).
    """
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    tiles = plan_tiles(slices)
    order = [Action("F", t) for t in tiles] + [Action("B", t) for t in reversed(tiles)]
    return [list(order) for _ in range(stages)]


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
