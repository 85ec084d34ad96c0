"""The memory estimate (docs/design.md §10): its closed form against its walk, and the walk against the bytes a
stage really keeps for its backward (`runtime.stage.SavedBytes`, counted from autograd's saved tensors)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import ROOT

from terapipe_cli.config.model import ModelConfig
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.memory import EqualSlices, grouping_peaks, stage_memory, stage_sizes
from terapipe_cli.plan.schedule import Schedule, plan_tiles
from terapipe_cli.profile.timer import TileTimer

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


def _measured_profile(cfg: ModelConfig, precision: str):
    """The bundled profile with this model, precision and an activation size measured here, as `terapipe profile`
    measures it."""
    timer = TileTimer(cfg, torch.device("cpu"), precision=precision)
    with timer.runner.step():
        act, _ = timer.activation_bytes_per_token(1, 64)
    params = sum(p.numel() for p in timer.runner.module.parameters())
    raw = dict(PROFILE.raw, state_bytes_per_param=16.0)
    return replace(
        PROFILE, model=cfg, precision=precision, activation_bytes_per_token_per_layer=act, params_per_layer=params,
        raw=raw,
    )  # fmt: skip


def _measured_peaks(cfg, slices, stages, order, recompute, precision):
    """Each stage's peak of kept bytes over one step, walked by the runtime's StageRunner in one process."""
    torch.manual_seed(0)
    L = cfg.seq_len
    data = torch.randint(0, cfg.vocab, (sum(b for b, _ in slices), L + 1))
    schedule = Schedule.build(slices, stages, order)
    peaks = []
    for k in range(stages):
        runner = StageRunner(cfg, k, stages, precision=precision, recompute=recompute[k])
        with runner.step():
            for a in schedule[k]:
                t = a.tile
                rows = slice(t.batch_start, t.batch_start + t.batch_size)
                cols = slice(t.token_start, t.token_start + t.tokens)
                if a.phase == "F":
                    x = data[rows, cols] if k == 0 else torch.randn(t.batch_size, t.tokens, cfg.hidden)
                    targets = data[rows, t.token_start + 1 : t.token_start + t.tokens + 1]
                    runner.forward_tile(t.batch_slice, t.token_slice, x, targets)
                else:
                    grad = None if k == stages - 1 else torch.randn(t.batch_size, t.tokens, cfg.hidden)
                    runner.backward_tile(t.batch_slice, t.token_slice, grad)
        assert runner.saved.alive == 0  # everything kept was released by the backwards
        peaks.append(runner.saved.peak)
    return peaks


CASES = [
    ("GPipe order", [(1, [96, 64, 64, 32])] * 2, 2, "gpipe", [False, False]),
    ("1F1B order", [(1, [128, 64, 64])] * 4, 2, "1f1b", [False, False]),
    ("recomputed", [(2, [160, 64, 32])], 2, "gpipe", [True, True]),
    ("1F1B, recomputed on stage 0", [(1, [64] * 4)] * 3, 3, "1f1b", [True, False, False]),
    # A grouping of the memory-aware search: batch slices of different sizes, each sliced its own way.
    ("unequal, 1F1B, recomputed", [(2, [32] * 8), (1, [64] * 4), (1, [96, 96, 64])], 3, "1f1b", [True] * 3),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name, slices, stages, order, recompute", CASES, ids=[c[0] for c in CASES])
def test_the_estimate_is_within_ten_percent_of_the_bytes_kept(name, slices, stages, order, recompute, precision):
    cfg = ModelConfig(name="mem", layers=6, hidden=128, heads=4, vocab=384, seq_len=256)
    prof = _measured_profile(cfg, precision)
    estimate = stage_memory(Schedule.build(slices, stages, order, recompute), prof)
    measured = _measured_peaks(cfg, slices, stages, order, recompute, precision)
    for k, (est, got) in enumerate(zip(estimate, measured, strict=True)):
        assert est.activation_bytes == pytest.approx(got, rel=0.10), f"stage {k}"


def test_the_memory_meter_can_fail():
    """Negative control: the meter sees what a tile keeps — a recomputed stage keeps far less than a plain one."""
    cfg = ModelConfig(name="mem", layers=2, hidden=128, heads=4, vocab=384, seq_len=256)
    slices = [(1, [128, 128])]
    plain = _measured_peaks(cfg, slices, 1, "gpipe", [False], "fp32")[0]
    rerun = _measured_peaks(cfg, slices, 1, "gpipe", [True], "fp32")[0]
    assert 0 < rerun < 0.7 * plain
