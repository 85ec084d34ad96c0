"""The memory estimate (docs/design.md §10): its closed forms against its walk along the schedule. (The walk
against the bytes a stage really keeps: engine/test_memory_measured.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT

from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.memory import EqualSlices, grouping_peaks, stage_memory, stage_sizes
from terapipe_cli.plan.schedule import Schedule, plan_tiles

PROFILE = read_profile(ROOT / "configs" / "profiles" / "tiny-cpu-measured.json")


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_the_closed_form_for_equal_batch_slices_is_the_walk(order, stages):
    """For D equal batch slices with one token slicing, `EqualSlices` gives each stage's peak without walking:
    the same number as the walk, for any slicing, with and without recomputation."""
    sizes = stage_sizes(PROFILE, stages)
    rng = np.random.default_rng(stages)
    for b, D in [(1, 1), (1, 3), (2, 2), (1, 6)]:
        for _ in range(4):
            cuts = np.sort(rng.choice(np.arange(8, 1024, 8), size=rng.integers(0, 5), replace=False))
            lengths = np.diff(np.concatenate([[0], cuts, [1024]])).tolist()
            slices = [(b, lengths)] * D
            eq = EqualSlices(sizes, b, D, 1024, order, limit=0.0)
            plain = stage_memory(Schedule.build(slices, stages, order), PROFILE)
            rerun = stage_memory(Schedule.build(slices, stages, order, [True] * stages), PROFILE)
            tiles = plan_tiles(slices[:1])
            i = np.array([t.tokens for t in tiles])
            j = np.array([t.token_start for t in tiles])
            for k in range(stages):
                assert plain[k].total_bytes == pytest.approx(eq.plain_bytes(k), rel=1e-12)
                assert rerun[k].total_bytes == pytest.approx(eq.recomputed_bytes(k, i, j).max(), rel=1e-12)
                assert rerun[k].total_bytes <= plain[k].total_bytes  # what the planner's search relies on


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_the_closed_form_for_any_grouping_is_the_walk(order, stages):
    """Batch slices of different sizes, each with its own token slicing, in any order: `grouping_peaks` (what the
    memory-aware search constrains) gives the walk's peak on every stage, with and without recomputation."""
    sizes = stage_sizes(PROFILE, stages)
    rng = np.random.default_rng(10 + stages)
    for _ in range(12):
        batch_sizes = rng.integers(1, 4, size=rng.integers(1, 7)).tolist()
        slices, worst = [], []
        for b in batch_sizes:
            cuts = np.sort(rng.choice(np.arange(8, 1024, 8), size=rng.integers(0, 5), replace=False))
            lengths = np.diff(np.concatenate([[0], cuts, [1024]])).tolist()
            slices.append((b, lengths))
            # The tile the closed form needs: the largest (j + i)·kept + i·rerun, found here by the walk's sizes.
            j = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            worst.append([(int(i), int(jj)) for i, jj in zip(lengths, j, strict=True)])
        for on in (False, True):
            walked = stage_memory(Schedule.build(slices, stages, order, [on] * stages), PROFILE)
            for k in range(stages):
                s = sizes[k]
                tiles = [max(w, key=lambda t, s=s: (t[1] + t[0]) * s.kept + t[0] * s.rerun) for w in worst]
                closed = grouping_peaks(batch_sizes, tiles, sizes, 1024, order, [on] * stages)[k]
                assert walked[k].total_bytes == pytest.approx(closed, rel=1e-12), (batch_sizes, k, on)


def test_order_and_recomputation_shrink_the_peak_and_slicing_alone_does_not():
    slices = [(1, [256] * 4)] * 4
    gpipe = stage_memory(Schedule.build(slices, 2), PROFILE)
    whole = stage_memory(Schedule.build([(1, [1024])] * 4, 2), PROFILE)
    one_f = stage_memory(Schedule.build(slices, 2, "1f1b"), PROFILE)
    rerun = stage_memory(Schedule.build(slices, 2, recompute=[True, True]), PROFILE)
    for k in range(2):
        # Every token of the step is kept in GPipe order: the same whatever the token slicing.
        assert gpipe[k].activation_bytes == pytest.approx(whole[k].activation_bytes)
        assert rerun[k].activation_bytes < one_f[k].activation_bytes < gpipe[k].activation_bytes
    assert one_f[0].activation_bytes == pytest.approx(gpipe[0].activation_bytes / 2)  # K − 0 = 2 of 4 in flight
    assert gpipe[0].state_bytes > gpipe[1].state_bytes  # the position embeddings (the head is tied in size)
