"""Calibration (`terapipe profile --calibrate`): the dispatch floor, fitting known constants back, the committed
calibrated H100 files, and bad input."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, without_accumulation

from terapipe_cli.config.hardware import hardware_from_dict, load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.plan.costmodel import profile_from_dict, read_profile
from terapipe_cli.profile.analytic import analytic_profile, kernels_per_tile, layer_seconds
from terapipe_cli.profile.calibrate import (
    calibrate,
    calibrated_toml,
    check_matches,
    combine,
    from_profile,
    read_tile_table,
    tile_errors,
    with_constants,
)

ROOT = Path(__file__).resolve().parents[2]
HARDWARE = ROOT / "configs" / "hardware"
MEASURED_FP32 = ROOT / "configs" / "profiles" / "gpt3-1b-h100-fp32-measured.json"
MEASURED_BF16 = ROOT / "configs" / "profiles" / "gpt3-1b-h100-bf16-measured.json"
TILES_BF16 = ROOT / "configs" / "profiles" / "layer-tiles-h100-bf16.csv"
GPT3_1B = load_model_config(ROOT / "configs" / "models" / "gpt3-1b.toml")
H100_FP32 = load_hardware(HARDWARE / "h100-fp32.toml")
H100_BF16 = load_hardware(HARDWARE / "h100-bf16.toml")
# What the synthetic measurements are made with, far from the files' own values the fit starts from.
TRUE = {"dispatch_s": 45e-6, "matmul_efficiency": 0.6, "matmul_half_dim": 150.0}


def synthetic_profile(hardware, device_name: str = "NVIDIA H100 80GB HBM3") -> dict:
    """A "measured" profile whose times are the analytic model's on ``hardware``: grid and context tiles."""
    prof = analytic_profile(GPT3_1B, hardware, batch_sizes=(1, 2, 4), token_step=16)
    rng = np.random.default_rng(0)
    b = rng.choice([1, 2, 4], 40).astype(float)
    i = rng.choice(prof["token_lengths"][:-1], 40).astype(float)
    j = np.floor(rng.uniform(0, 1, 40) * (GPT3_1B.seq_len - i) / 8) * 8
    fwd, bwd = layer_seconds(GPT3_1B, hardware, b, i, j)
    points = [
        {"b": int(x), "i": int(y), "j": int(z), "forward_s": float(f), "backward_s": float(w)}
        for x, y, z, f, w in zip(b, i, j, fwd, bwd, strict=True)
    ]
    prof.update(source="measured", context_points=points)
    prof["device"] = {"kind": "cuda", "name": device_name}
    return prof


def write_profile(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj))
    return path


# ------------------------------------------------------------------------------------------ the dispatch floor


def test_without_dispatch_s_the_model_is_the_plain_roofline():
    """Files without the field (all of the uncalibrated ones) price exactly as before it existed."""
    assert H100_FP32.device.dispatch_s == 0
    for name in ("v100", "a100", "h100"):
        hw = load_hardware(HARDWARE / f"{name}.toml")
        assert hw.device.dispatch_s == 0 and hw.training.attention == "dense"
    i = np.array([8.0, 64, 512, 2048])
    plain = layer_seconds(GPT3_1B, H100_FP32, 1, i, 0)
    floored = layer_seconds(GPT3_1B, with_constants(H100_FP32, {"dispatch_s": 1e-12}), 1, i, 0)
    np.testing.assert_array_equal(plain, floored)


def test_a_short_tile_costs_its_kernels_times_dispatch_s_and_a_long_one_its_gpu_time():
    hw = with_constants(H100_BF16, {"dispatch_s": 40e-6})
    n_fwd, n_bwd = kernels_per_tile("bf16")
    fwd, bwd = layer_seconds(GPT3_1B, hw, 1, np.array([8.0, 16384.0]), 0)
    assert fwd[0] == pytest.approx(n_fwd * 40e-6) and bwd[0] == pytest.approx(n_bwd * 40e-6)
    gpu_fwd, gpu_bwd = layer_seconds(GPT3_1B, H100_BF16, 1, 16384.0, 0)
    assert fwd[1] == pytest.approx(gpu_fwd) and bwd[1] == pytest.approx(gpu_bwd)


def test_kernel_counts_follow_the_runtime_layer():
    fwd, bwd = kernels_per_tile("fp32")
    assert 12 <= fwd <= 20 and 2 * fwd <= bwd <= 3 * fwd  # backward: two products per product, plus bookkeeping
    assert kernels_per_tile("bf16") > kernels_per_tile("fp32")  # autocast's casts
    assert kernels_per_tile("fp32", 2) > kernels_per_tile("fp32")  # the tensor-parallel all-reduces


# ---------------------------------------------------------------------------------------- recovering constants


def test_calibration_recovers_known_constants_from_a_synthetic_measured_profile():
    truth = with_constants(H100_FP32, TRUE)
    measurement = from_profile(profile_from_dict(synthetic_profile(truth), "synthetic.json"))
    result = calibrate(measurement, H100_FP32)
    assert set(result.fitted) == set(TRUE)
    for key, value in TRUE.items():
        assert result.fitted[key] == pytest.approx(value, rel=0.02), key
    assert result.rel_err_mean < 0.005
    assert result.uncalibrated_rel_err_mean > 0.1  # the files' own constants did not fit it


def test_calibration_recovers_the_gpu_floor_from_graphed_tiles(tmp_path: Path):
    """Eager and CUDA-graphed totals together pin the dispatch floor and the GPU's own shortest kernel (a tile
    table's stand-alone timing adds no gradients into standing ones: `TileTimes.accumulates`)."""
    truth = with_constants(without_accumulation(H100_BF16), {**TRUE, "kernel_launch_s": 12e-6})
    graphed = with_constants(truth, {"dispatch_s": 0.0})
    rows = ["model,hidden,heads,b,i,j,eager_ms,graphed_ms"]
    for b in (1, 4):
        for i in (8, 32, 128, 512, 2048):
            for j in (0, 1024):
                eager = sum(layer_seconds(GPT3_1B, truth, b, i, j))
                graph = sum(layer_seconds(GPT3_1B, graphed, b, i, j))
                rows.append(f"gpt3-1b,2048,16,{b},{i},{j},{eager * 1e3:.6g},{graph * 1e3:.6g}")
    path = tmp_path / "tiles.csv"
    path.write_text("# a comment line\n" + "\n".join(rows) + "\n")
    result = calibrate(read_tile_table(path, "bf16"), H100_BF16)
    assert set(result.fitted) == {*TRUE, "kernel_launch_s"}
    for key, value in {**TRUE, "kernel_launch_s": 12e-6}.items():
        assert result.fitted[key] == pytest.approx(value, rel=0.05), key
    assert set(result.by_kind) == {"gpt3-1b eager", "gpt3-1b graphed"}


# --------------------------------------------------------------------------------------------- mismatches


def test_mismatched_precision_or_device_is_one_line():
    measurement = from_profile(profile_from_dict(synthetic_profile(H100_FP32), "m.json"))
    with pytest.raises(UserError, match="measured in fp32, but .* prices bf16") as err:
        check_matches(measurement, H100_BF16)
    assert "\n" not in str(err.value)
    a100 = from_profile(profile_from_dict(synthetic_profile(H100_FP32, "NVIDIA A100-SXM4-40GB"), "a.json"))
    with pytest.raises(UserError, match="measured on 'NVIDIA A100-SXM4-40GB'") as err:
        calibrate(a100, H100_FP32)
    assert "\n" not in str(err.value)


def test_an_analytic_profile_is_not_a_measurement():
    prof = profile_from_dict(analytic_profile(GPT3_1B, H100_FP32, batch_sizes=(1,), token_step=256), "e.json")
    with pytest.raises(UserError, match="calibrate on a measured one"):
        from_profile(prof)


# ---------------------------------------------------------------------------------------------------- the CLI


def test_the_cli_writes_a_hardware_file_that_loads(tmp_path: Path, capsys):
    measured = write_profile(tmp_path / "measured.json", synthetic_profile(with_constants(H100_FP32, TRUE)))
    out = tmp_path / "calibrated.toml"
    p = run_cli(
        capsys,
        "profile",
        "--calibrate",
        str(measured),
        "--hardware",
        str(HARDWARE / "h100-fp32.toml"),
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    hw = load_hardware(out)
    assert hw.device.dispatch_s == pytest.approx(TRUE["dispatch_s"], rel=0.02)
    assert hw.device.peak_flops == H100_FP32.device.peak_flops and hw.training == H100_FP32.training
    text = out.read_text()
    assert text.startswith("# CALIBRATED on") and "FITTED to" in text
    assert "error" in p.stdout and "dispatch_s" in p.stdout and "wrote" in p.stdout
    # Every setting of the file it came from that was not fitted is still there, its source comment with it.
    base = (HARDWARE / "h100-fp32.toml").read_text().splitlines()
    fitted = ("matmul_efficiency", "matmul_half", "constants")
    kept = [ln for ln in base if re.match(r"\w+ *=|\[", ln) and not ln.startswith(fitted)]
    assert kept and all(ln in text.splitlines() for ln in kept)
    # ... and it says its constants are calibrated now (the base file's are estimated).
    assert load_hardware(HARDWARE / "h100-fp32.toml").constants == "estimated" and hw.constants == "calibrated"


@pytest.mark.parametrize(
    "case",
    ["missing", "not-json", "wrong-schema", "precision", "device", "csv-no-precision", "csv-columns", "same-file"],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, capsys, case: str):
    out = tmp_path / "out.toml"
    hardware = str(HARDWARE / "h100-fp32.toml")
    measured = tmp_path / "m.json"
    extra: list[str] = []
    needle = str(measured)
    if case == "missing":
        needle = "not found"
    elif case == "not-json":
        measured.write_text("{")
    elif case == "wrong-schema":
        measured.write_text(json.dumps({"schema": "terapipe.plan/1"}))
        needle = "schema"
    elif case == "precision":
        write_profile(measured, synthetic_profile(H100_FP32))
        hardware, needle = str(HARDWARE / "h100-bf16.toml"), "fp32"
    elif case == "device":
        write_profile(measured, synthetic_profile(H100_FP32, "Tesla V100-SXM2-16GB"))
        needle = "V100"
    elif case == "csv-no-precision":
        measured = tmp_path / "t.csv"
        measured.write_text(TILES_BF16.read_text())
        needle = "--precision"
    elif case == "csv-columns":
        measured = tmp_path / "t.csv"
        measured.write_text("model,b,i\ngpt3-1b,1,8\n")
        extra, needle = ["--precision", "fp32"], "hidden"
    elif case == "same-file":
        write_profile(measured, synthetic_profile(H100_FP32))
        out = tmp_path / "hw.toml"
        out.write_text((HARDWARE / "h100-fp32.toml").read_text())
        hardware, needle = str(out), "--out"
    before = out.read_text() if out.exists() else None
    p = run_cli(capsys, "profile", "--calibrate", str(measured), "--hardware", hardware, "--out", str(out), *extra)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert (out.read_text() if out.exists() else None) == before


def test_options_that_do_not_apply_are_refused(tmp_path: Path, capsys):
    measured = write_profile(tmp_path / "m.json", synthetic_profile(H100_FP32))
    p = run_cli(
        capsys, "profile", "--calibrate", str(measured), "--hardware", "h100-fp32", "--model", "tiny", "--out", "x.toml"
    )
    assert p.returncode == 2 and "--model" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------ the committed H100 files


def test_calibrated_h100_fp32_fits_the_measured_profile():
    """configs/hardware/h100-fp32-calibrated.toml against the measured GPT3-1B profile it was fitted to: the mean
    relative error of its tiles' forward + backward (148 tiles) is what the file's header reports, 8.0% (7.0% before the
    analytic model counted the pass over the weight gradients on every tile)."""
    hw = load_hardware(HARDWARE / "h100-fp32-calibrated.toml")
    measurement = from_profile(read_profile(MEASURED_FP32))
    errors = np.concatenate([e for _, _, e in tile_errors(hw, measurement)])
    assert errors.size == 148
    assert errors.mean() <= 0.081
    before = np.concatenate([e for _, _, e in tile_errors(load_hardware(HARDWARE / "h100.toml"), measurement)])
    assert before.mean() > 0.8  # the fp16 file without a floor: off by several times on every tile


def bf16_measurement():
    """What configs/hardware/h100-bf16-calibrated.toml is fitted to: the runtime's own bf16 profile of GPT3-1B on
    an H100 and the tile table's CUDA-graphed rows (its eager rows, a stand-alone layer, give way)."""
    return combine([from_profile(read_profile(MEASURED_BF16)), read_tile_table(TILES_BF16, "bf16")])


def test_calibrated_h100_bf16_fits_the_runtime_profile_and_the_graphed_tiles():
    """configs/hardware/h100-bf16-calibrated.toml against what it was fitted to: the runtime's grid and context
    tiles and both shapes' graphed tiles (priced without the dispatch floor), 11.6% mean over 228 tiles."""
    measurement, left_out = bf16_measurement()
    assert left_out == 52  # the table's eager rows
    hw = load_hardware(HARDWARE / "h100-bf16-calibrated.toml")
    by_kind = {t.kind: e.mean() for t, _, e in tile_errors(hw, measurement)}
    assert set(by_kind) == {"grid", "context", "gpt3-1b graphed", "gpt3-13b graphed"}
    assert np.mean(list(by_kind.values())) <= 0.13 and max(by_kind.values()) <= 0.17
    before = {t.kind: e.mean() for t, _, e in tile_errors(H100_BF16, measurement)}
    assert min(before.values()) > 0.3  # the uncalibrated file (no dispatch floor) was far off on every kind


def test_refitting_the_bf16_file_reproduces_it():
    """The committed bf16 file is what `--calibrate PROFILE --calibrate TABLE` writes from its base file."""
    measurement, _ = bf16_measurement()
    text = calibrated_toml((HARDWARE / "h100-bf16.toml").read_text(), calibrate(measurement, H100_BF16), "x")
    committed = load_hardware(HARDWARE / "h100-bf16-calibrated.toml")
    assert hardware_from_dict(tomllib.loads(text), str(HARDWARE / "h100-bf16-calibrated.toml")) == committed


def test_several_files_are_fitted_together_and_must_agree(tmp_path: Path, capsys):
    """Two measured profiles of one device fit as one; a tile table's eager rows give way to a profile's; a
    profile of another device or precision is one line."""
    a = write_profile(tmp_path / "a.json", synthetic_profile(with_constants(H100_FP32, TRUE)))
    b = write_profile(tmp_path / "b.json", synthetic_profile(with_constants(H100_FP32, TRUE)))
    one, left_out = combine([from_profile(read_profile(a)), from_profile(read_profile(b))])
    assert left_out == 0 and one.count == 2 * from_profile(read_profile(a)).count
    table = tmp_path / "t.csv"
    table.write_text("model,hidden,heads,b,i,j,eager_ms,graphed_ms\ngpt3-1b,2048,16,1,8,0,1.6,0.5\n")
    mixed, left_out = combine([from_profile(read_profile(a)), read_tile_table(table, "fp32")])
    assert left_out == 1 and [t.kind for t in mixed.tiles][-1] == "gpt3-1b graphed"
    # Without a profile, a table's eager rows stay.
    alone, left_out = combine([read_tile_table(table, "fp32"), read_tile_table(table, "fp32")])
    assert left_out == 0 and len(alone.tiles) == 4
    out = tmp_path / "hw.toml"
    p = run_cli(capsys, "profile", "--calibrate", str(a), "--calibrate", str(b), "--hardware", "h100-fp32",
                "--out", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert load_hardware(out).device.dispatch_s == pytest.approx(TRUE["dispatch_s"], rel=0.02)
    header = "".join(out.read_text().split("(`terapipe")[0].replace("# ", "").split())  # wrapped at any character
    assert header == f"CALIBRATEDon{a}and{b}".replace(" ", "")
    for other, needle in (
        (synthetic_profile(H100_FP32, "Tesla V100-SXM2-16GB"), "V100"),
        ({**synthetic_profile(H100_FP32), "precision": "bf16"}, "bf16"),
    ):
        c = write_profile(tmp_path / "c.json", other)
        out.unlink(missing_ok=True)
        p = run_cli(capsys, "profile", "--calibrate", str(a), "--calibrate", str(c), "--hardware", "h100-fp32",
                    "--out", str(out))  # fmt: skip
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not out.exists()


def test_refitting_a_calibrated_file_reproduces_it():
    """The committed file is what `--calibrate` writes from its base file (numbers and header)."""
    result = calibrate(from_profile(read_profile(MEASURED_FP32)), H100_FP32)
    text = calibrated_toml(
        (HARDWARE / "h100-fp32.toml").read_text(), result, "configs/profiles/gpt3-1b-h100-fp32-measured.json"
    )
    committed = load_hardware(HARDWARE / "h100-fp32-calibrated.toml")
    rebuilt = hardware_from_dict(tomllib.loads(text), str(HARDWARE / "h100-fp32-calibrated.toml"))
    assert rebuilt == committed


def test_estimated_floors_carry_the_h100s_over_and_say_so():
    """The V100 and A100 floors are scaled from the stand-alone layer's H100 dispatch (the tile table's eager and
    graphed rows alone: 37.25 µs per kernel), as the published runs' own code ran a layer."""
    h100 = calibrate(read_tile_table(TILES_BF16, "bf16"), H100_BF16).fitted["dispatch_s"]
    assert h100 == pytest.approx(37.25e-6, rel=1e-3)
    for name in ("v100", "a100"):
        path = HARDWARE / f"{name}-dispatch.toml"
        hw, plain = load_hardware(path), load_hardware(HARDWARE / f"{name}.toml")
        assert path.read_text().startswith("# ESTIMATE")
        assert 1.0 <= hw.device.dispatch_s / h100 <= 1.5  # older hosts dispatch somewhat slower, not GPU-fold
        assert replace(hw, device=replace(hw.device, dispatch_s=0.0), path=None) == replace(plain, path=None)
