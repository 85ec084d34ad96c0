"""Hardware TOML files: the shipped ones load and document every constant; bad ones fail in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from file_errors import assert_file_error

from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "configs" / "hardware").glob("*.toml"))


def test_the_three_published_nodes_are_there():
    names = {load_hardware(p).name for p in FILES}
    assert {"aws-p3.16xlarge", "aws-p4d.24xlarge", "aws-p5.48xlarge"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_constant_has_a_source_comment(path: Path):
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"\s*(\w+)\s*=\s*([^#]*)", line)
        if m and m.group(1) not in {"name", "dtype"}:
            assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, f"{path.name}:{n} has no source: {line}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_numbers_are_sane(path: Path):
    hw = load_hardware(path)
    d = hw.device
    # Compute-to-bandwidth ratios of real accelerators lie between ~50 and ~500 FLOP/byte on their tensor cores,
    # ~10-50 on their fp32 CUDA cores.
    low, high = (10, 50) if hw.training.dtype == "fp32" else (50, 500)
    assert low < d.peak_flops / d.memory_bytes_per_s < high
    assert hw.intra_node.bytes_per_s > hw.network.bytes_per_s / hw.gpus_per_node
    assert hw.training.dtype_bytes == {"fp32": 4, "bf16": 2, "fp16": 2}[hw.training.dtype]
    # The host dispatches a kernel in microseconds to tens of them, never in a millisecond.
    assert 0 <= d.dispatch_s < 200e-6


V100 = (ROOT / "configs" / "hardware" / "v100.toml").read_text()


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda s: s.replace("peak_flops = 125e12", "peak_flops = -1"), "device.peak_flops"),
        (lambda s: s.replace("matmul_efficiency = 0.8", "matmul_efficiency = 1.5"), "device.matmul_efficiency"),
        (lambda s: s.replace("latency_s = 50e-6", 'latency_s = "fast"'), "network.latency_s"),
        (lambda s: s.replace("gpus_per_node = 8", "gpus_per_nod = 8"), "hardware.gpus_per_nod"),
        (lambda s: s.replace("[intra_node]", "[intranode]"), "intranode"),
        (lambda s: s.replace("dtype_bytes = 2", ""), "training.dtype_bytes"),
    ],
)
def test_bad_file_is_one_line_naming_the_field(tmp_path: Path, edit, field: str):
    path = tmp_path / "hw.toml"
    path.write_text(edit(V100))
    assert_file_error(load_hardware, path, field)


def test_optional_fields_default_to_the_files_before_them(tmp_path: Path):
    """dispatch_s (no floor) and attention (dense) are optional: files written before them keep their meaning."""
    hw = load_hardware(ROOT / "configs" / "hardware" / "v100.toml")
    assert hw.device.dispatch_s == 0 and hw.training.attention == "dense"
    path = tmp_path / "hw.toml"
    path.write_text(V100.replace('dtype = "fp16"', 'dtype = "fp16"\nattention = "flash"'))
    assert_file_error(load_hardware, path, "training.attention", "dense or fused")
    path.write_text(V100.replace("kernel_launch_s = 5e-6", "kernel_launch_s = 5e-6\ndispatch_s = -1"))
    assert_file_error(load_hardware, path, "device.dispatch_s")


def test_missing_and_malformed_files(tmp_path: Path):
    with pytest.raises(UserError, match="not found"):
        load_hardware(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[device\n")
    with pytest.raises(UserError, match="malformed TOML"):
        load_hardware(bad)
