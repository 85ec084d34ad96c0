"""`terapipe profile --check-profile` of an analytic profile: refused in one line off the device and precision it
describes, checked tile by tile like a measured profile on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_one_line_error, run_cli

from terapipe_cli.config import device as device_mod
from terapipe_cli.config.device import same_device_name
from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.models import GptConfig, ModelConfig
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.profile import options, probe
from terapipe_cli.profile.analytic import analytic_profile

MICRO = GptConfig(name="micro", layers=2, hidden=32, heads=2, vocab=16, seq_len=64)
CPU_NAME = probe.device_info(torch.device("cpu"))["name"]


def write_analytic(
    path: Path, hardware: str = "h100", *, tensor_parallel: int = 1, model: ModelConfig | None = None, **device
) -> Path:
    """An analytic profile of ``model`` (the tiny model unless given) on ``hardware``, one batch size (a quick check
    stays fast); its ``device`` entry updated with ``device`` (and ``precision`` moved out of it into the profile)."""
    prof = analytic_profile(
        model or load_model_config("tiny"),
        load_hardware(ROOT / f"configs/hardware/{hardware}.toml"),
        tensor_parallel=tensor_parallel,
        batch_sizes=(1,),
    )
    if "precision" in device:
        prof["precision"] = prof["dtype"] = device.pop("precision")
    prof["device"].update(device)
    write_json_atomic(path, prof)
    return path


def test_an_h100_estimate_is_refused_on_this_cpu_in_one_line(tmp_path: Path, capsys):
    out = tmp_path / "h100.json"
    made = run_cli(
        capsys,
        "profile",
        "--analytic",
        "--hardware",
        ROOT / "configs/hardware/h100.toml",
        "--model",
        ROOT / "configs/models/tiny.toml",
        "--out",
        out,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    before = sorted(tmp_path.iterdir())
    p = run_cli(capsys, "profile", "--check-profile", out)
    # Both devices and both precisions, and what to do instead: the model's file to profile, as it was given.
    model = f"terapipe profile --model {ROOT / 'configs/models/tiny.toml'} --check"
    assert_one_line_error(p, str(out), "analytic", "NVIDIA H100-SXM5-80GB (cuda) in fp16", f"{CPU_NAME} (cpu)", model)
    assert "measured profile" in p.stderr and p.stdout == ""
    assert sorted(tmp_path.iterdir()) == before  # nothing written


def test_an_estimate_of_this_cpu_is_checked_tile_by_tile(tmp_path: Path, capsys):
    # Of a micro model: the check times its tiles, which cost a fraction of the tiny model's (L = 1024) and go
    # through the same check and report.
    out = write_analytic(tmp_path / "cpu.json", model=MICRO, kind="cpu", name=CPU_NAME, precision="fp32")
    before = sorted(tmp_path.iterdir())
    p = run_cli(capsys, "profile", "--check-profile", out, "--quick")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "an analytic estimate for" in p.stdout and "in fp32" in p.stdout
    # The measured profile's report: one row per check tile, the error of each, then the summary.
    assert "measured" in p.stdout and "predicted" in p.stdout and "error" in p.stdout
    rows = [line for line in p.stdout.splitlines() if line.count("ms") == 2 and "%" in line]
    assert len(rows) == 4, p.stdout
    assert "check: relative error mean" in p.stdout and "their estimated time" in p.stdout
    assert sorted(tmp_path.iterdir()) == before


def test_refusals_of_a_matching_device(tmp_path: Path, capsys):
    # Another --precision than the estimate's, an estimate at T > 1, and a made-up (example) profile.
    out = write_analytic(tmp_path / "cpu.json", kind="cpu", name=CPU_NAME, precision="fp32")
    with pytest.raises(UserError, match="bf16 asked for, but .* was estimated in fp32"):
        options.profile_to_check(out, "cpu", precision="bf16", model=None, analytic=False)
    t2 = write_analytic(tmp_path / "t2.json", tensor_parallel=2, kind="cpu", name=CPU_NAME, precision="fp32")
    with pytest.raises(UserError, match="estimate for tensor parallelism 2; .*--tensor-parallel 2 --check"):
        options.profile_to_check(t2, "cpu", precision=None, model=None, analytic=False)
    example = ROOT / "configs/profiles/example-tiny-cpu.json"
    assert_one_line_error(
        run_cli(capsys, "profile", "--check-profile", example), "'example' profile", "measured profile"
    )


def test_on_a_gpu_the_hardware_files_name_matches_what_cuda_reports(tmp_path: Path, monkeypatch):
    """No GPU here: the device this process would time is pretended (its name and whether it has bf16)."""
    gpu = torch.device("cuda", 0)
    pretend = {"name": ""}
    monkeypatch.setattr(probe, "device_info", lambda dev: dict(pretend))
    monkeypatch.setattr(device_mod, "_native_bf16", lambda: pretend["name"].startswith("NVIDIA H100"))
    h100 = read_profile(write_analytic(tmp_path / "h100.json"))
    pretend["name"] = "NVIDIA H100 80GB HBM3"
    options.check_analytic_device(h100, gpu, tmp_path / "h100.json")  # accepted
    for other in ("NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
        pretend["name"] = other
        with pytest.raises(UserError, match=f"NVIDIA H100-SXM5-80GB \\(cuda\\) in fp16, .*{other} \\(cuda\\)"):
            options.check_analytic_device(h100, gpu, tmp_path / "h100.json")
    # A bf16 estimate for a V100, which has no native bf16: the precision is named, and what it would run.
    v100 = read_profile(write_analytic(tmp_path / "v100.json", "v100", precision="bf16"))
    pretend["name"] = "Tesla V100-SXM2-16GB"
    with pytest.raises(UserError, match=r"V100-SXM2-16GB \(cuda\) in bf16, .*V100-SXM2-16GB \(cuda\) in fp16"):
        options.check_analytic_device(v100, gpu, tmp_path / "v100.json")


@pytest.mark.parametrize(
    ("described", "local", "same"),
    [
        ("NVIDIA H100-SXM5-80GB", "NVIDIA H100 80GB HBM3", True),
        ("NVIDIA H100-SXM5-80GB", "NVIDIA H100", True),
        ("NVIDIA V100-SXM2-16GB", "Tesla V100-SXM2-16GB", True),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", True),
        ("NVIDIA H100-SXM5-80GB", "NVIDIA H100 PCIe", False),  # form factor
        ("NVIDIA H100-SXM5-80GB", "NVIDIA H100 NVL", False),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", False),  # memory
        ("NVIDIA H100-SXM5-80GB", "NVIDIA H200", False),  # model
        ("NVIDIA H100-SXM5-80GB", "NVIDIA GH200 480GB", False),
        ("NVIDIA H100-SXM5-80GB", "AMD EPYC", False),
        ("Intel(R) Xeon(R) CPU @ 2.20GHz", "intel(r)  xeon(r) cpu @ 2.20ghz", True),  # no GPU model: equal names
        ("Intel(R) Xeon(R) CPU @ 2.20GHz", "Intel(R) Xeon(R) CPU @ 3.10GHz", False),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", True),
    ],
)
def test_device_names_match_by_gpu_model(described: str, local: str, same: bool):
    assert same_device_name(described, local) is same


def test_the_check_compares_one_layers_tile_not_a_stage_with_the_head():
    """The check times one decoder layer, so it compares that with the profile's one-layer tile. A stage's cost would
    add the LM head (here, with a 50K vocabulary, most of the stage's time): timings equal to the layer's tile check
    with no error, while the stage's cost would read them as far off."""
    from terapipe_cli.plan.costmodel import CostModel, profile_from_dict
    from terapipe_cli.profile.measure import check_against

    model = GptConfig(name="wide-vocab", layers=4, hidden=256, heads=4, vocab=50_000, seq_len=256)
    profile = analytic_profile(model, load_hardware("h100"), batch_sizes=(1, 2), token_step=16)
    cost = CostModel(profile_from_dict(profile, "profile"), stages=model.layers)
    tiles = [(1, 24, 40), (2, 72, 8), (1, 200, 0)]
    measured = []
    for b, i, j in tiles:
        layer = float(cost.no_context(b, i) + cost.context(b, i, j))
        assert float(cost(b, i, j)) > 1.5 * layer  # the head's stage: what the check must not compare with
        measured.append({"b": b, "i": i, "j": j, "forward_s": layer / 3, "backward_s": 2 * layer / 3})
    result = check_against(profile, measured)
    assert result["rel_err_max"] < 1e-9, result["points"]
