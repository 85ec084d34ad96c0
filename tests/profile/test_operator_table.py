"""Operator tables: the reader refuses bad files in one line, the interpolation keeps to its grid, a tile priced from
a hand-made table is the sum of its kernels, and the commands time a table, price a profile from it and plan on it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.costmodel import profile_from_dict
from terapipe_cli.profile.analytic import kernels_per_tile, layer_seconds_split, weight_kernels_per_tile
from terapipe_cli.profile.operator_table import (
    OPERATORS_SCHEMA,
    TablePricer,
    operator_profile,
    operator_table_from_dict,
    read_operator_table,
    table_hardware,
)
from terapipe_cli.profile.options import profile_to_check

G, A, S, HOST = 1e-4, 3e-4, 2e-5, 1e-6  # every product, attention forward (backward 2A), element-wise pass, host
# A hand-made per-tile host term of the gpt family: without context forward, backward, I, W; with context.
TILE = {"forward": 1e-3, "backward": 2e-3, "input": 1.5e-3, "weight": 1e-3, "context_forward": 3e-3,
        "context_backward": 5e-3}  # fmt: skip


def flat_table() -> dict:
    """A 2-point-per-axis table whose every product takes G, attention A forward and 2A backward, every pass S."""
    att_shape = (2, 2, 2, 2, 2)
    return {
        "schema": OPERATORS_SCHEMA,
        "device": {"kind": "cpu", "name": "test cpu", "memory_bytes": 2**34},
        "precision": "fp32",
        "torch": "test",
        "host_s": HOST,
        "gemm": {
            "m": [1, 64],
            "n": [1, 64],
            "k": [1, 64],
            **{f"{x}_s": np.full((2, 2, 2), G).tolist() for x in ("forward", "dgrad", "wgrad")},
        },
        "attention": {
            "heads": [1, 8],
            "group": [1, 4],
            "head_dim": [1, 8],
            "i": [1, 16],
            "j": [0, 16],
            "forward_s": np.full(att_shape, A).tolist(),
            "backward_s": np.full(att_shape, 2 * A).tolist(),
        },  # fmt: skip
        "stream": {"bytes": [1, 10**9], "seconds": [S, S]},
    }


def write(tmp_path: Path, obj: dict) -> Path:
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda t: t.update(schema="terapipe.operators/0"), "field 'schema'"),
        (lambda t: t.pop("host_s"), "field 'host_s' is missing"),
        (lambda t: t["gemm"].update(wgrad_s=[[G]]), "field 'gemm.wgrad_s' must have the grid's shape"),
        (lambda t: t["gemm"].update(m=[64, 1]), "field 'gemm.m' must be strictly ascending"),
        (lambda t: t["attention"]["forward_s"][0][0][0][0].__setitem__(0, -1.0), "field 'attention.forward_s'"),
        (lambda t: t["device"].update(kind="tpu"), "field 'device.kind' must be cpu or cuda"),
        (lambda t: t.update(precision="fp8"), "field 'precision'"),
        (lambda t: t.update(tile_host_s=[]), "field 'tile_host_s' must be an object"),
        (lambda t: t.update(tile_host_s={}), "field 'tile_host_s' must name at least one model family"),
        (lambda t: t.update(tile_host_s={"gpt": {**TILE, "weight": -1e-3}}), "field 'tile_host_s.gpt.weight' must be"),
        (lambda t: t.update(tile_host_s={"gpt": {"forward": 1e-3}}), "field 'tile_host_s.gpt.backward' is missing"),
    ],
)
def test_the_reader_refuses_a_bad_table_in_one_line(tmp_path, change, field):
    table = copy.deepcopy(flat_table())
    change(table)
    path = write(tmp_path, table)
    with pytest.raises(UserError) as e:
        read_operator_table(path)
    text = str(e.value)
    assert str(path) in text and field in text and "\n" not in text


def test_the_reader_takes_a_table_with_or_without_the_per_tile_host_term(tmp_path):
    assert read_operator_table(write(tmp_path, flat_table())).tile_host_s is None
    table = read_operator_table(write(tmp_path, {**flat_table(), "tile_host_s": {"gpt": TILE, "llama": TILE}}))
    assert table.tile_host_s == {"gpt": TILE, "llama": TILE}


def test_interpolation_returns_grid_points_and_stays_between_neighbours():
    table = flat_table()
    table["gemm"]["forward_s"] = [[[1e-5, 2e-5], [3e-5, 4e-5]], [[5e-5, 6e-5], [7e-5, 8e-4]]]
    t = operator_table_from_dict(table, "ops.json")
    assert t.gemm_seconds(64, 1, 64) == pytest.approx(6e-5)
    assert t.gemm_seconds(64, 64, 64) == pytest.approx(8e-4)
    between = t.gemm_seconds(64, 64, np.array([2.0, 8.0, 32.0]))
    assert np.all((between > 7e-5) & (between < 8e-4)) and np.all(np.diff(between) > 0)
    # Beyond the grid: the edge's time scaled by FLOPs (twice the k, twice the time); below it: held.
    assert t.gemm_seconds(64, 64, 128) == pytest.approx(2 * 8e-4)
    assert t.gemm_seconds(0.5, 1, 1) == pytest.approx(1e-5)


@pytest.mark.parametrize(("tile_host", "j"), [(None, 4), (TILE, 0), (TILE, 4)])
def test_a_tile_priced_from_a_table_is_the_sum_of_its_kernels(tile_host, j):
    model = ModelConfig.from_dict({"name": "t", "layers": 2, "hidden": 8, "heads": 2, "vocab": 16, "seq_len": 16}, "t")
    raw = flat_table() if tile_host is None else {**flat_table(), "tile_host_s": {"gpt": tile_host, "llama": TILE}}
    table = operator_table_from_dict(raw, "ops.json")
    fwd, bwd, inp, wgt = (float(x) for x in layer_seconds_split(model, table_hardware(table), 1, 8, j, 1,
                                                                  TablePricer(table)))  # fmt: skip
    kernels_f, kernels_b = kernels_per_tile("fp32", 1, model)
    kernels_w = weight_kernels_per_tile("fp32", model)
    # gpt's layer, fused attention: 4 products (qkv, proj, fc, fc2), 5 element-wise passes each way (2 norms, the
    # residuals, GeLU; no score passes), attention once. Backward: 4 dgrad and the attention in I with the 5 passes;
    # 4 wgrad and the gradients' accumulation (one pass) in W. Every other kernel the layer launches costs HOST.
    forward = 4 * G + A + 5 * S + (kernels_f - 10) * HOST
    inputs = 4 * G + 2 * A + 5 * S + (kernels_b - kernels_w - 10) * HOST
    weight = 4 * G + S + (kernels_w - 5) * HOST
    backward = inputs + weight
    # The family's per-tile host term on top: a tile with context takes its context terms, the difference in I.
    # The whole backward takes its own term, not I's and W's: the split's two calls cost the host more than one.
    if tile_host is not None and j:
        forward, backward = forward + TILE["context_forward"], backward + TILE["context_backward"]
        inputs, weight = inputs + TILE["input"] + TILE["context_backward"] - TILE["backward"], weight + TILE["weight"]
    elif tile_host is not None:
        forward, backward = forward + TILE["forward"], backward + TILE["backward"]
        inputs, weight = inputs + TILE["input"], weight + TILE["weight"]
    assert fwd == pytest.approx(forward)
    assert inp == pytest.approx(inputs)
    assert wgt == pytest.approx(weight)
    assert bwd == pytest.approx(backward)


def test_on_a_gpu_the_per_tile_host_term_raises_the_dispatch_floor():
    model = ModelConfig.from_dict({"name": "t", "layers": 2, "hidden": 8, "heads": 2, "vocab": 16, "seq_len": 16}, "t")
    slow = {key: 1.0 for key in TILE}  # a host far slower than the kernels: the floor sets the tile's time
    raw = {**flat_table(), "device": {"kind": "cuda", "name": "test gpu"}, "tile_host_s": {"gpt": slow}}
    table = operator_table_from_dict(raw, "ops.json")
    fwd, bwd, inp, wgt = (float(x) for x in layer_seconds_split(model, table_hardware(table), 1, 8, 0, 1,
                                                                  TablePricer(table)))  # fmt: skip
    kernels_f, kernels_b = kernels_per_tile("fp32", 1, model)
    kernels_w = weight_kernels_per_tile("fp32", model)
    assert fwd == pytest.approx(kernels_f * HOST + 1.0) and bwd == pytest.approx(kernels_b * HOST + 1.0)
    assert inp == pytest.approx((kernels_b - kernels_w) * HOST + 1.0) and wgt == pytest.approx(kernels_w * HOST + 1.0)


def test_an_operator_profile_says_where_it_comes_from(tmp_path):
    model = ModelConfig.from_dict({"name": "t", "layers": 2, "hidden": 8, "heads": 2, "vocab": 16, "seq_len": 16}, "t")
    table = read_operator_table(write(tmp_path, flat_table()))
    prof = operator_profile(model, table, batch_sizes=(1, 2), token_step=4)
    assert prof["source"] == "operators" and str(table.path) in prof["note"] and "links priced as free" in prof["note"]
    assert "no per-tile host work" in prof["note"]  # a table timed without the term prices tiles as before
    assert prof["device"]["kind"] == "cpu" and "hardware_config" not in prof
    profile_from_dict(prof, "p.json")


def test_time_a_table_price_a_profile_and_plan_on_it(capsys, tmp_path, monkeypatch):
    from terapipe_cli.profile import operators

    tiny = operators.OperatorGrid(m=(8, 64), n=(64,), k=(64,), heads=(4,), group=(1,), head_dim=(64,), i=(8, 64),
                                  j=(0, 64), bytes=(1024, 65536), rounds=1)  # fmt: skip
    monkeypatch.setattr(operators, "QUICK_GRID", tiny)  # --quick's grid, smaller still: the commands are under test
    ops, prof = tmp_path / "ops.json", tmp_path / "p.json"
    p = run_cli(capsys, "profile", "--operators", "--quick", "--out", ops)
    assert p.returncode == 0, p.stderr
    assert "host cost of a kernel" in p.stdout
    table = read_operator_table(ops)
    assert table.device["kind"] == "cpu" and table.precision == "fp32"
    assert table.tile_host_s is not None and set(table.tile_host_s) == {"gpt", "gpt2", "llama"}
    p = run_cli(capsys, "profile", "--analytic", "--operator-table", ops, "--model", "tiny", "--out", prof)
    assert p.returncode == 0, p.stderr
    assert json.loads(prof.read_text())["source"] == "operators"
    p = run_cli(capsys, "plan", "--profile", prof, "--stages", "2", "--batch", "2", "--out", tmp_path / "plan.json")
    assert p.returncode == 0, p.stderr
    assert "operators: each kernel priced from the table ops.json" in p.stdout
    # --check-profile times it on the device its table was timed on (this one), as an analytic estimate for it.
    checked, device = profile_to_check(prof, "cpu", precision=None, model=None, analytic=False)
    assert checked.source == "operators" and device.type == "cpu"


def test_attention_is_read_at_its_grid_points_and_scaled_by_flops_beyond(tmp_path):
    table = flat_table()
    table["attention"]["forward_s"][1][0][1][1][1] = 8 * A  # 8 heads, no grouping, head_dim 8, i = 16, j = 16
    t = operator_table_from_dict(table, "ops.json")
    forward, backward = t.attention_seconds(8, 1, 8, 16, 16)
    assert forward == pytest.approx(8 * A) and backward == pytest.approx(2 * A)
    # i = 32, j = 32 is beyond the grid: i·(i + j) four times the edge's, so four times its time.
    assert t.attention_seconds(8, 1, 8, 32, 32)[0] == pytest.approx(4 * 8 * A)
    between = t.attention_seconds(8, 1, 8, 16, np.array([1.0, 4.0, 15.0]))[0]
    assert np.all((between > A) & (between < 8 * A)) and np.all(np.diff(between) > 0)


def test_the_commands_refuse_what_does_not_apply_in_one_line(capsys, tmp_path):
    ops = write(tmp_path, flat_table())
    p = run_cli(capsys, "profile", "--operators", "--model", "tiny", "--out", tmp_path / "o.json")
    assert p.returncode != 0 and "--model" in p.stderr and "--operators" in p.stderr
    p = run_cli(capsys, "profile", "--analytic", "--operator-table", ops, "--model", "tiny", "--precision", "bf16")
    assert p.returncode != 0 and "--precision" in p.stderr and "fp32" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_a_points_tensors_are_kept_when_small_and_made_again_when_large():
    """Every point of the CPU grid keeps its tensors between visits (made once); a GPU grid's large products and
    attention shapes are made anew at each visit, so the grid's points never need to fit in memory all at once."""
    import itertools

    from terapipe_cli.profile import operators as ops

    made = []

    def make(device, dtype, size):
        made.append(size)
        return lambda clock, repeat: float(size)

    small, large = (
        ops._Point(make, ops.KEEP_BYTES, "cpu", None, (1,)),
        ops._Point(make, ops.KEEP_BYTES + 1, "cpu", None, (2,)),
    )
    for _ in range(3):
        assert small(None, 1) == 1.0 and large(None, 1) == 2.0
    assert made.count(1) == 1 and made.count(2) == 3

    def sizes(grid):
        gemms = [ops._gemm_bytes(*p) for p in itertools.product(ops.GEMM_LAYOUTS, grid.m, grid.n, grid.k)]
        axes = (grid.heads, grid.group, grid.head_dim, grid.i, grid.j)
        return gemms + [ops._attention_bytes(*p) for p in itertools.product(*axes)] + list(grid.bytes)

    assert max(sizes(ops.CPU_GRID)) <= ops.KEEP_BYTES and max(sizes(ops.QUICK_GRID)) <= ops.KEEP_BYTES
    gpu = sizes(ops.GPU_GRID)
    kept = sum(b for b in gpu if b <= ops.KEEP_BYTES)
    assert max(gpu) > ops.KEEP_BYTES and kept < 16 * 2**30  # what stays allocated on a GPU: well within one device
