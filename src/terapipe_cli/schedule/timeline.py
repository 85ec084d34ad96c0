"""Timelines: what each stage did when, in one form for measured runs (the workers' records) and predicted ones
(`plan.simulate`), so the report draws and compares them alike. `stage_times` is the one reading of a timeline into
busy and idle time per stage and the bubble fraction.

Timeline file (schema ``terapipe.timeline/1``), one per rank or one per simulation::

    {"schema": "terapipe.timeline/1",
     "meta": {...free-form: rank, stage, replica, source ("measured" | "simulated"), device, ...},
     "events": [{"stage": 0, "phase": "F", "batch_slice": 0, "token_slice": 2,
                 "start_s": 0.0123, "end_s": 0.0190, "rank": 0, "replica": 0, "step": 3, "chunk": null}, ...]}

``stage`` is the device (its row in a picture); ``chunk`` the chunk it ran when a device runs several (interleaved
virtual stages, `schedule.partition`), else null (absent in files written before it existed).

``start_s``/``end_s`` are seconds from the start of that step (all ranks start a step together, after a
collective), so events of different ranks can be laid on one time axis. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from terapipe_cli.files import Fields, read_json, write_json_atomic
from terapipe_cli.schedule.schedule import PHASES

TIMELINE_SCHEMA = "terapipe.timeline/1"


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
    chunk: int | None = None  # the chunk (virtual stage) it ran, when a device runs several (None: the stage's one)


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
            raise ef.fail("phase", f"must be one of {', '.join(PHASES)}, got {phase!r}")
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
                chunk=ef.int("chunk", minimum=0) if e.get("chunk") is not None else None,
            )
        )
    return meta, events
