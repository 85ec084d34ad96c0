#!/usr/bin/env python3
"""Simulated bubble with and without the split backward: a plan's slicing on K stages, walked by the
simulator in 1F1B order, ZB-H1 (v = 1), interleaved 1F1B and ZB-H1 with v = 2, and ZB-V on the V.

    python scripts/zero_bubble_table.py PROFILE.json --stages 8 --batch 16 [--token-slices 4]
    python scripts/zero_bubble_table.py PROFILE.json --stages 8 --batch 16 --planned

``--planned``: the planner's own plans instead (`terapipe plan` with every choice left to it, within the profile
device's memory): the chosen plan with the split (`--order auto`) against the best without it (the faster of
`--order gpipe` and `--order 1f1b`), each with its scheme, order, v, simulated step and bubble.

Each batch slice is one sequence cut into ``--token-slices`` equal token slices (1: whole sequences, GPipe's
slicing); the split prices I and W as the profile has them (`Profile.split_grids`). Prints the simulated step, the
bubble fraction (1 − busy / (K · span)) and the peak memory estimate of each. No torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from terapipe_cli.plan.configs import plan_configured  # noqa: E402
from terapipe_cli.plan.costmodel import CostModel, read_profile  # noqa: E402
from terapipe_cli.plan.memory import stage_memory  # noqa: E402
from terapipe_cli.plan.request import plan_request  # noqa: E402
from terapipe_cli.plan.simulate import simulate  # noqa: E402
from terapipe_cli.schedule.partition import Partition  # noqa: E402
from terapipe_cli.schedule.schedule import Schedule  # noqa: E402
from terapipe_cli.units import format_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--token-slices", type=int, default=1)
    parser.add_argument("--planned", action="store_true", help="The planner's plans with and without the split.")
    a = parser.parse_args()
    profile = read_profile(a.profile)
    if a.planned:
        planned_table(profile, a.stages, a.batch)
        return
    L, N, K = profile.model.seq_len, profile.model.layers, a.stages
    slices = [(1, [L // a.token_slices] * a.token_slices)] * a.batch
    print(f"{profile.model.name}, K = {K}, B = {a.batch}, {a.token_slices} token slice(s) of {L // a.token_slices}")
    print("| order | v | simulated step | bubble | peak memory (fullest device) |\n|---|---|---|---|---|")
    for order, v in (("1f1b", 1), ("zb1p", 1), ("1f1b", 2), ("zb1p", 2), ("zbv", 2)):
        part = Partition.balanced(N, K, v)
        schedule = Schedule.build(slices, K, order, partition=part)
        sim = simulate(schedule, CostModel(profile, K, partition=schedule.partition), step_s=0.0)
        memory = stage_memory(schedule, profile)
        peak = max(m.total_bytes for m in memory) if memory else float("nan")
        bubble = sim.stage_times().bubble_fraction
        print(f"| {order} | {v} | {sim.latency_s * 1e3:.1f} ms | {bubble:.1%} | {format_bytes(peak)} |")


def planned_table(profile, stages: int, batch: int) -> None:
    """The plan `--order auto` chooses against the best plan without the split, as `terapipe plan` makes them."""
    print(f"{profile.model.name}, K = {stages}, B = {batch}: the planner's plans (order, v and partition chosen)")
    print("| plan | scheme | order; v | simulated step | bubble | peak memory |\n|---|---|---|---|---|---|")
    plans = {}
    for order in (None, "gpipe", "1f1b"):
        request = plan_request(profile, stages=stages, batch_size=batch, order=order, virtual="auto", partition="auto")
        plans[order] = plan_configured(profile, request).planned
    without = min((plans["gpipe"], plans["1f1b"]), key=lambda p: p.simulated_s[p.scheme])
    for name, p in (("with the split (--order auto)", plans[None]), ("without (best of gpipe, 1f1b)", without)):
        schedule = p.schedule()
        sim = simulate(schedule, p.cost, step_s=0.0)
        peak = max(m.total_bytes for m in stage_memory(schedule, profile))
        print(
            f"| {name} | `{p.chosen.short_form(fold=True)}` | {p.order}; {p.partition.virtual} | "
            f"{p.simulated_s[p.scheme] * 1e3:.1f} ms | {sim.stage_times().bubble_fraction:.1%} | {format_bytes(peak)} |"
        )


if __name__ == "__main__":
    main()
