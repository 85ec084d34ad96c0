"""`--order auto` with the split backward: the planner's searches price GPipe and 1F1B alike, then, on a profile that
timed I and W apart as the runtime runs them (schema /2, measured), each configuration is also tried with every
backward split into I and W (ZB-H1 on its own partition, ZB-V as a configuration of its own on the V), and the
simulator keeps the fastest that fits. Checked against brute force: every order planned alone, and every scheme of a
small case simulated in every order. From any other profile the split is an estimate: planned only when asked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from brute import compositions

from terapipe_cli.plan.configs import plan_configured, split_timed
from terapipe_cli.plan.costmodel import CostModel, Profile, profile_from_dict
from terapipe_cli.plan.memory import stage_memory
from terapipe_cli.plan.request import plan_request
from terapipe_cli.plan.search import evaluate
from terapipe_cli.plan.simulate import simulate
from terapipe_cli.schedule.orders import ALL_ORDERS, order_of
from terapipe_cli.schedule.partition import Partition
from terapipe_cli.schedule.schedule import Schedule

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
RAW = json.loads(MEASURED.read_text())


def _with_split(input_share: float, weight_share: float, source: str = "measured") -> Profile:
    """The tiny measured profile with I and W these shares of its backward (schema /2), from ``source``."""
    backward = np.asarray(RAW["backward_s"])
    obj = {**RAW, "schema": "terapipe.profile/2", "source": source}
    obj.update(backward_input_s=(input_share * backward).tolist(), backward_weight_s=(weight_share * backward).tolist())
    return profile_from_dict(obj, f"{source}-split.json")


def _schema_1() -> Profile:
    """The tiny measured profile as an older one of schema /1: its backward timed whole."""
    obj = {k: v for k, v in RAW.items() if k not in ("backward_input_s", "backward_weight_s")}
    return profile_from_dict({**obj, "schema": "terapipe.profile/1"}, "schema-1.json")


# Measured, I and W costing what B costs: the split pays (W fills the bubble), so auto's choice among every order is
# exercised.
PROFILE = _with_split(0.6, 0.4)
SHAPE = {"stages": 2, "batch_size": 2, "seq_len": 256, "token_step": 64}


def _planned(order: str | None, virtual="auto", profile: Profile = PROFILE, **extra):
    request = plan_request(profile, **SHAPE, order=order, virtual=virtual, partition="auto", **extra)
    return plan_configured(profile, request).planned


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
    # The split pays here (W fills 1F1B's bubble at no extra cost), so the plan splits.
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


ESTIMATED = {
    "schema /1": _schema_1,
    "analytic /2": lambda: _with_split(0.6, 0.4, "analytic"),
    "example /2": lambda: _with_split(0.6, 0.4, "example"),
}


@pytest.mark.parametrize("kind", list(ESTIMATED))
def test_auto_plans_the_split_only_from_a_profile_that_timed_it(kind):
    """The same split that pays when measured (the brute-force test above: auto splits there) is not planned by
    `--order auto` (v = 1, 2 and ZB-V's V) when the profile only estimates it (the runtime's two calls can cost more
    than the whole backward: the tiny model on a CPU, ~40% more); asked for (`--order zb1p`, `zbv`), it is planned,
    and its line says the split is an estimate."""
    profile = ESTIMATED[kind]()
    assert not split_timed(profile) and split_timed(PROFILE)
    assert not order_of(_planned(None, "auto", profile).order).split
    for order, virtual in (("zb1p", 1), ("zbv", "auto"))[: 2 if kind == "schema /1" else 1]:
        asked = _planned(order, virtual, profile)
        assert asked.order == order
        assert "an estimate" in asked.choice_text() and "timed apart (measured)" not in asked.choice_text()
    timed = _planned("zb1p", 1).choice_text()
    assert "of the tiles' backward, timed apart (measured)" in timed and "estimate" not in timed
