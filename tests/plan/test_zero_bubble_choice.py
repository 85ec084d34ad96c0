"""`--order auto` with the split backward (issue 37): the planner's searches price GPipe and 1F1B alike, then each
configuration is also tried with every backward split into I and W (ZB-H1 on its own partition, ZB-V as a
configuration of its own on the V), and the simulator keeps the fastest that fits. Checked against brute force:
every order planned alone, and every scheme of a small case simulated in every order."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from brute import compositions

from terapipe_cli.plan.configs import plan_configured
from terapipe_cli.plan.costmodel import CostModel, read_profile
from terapipe_cli.plan.memory import stage_memory
from terapipe_cli.plan.orders import ALL_ORDERS, order_of
from terapipe_cli.plan.partition import Partition
from terapipe_cli.plan.request import plan_request
from terapipe_cli.plan.schedule import Schedule
from terapipe_cli.plan.search import evaluate
from terapipe_cli.plan.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
PROFILE = read_profile(ROOT / "configs" / "profiles" / "tiny-cpu-measured.json")
SHAPE = {"stages": 2, "batch_size": 2, "seq_len": 256, "token_step": 64}


def _planned(order: str | None, virtual="auto", **extra):
    request = plan_request(PROFILE, **SHAPE, order=order, virtual=virtual, partition="auto", **extra)
    return plan_configured(PROFILE, request).planned


def _step(planned) -> float:
    return planned.simulated_s[planned.scheme]


@pytest.mark.parametrize("virtual", [1, 2, "auto"])
def test_auto_is_the_fastest_order_planned_alone(virtual):
    """Brute force over the orders: `--order auto` simulates as fast as the fastest of GPipe, 1F1B, ZB-H1 and ZB-V
    (with two chunks per device) each planned alone — no faster (it finds nothing they do not) and no slower."""
    orders = [o for o in ALL_ORDERS if order_of(o).placement == "interleaved" or virtual in (2, "auto")]
    alone = {o: _planned(o, virtual) for o in orders}
    auto = _planned(None, virtual)
    fastest = min(orders, key=lambda o: _step(alone[o]))
    assert _step(auto) == pytest.approx(_step(alone[fastest]), rel=1e-12)
    assert auto.order == alone[fastest].order
    # The split pays here (the measured tiny profile: W fills 1F1B's bubble), so the plan splits.
    assert order_of(auto.order).split
    assert _step(auto) < min(_step(alone[o]) for o in ("gpipe", "1f1b")) * (1 - 1e-6)


def _schemes(n_units: int, g: int):
    comps = [[u * g for u in c] for c in compositions(n_units)]
    for c in comps:
        yield [(2, c)]
    for a in comps:
        for b in comps:
            yield [(1, a), (1, b)]


def test_no_order_runs_the_objectives_optimum_faster_than_the_plan():
    """Brute force over every scheme of the small case (two batch slices or one, every token slicing) and every
    order on the balanced partition, v = 1: the objective's optimum found by enumeration, simulated in each order, is
    never faster than the plan (`--order auto`: its candidates include that optimum in every order it tries)."""
    K, L, g = SHAPE["stages"], SHAPE["seq_len"], SHAPE["token_step"]
    part = Partition.balanced(PROFILE.model.layers, K)
    cost = CostModel(PROFILE, K, partition=part, within_profile=True)
    optimum = min(_schemes(L // g, g), key=lambda s: evaluate(cost, s, K))
    request = plan_request(PROFILE, **SHAPE, order=None, virtual=1, partition="balanced")
    plan = plan_configured(PROFILE, request).planned
    for order in ("gpipe", "1f1b", "zb1p"):
        sim = simulate(Schedule.build(optimum, K, order, partition=part), cost).latency_s
        assert _step(plan) <= sim * (1 + 1e-12), order


def test_the_split_is_not_chosen_where_it_does_not_fit():
    """W keeps a tile's tensors from its forward until its W: with a limit between 1F1B's peak and ZB-H1's of the
    plans without a limit, `--order auto` plans something whose estimate fits — not ZB-H1's plan without the limit
    (it may still split a scheme of smaller tiles that fits)."""
    zb = _planned("zb1p", 1)
    plain = _planned("1f1b", 1)
    peak = lambda p: max(m.total_bytes for m in stage_memory(p.schedule(), PROFILE))  # noqa: E731
    assert peak(zb) > peak(plain)
    limit_gib = (peak(zb) + peak(plain)) / 2 / 2**30
    auto = _planned(None, 1, memory_limit_gib=limit_gib)
    assert peak(auto) <= limit_gib * 2**30
    assert (auto.chosen.slices, auto.order) != (zb.chosen.slices, zb.order)
    assert math.isfinite(_step(auto))
