from terapipe_cli.schedule import Action, Event, Tile, build_schedule, plan_tiles, read_timeline, write_timeline


def test_plan_tiles_uneven_slices_and_batch_slices():
    tiles = plan_tiles([(2, [5, 3]), (1, [8])])
    assert tiles == [
        Tile(0, 0, 0, 2, 0, 5),
        Tile(0, 1, 0, 2, 5, 3),
        Tile(1, 0, 2, 1, 0, 8),
    ]


def test_build_schedule_forward_in_order_then_backward_reversed():
    slices = [(1, [4, 4]), (1, [2, 6])]
    schedule = build_schedule(slices, stages=3)
    assert len(schedule) == 3
    tiles = plan_tiles(slices)
    for actions in schedule:
        assert actions == [Action("F", t) for t in tiles] + [Action("B", t) for t in reversed(tiles)]


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
