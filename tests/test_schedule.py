from terapipe_cli.plan.schedule import Action, Schedule, Tile, plan_tiles
from terapipe_cli.plan.timeline import Event, read_timeline, write_timeline


def test_plan_tiles_uneven_slices_and_batch_slices():
    tiles = plan_tiles([(2, [5, 3]), (1, [8])])
    assert tiles == [
        Tile(0, 0, 0, 2, 0, 5),
        Tile(0, 1, 0, 2, 5, 3),
        Tile(1, 0, 2, 1, 0, 8),
    ]


def test_build_schedule_forward_in_order_then_backward_reversed():
    slices = [(1, [4, 4]), (1, [2, 6])]
    schedule = Schedule.build(slices, stages=3)
    assert len(schedule) == 3
    tiles = plan_tiles(slices)
    for k, actions in enumerate(schedule):
        assert list(actions) == [Action("F", t, k) for t in tiles] + [Action("B", t, k) for t in reversed(tiles)]


def test_timeline_round_trip(tmp_path):
    events = [Event(stage=1, phase="F", batch_slice=0, token_slice=2, start_s=0.5, end_s=0.75, rank=1, step=3)]
    path = write_timeline(tmp_path / "t.json", events, rank=1, source="measured")
    meta, back = read_timeline(path)
    assert meta == {"rank": 1, "source": "measured"}
    assert back == events


def test_timeline_rejects_bad_phase(tmp_path):
    import json

    import pytest

    from terapipe_cli.errors import UserError

    p = tmp_path / "t.json"
    p.write_text(
        json.dumps(
            {
                "schema": "terapipe.timeline/1",
                "meta": {},
                "events": [{"stage": 0, "phase": "X", "batch_slice": 0, "token_slice": 0, "start_s": 0, "end_s": 1}],
            }
        )
    )
    with pytest.raises(UserError, match="phase"):
        read_timeline(p)


def test_1f1b_runs_each_batch_slice_forward_then_backward_reversed_with_bounded_lookahead():
    import pytest

    from terapipe_cli.plan.simulate import simulate, uniform_parts

    slices = [(1, [3, 5])] * 5
    stages = 3
    schedule = Schedule.build(slices, stages, "1f1b")
    for k, actions in enumerate(schedule):
        # Every tile once forward and once backward; a batch slice's tiles forward in order, backward reversed.
        assert len(actions) == 2 * len(plan_tiles(slices))
        assert {(a.phase, a.tile) for a in actions} == {(p, t) for p in "FB" for t in plan_tiles(slices)}
        for d in range(len(slices)):
            mine = [(a.phase, a.tile.token_slice) for a in actions if a.tile.batch_slice == d]
            assert mine == [("F", 0), ("F", 1), ("B", 1), ("B", 0)]
        # At most K - k batch slices are open (forward begun, backward not finished) at once.
        open_, most = set(), 0
        for a in actions:
            if a.phase == "F":
                open_.add(a.tile.batch_slice)
            elif a.tile.token_slice == 0:
                open_.discard(a.tile.batch_slice)
            most = max(most, len(open_))
        assert most == min(stages - k, len(slices))
    # The order can run: the simulator walks it without waiting forever (it raises when an order deadlocks).
    sim = simulate(schedule, uniform_parts(1.0, 2.0), step_s=0.0)
    gpipe = simulate(Schedule.build(slices, stages), uniform_parts(1.0, 2.0), step_s=0.0)
    assert sim.latency_s == pytest.approx(gpipe.latency_s, rel=0.5)
    with pytest.raises(ValueError):
        Schedule.build(slices, stages, "interleaved")
