"""The batch groupings of the memory-aware search (`plan.groupings`) against every composition of the batch: the
state machine's paths are exactly the groupings whose closed-form peak fits the limit, in GPipe and 1F1B order."""

from __future__ import annotations

import pytest
from brute import compositions

from terapipe_cli.plan.groupings import grouping_search
from terapipe_cli.plan.memory import StageSizes, grouping_peaks

SEQ_LEN = 16


def _paths(seq) -> set[tuple[int, ...]]:
    into: dict[int, list[tuple[int, int]]] = {}
    for a, c, r in seq.moves:
        into.setdefault(a, []).append((c, r))
    out, todo = set(), [(0, ())]
    while todo:
        state, placed = todo.pop()
        if state in seq.finals and placed:
            out.add(placed[::-1] if seq.placed_last_first else placed)
        for c, r in into.get(state, []):
            todo.append((c, (*placed, seq.row_sizes[r])))
    return out


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3])
def test_the_paths_are_the_groupings_that_fit(order, stages):
    # The first stage keeps the most per token (larger caches), the others alike; a limit that binds part-way.
    sizes = [StageSizes(100.0, 3.0, 5.0, 1.0, 2.0)] + [StageSizes(80.0, 2.0, 4.0, 1.0, 2.0)] * (stages - 1)
    batch, counts = 7, []
    for limit in (100.0 + 3 * SEQ_LEN * 8, 100.0 + 5 * SEQ_LEN * 8, 100.0 + 7 * SEQ_LEN * 8, 1e9):
        seq = grouping_search(sizes, batch, SEQ_LEN, 4, order, limit, recompute=False)
        fitting = {
            g
            for g in compositions(batch)
            if max(grouping_peaks(list(g), None, sizes, SEQ_LEN, order, [False] * stages)) <= limit
        }
        assert _paths(seq) == fitting, limit
        counts.append(len(fitting))
    # GPipe keeps every batch slice open: all groupings fit or none. In 1F1B order the limits bind part-way.
    assert counts[-1] == 2 ** (batch - 1)
    assert any(0 < n < counts[-1] for n in counts) == (order == "1f1b")


def test_too_many_rows_is_no_search():
    # Recomputed, every (size, sequences open) pair is a row of its own: 7 sizes at 65 token steps is over the cells.
    sizes = [StageSizes(100.0, 3.0, 5.0, 1.0, 2.0)] * 2
    assert grouping_search(sizes, 200, 4096, 4, "gpipe", 1e9, recompute=True) is None
