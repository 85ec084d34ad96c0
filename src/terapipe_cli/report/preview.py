"""A plan seen before training (`terapipe plan --show`): its simulated step next to its GPipe baseline's, and every
stage's estimated peak memory against the limit, drawn from the `plan.choice.Planned` the planner returns."""

from __future__ import annotations

from pathlib import Path

from terapipe_cli.plan.choice import Planned
from terapipe_cli.plan.simulate import simulate
from terapipe_cli.report.figures import TimelinePanel, draw_plan
from terapipe_cli.schedule.schedule import Schedule, plan_tiles
from terapipe_cli.schedule.timeline import stage_times
from terapipe_cli.units import format_bytes, format_seconds

_LABELS = {"terapipe": "TeraPipe", "gpipe": "GPipe", "uniform": "uniform"}


def write_plan_picture(planned: Planned, path: str | Path) -> Path:
    """Draw the plan's scheme (``planned.scheme``) and GPipe, simulated by the plan's cost model in the plan's order
    and recomputation, with their memory per stage; write a PNG to ``path``."""
    r = planned.request
    names = [planned.scheme] + (["gpipe"] if planned.scheme != "gpipe" else [])
    panels, memory = [], []
    for name in names:
        result = getattr(planned, name)
        schedule = Schedule.build(result.slices, r.stages, planned.order, planned.recompute, planned.partition)
        sim = simulate(schedule, planned.cost)
        order = {(t.batch_slice, t.token_slice): n for n, t in enumerate(plan_tiles(result.slices))}
        bubble = stage_times([sim.events], r.stages).bubble_fraction
        title = (
            f"{_LABELS[name]} {result.short_form(fold=True)}\npredicted by the simulator: "
            f"{format_seconds(sim.latency_s, digits=0)} per step, bubble {bubble:.0%}"
        )
        panels.append(TimelinePanel(title, sim.events, r.stages, order, step_end_s=sim.latency_s))
        check = planned.scheme_memory.get(name)
        if check is not None:
            memory.append((_LABELS[name], [m.total_bytes for m in check.per_stage]))
    check = planned.scheme_memory.get(planned.scheme)
    limit = check.limit_bytes if check is not None and not check.copies else None
    label = f"limit: {format_bytes(limit)} {check.limit_source}" if limit else ""
    title = f"{planned.profile.model.name}: L={r.seq_len}, B={r.batch_size}, K={r.stages}, {planned.choice_text()}"
    return draw_plan(panels, memory, path, limit_bytes=limit, limit_label=label, title=title)
