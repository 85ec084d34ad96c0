"""The schedule's vocabulary with a split backward (schedule/actions.py) and the zero-bubble order
(schedule/orders): I and W actions printed and parsed as torch.distributed.pipelining writes them, one dependency rule
for the check, the grid, the simulator and the memory walk, and ZB-H1 legal for any K, v and slicing."""

from pathlib import Path

import pytest

from terapipe_cli.errors import UserError
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.memory import stage_memory, stage_sizes
from terapipe_cli.plan.simulate import simulate, uniform_parts
from terapipe_cli.schedule.actions import Action, Phase, Tile, waits_for, walk_rows
from terapipe_cli.schedule.orders import ALL_ORDERS, ORDERS, order_of
from terapipe_cli.schedule.partition import Partition
from terapipe_cli.schedule.schedule import Schedule, parse_schedule

ROOT = Path(__file__).resolve().parents[2]
PROFILE = read_profile(ROOT / "configs" / "profiles" / "tiny-cpu-measured.json")


def test_a_kind_is_an_enum_that_prints_as_its_letter():
    t = Tile(3, 2, 0, 1, 0, 8)
    assert [str(Action(p, t, 0)) for p in "FIWB"] == ["0F3.2", "0I3.2", "0W3.2", "0B3.2"]
    assert Action("I", t).phase is Phase.I and Phase.I == "I"
    with pytest.raises(ValueError):
        Action("X", t)


def test_the_one_rule():
    t = Tile(0, 1, 0, 1, 8, 8)
    assert waits_for(Action("F", t, 0), 3, 3) == ()
    assert waits_for(Action("F", t, 2), 3, 3) == ((1, Phase.F, 0, 1),)
    assert waits_for(Action("I", t, 1), 3, 3) == ((1, Phase.F, 0, 1), (2, Phase.I, 0, 1), (1, Phase.I, 0, 2))
    assert waits_for(Action("B", t, 2), 3, 2) == ((2, Phase.F, 0, 1),)  # last chunk, last token slice
    assert waits_for(Action("W", t, 1), 3, 3) == ((1, Phase.I, 0, 1),)


def test_a_torch_format_schedule_with_i_and_w_loads_and_round_trips():
    slices = [(1, [32])] * 2
    text = "0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n"
    schedule = parse_schedule(text, slices, 2)
    assert schedule.split and schedule.to_csv() == text
    assert parse_schedule(schedule.to_csv(), slices, 2).actions == schedule.actions
    grid = schedule.grid().splitlines()
    assert "1I0" in grid[2] and "0W1" in grid[1]


SPLIT_ILLEGAL = [
    ("0F0.0,0F0.1,0I0.1,0W0.0,0I0.0,0W0.1\n1F0.0,1F0.1,1B0.1,1B0.0\n", ["action 4 '0W0.0'", "before its own I"]),
    ("0F0.0,0F0.1,0I0.1,0B0.1,0B0.0\n1F0.0,1F0.1,1B0.1,1B0.0\n", ["action 4 '0B0.1'", "runs twice"]),
    ("0F0.0,0F0.1,0I0.1,0I0.0,0W0.0\n1F0.0,1F0.1,1B0.1,1B0.0\n", ["row 1 (stage 0) lacks '0W0.1'"]),
    ("0F0.0,0F0.1,0I0.0,0I0.1,0W0.1,0W0.0\n1F0.0,1F0.1,1B0.1,1B0.0\n", ["'0I0.0'", "reverse token order"]),
    ("0F0.0,0F0.1,0I0.1,0I0.0,0W0.1,0W0.0\n1F0.0,1F0.1,1I0.0,1I0.1,1W0.1,1W0.0\n", ["'1I0.0'", "reverse token"]),
]


@pytest.mark.parametrize("text, words", SPLIT_ILLEGAL)
def test_an_illegal_split_schedule_is_refused_in_one_line(text, words):
    with pytest.raises(UserError) as e:
        parse_schedule(text, [(1, [16, 16])], 2)
    for word in words:
        assert word in str(e.value), str(e.value)


SLICINGS = {
    "whole sequences": [(1, [32])] * 4,
    "unequal token slices": [(2, [13, 1, 11, 7])],
    "two batch slices sliced differently": [(1, [20, 12]), (2, [5, 5, 22])],
    "many": [(1, [8, 8, 16])] * 5,
}


@pytest.mark.parametrize("slicing", list(SLICINGS))
def test_zb1p_is_legal_for_any_k_v_and_slicing(slicing):
    slices = SLICINGS[slicing]
    for K in range(1, 7):
        for v in range(1, 4):
            part = Partition.balanced(K * v, K, v) if v > 1 else None
            s = Schedule.build(slices, K, "zb1p", partition=part)
            s.check()  # every tile F, I and W once per chunk, in order, no deadlock
            assert s.split and all(a.phase is not Phase.B for row in s for a in row)
            # The forwards and I's in 1F1B's order: the same rows with I for B and the W's left out.
            base = Schedule.build(slices, K, "1f1b", partition=part)
            for zb_row, row in zip(s, base, strict=True):
                assert [(a.phase.replace("I", "B"), a.tile, a.stage) for a in zb_row if a.phase != "W"] == [
                    (a.phase, a.tile, a.stage) for a in row
                ]
            sim = simulate(s, uniform_parts(1.0, 2.0, 0.1))
            assert len(sim.events) == sum(len(r) for r in s)


@pytest.mark.parametrize("slicing", list(SLICINGS))
def test_zbv_is_legal_for_any_k_and_slicing_on_the_v(slicing):
    """ZB-V runs two chunks per device (v = 2) on the V placement: device k holds chunks k and 2K − 1 − k."""
    slices = SLICINGS[slicing]
    for K in range(1, 7):
        s = Schedule.build(slices, K, "zbv", partition=Partition.balanced(2 * K, K, 2))
        assert s.partition.placement == "v" and [s.device(c) for c in range(2 * K)] == [*range(K), *reversed(range(K))]
        s.check()
        one_f = simulate(Schedule.build(slices, K, "1f1b", partition=Partition.balanced(2 * K, K, 2)),
                         uniform_parts(0.5, 1.0), step_s=0.0)  # fmt: skip
        zbv = simulate(s, uniform_parts(0.5, 1.0), step_s=0.0)
        assert zbv.latency_s <= one_f.latency_s + 1e-9
    with pytest.raises(ValueError, match="two chunks per device"):
        Schedule.build(SLICINGS["many"], 2, "zbv", partition=Partition.balanced(6, 2, 3))


@pytest.mark.parametrize("K, D", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_zb1p_has_zb_h1s_bubble(K, D):
    """F = 1, I = W = 1 (B = 2), free transfers: 1F1B's step is 3D + 3(K − 1), ZB-H1's 3D + (K − 1) — the bubble of
    Qi et al.'s ZB-H1, (K − 1)(F + I − W)."""
    slices = [(1, [32])] * D
    one_f = simulate(Schedule.build(slices, K, "1f1b"), uniform_parts(1.0, 2.0), step_s=0.0).latency_s
    zb = simulate(Schedule.build(slices, K, "zb1p"), uniform_parts(1.0, 2.0), step_s=0.0).latency_s
    assert one_f == pytest.approx(3 * D + 3 * (K - 1))
    assert zb == pytest.approx(3 * D + (K - 1))


def test_the_orders_are_objects_and_the_planner_picks_among_its_own():
    assert ORDERS == ("gpipe", "1f1b") and set(ALL_ORDERS) == {"gpipe", "1f1b", "zb1p", "zbv"}
    assert order_of("zb1p").split and not order_of("1f1b").split
    assert order_of("gpipe").in_flight([1, 2, 1], 2) == [[1, 3, 4], [1, 3, 4]]
    assert order_of("1f1b").in_flight([1, 2, 1], 2) == [[3, 3, 1], [1, 2, 1]]
    with pytest.raises(ValueError, match="order must be one of"):
        order_of("interleaved")


def test_the_memory_walk_keeps_a_tile_until_its_w():
    """The split keeps each tile's graph from its F to its W, and its weight consumers' output gradients from its I:
    ZB-H1 holds at least 1F1B's peak, and the lag's W's on top (the last device, whose lag is K − 1, most); with
    recomputation the re-run's tensors stay until W too."""
    slices = [(1, [256] * 4)] * 6
    for recompute in (False, True):
        one_f = stage_memory(Schedule.build(slices, 3, "1f1b", [recompute] * 3), PROFILE)
        zb = stage_memory(Schedule.build(slices, 3, "zb1p", [recompute] * 3), PROFILE)
        assert all(z.activation_bytes >= o.activation_bytes for z, o in zip(zb, one_f, strict=True))
        assert zb[-1].activation_bytes > one_f[-1].activation_bytes
        # I then W at once is B, but for the consumers' output gradients of one tile between them.
        now = [[a for b in row for a in ((Action("I", b.tile, b.stage), Action("W", b.tile, b.stage))
                if b.phase == "B" else (b,))] for row in Schedule.build(slices, 3, "1f1b")]  # fmt: skip
        same = Schedule.of_rows(slices, 3, "custom", now, [recompute] * 3)
        assert not walk_rows(same.actions, 3)[1]
        sizes = stage_sizes(PROFILE, 3)
        for m, o, size in zip(stage_memory(same, PROFILE), one_f, sizes, strict=True):
            assert o.activation_bytes <= m.activation_bytes <= o.activation_bytes + 256 * size.weight_grads


def _walk_by_passes(rows, chunks):
    """The legality walk by its definition: pass over every row, running each row's head while what it waits for
    is done, until no row moves; the rows' stuck positions."""
    from terapipe_cli.schedule.actions import completes, token_slice_counts

    counts, done, pos = token_slice_counts(rows), set(), [0] * len(rows)
    moved = True
    while moved:
        moved = False
        for k, row in enumerate(rows):
            while pos[k] < len(row) and all(
                key in done for key in waits_for(row[pos[k]], chunks, counts[row[pos[k]].tile.batch_slice])
            ):
                done.update(completes(row[pos[k]]))
                pos[k], moved = pos[k] + 1, True
    return [(k, pos[k]) for k, row in enumerate(rows) if pos[k] < len(row)]


@pytest.mark.parametrize("seed", range(6))
def test_the_coded_walk_stops_where_the_walk_by_its_definition_does(seed):
    """`walk_rows` (keys coded as integers, rows woken by what they wait for) against the plain walk, on every
    order's rows and on the same rows with two actions of a row swapped (mostly illegal): the same stuck points,
    and every action walked once where none sticks."""
    import random

    rng = random.Random(seed)
    devices, virtual = rng.choice([(2, 1), (3, 1), (2, 2), (3, 2), (4, 2)])
    slices = [(1, [8] * rng.randint(1, 3)) for _ in range(rng.randint(1, 4))]
    for name in ALL_ORDERS:
        placement = "v" if name == "zbv" else "interleaved"
        if name == "zbv" and virtual != 2:
            continue
        part = Partition.balanced(devices * virtual, devices, virtual, placement) if virtual > 1 else None
        rows = Schedule.build(slices, devices, name, partition=part).actions
        chunks = devices * virtual
        for trial in range(3):
            rows = [list(r) for r in rows]
            if trial:
                row = rng.choice([r for r in rows if len(r) > 1])
                i, j = sorted(rng.sample(range(len(row)), 2))
                row[i], row[j] = row[j], row[i]
            walked, stuck = walk_rows(rows, chunks)
            assert stuck == _walk_by_passes(rows, chunks), (name, trial)
            if not stuck:
                assert sorted(map(str, walked)) == sorted(str(a) for r in rows for a in r)


# (K, v, batch slices of one tile): the first legal extra lies far above `least_extra`'s bound there, and extras
# are skipped on an earlier deadlock's cycle (as on Table 2's 529.6B rows).
@pytest.mark.parametrize("devices, virtual, tiles", [(8, 3, 20), (8, 3, 28), (10, 3, 24), (10, 3, 34), (12, 3, 28)])
def test_interleaved_1f1bs_extra_warm_up_is_the_first_that_walks_by_its_definition(devices, virtual, tiles):
    """`least_extra` skips extras where an earlier deadlock's cycle still stands: the first legal extra scanned one
    by one with the walk by its definition is the same."""
    from terapipe_cli.schedule.orders.base import by_slice, interleaved_forwards
    from terapipe_cli.schedule.orders.one_f_one_b import alternating_1f1b, interleaved_backwards, least_extra

    slices = [(1, [8])] * tiles
    every = list(Schedule.build(slices, devices, "gpipe").tiles)
    forward = [interleaved_forwards(k, every, devices, virtual) for k in range(devices)]
    backward = interleaved_backwards(by_slice(every, tiles), devices, virtual)
    chunks = devices * virtual
    legal = (
        e
        for e in range(len(forward[0]) + 1)
        if not _walk_by_passes(alternating_1f1b(forward, backward, virtual, e), chunks)
    )
    assert least_extra(forward, backward, chunks, virtual) == next(legal)
