"""The memory traced from the runtime on fake tensors (`profile.memtrace`) and the estimate that reads it
(`plan.memory` with `plan.traced`).

The traced coefficients of a small model are stored (tests/data/memtrace-*.json, made by ``scripts/bench_memory.py
--part trace`` with the model below, layers 4): tracing one takes a minute or two of CPU, while walking one step of a
schedule on fake tensors takes a second. The estimate is held against that walk (the tracked peak) on schedules
the coefficients were not fitted on: GPipe, 1F1B, ZB-H1, recomputation, unequal batch slices, fp32 and bf16."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import ROOT

from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.memory import stage_memory, stage_sizes
from terapipe_cli.plan.traced import _forms, traced_from_dict
from terapipe_cli.profile.memtrace import (
    LiveBytes,
    _fit_pieces,
    _head_shapes,
    cuda_block_bytes,
    envelope,
    tracked_step_peaks,
)
from terapipe_cli.schedule.schedule import Schedule

BUNDLED = read_profile(ROOT / "configs" / "profiles" / "tiny-cpu-measured.json")


def _traced_profile(precision: str):
    obj = json.loads((ROOT / "tests" / "data" / f"memtrace-{precision}.json").read_text())
    # Two layers: the coefficients are per layer and per stage kind, whatever the model's depth.
    cfg = ModelConfig.from_dict(dict(obj.pop("model"), layers=2), "memtrace")
    params = cfg.params_per_layer(1)
    prof = replace(
        BUNDLED, model=cfg, precision=precision, params_per_layer=params, tensor_parallel=1, vocab_parallel=True,
        activation_bytes_per_token_per_layer=None, memory=traced_from_dict(obj, "memtrace"),
    )  # fmt: skip
    return cfg, prof


def test_live_bytes_counts_each_storage_once_until_it_is_released():
    live = LiveBytes()
    with live:
        a = torch.empty(1000, dtype=torch.float32)
        view = a[10:]  # the same storage: nothing more
        b = a * 2
        assert live.alive == 8000
        del b
        assert live.alive == 4000 and live.peak == 8000
        del a
        assert live.alive == 4000  # the view still holds the storage
        del view
    assert live.alive == 0


def test_the_cuda_allocator_rounds_requests_into_its_blocks():
    assert cuda_block_bytes(1) == 512
    assert cuda_block_bytes(5 * 2**20 + 1) == 5 * 2**20 + 512  # split from a 20 MiB segment
    assert cuda_block_bytes(11 * 2**20 + 1) == 12 * 2**20  # its own segment, 2 MiB rounded


# Two cheap cases (a step on fake tensors costs its ops' dispatch: ~1 s for a few tiles); the grid of 22 shapes and
# schemes is scripts/bench_memory.py --part grid.
# Two cheap cases (a step on fake tensors costs its ops' dispatch: a few seconds for a few tiles); the grid of 22 shapes
# and schemes is scripts/bench_memory.py --part grid. The last number of each: how far under the tracked peak the
# estimate may be. The target is 2% under at most; the split backward's schedules do not meet it yet (the K/V
# gradients I and W hand back are not all the trace sees: 4-6% under on this case).
CASES = [
    ("ZB-H1, unequal, recomputed on stage 0", [(2, [64, 64]), (1, [96, 160])], 2, "zb1p", [True, False], "fp32", 0.07),
    ("K = 1, sliced, bf16", [(1, [128, 128])], 1, "gpipe", [False], "bf16", 0.02),
]  # fmt: skip


@pytest.mark.parametrize("name, slices, stages, order, recompute, precision, under", CASES, ids=[c[0] for c in CASES])
def test_the_traced_estimate_holds_the_tracked_peak(name, slices, stages, order, recompute, precision, under):
    """Within 5% over the live bytes of the step walked on fake tensors (and ``under`` below them)."""
    cfg, prof = _traced_profile(precision)
    schedule = Schedule.build(slices, stages, order, recompute)
    estimate = [m.activation_bytes for m in stage_memory(schedule, prof)]
    tracked = tracked_step_peaks(cfg, schedule, precision=precision)
    for k, (est, got) in enumerate(zip(estimate, tracked, strict=True)):
        assert -under <= (est - got) / got <= 0.05, f"stage {k}: estimate {est:.0f}, tracked {got:.0f}"


def test_the_traced_fit_holds_on_tiles_it_was_not_fitted_on():
    for precision in ("fp32", "bf16"):
        _, prof = _traced_profile(precision)
        assert prof.memory.heldout_rel_err_max < 0.05


def test_the_hand_formulas_keep_what_the_trace_keeps():
    """The fallback for profiles without traces: what a tile keeps per token (its transients apart, which only the
    trace sees) within 10% of the traced, stage by stage."""
    cfg, prof = _traced_profile("fp32")
    kv = 2.0 * cfg.kv_width * 4
    hand = stage_sizes(replace(prof, memory=None, activation_bytes_per_token_per_layer=_measured_activation(cfg)), 2)
    traced = stage_sizes(prof, 2)
    for h, t in zip(hand, traced, strict=True):
        assert h.tile == pytest.approx(t.tile, rel=0.10)
        assert h.cache == pytest.approx(t.cache, rel=0.01) and h.cache == pytest.approx(kv * cfg.layers / 2)


def _measured_activation(cfg: ModelConfig) -> float:
    """One layer's kept bytes per token as `terapipe profile` measures them (the hand formulas' input)."""
    from terapipe_cli.profile.timer import TileTimer

    timer = TileTimer(cfg, torch.device("cpu"))
    with timer.runner.step():
        return timer.activation_bytes_per_token(1, 64)[0]


def test_a_quantity_takes_the_forms_of_its_piece_of_tile_tokens():
    """``pieces``: tiles of more than ``above_tokens`` tokens b·i take the piece's forms, the rest the base's."""
    base = {"no_context": [[0, 1, 0, 0]], "context": [[0, 2, 0, 0]]}
    obj = dict(base, pieces=[{"above_tokens": 100, "no_context": [[100, 0, 0, 0]], "context": [[200, 0, 0, 0]]}])
    forms = _forms(obj, "q")
    assert forms(1, [50, 100, 400], 0).tolist() == [50, 100, 100]
    assert forms([1, 2], 100, 8).tolist() == [200, 200]
    with pytest.raises(UserError):
        _forms(dict(base, pieces=[{"above_tokens": 0, **base}]), "q")


def test_the_head_is_fitted_in_pieces_that_stop_growing_at_its_chunk():
    """A transient shaped as the chunked head's (engine/loss.py): linear in n = b·i up to the chunk c, then a chunk's
    logits, the tile's own bytes and a weight gradient's block shrinking as 1/n. Fitted in the pieces `trace_memory`
    fits, it holds every tile a plan may run from above, within 5% (on the tiles it was fitted and checked on, 3%),
    where one linear fit through tiles of both sides of c doubles a whole sequence's."""
    L, c, V = 4096, 1024, 65536.0

    def head(n):
        n = np.asarray(n, dtype=float)
        return 1e6 + 64.0 * n + np.where(n <= c, 4 * V * n + 2e8, 4 * V * c + 2e8 * c / n)

    fitted = []
    for k, (lo, hi, shapes) in enumerate(_head_shapes(L, c)):
        fit, held = shapes["no_context"]
        got = _fit_pieces(fit, [[float(head(b * i))] for b, i, _ in fit], L, (lo, hi), k > 0)
        fitted.extend(got)
        for b, i, _ in fit + held:
            forms = [f for above, f in got if b * i > above or above == got[0][0]][-1]
            assert float(envelope(forms, b, i, 0)) == pytest.approx(float(head(b * i)), rel=0.03)
    assert [round(above) for above, _ in fitted[:4]] == [0, c, round(c * 2**0.5), 2 * c] and fitted[-1][0] >= 64 * L
    n = np.unique(np.geomspace(1, 128 * L, 400).round())
    est = np.zeros_like(n)
    for above, forms in fitted:
        est = np.where(n > above, envelope(forms, 1, n, 0), est)
    assert np.all(est >= head(n) * (1 - 1e-9)) and np.all(est <= head(n) * 1.05)
    assert not _head_shapes(256, 2**16)  # no tile reaches the chunk: the quantity's own forms only


def test_every_case_of_the_memory_bench_is_a_model_that_loads(monkeypatch):
    """scripts/bench_memory.py's grid and device cases name models the config accepts (a case that stopped loading
    when a setting moved would end the GPU step or the grid at that case)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    bench = importlib.import_module("bench_memory")
    cases = bench.grid_cases() + bench.device_cases(True) + bench.device_cases(False)
    assert len(cases) >= 20
    for case in cases:
        ModelConfig.from_dict(case.model, case.name)
