"""Analytic profiles: exact FLOP counts, roofline behaviour, and valid profiles the cost model reads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.plan.costmodel import CostModel, profile_from_dict, ring_allreduce_seconds
from terapipe_cli.profile.analytic import (
    analytic_profile,
    ends_params,
    ends_seconds,
    extended_for_batch,
    layer_flops,
    layer_seconds,
    token_grid,
)

ROOT = Path(__file__).resolve().parents[2]
HW = {n: load_hardware(ROOT / "configs" / "hardware" / f"{n}.toml") for n in ("v100", "a100", "h100")}
MODELS = {
    n: load_model_config(ROOT / "configs" / "models" / f"{n}.toml")
    for n in ("gpt3-1b", "gpt3-13b", "gpt3-44b", "gpt3-175b")
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_flops_match_the_closed_form(name: str, tp: int):
    m = MODELS[name]
    H = m.hidden
    b, i, j = np.meshgrid([1, 3, 8], [1, 8, 100, 2048], [0, 5, 1000], indexing="ij")
    fwd, bwd = layer_flops(m, b, i, j, tp)
    closed = (24 * b * i * H**2 + 4 * b * i * (i + j) * H) / tp
    np.testing.assert_allclose(fwd, closed, rtol=1e-12)
    np.testing.assert_allclose(fwd + bwd, 3 * closed, rtol=1e-12)


def test_params_per_layer_is_12h2_plus_13h_and_shards():
    m = MODELS["gpt3-175b"]
    H = m.hidden
    assert m.params_per_layer(1) == 12 * H * H + 13 * H
    # All 96 layers: the published 175B minus the embeddings (~0.6B).
    assert 173e9 < 96 * m.params_per_layer(1) < 175e9
    assert m.params_per_layer(8) < m.params_per_layer(1) / 7.9


def test_never_faster_than_peak():
    for hw in HW.values():
        for m in MODELS.values():
            i = np.array(token_grid(m.seq_len, 8), float)
            fwd, bwd = layer_seconds(m, hw, 1, i, 0, 1)
            flops_f, flops_b = layer_flops(m, 1, i, 0, 1)
            assert np.all(flops_f / fwd < hw.device.peak_flops)
            assert np.all(flops_b / bwd < hw.device.peak_flops)


CASES = [(hw, m, tp) for hw in HW for m in MODELS for tp in (1, 8)]


@pytest.fixture(scope="module")
def profiles() -> dict:
    return {(hw, m, tp): analytic_profile(MODELS[m], HW[hw], tensor_parallel=tp) for hw, m, tp in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_profile_is_valid_and_the_cost_model_reads_it(profiles, case):
    obj = profiles[case]
    prof = profile_from_dict(obj, "analytic")
    assert prof.source == "analytic" and prof.dtype_bytes == 2 and obj["dtype"] == "fp16"
    assert prof.token_lengths[0] == 8 and prof.token_lengths[-1] == MODELS[case[1]].seq_len
    assert all(b - a == 8 for a, b in zip(prof.token_lengths, prof.token_lengths[1:], strict=False))
    stages = 4
    cost = CostModel(prof, stages=stages, data_parallel=2)
    assert cost.allreduce_s > 0 and cost.step_s > cost.allreduce_s
    t = cost(np.array([1, 1, 2]), np.array([256, 256, 256]), np.array([0, 1024, 1024]))
    assert np.all(t > 0) and t[1] > t[0] and t[2] > t[1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_time_per_token_falls_until_the_device_is_saturated(profiles, case):
    prof = profile_from_dict(profiles[case], "analytic")
    lengths = np.array(prof.token_lengths, float)
    for b, row in zip(prof.batch_sizes, prof.forward_s + prof.backward_s, strict=True):
        per_token = row / lengths
        best = int(np.argmin(per_token))
        # Short slices under-use the device: time per token falls strictly up to 64 tokens and keeps
        # falling (allowing for float noise) until the best length, which is a long slice.
        assert np.all(np.diff(per_token[lengths <= 64]) < 0)
        assert np.all(np.diff(per_token[: best + 1]) <= 1e-12 * per_token[0])
        assert lengths[best] >= 128
        if b == 1:  # one sequence, 8 tokens: most of the device idles
            assert per_token[0] > 3 * per_token[best]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_context_fit_is_checked_on_held_out_points(profiles, case):
    ctx = profiles[case]["context"]
    for part in ("forward", "backward"):
        assert ctx[part]["heldout_points"] >= 20
        assert ctx[part]["heldout_rel_err_mean"] < 0.02
        assert ctx[part]["heldout_rel_err_max"] < 0.15


def test_context_costs_grow_with_context(profiles):
    prof = profile_from_dict(profiles[("v100", "gpt3-13b", 8)], "analytic")
    cost = CostModel(prof, stages=1)
    j = np.arange(0, 2048 - 64, 64)
    # Launch-bound attention kernels make a short context free; beyond that every context token costs.
    extra = cost.context(1, 64, j)
    assert np.all(np.diff(extra) >= 0) and np.all(np.diff(extra[j >= 512]) > 0)
    # The fit follows the analytic model it was fitted to.
    f, b = layer_seconds(MODELS["gpt3-13b"], HW["v100"], 1, 64, j[1:], 8)
    np.testing.assert_allclose(cost.no_context(1, 64) + cost.context(1, 64, j[1:]), f + b, rtol=0.05)


def test_data_parallel_allreduce_uses_the_shared_network(profiles):
    hw, m = HW["v100"], MODELS["gpt3-13b"]
    prof = profile_from_dict(profiles[("v100", "gpt3-13b", 8)], "analytic")
    cost = CostModel(prof, stages=20, data_parallel=4)
    # The fullest stage: two layers and the embedding (its rows split over the tensor ranks), fp16 gradients.
    grad_bytes = (2 * m.params_per_layer(8) + max(ends_params(m, 8, vocab_parallel=True))) * 2
    shared = {"latency_s": hw.network.latency_s, "bytes_per_s": hw.network.bytes_per_s / hw.gpus_per_node}
    assert cost.allreduce_s == pytest.approx(float(ring_allreduce_seconds(grad_bytes, 4, **shared)))


def test_ring_allreduce_formula():
    link = HW["v100"].intra_node
    over = {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s}
    assert ring_allreduce_seconds(1e6, 1, **over) == 0
    expect = 6 * link.latency_s + 6 / 4 * 1e6 / link.bytes_per_s
    assert ring_allreduce_seconds(1e6, 4, **over) == pytest.approx(expect)


def test_tensor_parallel_speeds_a_layer_up_but_not_linearly():
    m, hw = MODELS["gpt3-175b"], HW["v100"]
    f1, b1 = layer_seconds(m, hw, 1, 512, 0, 1)
    f8, b8 = layer_seconds(m, hw, 1, 512, 0, 8)
    assert (f1 + b1) / 8 < f8 + b8 < (f1 + b1) / 4


@pytest.mark.parametrize(
    "kwargs, where",
    [
        ({"tensor_parallel": 16}, "tensor_parallel"),
        ({"tensor_parallel": 3}, "tensor_parallel"),
        ({"tensor_parallel": 0}, "tensor_parallel"),
        ({"token_step": 0}, "token_step"),
        ({"batch_sizes": []}, "batch_sizes"),
    ],
)
def test_bad_options_are_user_errors(kwargs, where):
    with pytest.raises(UserError, match=where):
        analytic_profile(MODELS["gpt3-1b"], HW["v100"], **kwargs)


def test_token_step_one_and_short_sequences():
    tiny = load_model_config(ROOT / "configs" / "models" / "tiny.toml")
    obj = analytic_profile(tiny, HW["v100"], token_step=1, batch_sizes=(1,))
    prof = profile_from_dict(obj, "analytic")
    assert prof.token_lengths == tuple(range(1, tiny.seq_len + 1))
    assert token_grid(20, 8) == [8, 16, 20]


@pytest.mark.parametrize("name", sorted(HW))
def test_the_profile_is_at_the_precision_of_the_hardware_files_peak(name):
    hw = HW[name]
    obj = analytic_profile(MODELS["gpt3-1b"], hw, batch_sizes=(1,), token_step=256)
    assert obj["precision"] == profile_from_dict(obj, "analytic").precision == hw.training.dtype == "fp16"
    unknown = replace(hw, training=replace(hw.training, dtype="int8"))
    with pytest.raises(UserError, match=r"\[training\] dtype must be fp32, bf16 or fp16.*'int8'"):
        analytic_profile(MODELS["gpt3-1b"], unknown, batch_sizes=(1,), token_step=256)


def test_gpt3_175b_at_t8_splits_the_vocabulary_over_the_tensor_ranks():
    """As the runtime runs them, the analytic profile prices the embedding and the head split by vocabulary rows:
    it records ``vocab_parallel``, each device holds the fullest rank's ⌈50257/8⌉ = 6283 rows of both, and the
    head's work shrinks accordingly; the memory estimate then splits them (plan/memory.py)."""
    m, hw = MODELS["gpt3-175b"], HW["v100"]
    obj = analytic_profile(m, hw, tensor_parallel=8, batch_sizes=(1,), token_step=256)
    prof = profile_from_dict(obj, "analytic")
    assert obj["vocab_parallel"] is True and prof.vocab_parallel
    H = m.hidden
    assert ends_params(m, 8, vocab_parallel=True) == (6283 * H + m.seq_len * H, 6283 * H + 2 * H)
    assert (obj["ends"]["embed_params"], obj["ends"]["head_params"]) == ends_params(m, 8, vocab_parallel=True)
    whole = ends_params(m, 8)
    assert obj["ends"]["head_params"] < whole[1] / 7.9
    split, unsplit = (ends_seconds(m, hw, 1, 2048, 8, vocab_parallel=v) for v in (True, False))
    assert split["head_forward"] < unsplit["head_forward"] / 4 and split["head_backward"] < unsplit["head_backward"] / 4


def test_an_old_profile_priced_again_keeps_its_whole_vocabulary():
    """A profile made before the split (no ``vocab_parallel``), extended to a larger batch, is priced as it was."""
    obj = analytic_profile(MODELS["gpt3-1b"], HW["v100"], tensor_parallel=8, batch_sizes=(1,), token_step=256)
    del obj["vocab_parallel"]
    old = profile_from_dict(obj, "old")
    extended = extended_for_batch(old, 4)
    assert not extended.vocab_parallel and not old.vocab_parallel
    assert extended.ends.head_params == ends_params(MODELS["gpt3-1b"], 8)[1]
    new = extended_for_batch(
        profile_from_dict(
            analytic_profile(MODELS["gpt3-1b"], HW["v100"], tensor_parallel=8, batch_sizes=(1,), token_step=256), "new"
        ),
        4,
    )
    assert new.vocab_parallel and new.ends.head_params == ends_params(MODELS["gpt3-1b"], 8, vocab_parallel=True)[1]


def test_every_tiles_backward_adds_its_weight_gradients_into_the_steps():
    """The pass over the stage's weight gradients (`w.grad += grad_w`; AccumulateGrad): bytes per parameter over
    the memory bandwidth on every tile's backward, whatever its length, in W of the split backward, not in I; the
    ends' tables too; 3 × dtype_bytes unless the file says otherwise."""
    from terapipe_cli.profile.analytic import layer_seconds_split

    hw, model = HW["v100"], MODELS["gpt3-175b"]
    assert hw.training.grad_accumulate_bytes_per_param == 3 * hw.training.dtype_bytes
    plain = replace(hw, training=replace(hw.training, grad_accumulate_bytes_per_param=0.0))
    bandwidth = hw.device.memory_bytes_per_s * hw.device.memory_efficiency
    b, i, j = np.array([1, 1, 2]), np.array([8, 72, 2048]), np.array([0, 1024, 0])
    with_pass, without = layer_seconds_split(model, hw, b, i, j, 4), layer_seconds_split(model, plain, b, i, j, 4)
    expected = 3 * hw.training.dtype_bytes * model.params_per_layer(4) / bandwidth
    for part, before, added in zip(with_pass, without, (0.0, expected, 0.0, expected), strict=True):  # F, B, I, W
        assert np.allclose(part, before + added, rtol=1e-12)
    embed, head = ends_params(model, 4, vocab_parallel=True)
    ends, ends_plain = (ends_seconds(model, h, b, i, 4, vocab_parallel=True) for h in (hw, plain))
    per = 3 * hw.training.dtype_bytes / bandwidth
    assert np.allclose(ends["embed_backward"] - ends_plain["embed_backward"], embed * per, rtol=1e-9)
    assert np.allclose(ends["head_backward"] - ends_plain["head_backward"], head * per, rtol=1e-9)
    assert np.array_equal(ends["head_forward"], ends_plain["head_forward"])
