"""Megatron-LM's settings plan the same before and after the planner's speed-ups (a ceiling on each
partition's search, one judge over the plan and its baselines): the plans of settings 1 and 4 (b) and (b′), recorded
at a58f813 before those changes, come out again — scheme, order, recomputation, v, partition and simulated step
(priced as then: without the pass over the weight gradients on every tile, `conftest.without_accumulation`); recorded
again since the chunked head (engine/loss.py) makes its logits again in the backward (the analytic head's backward
has one product more) and keeps no logits (setting 4's batch slices, chosen under the memory limit, reordered). The
pipelined settings take minutes each on this machine: `python scripts/bench_planner.py --commands --cases megatron
--record FILE` records and times them all (docs/results.md)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, without_accumulation

sys.path.insert(0, str(ROOT / "scripts"))
from megatron_table import DEFAULT_TOKEN_STEP, SETTINGS, TOKEN_STEP, setting_profile, terapipe_plan  # noqa: E402

from terapipe_cli.config.hardware import load_hardware  # noqa: E402

# (setting, recompute) -> (short form, order, recompute per chunk, v, layers, simulated step s)
RECORDED = {
    (1, None): ("[(8, [1136, 912])] * 2", "1f1b", [False], 1, [24], 1.9941980885488242),
    (1, True): ("[(8, [1144, 904])] * 2", "gpipe", [True], 1, [24], 2.554619686440838),
    (4, None): (
        "[(6, [2048])] + [(5, [2048])] + [(6, [2048])] + [(5, [2048])] * 3", "1f1b", [False], 1, [40],
        5.6845458863475695,
    ),
    (4, True): (
        "[(6, [2048])] * 2 + [(8, [1160, 888])] + [(6, [2048])] * 2", "1f1b", [True], 1, [40], 7.63192163244762,
    ),
}  # fmt: skip


@pytest.mark.parametrize("number", [1, 4])
def test_megatron_settings_plan_as_recorded(number):
    setting = next(s for s in SETTINGS if s.number == number)
    g = TOKEN_STEP.get(number, DEFAULT_TOKEN_STEP)
    hardware = without_accumulation(load_hardware(ROOT / "configs" / "hardware" / "dgx-a100.toml"))
    profile = setting_profile(setting, hardware, g)
    for recompute in (None, True):
        planned = terapipe_plan(profile, setting, g, recompute)[0].planned
        form, order, chunks, v, layers, simulated = RECORDED[(number, recompute)]
        assert planned.chosen.short_form() == form
        assert (planned.order, list(planned.recompute)) == (order, chunks)
        assert (planned.partition.virtual, list(planned.partition.layers)) == (v, layers)
        assert planned.simulated_s[planned.scheme] == pytest.approx(simulated, rel=1e-12)
