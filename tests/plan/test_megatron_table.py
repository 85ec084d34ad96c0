"""scripts/megatron_table.py and configs/hardware/dgx-a100.toml: the node file loads as an estimate, the model FLOPs
are the paper's eq. 3 counted without recomputation, Megatron-LM's interleaved order has its published bubble, and
one small setting prints a row."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from megatron_table import SETTINGS, main, megatron_rows, megatron_virtual, model_flops  # noqa: E402

from terapipe_cli.config.hardware import load_hardware  # noqa: E402
from terapipe_cli.plan.simulate import simulate, uniform_parts  # noqa: E402
from terapipe_cli.schedule.partition import Partition  # noqa: E402
from terapipe_cli.schedule.schedule import CUSTOM, Schedule, plan_tiles  # noqa: E402


def test_the_dgx_a100_file_is_an_estimate_of_the_node():
    hw = load_hardware(ROOT / "configs" / "hardware" / "dgx-a100.toml")
    assert hw.constants == "estimated"
    assert hw.gpus_per_node == 8 and hw.device.memory_bytes == 80 * 2**30
    assert hw.device.peak_flops == 312e12 and hw.device.memory_bytes_per_s == 2039e9
    assert hw.intra_node.bytes_per_s == 300e9  # NVLink 3: 600 GB/s both ways together
    assert hw.network.bytes_per_s == 8 * 25e9  # 8 HDR HCAs of 200 Gbit/s


def test_model_flops_are_the_plans_count_and_eq_3_with_the_recomputed_forward():
    # Setting 1 (1.7B): 72·B·s·l·h² = 72·512·2048·24·2304² = 1 811 939 328 · 5 308 416, times
    # 1 + s/(6h) + V/(12·l·h) = 1 + 2048/13824 + 51200/663552 = 1 + 4/27 + 25/324 = 397/324.
    assert model_flops(SETTINGS[0]) == pytest.approx(1_811_939_328 * 5_308_416 * 397 / 324, rel=1e-12)
    # With the recomputed forward: the paper's eq. 3, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), 521/432 of it.
    eq_3 = 96 / 72 * 1_811_939_328 * 5_308_416 * 521 / 432
    assert model_flops(SETTINGS[0], recompute=True) == pytest.approx(eq_3, rel=1e-12)
    # The paper's count is near 8 FLOPs per parameter and token (its eq. 4) at 1T parameters.
    one_t = SETTINGS[-1]
    assert model_flops(one_t, recompute=True) / (8 * one_t.batch * 2048 * 1008e9) == pytest.approx(1.0, abs=0.02)


def test_the_settings_are_table_1():
    assert [s.data_parallel for s in SETTINGS] == [32, 32, 32, 32, 32, 32, 24, 15, 9, 6]
    assert [s.batch_per_replica for s in SETTINGS] == [16, 16, 16, 32, 48, 56, 96, 144, 280, 512]
    # Equal chunks: 15 layers per device (76.1B) and 3 (529.6B) take v = 3; no pipeline, no chunks.
    assert [megatron_virtual(s) for s in SETTINGS] == [1, 1, 1, 1, 2, 3, 2, 2, 3, 2]


@pytest.mark.parametrize("devices, virtual, micro", [(4, 1, 8), (4, 2, 8), (4, 2, 4), (4, 3, 12), (8, 2, 16)])
def test_megatron_order_is_legal_and_has_the_interleaved_bubble(devices: int, virtual: int, micro: int):
    slices = [(1, [16])] * micro
    part = Partition.balanced(devices * virtual * 2, devices, virtual)
    rows = megatron_rows(plan_tiles(slices), devices, virtual)
    schedule = Schedule.of_rows(slices, devices, CUSTOM, rows, (False,) * part.chunks, part)
    schedule.check()
    # Chunk actions of 1 s forward and 2 s backward: M·v chunk-steps per device plus K − 1 of fill and drain, the
    # bubble of Narayanan et al. 2021 §2.2.2 ((K − 1)/v microbatch-times).
    step = simulate(schedule, uniform_parts(1.0, 2.0), step_s=0.0).latency_s
    assert step == pytest.approx(micro * virtual * 3.0 + (devices - 1) * 3.0)


@pytest.mark.parametrize("devices, virtual, micro", [(4, 2, 8), (4, 2, 12), (4, 3, 12), (8, 2, 16), (2, 4, 6)])
def test_terapipe_interleaved_1f1b_of_whole_sequences_is_megatron_order(devices: int, virtual: int, micro: int):
    """One tile per batch slice and a multiple of K of them: the built-in interleaved 1F1B is Megatron-LM's order,
    action for action (an earlier greedy order was not: its bursts of backwards cost 16% on the 310.1B setting)."""
    slices = [(1, [16])] * micro
    part = Partition.balanced(devices * virtual * 2, devices, virtual)
    built = Schedule.build(slices, devices, "1f1b", partition=part)
    assert [list(row) for row in built.actions] == megatron_rows(plan_tiles(slices), devices, virtual)


@pytest.mark.parametrize("devices, virtual, tokens", [(2, 2, 4), (4, 2, 3), (4, 3, 2), (3, 2, 5)])
def test_interleaved_1f1b_with_token_slices_is_legal_and_no_slower_than_gpipe_order(devices, virtual, tokens):
    """With token slices a group of batch slices holds more than K tiles and the warm-up grows until no device can
    deadlock; with unit tiles the 1F1B order is then no slower than GPipe order's (and keeps fewer tiles open)."""
    slices = [(1, [16] * tokens)] * (2 * devices)
    part = Partition.balanced(devices * virtual * 2, devices, virtual)
    one_f, gpipe = (Schedule.build(slices, devices, order, partition=part) for order in ("1f1b", "gpipe"))
    one_f.check()
    cost = uniform_parts(1.0, 2.0)
    assert simulate(one_f, cost, step_s=0.0).latency_s <= simulate(gpipe, cost, step_s=0.0).latency_s


def test_one_small_setting_prints_a_row(capsys):
    assert main(["--settings", "1", "--markdown"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| # |"))
    row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    cells = dict(zip(header.strip("|").split(" | "), row.strip("|").split(" | "), strict=True))
    cells = {k.strip(): v.strip() for k, v in cells.items()}
    assert cells["model"] == "1.7B" and cells["D"] == "32" and cells["B"] == "16"
    for key in ("(a) TFLOP/s", "(b) TFLOP/s", "(b') TFLOP/s"):
        assert 0 < float(cells[key]) < 312
    assert cells["published"] == "137"
    assert "ESTIMATED" in out


def test_a_setting_that_does_not_exist_is_one_line(capsys):
    assert main(["--settings", "0,11"]) == 2
    assert "setting 0 does not exist" in capsys.readouterr().err
