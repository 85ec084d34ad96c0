"""The cost model t(b, i, j) of docs/design.md §3 read from a profile, and the profile reader's errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from file_errors import assert_file_error

from terapipe_cli.errors import UserError
from terapipe_cli.plan.costmodel import CostModel, read_profile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"
RAW = json.loads(EXAMPLE.read_text())
LAYERS = RAW["model"]["layers"]  # 4
BATCHES = RAW["batch_sizes"]
TOKENS = RAW["token_lengths"]
NC = np.asarray(RAW["forward_s"]) + np.asarray(RAW["backward_s"])  # per layer, no context, fwd + bwd


def comm_expected(b, i) -> np.ndarray:
    """Forward activation + backward gradient, each latency + b·i·H·dtype_bytes / bandwidth."""
    c = RAW["comm"]
    nbytes = np.asarray(b, dtype=float) * np.asarray(i, dtype=float) * RAW["model"]["hidden"] * RAW["dtype_bytes"]
    return 2 * c["latency_s"] + 2 * nbytes / c["bytes_per_s"]


def ctx_expected(b, i, j) -> np.ndarray:
    total = 0.0
    for part in ("forward", "backward"):
        a0, a1, a2, a3 = RAW["context"][part]["coef"]
        total = total + a0 + a1 * b * i + a2 * b * j + a3 * b * i * j
    return np.where(np.asarray(j) > 0, total, 0.0)


def write_profile(tmp_path: Path, obj, name: str = "profile.json") -> Path:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


# --- values -------------------------------------------------------------------------------------------


def test_callable_and_broadcasting() -> None:
    cost = CostModel.from_profile(EXAMPLE, stages=2)
    b = np.array([1, 2, 4])[:, None, None]
    i = np.array([8, 64, 1024])[None, :, None]
    j = np.array([0, 8, 512])[None, None, :]
    out = cost(b, i, j)
    assert out.shape == (3, 3, 3)
    for x, bb in enumerate((1, 2, 4)):
        for y, ii in enumerate((8, 64, 1024)):
            for z, jj in enumerate((0, 8, 512)):
                assert out[x, y, z] == pytest.approx(float(cost(bb, ii, jj)), rel=1e-12)
    assert np.all(np.isfinite(out)) and np.all(out > 0)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_grid_points_are_exact_and_layers_scale(stages: int) -> None:
    cost = CostModel.from_profile(EXAMPLE, stages=stages)
    layers = LAYERS // stages
    assert cost.layers_per_stage == layers
    b = np.asarray(BATCHES)[:, None]
    i = np.asarray(TOKENS)[None, :]
    comm = comm_expected(b, i) if stages > 1 else 0.0  # one stage sends nothing
    np.testing.assert_allclose(cost.no_context(b, i), NC, rtol=1e-12)
    np.testing.assert_allclose(cost(b, i, 0), layers * NC + comm, rtol=1e-12)


def test_comm_is_zero_for_one_stage() -> None:
    one = CostModel.from_profile(EXAMPLE, stages=1)
    two = CostModel.from_profile(EXAMPLE, stages=2)
    assert np.all(one.comm(np.array([1, 4]), np.array([8, 1024])) == 0)
    np.testing.assert_allclose(two.comm(np.array([1, 4]), np.array([8, 1024])), comm_expected([1, 4], [8, 1024]))
    # Without comm, one stage of 4 layers costs exactly twice a stage of 2 layers.
    b, i, j = np.array([1, 2, 3]), np.array([24, 100, 1000]), np.array([0, 16, 8])
    np.testing.assert_allclose(one(b, i, j), 2 * (two(b, i, j) - two.comm(b, i)), rtol=1e-12)


def test_linear_between_grid_points() -> None:
    cost = CostModel.from_profile(EXAMPLE, stages=1)
    # Halfway along tokens (8 -> 16, 512 -> 1024) for a measured batch size.
    assert float(cost.no_context(1, 12)) == pytest.approx((NC[0, 0] + NC[0, 1]) / 2, rel=1e-12)
    assert float(cost.no_context(2, 768)) == pytest.approx((NC[1, 6] + NC[1, 7]) / 2, rel=1e-12)
    # A quarter of the way from 16 to 32 tokens.
    assert float(cost.no_context(4, 20)) == pytest.approx(NC[2, 1] + 0.25 * (NC[2, 2] - NC[2, 1]), rel=1e-12)
    # Halfway along batch sizes (2 -> 4) at a measured token length.
    assert float(cost.no_context(3, 64)) == pytest.approx((NC[1, 3] + NC[2, 3]) / 2, rel=1e-12)
    # Both at once: bilinear.
    mid_b2 = (NC[1, 4] + NC[1, 5]) / 2
    mid_b4 = (NC[2, 4] + NC[2, 5]) / 2
    assert float(cost.no_context(3, 192)) == pytest.approx((mid_b2 + mid_b4) / 2, rel=1e-12)


def test_outside_the_grid() -> None:
    # Documented in costmodel.py: linear extrapolation above the grid, held at the smallest point below it.
    cost = CostModel.from_profile(EXAMPLE, stages=1)
    slope = (NC[0, -1] - NC[0, -2]) / (TOKENS[-1] - TOKENS[-2])
    assert float(cost.no_context(1, 2048)) == pytest.approx(NC[0, -1] + slope * 1024, rel=1e-12)
    assert float(cost.no_context(1, 1)) == pytest.approx(NC[0, 0], rel=1e-12)
    # Never decreasing in i or b across and beyond the grid (this profile is monotone).
    i = np.arange(1, 2049)
    for b in (1, 2, 3, 4, 6):
        assert np.all(np.diff(cost.no_context(b, i)) >= 0)
    assert np.all(np.diff(cost.no_context(np.arange(1, 9), 256)) > 0)


def test_context_term() -> None:
    cost = CostModel.from_profile(EXAMPLE, stages=1)
    b = np.array([1, 2, 4, 3])
    i = np.array([8, 64, 200, 1000])
    assert np.all(cost.context(b, i, 0) == 0)  # no context, no extra time — not a0
    for j in (8, 100, 1016):
        np.testing.assert_allclose(cost.context(b, i, j), ctx_expected(b, i, j), rtol=1e-12)
        np.testing.assert_allclose(cost(b, i, j), LAYERS * (cost.no_context(b, i) + ctx_expected(b, i, j)))
    # Context only ever adds time: t(b, i, j) grows with j.
    j = np.arange(0, 1024, 8)
    assert np.all(np.diff(cost(2, 64, j)) > 0)


def test_step_s_and_data_parallel(tmp_path: Path) -> None:
    cost = CostModel.from_profile(EXAMPLE, stages=2)
    assert cost.step_s == pytest.approx(2 * RAW["optimizer_s_per_layer"] + RAW.get("step_overhead_s", 0.0))
    assert cost.allreduce_s == 0.0 and cost.allreduce_unpriced is None
    # Without a data-parallel link the replicas still plan: the all-reduce is left out, and the model says why.
    unpriced = CostModel.from_profile(EXAMPLE, stages=2, data_parallel=2)
    assert unpriced.allreduce_s == 0.0 and unpriced.step_s == cost.step_s
    assert unpriced.allreduce_unpriced == f"{EXAMPLE} has no 'params_per_layer' or 'data_parallel_link'"
    # With the link described, the ring all-reduce of a stage's gradients is added once per step.
    obj = copy.deepcopy(RAW)
    obj["params_per_layer"] = 1_000_000
    obj["data_parallel_link"] = {"latency_s": 1e-4, "bytes_per_s": 1e9}
    path = write_profile(tmp_path, obj)
    one = CostModel.from_profile(path, stages=2, data_parallel=1)
    four = CostModel.from_profile(path, stages=2, data_parallel=4)
    grad_bytes = 2 * 1_000_000 * RAW["dtype_bytes"]
    expected = 2 * 3 * 1e-4 + 2 * 3 / 4 * grad_bytes / 1e9
    assert four.allreduce_s == pytest.approx(expected, rel=1e-12) and four.allreduce_unpriced is None
    assert four.step_s == pytest.approx(one.step_s + expected, rel=1e-12)
    np.testing.assert_allclose(four(1, 64, 64), one(1, 64, 64))  # tiles are unchanged
    with pytest.raises(UserError):
        CostModel.from_profile(path, stages=2, data_parallel=0)


def test_stages_need_not_divide_the_layers_but_may_not_outnumber_them() -> None:
    """3 stages of the 4-layer model: the most even split, the extra layer in the middle (docs/design.md §11)."""
    cost = CostModel.from_profile(EXAMPLE, stages=3)
    assert cost.partition.layers == (1, 2, 1) and cost.layers_per_stage == 2
    with pytest.raises(UserError, match="more than the 4 layers"):
        CostModel.from_profile(EXAMPLE, stages=5)
    with pytest.raises(UserError):
        CostModel.from_profile(EXAMPLE, stages=0)


def test_read_profile_records_path_and_hash() -> None:
    import hashlib

    prof = read_profile(EXAMPLE)
    assert prof.path == str(EXAMPLE)
    assert prof.sha256 == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert prof.token_step == RAW["token_step"] and prof.model.seq_len == RAW["model"]["seq_len"]
    # Made before the runtime split the vocabulary over tensor ranks: read as whole embeddings and head.
    assert "vocab_parallel" not in RAW and prof.vocab_parallel is False


# --- bad profiles -------------------------------------------------------------------------------------


def _without(key: str) -> dict:
    obj = copy.deepcopy(RAW)
    del obj[key]
    return obj


def _with(path: tuple, value) -> dict:
    obj = copy.deepcopy(RAW)
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj


BAD = [
    # (what, profile object or raw text, a word the message must contain)
    ("malformed JSON", '{"schema": "terapipe.profile/1", ', "malformed JSON"),
    ("not an object", "[1, 2, 3]", "JSON object"),
    ("no schema", _without("schema"), "schema"),
    ("wrong schema", _with(("schema",), "terapipe.plan/1"), "schema"),
    ("missing comm", _without("comm"), "comm"),
    ("missing forward_s", _without("forward_s"), "forward_s"),
    ("missing token_step", _without("token_step"), "token_step"),
    ("missing model field", _with(("model",), {k: v for k, v in RAW["model"].items() if k != "hidden"}), "hidden"),
    ("forward_s one row short", _with(("forward_s",), RAW["forward_s"][:-1]), "forward_s"),
    ("backward_s one column short", _with(("backward_s",), [r[:-1] for r in RAW["backward_s"]]), "backward_s"),
    (
        "ragged forward_s",
        _with(("forward_s",), [RAW["forward_s"][0], RAW["forward_s"][1][:3], RAW["forward_s"][2]]),
        "forward_s",
    ),
    ("negative time", _with(("forward_s",), [[-1.0] * len(TOKENS)] * len(BATCHES)), "forward_s"),
    ("NaN time", _with(("backward_s",), [[float("nan")] * len(TOKENS)] * len(BATCHES)), "backward_s"),
    ("token_lengths not ascending", _with(("token_lengths",), list(reversed(TOKENS))), "token_lengths"),
    ("batch_sizes not integers", _with(("batch_sizes",), [1, 2.5, 4]), "batch_sizes"),
    ("three context coefficients", _with(("context", "forward", "coef"), [1e-5, 0.0, 1e-8]), "coef"),
    ("zero bandwidth", _with(("comm", "bytes_per_s"), 0), "bytes_per_s"),
    ("unknown source", _with(("source",), "guessed"), "source"),
    ("heads not dividing hidden", _with(("model", "heads"), 3), "heads"),
    ("dtype_bytes not an integer", _with(("dtype_bytes",), "4"), "dtype_bytes"),
    ("vocab_parallel not a boolean", _with(("vocab_parallel",), "yes"), "vocab_parallel"),
]


@pytest.mark.parametrize("what, obj, word", BAD, ids=[b[0] for b in BAD])
def test_bad_profile_names_file_and_field(tmp_path: Path, what: str, obj, word: str) -> None:
    path = write_profile(tmp_path, obj)
    assert_file_error(lambda p: CostModel.from_profile(p, stages=2), path, word)


def test_missing_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(UserError, match="not found") as err:
        CostModel.from_profile(path, stages=1)
    assert str(path) in str(err.value)


def test_profile_that_is_a_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="folder"):
        read_profile(tmp_path)


def test_single_grid_point_profiles(tmp_path: Path) -> None:
    # One measured batch size / token length: time proportional to size above it, held below it (costmodel.py).
    obj = copy.deepcopy(RAW)
    obj["batch_sizes"] = [2]
    obj["token_lengths"] = [64]
    for grid in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s"):
        obj[grid] = [[RAW[grid][1][3]]]
    cost = CostModel.from_profile(write_profile(tmp_path, obj), stages=1)
    base = NC[1, 3]
    assert float(cost.no_context(2, 64)) == pytest.approx(base, rel=1e-12)
    assert float(cost.no_context(2, 128)) == pytest.approx(2 * base, rel=1e-12)
    assert float(cost.no_context(4, 64)) == pytest.approx(2 * base, rel=1e-12)
    assert float(cost.no_context(4, 256)) == pytest.approx(8 * base, rel=1e-12)
    assert float(cost.no_context(1, 8)) == pytest.approx(base, rel=1e-12)
