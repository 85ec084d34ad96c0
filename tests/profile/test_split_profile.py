"""A profile of schema /2 times a tile's backward split as the zero-bubble executor runs it (docs/design.md §11b): I
and W measured through the runtime's `StageRunner.backward_input` / `backward_weight`, or estimated from the
architecture's kernel tables (`--analytic`). No timing is asserted: what is there, its shape and sign."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.models import GptConfig, backward_input_share
from terapipe_cli.plan.costmodel import profile_from_dict
from terapipe_cli.profile.analytic import analytic_profile, layer_seconds, layer_seconds_split
from terapipe_cli.profile.tiles import Point, context_points, token_grid
from terapipe_cli.profile.timer import TileTimer, time_points

ROOT = Path(__file__).resolve().parents[2]
MICRO = GptConfig(name="micro", layers=2, hidden=32, heads=2, vocab=16, seq_len=64)


def test_the_timer_times_i_and_w_through_the_runtimes_split(monkeypatch):
    timer = TileTimer(MICRO, torch.device("cpu"))
    runner, calls = timer.runner, []
    for name in ("backward_input", "backward_weight"):
        method = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    with runner.step():
        for b, i in [(1, 8), (2, 32)]:
            times = timer.time_tile_split(b, i)
            assert len(times) == 4 and all(t > 0 for t in times)
            assert runner.pending_tiles == 0  # every tile's graph is gone, its W's too
        assert calls == ["backward_input", "backward_weight"] * 2
        assert len(timer.time_tile(1, 8, 16)) == 2 and calls == ["backward_input", "backward_weight"] * 2


class _FakeEvent:
    """A CUDA event's interface on the host clock: the CUDA branch's bookkeeping, run on a CPU."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _FakeEvent) -> float:
        return (other.t - self.t) * 1e3  # milliseconds, as CUDA's

    def synchronize(self) -> None:
        pass


def test_the_cuda_branch_times_the_split_by_events(monkeypatch):
    timer = TileTimer(MICRO, torch.device("cpu"))
    for b, n in [(2, 16), (1, 8)]:
        timer._tensors(b, n)  # the inputs made on the CPU, before the timer takes itself for a GPU
    timer.device = torch.device("cuda")  # the CUDA branch; the runner stays on the CPU
    timer._events = [_FakeEvent() for _ in range(5)]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with timer.runner.step():
        times = timer.time_tile_split(2, 16)
        assert len(times) == 4 and all(t > 0 for t in times)
        assert all(t > 0 for t in timer.time_tile(1, 8, 8))
    assert timer.runner.pending_tiles == 0


def test_time_points_split_the_grid_tiles_in_the_same_visits():
    timer = TileTimer(MICRO, torch.device("cpu"))
    grid = [Point(b, n, 0, "grid") for b in (1, 2) for n in token_grid(64, 8, quick=True)]
    pts = grid + context_points((1, 2), token_grid(64, 8, quick=True), 64, 8, fit=4, heldout=2, seed=0)
    t = time_points(timer, pts, repeats=2, warmup_all=False, seed=0, split=True)
    for k, p in enumerate(pts):
        if p.role == "grid":  # one I and one W per visit, as many as the whole backward's
            assert len(t.input[k]) == len(t.weight[k]) == len(t.backward[k]) >= 2
            assert min(t.input[k]) > 0 and min(t.weight[k]) > 0
        else:  # a context tile is not split (its context adds to I alone)
            assert t.input[k] == t.weight[k] == []
    med = t.stats("input")[0]
    assert np.all(np.isfinite(med[: len(grid)])) and np.all(np.isnan(med[len(grid) :]))
    assert time_points(timer, grid[:2], repeats=1, warmup_all=False, seed=0).input is None  # not asked: none


@pytest.mark.parametrize("hardware", ["v100", "a100-dispatch"])
@pytest.mark.parametrize("name", ["gpt3-1b", "llama3-8b"])
def test_an_analytic_profile_splits_i_and_w_by_the_kernel_tables(hardware, name):
    model = load_model_config(ROOT / "configs" / "models" / f"{name}.toml")
    hw = load_hardware(ROOT / "configs" / "hardware" / f"{hardware}.toml")
    obj = analytic_profile(model, hw, batch_sizes=(1, 2), token_step=256)
    prof = profile_from_dict(obj, "analytic")
    assert obj["schema"] == "terapipe.profile/3" and prof.split_source == "analytic"
    inputs, weights = prof.split_grids()
    assert inputs.shape == weights.shape == prof.backward_s.shape
    assert np.all(inputs > 0) and np.all(weights > 0)
    # Each part at least what it computes, together at least the whole backward (each at its own dispatch floor).
    assert np.all(inputs + weights >= prof.backward_s * (1 - 1e-12))
    if not hw.device.dispatch_s:
        np.testing.assert_allclose(inputs + weights, prof.backward_s, rtol=1e-12)
    # W's products run over the tile's own rows: its context changes I alone, W not at all.
    b, i = 2.0, np.array([256.0, 1024.0])
    f0, b0, i0, w0 = layer_seconds_split(model, hw, b, i, 0.0)
    f1, b1, i1, w1 = layer_seconds_split(model, hw, b, i, 1024.0)
    np.testing.assert_array_equal(w0, w1)
    assert np.all(i1 >= i0) and i1[-1] > i0[-1]  # (a short tile's I can stay at its dispatch floor)
    assert [x.tolist() for x in layer_seconds(model, hw, b, i, 1024.0)] == [f1.tolist(), b1.tolist()]
    # Without floors, I's share of the FLOPs-bound backward is near the architecture's FLOP ratio.
    share = backward_input_share(model, b, i, 0)
    assert np.all((0.5 < share) & (share < 1))
