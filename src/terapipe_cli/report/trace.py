"""``trace.json`` in the Chrome trace event format (opens in Perfetto, https://ui.perfetto.dev, and
chrome://tracing): one process per rank, one complete ("X") event per forward or backward action.

Timeline files give times from each step's start; steps are laid end to end here, each starting after the
previous steps' measured ``iteration_s`` (the time between two step starts also holds a few microseconds of
logging, which the trace leaves out). Several runs go into one trace as separate groups of processes
(process ids ``offset + rank``), so a run and its baseline can be compared in one view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.schedule.schedule import plan_tiles
from terapipe_cli.schedule.timeline import Event


@dataclass
class TraceRun:
    """One run for the trace: its ranks' events, per-step latency, and names."""

    label: str  # "TeraPipe", "GPipe"
    events: dict[int, list[Event]]  # rank -> events
    iteration_s: Sequence[float]  # per step, steps 1..n
    layout: Layout  # where each rank sits (stage, replica, tensor rank)
    slices: Sequence  # to name tiles by their sizes
    steps: tuple[int, int] | None = None  # the first and last step of these events (None: every step)


def chrome_trace(runs: Sequence[TraceRun]) -> dict:
    """The trace object: ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` with µs timestamps."""
    out: list[dict] = []
    pid_offset = 0
    for run in runs:
        step_start = [0.0]
        for dt in run.iteration_s:
            step_start.append(step_start[-1] + float(dt))
        tiles = {(t.batch_slice, t.token_slice): (n, t) for n, t in enumerate(plan_tiles(run.slices))}
        for rank in sorted(run.events):
            pid = pid_offset + rank
            out.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "name": "process_name",
                    "args": {"name": f"{run.label} · rank {rank} ({run.layout.describe(rank)})"},
                }
            )
            out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
            out.append({"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}})
            out.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "steps"}})
            first, last = run.steps or (1, len(run.iteration_s))
            for step, dt in enumerate(run.iteration_s, 1):
                if not first <= step <= last:
                    continue
                out.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": 1,
                        "name": f"step {step}",
                        "cat": "step",
                        "ts": step_start[step - 1] * 1e6,
                        "dur": float(dt) * 1e6,
                        "args": {"step": step},
                    }
                )
            for e in run.events[rank]:
                if not first <= e.step <= min(last, len(run.iteration_s)):
                    continue
                n, tile = tiles.get((e.batch_slice, e.token_slice), (None, None))
                args = {"step": e.step, "batch_slice": e.batch_slice, "token_slice": e.token_slice}
                if tile is not None:
                    args.update(tile=n, sequences=tile.batch_size, tokens=tile.tokens, context=tile.token_start)
                chunk = "" if e.chunk is None else f" (chunk {e.chunk})"
                if e.chunk is not None:
                    args["chunk"] = e.chunk
                out.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": 0,
                        "cat": "forward" if e.phase == "F" else "backward",
                        "name": f"{e.phase} tile {n if n is not None else '?'}{chunk}",
                        "ts": (step_start[e.step - 1] + e.start_s) * 1e6,
                        "dur": (e.end_s - e.start_s) * 1e6,
                        "args": args,
                    }
                )
        pid_offset += max(run.events, default=-1) + 1
    return {"traceEvents": out, "displayTimeUnit": "ms"}
