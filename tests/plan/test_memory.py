"""The memory estimate (docs/design.md §10): its closed forms against its walk along the schedule. (The walk
against the bytes a stage really keeps: engine/test_memory_measured.py.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import ROOT

from terapipe_cli.models import vocab_share
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.memory import (
    LOSS_BYTES_PER_LOGIT,
    EqualSlices,
    grouping_peaks,
    loss_chunk_tokens,
    stage_memory,
    stage_sizes,
)
from terapipe_cli.schedule.schedule import Schedule, plan_tiles

PROFILE = read_profile(ROOT / "tests" / "data" / "tiny-cpu-measured-schema1.json")


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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_vocab_parallel_profile_splits_the_embedding_and_the_head(precision):
    """With ``vocab_parallel`` the first and the last stage count the fullest tensor rank's ⌈V/T⌉ rows of the token
    embedding and of the LM head — their parameters' state, the head's 16-bit copy, the logits of a chunk — plus the
    mask of the split; a profile without it (made before the runtime split them) counts them whole, as before. The
    middle stages are the same either way, and with T = 1 nothing changes."""
    V, T = 1001, 4  # 251 rows on the fullest rank
    base = replace(PROFILE, model=replace(PROFILE.model, vocab=V), tensor_parallel=T, precision=precision)
    old, new = stage_sizes(base, 4), stage_sizes(replace(base, vocab_parallel=True), 4)
    H, gone = base.model.hidden, V - vocab_share(V, T)
    state_per_param = float(PROFILE.raw.get("state_bytes_per_param", 16.0))
    assert vocab_share(V, T) == 251
    for k in (0, 3):
        assert old[k].state - new[k].state == gone * H * state_per_param
    assert old[1:3] == new[1:3]
    # The chunked head keeps nothing of size V for the backward: its logits are one chunk's, for a moment.
    assert old[3].tile == new[3].tile
    L = base.model.seq_len
    chunks = [min(loss_chunk_tokens(rows), L) for rows in (V, vocab_share(V, T))]
    logits = chunks[0] * V * LOSS_BYTES_PER_LOGIT - chunks[1] * vocab_share(V, T) * LOSS_BYTES_PER_LOGIT
    assert old[3].transient - new[3].transient == pytest.approx(logits + (2 * gone * H if precision == "bf16" else 0))
    assert new[0].tile - old[0].tile == 9  # the local token ids and the mask of those held elsewhere
    assert old[3].copies - new[3].copies == (2 * gone * H if precision == "bf16" else 0)
    schedule = Schedule.build([(1, [256] * 4)] * 2, 4, "gpipe")
    whole, split = (
        [m.total_bytes for m in stage_memory(schedule, p)] for p in (base, replace(base, vocab_parallel=True))
    )
    assert split[0] < whole[0] and split[3] < whole[3] and split[1:3] == whole[1:3]
    one = replace(base, tensor_parallel=1)
    assert stage_sizes(one, 4) == stage_sizes(replace(one, vocab_parallel=True), 4)
