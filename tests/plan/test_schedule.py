import pytest

from terapipe_cli.errors import UserError
from terapipe_cli.plan.simulate import simulate, uniform_parts
from terapipe_cli.schedule.schedule import Action, Schedule, Tile, parse_schedule, plan_tiles
from terapipe_cli.schedule.timeline import Event, read_timeline, write_timeline


def test_plan_tiles_uneven_slices_and_batch_slices():
    tiles = plan_tiles([(2, [5, 3]), (1, [8])])
    assert tiles == [
        Tile(0, 0, 0, 2, 0, 5),
        Tile(0, 1, 0, 2, 5, 3),
        Tile(1, 0, 2, 1, 0, 8),
    ]


def test_the_gpipe_schedule_runs_forwards_in_order_then_backwards_reversed():
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


# --------------------------------------------------------------------------------------------- the object


def test_actions_print_as_torch_pipelining_does_with_the_token_slice():
    schedule = Schedule.build([(1, [8, 8]), (1, [16])], 2)
    assert [str(a) for a in schedule[1][:3]] == ["1F0.0", "1F0.1", "1F1.0"]
    assert schedule.label(schedule[0][-1]) == "0B0.0"
    gpipe = Schedule.build([(1, [16])] * 3, 2)  # one token slice per batch slice: torch's own form
    assert [gpipe.label(a) for a in gpipe[0][:3]] == ["0F0", "0F1", "0F2"]


def test_the_csv_round_trips_and_the_grid_shows_every_action_once():
    slices = [(1, [8, 8, 16])] * 3
    for order in ("gpipe", "1f1b"):
        schedule = Schedule.build(slices, 3, order, [False, True, False])
        back = parse_schedule(schedule.to_csv(), slices, 3, [False, True, False])
        assert back.actions == schedule.actions and back.recompute == schedule.recompute
        grid = schedule.grid()
        lines = grid.splitlines()
        assert len(lines) == 1 + 3 and lines[1].startswith("stage 0")
        for k in range(3):
            assert sorted(c for c in lines[1 + k].split()[2:] if c != "·") == sorted(map(str, schedule[k]))
        # Every action one step, as early as its input allows: stage k's first forward at step k.
        assert lines[2].split()[2:4] == ["·", "1F0.0"]
    assert schedule.grid(width=4).splitlines()[1].endswith("…")


ILLEGAL = [
    # (the CSV, words of its one-line error)
    (
        "0F0.0,0F0.1,0B0.0,0B0.1\n1F0.0,1F0.1,1B0.1,1B0.0\n",
        ["row 1 (stage 0), action 3 '0B0.0'", "reverse token order"],
    ),
    ("0F0.1,0F0.0,0B0.1,0B0.0\n1F0.0,1F0.1,1B0.1,1B0.0\n", ["action 1 '0F0.1'", "token order"]),
    ("0F0.0,0B0.0,0F0.1,0B0.1\n1F0.0,1F0.1,1B0.1,1B0.0\n", ["action 2 '0B0.0'", "before the last forward"]),
    ("0F0.0,0F0.1,0B0.1,0B0.0\n1F0.0,1F0.1,1B0.1\n", ["row 2 (stage 1) lacks '1B0.0'"]),
    ("0F0.0,0F0.1,0B0.1,0B0.0,0B0.0\n1F0.0,1F0.1,1B0.1,1B0.0\n", ["action 5 '0B0.0'", "runs twice"]),
    ("0F0.0,0F0.1,0B0.1,0B0.0\n0F0.0,1F0.1,1B0.1,1B0.0\n", ["row 2 (stage 1), action 1 '0F0.0'", "of stage 0"]),
    ("0F0.0,0F0.1,0B0.1,0B0.0\n", ["has 1 rows", "one per stage"]),
    ("0F0.0,0F0.1,0X0.1\n", ["'0X0.1'", "not an action"]),
    ("0F0.0,0F0.2\n", ["no token slice 2 in batch slice 0"]),
    ("0F1.0\n", ["no batch slice 1"]),
    ("0F0\n", ["batch slice 0 has 2 token slices"]),
]


@pytest.mark.parametrize("text, words", ILLEGAL)
def test_an_illegal_schedule_is_refused_in_one_line_naming_the_first_bad_action(text, words):
    with pytest.raises(UserError) as e:
        parse_schedule(text, [(1, [16, 16])], 2, where="mine.csv")
    line = str(e.value)
    assert "\n" not in line and line.startswith("mine.csv: ")
    for word in words:
        assert word in line, line


def test_a_schedule_that_deadlocks_is_refused_naming_where_each_stage_waits():
    text = "0F0.0,0F0.1,0B0.1,0B0.0,0F1,0B1\n1F1,1B1,1F0.0,1F0.1,1B0.1,1B0.0\n"
    with pytest.raises(UserError, match="deadlocks: stage 0 at '0B0.1' and stage 1 at '1F1.0'"):
        parse_schedule(text, [(1, [16, 16]), (1, [32])], 2)


def test_the_simulator_and_the_memory_walk_take_a_hand_written_schedule():
    """One object for all: a legal hand-written order is simulated and its memory walked like a built-in one."""
    slices = [(1, [16, 16]), (1, [32])]
    text = "0F1, 0F0.0, 0F0.1, 0B1, 0B0.1, 0B0.0\n1F1, 1B1, 1F0.0, 1F0.1, 1B0.1, 1B0.0\n"
    mine = parse_schedule(text, slices, 2)
    sim = simulate(mine, uniform_parts(1.0, 2.0))
    assert sorted((e.stage, e.phase, e.batch_slice, e.token_slice) for e in sim.events) == sorted(
        (a.stage, a.phase, a.tile.batch_slice, a.tile.token_slice) for row in mine for a in row
    )
    first = [e for e in sim.events if e.stage == 0][:1]
    assert (first[0].phase, first[0].batch_slice) == ("F", 1)
