"""The schedule simulator: exact on equal tiles, close to the formula on a real profile, causally consistent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from terapipe_cli.plan.costmodel import CostModel, read_profile
from terapipe_cli.plan.search import evaluate, gpipe_baseline, solve, uniform_baseline
from terapipe_cli.plan.simulate import compare_timelines, cost_model_parts, simulate, uniform_parts
from terapipe_cli.schedule.schedule import Action, Schedule, plan_tiles
from terapipe_cli.schedule.timeline import read_timeline, write_timeline

ROOT = Path(__file__).resolve().parents[2]
PROFILE = read_profile(ROOT / "configs" / "profiles" / "example-tiny-cpu.json")
SCHEMES = [
    [(1, [64])],
    [(1, [16, 16, 16, 16])] * 3,
    [(2, [40, 24]), (1, [8, 8, 48])],
    [(1, [32, 32])] * 5,
]


def constant(value: float):
    """A cost callable: every tile costs ``value`` (the formula's view of uniform_parts)."""
    return lambda b, i, j: np.full(np.broadcast(np.asarray(b), np.asarray(i), np.asarray(j)).shape, value)


@pytest.mark.parametrize("slices", SCHEMES)
@pytest.mark.parametrize("stages", [1, 2, 3, 7])
def test_equal_tiles_free_transfers_equal_the_formula_exactly(slices, stages):
    fwd, bwd = 0.375, 0.75  # exactly representable, so the comparison is exact
    sim = simulate(Schedule.build(slices, stages), uniform_parts(fwd, bwd), step_s=0.5)
    formula = evaluate(constant(fwd + bwd), slices, stages) + 0.5
    assert sim.latency_s == formula
    assert len(sim.events) == 2 * stages * len(plan_tiles(slices))


@pytest.mark.parametrize("slices", SCHEMES)
@pytest.mark.parametrize("stages", [2, 5])
def test_equal_tiles_with_transfers_pay_each_hop_once_on_the_critical_path(slices, stages):
    fwd, bwd, send = 0.5, 1.0, 0.25  # send <= fwd: the link keeps up with the stages
    tiles = len(plan_tiles(slices))
    sim = simulate(Schedule.build(slices, stages), uniform_parts(fwd, bwd, send))
    assert sim.latency_s == pytest.approx((tiles + stages - 1) * (fwd + bwd) + 2 * (stages - 1) * send, rel=1e-12)


def test_a_slow_link_becomes_the_bottleneck():
    # Transfers twice as long as the compute: the pipeline runs at the link's pace.
    slices, stages = [(1, [8] * 10)], 3
    sim = simulate(Schedule.build(slices, stages), uniform_parts(1.0, 1.0, 2.0))
    assert sim.latency_s > (10 + stages - 1) * 2.0 + 2 * (stages - 1) * 2.0
    tiles = 10
    assert sim.latency_s >= 2 * tiles * 2.0  # every message crosses each link one at a time, both directions


def _check_causality(sim, slices, stages, parts):
    tiles = plan_tiles(slices)
    idx = {(t.batch_slice, t.token_slice): n for n, t in enumerate(tiles)}
    _, _, send_f, send_b = parts(
        np.array([t.batch_size for t in tiles]),
        np.array([t.tokens for t in tiles]),
        np.array([t.token_start for t in tiles]),
    )
    ev = {(e.stage, e.phase, e.batch_slice, e.token_slice): e for e in sim.events}
    for (k, phase, d, m), e in ev.items():
        n = idx[(d, m)]
        if phase == "F" and k > 0:
            assert e.start_s >= ev[(k - 1, "F", d, m)].end_s + send_f[n] - 1e-12
        if phase == "B":
            assert e.start_s >= ev[(k, "F", d, m)].end_s
            if k < stages - 1:
                assert e.start_s >= ev[(k + 1, "B", d, m)].end_s + send_b[n] - 1e-12
    schedule = Schedule.build(slices, stages)
    for k in range(stages):
        mine = sorted((e for e in sim.events if e.stage == k), key=lambda e: e.start_s)
        assert [(e.phase, e.batch_slice, e.token_slice) for e in mine] == [
            (a.phase, a.tile.batch_slice, a.tile.token_slice) for a in schedule[k]
        ]
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:], strict=False))


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_on_the_example_profile_the_simulator_is_within_a_few_percent_of_the_formula(stages, batch_size):
    cost = CostModel(PROFILE, stages)
    L = PROFILE.model.seq_len
    for res in (
        solve(cost, seq_len=L, batch_size=batch_size, stages=stages, token_step=8),
        gpipe_baseline(cost, seq_len=L, batch_size=batch_size, stages=stages),
        uniform_baseline(cost, seq_len=L, batch_size=batch_size, stages=stages, token_step=8),
    ):
        sim = simulate(Schedule.build(res.slices, stages), cost)
        assert sim.latency_s == pytest.approx(res.predicted_s, rel=0.03)
        _check_causality(sim, res.slices, stages, cost_model_parts(cost))


def test_cost_model_parts_add_up_to_the_cost_model():
    cost = CostModel(PROFILE, 4)
    b, i, j = np.meshgrid([1, 2, 3, 4, 6], [1, 8, 13, 100, 1024], [0, 7, 500], indexing="ij")
    f, bw, sf, sb = cost_model_parts(cost)(b, i, j)
    np.testing.assert_allclose(f + bw + sf + sb, cost(b, i, j), rtol=1e-12)
    assert np.all(f > 0) and np.all(bw > f)  # the example profile's backward is about twice its forward


def test_step_constant_and_single_stage():
    cost = CostModel(PROFILE, 1)
    slices = [(1, [512, 512])]
    sim = simulate(Schedule.build(slices, 1), cost)
    f, b, _, _ = cost_model_parts(cost)(np.array([1, 1]), np.array([512, 512]), np.array([0, 512]))
    assert sim.latency_s == pytest.approx(float(f.sum() + b.sum()) + cost.step_s)
    assert sim.step_s == cost.step_s > 0


def test_a_schedule_that_cannot_finish_is_rejected():
    slices = [(1, [4, 4])]
    built = Schedule.build(slices, 2)
    t0 = plan_tiles(slices)[0]
    # Stage 0 wants a backward before any forward has reached the last stage.
    first = [Action("B", t0, 0)] + [a for a in built[0] if a != Action("B", t0, 0)]
    schedule = Schedule.of_rows(slices, 2, "custom", [first, built[1]])
    with pytest.raises(ValueError, match="deadlock"):
        simulate(schedule, uniform_parts(1.0, 1.0))


def test_timeline_round_trip_and_comparison(tmp_path: Path):
    slices, stages = [(1, [16, 16, 32])] * 2, 3
    sim = simulate(Schedule.build(slices, stages), uniform_parts(0.5, 1.0, 0.1))
    path = write_timeline(tmp_path / "sim.json", sim.events, source="simulated", latency_s=sim.latency_s)
    meta, events = read_timeline(path)
    assert meta["source"] == "simulated" and events == sim.events
    same = compare_timelines(sim.events, events)
    assert same.rel_err == 0 and same.action_rel_err_mean == 0 and same.matched == len(events)
    slower = simulate(Schedule.build(slices, stages), uniform_parts(0.5 * 1.25, 1.0 * 1.25, 0.1 * 1.25))
    err = compare_timelines(sim.events, slower.events)
    assert err.rel_err == pytest.approx(1 / 1.25 - 1)
    assert err.action_rel_err_mean == pytest.approx(1 - 1 / 1.25)
