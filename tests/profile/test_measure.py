"""`terapipe profile`: grids, the timed runtime path, a real quick profile of a micro model, bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, run_cli, terapipe

from terapipe_cli.config.device import default_precision, resolve_precision
from terapipe_cli.errors import UserError
from terapipe_cli.models import GptConfig
from terapipe_cli.plan.costmodel import CostModel, profile_from_dict, read_profile
from terapipe_cli.plan.file import read_plan
from terapipe_cli.profile.probe import resolve_device
from terapipe_cli.profile.tiles import check_points, context_points, token_grid
from terapipe_cli.profile.timer import TileTimer, time_points

ROOT = Path(__file__).resolve().parents[2]
MICRO = GptConfig(name="micro", layers=2, hidden=32, heads=2, vocab=16, seq_len=64)


def write_model(path: Path, **fields) -> Path:
    cfg = dict(MICRO.to_dict(), **fields)
    cfg.pop("mlp_ratio")
    body = "\n".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in cfg.items())
    path.write_text("[model]\n" + body.replace("'", '"') + "\n")
    return path


# ------------------------------------------------------------------------------------------------ grids


@pytest.mark.parametrize(("seq_len", "step"), [(1024, 8), (2048, 16), (100, 1), (64, 8), (1000, 24)])
def test_token_grid_is_multiples_of_the_step_plus_the_sequence_length(seq_len, step):
    for quick in (False, True):
        grid = token_grid(seq_len, step, quick=quick)
        assert grid == sorted(set(grid))
        assert grid[0] == step and grid[-1] == seq_len
        assert all(n % step == 0 for n in grid[:-1])
    assert set(token_grid(seq_len, step, quick=True)) <= set(token_grid(seq_len, step))


def test_token_grid_rejects_impossible_steps():
    with pytest.raises(UserError, match="--token-step"):
        token_grid(64, 0)
    with pytest.raises(UserError, match="longer than"):
        token_grid(64, 128)


def test_context_points_are_distinct_valid_and_split():
    grid = token_grid(1024, 8)
    pts = context_points((1, 2, 4), grid, 1024, 8, fit=40, heldout=10, seed=3)
    assert len({(p.b, p.i, p.j) for p in pts}) == 50
    assert [p.role for p in pts].count("fit") == 40
    for p in pts:
        assert p.i in grid and p.j > 0 and p.j % 8 == 0 and p.i + p.j <= 1024 and p.b in (1, 2, 4)
    assert pts == context_points((1, 2, 4), grid, 1024, 8, fit=40, heldout=10, seed=3)  # reproducible


def test_context_points_refuse_a_sequence_too_short_to_fit():
    with pytest.raises(UserError, match="--token-step"):
        context_points((1,), [8, 16], 16, 8, fit=16, heldout=8, seed=0)


def test_check_points_lie_off_the_measured_grid():
    grid = token_grid(1024, 8)
    pts = check_points((1, 2, 4), grid, 1024, 8, count=8, seed=0)
    assert len(pts) == 8
    assert all(p.i not in grid and p.i + p.j <= 1024 for p in pts)
    assert any(p.b == 3 for p in pts)  # between measured batch sizes: tests the interpolation in b
    assert any(p.j == 0 for p in pts) and any(p.j > 0 for p in pts)


# ------------------------------------------------------------------------------------------------ timing


def test_device_auto_is_cpu_without_a_gpu_and_cuda_with_one(monkeypatch):
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(UserError, match="--device"):
            resolve_device("cuda")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(UserError, match="--device"):
        resolve_device("tpu")


def test_precision_is_bf16_on_cuda_and_fp32_on_cpu_unless_asked(monkeypatch):
    assert default_precision("cpu") == resolve_precision(None, "cpu") == resolve_precision("auto", "cpu") == "fp32"
    for name in ("fp32", "bf16", "fp16"):
        assert resolve_precision(name, "cpu") == name  # CPU autocast has both low precisions
    for bad in ("fp8", "FP16", "float32", ""):
        with pytest.raises(UserError) as err:
            resolve_precision(bad, "cpu")
        assert str(err.value).startswith("--precision: must be auto, fp32, bf16 or fp16") and "\n" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert default_precision("cuda") == resolve_precision(None, "cuda") == "bf16"
    # A GPU older than Ampere has no native bf16: fp16 by default, and bf16 is refused in one line.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert default_precision("cuda") == resolve_precision("auto", "cuda") == "fp16"
    assert resolve_precision("fp16", "cuda") == "fp16"
    with pytest.raises(UserError, match="^--precision: .*use fp16$"):
        resolve_precision("bf16", "cuda")


def test_tile_timer_runs_the_runtime_path_and_leaves_it_clean():
    timer = TileTimer(MICRO, torch.device("cpu"))
    # One decoder layer, no embedding or head: the per-layer cost.
    assert len(timer.runner.module.blocks) == 1 and not timer.runner.first and not timer.runner.last
    for b, i, j in [(1, 8, 0), (2, 16, 24), (1, 8, 56)]:
        fwd, bwd = timer.time_tile(b, i, j)
        assert fwd > 0 and bwd > 0
        assert timer.runner.pending_tiles == 0
    before = {k: v.clone() for k, v in timer.runner.module.state_dict().items()}
    assert timer.optimizer_step_s(repeats=2) > 0
    after = timer.runner.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the optimizer timing leaves weights alone
    act, method = timer.activation_bytes_per_token(1, 16)
    assert act >= 2 * MICRO.hidden * 4  # at least the tile's input and output are kept for the backward
    assert method.startswith("measured")
    # The K/V cache holds the whole sequence's rows, but a tile keeps only its own: the same per token for a
    # tile of 8 tokens as for one of 32.
    assert timer.activation_bytes_per_token(1, 8)[0] == timer.activation_bytes_per_token(1, 32)[0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_tiles_share_the_steps_weight_copies(precision):
    timer = TileTimer(MICRO, torch.device("cpu"), precision=precision)
    assert timer.runner.precision == precision
    fp32 = TileTimer(MICRO, torch.device("cpu"))
    with timer.runner.step():
        assert all(t > 0 for t in timer.time_tile(2, 16, 24))
        shared, _ = timer.activation_bytes_per_token(1, 16)
    alone, _ = timer.activation_bytes_per_token(1, 16)  # outside a step: every tile casts the weights again
    # The difference is exactly the low-precision copy of the layer's weight matrices (2 bytes per element).
    matrices = sum(p.numel() for p in timer.runner.module.parameters() if p.dim() == 2)
    assert alone - shared == pytest.approx(2 * matrices / 16)
    assert shared < fp32.activation_bytes_per_token(1, 16)[0]  # low-precision activations are smaller
    assert timer.optimizer_step_s(repeats=2) > 0


def test_timings_interleave_points_and_sample_cheap_tiles_more():
    timer = TileTimer(MICRO, torch.device("cpu"))
    pts = context_points((1, 2), token_grid(64, 8, quick=True), 64, 8, fit=4, heldout=2, seed=0)
    seen = []
    t = time_points(timer, pts, repeats=2, warmup_all=False, seed=0, progress=lambda *a: seen.append(a))
    assert all(len(s) >= 2 for s in t.forward) and all(
        len(s) == len(f) for s, f in zip(t.backward, t.forward, strict=True)
    )
    med, lo, hi = t.stats("total")
    assert np.all(lo <= med) and np.all(med <= hi) and np.all(lo > 0)
    assert seen[-1][1] == pytest.approx(seen[-1][2])  # the progress bar ends full


# ------------------------------------------------------------------------------------------------ the command


def cost_ends_positive(prof) -> np.ndarray:
    cost = CostModel(prof, 2)
    b, i = np.array([1, 2]), np.array([8, 40])
    return np.concatenate([cost.embedding(b, i), cost.head(b, i)]) > 0


def test_quick_profile_of_a_micro_model_is_a_valid_profile_the_planner_reads(tmp_path, capsys):
    model = write_model(tmp_path / "micro.toml")
    out = tmp_path / "sub" / "profile.json"
    p = run_cli(
        capsys, "profile", "--model", model, "--quick", "--check", "--no-comm", "--no-allreduce",
        "--batch-sizes", "2,1", "--out", out,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "held-out tile error" in p.stdout and "check: relative error" in p.stdout
    prof = read_profile(out)
    precision = default_precision(prof.device["kind"])  # fp32 on a CPU, bf16 on a GPU
    assert prof.precision == precision and f"in {precision}" in p.stdout
    assert prof.source == "measured" and prof.model.name == "micro" and prof.batch_sizes == (1, 2)
    assert prof.device["kind"] in ("cpu", "cuda") and prof.device["name"]
    raw = json.loads(out.read_text())
    assert raw["created"].endswith("Z")
    for which in ("forward", "backward"):
        ctx = raw["context"][which]
        assert np.isfinite(ctx["heldout_rel_err_mean"]) and ctx["heldout_rel_err_max"] >= ctx["heldout_rel_err_mean"]
        assert ctx["heldout_points"] == 8
    assert raw["optimizer_s_per_layer"] > 0 and raw["activation_bytes_per_token_per_layer"] > 0
    # Schema /2: the grid's backward timed split too, I then W, as the zero-bubble executor runs it.
    assert raw["schema"] == "terapipe.profile/3" and prof.split_source == "measured"
    for key in ("backward_input_s", "backward_weight_s"):
        grid = np.asarray(raw[key])
        assert grid.shape == np.asarray(raw["backward_s"]).shape and np.all(grid > 0)
        assert np.all(np.asarray(raw["grid"][f"{key[:-2]}_min_s"]) <= grid)
    # The embedding and the head, timed on the grid through the runtime's own chunks, and held out off it.
    ends = raw["ends"]
    for key in ("embed_forward_s", "embed_backward_s", "head_forward_s", "head_backward_s"):
        assert np.asarray(ends[key]).shape == (2, len(raw["token_lengths"])) and np.all(np.asarray(ends[key]) > 0)
    assert ends["embed_params"] == 16 * 32 + 64 * 32 and ends["head_params"] == 16 * 32 + 2 * 32
    assert raw["vocab_parallel"] is True  # the runtime splits them under T (whole at T = 1)
    assert len(ends["heldout"]["points"]) == 8
    assert all(np.isfinite(ends["heldout"][end]["rel_err_mean"]) for end in ("embed", "head"))
    assert prof.ends is not None and np.all(cost_ends_positive(prof))
    assert "not measured" in raw["comm"]["method"]
    assert "data_parallel_link" not in raw and "--no-allreduce" in raw["data_parallel_link_skipped"]
    assert len(raw["check"]["points"]) == 4
    cost = CostModel.from_profile(out, stages=2)
    t = cost(np.array([1, 2]), np.array([8, 24]), np.array([0, 16]))
    assert np.all(np.isfinite(t)) and np.all(t > 0)
    # `terapipe plan` consumes it.
    plan_out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", "--profile", str(out), "--stages", "2", "--batch", "2", "--out", str(plan_out))
    assert p.returncode == 0, p.stderr
    assert read_plan(plan_out).precision == precision
    # And the profile can be re-checked against fresh timings.
    p = run_cli(capsys, "profile", "--check-profile", str(out), "--quick")
    assert p.returncode == 0, p.stderr
    assert "check: relative error" in p.stdout and "machine speed now" in p.stdout


def test_a_bf16_profile_records_it_and_is_checked_at_it(tmp_path, capsys):
    model = write_model(tmp_path / "micro.toml")
    out = tmp_path / "bf16.json"
    args = ["profile", "--model", str(model), "--quick", "--no-comm", "--no-allreduce", "--device", "cpu"]
    args += ["--precision", "bf16"]
    p = run_cli(capsys, *args, "--out", str(out))
    assert p.returncode == 0, p.stderr
    raw = json.loads(out.read_text())
    assert raw["precision"] == read_profile(out).precision == "bf16"
    assert "in bf16" in raw["note"] and "in bf16" in p.stdout
    assert raw["dtype_bytes"] == 4  # what goes between stages stays fp32
    # --check-profile times at the profile's precision and refuses another one.
    for other in ("fp32", "fp16"):
        p = run_cli(capsys, "profile", "--check-profile", str(out), "--precision", other)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "--precision" in p.stderr and "measured in bf16" in p.stderr and "Traceback" not in p.stderr
    p = run_cli(capsys, "profile", "--check-profile", str(out), "--quick", "--precision", "auto")
    assert p.returncode == 0, p.stderr
    assert "in bf16" in p.stdout and "check: relative error" in p.stdout


def test_a_profile_without_precision_reads_as_fp32_and_a_bad_one_is_refused():
    example = ROOT / "configs/profiles/example-tiny-cpu.json"
    raw = json.loads(example.read_text())
    assert "precision" not in raw and read_profile(example).precision == "fp32"
    assert profile_from_dict({**raw, "precision": "fp16"}, "p.json").precision == "fp16"
    with pytest.raises(UserError, match="^p.json: field 'precision' must be fp32, bf16 or fp16, got 'half'$"):
        profile_from_dict({**raw, "precision": "half"}, "p.json")


# ------------------------------------------------------------------------------------------------ bad input


def bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    (tmp_path / "broken.toml").write_text("[model\nname = 'x'\n")
    return [
        (["--model", str(tmp_path / "nope.toml")], "not found"),
        (["--model", str(tmp_path / "broken.toml")], "malformed TOML"),
        (["--model", str(write_model(tmp_path / "heads.toml", heads=3))], "must divide hidden"),
        (["--model", str(write_model(tmp_path / "zero.toml", hidden=0))], "model.hidden"),
        (["--model", str(write_model(tmp_path / "ok.toml")), "--token-step", "128"], "--token-step"),
        (["--model", str(tmp_path / "ok.toml"), "--batch-sizes", "1,0"], "--batch-sizes"),
        (["--model", str(write_model(tmp_path / "short.toml", seq_len=24)), "--quick"], "context tiles"),
        (["--model", str(tmp_path / "ok.toml"), "--batch-sizes", "one"], "--batch-sizes"),
        (["--model", str(tmp_path / "ok.toml"), "--device", "tpu"], "--device"),
        (["--model", str(tmp_path / "ok.toml"), "--clock", "sundial"], "--clock"),
        (["--model", str(tmp_path / "ok.toml"), "--precision", "fp8"], "--precision: must be auto, fp32, bf16 or fp16"),
        (["--model", str(write_model(tmp_path / "huge.toml", hidden=65536, heads=64, seq_len=65536))], "GiB"),
        (["--check-profile", str(ROOT / "configs/profiles/example-tiny-cpu.json")], "measured profile"),
        (["--analytic", "--model", str(tmp_path / "ok.toml")], "--hardware"),
        (
            [
                "--analytic",
                "--hardware",
                str(ROOT / "configs/hardware/v100.toml"),
                "--model",
                str(tmp_path / "ok.toml"),
                "--check",
            ],
            "--check",
        ),
        (
            [
                "--analytic",
                "--hardware",
                str(ROOT / "configs/hardware/v100.toml"),
                "--model",
                str(tmp_path / "ok.toml"),
                "--precision",
                "bf16",
            ],
            "--precision: must be fp16",
        ),
        (
            [
                "--analytic",
                "--hardware",
                str(ROOT / "configs/hardware/v100.toml"),
                "--model",
                str(tmp_path / "ok.toml"),
                "--no-allreduce",
            ],
            "--no-allreduce",
        ),
        (["--model", str(tmp_path / "ok.toml"), "--hardware", str(ROOT / "configs/hardware/v100.toml")], "--analytic"),
        (["--model", str(tmp_path / "ok.toml"), "--tensor-parallel", "3"], "3 does not divide the 2 heads"),
        ([], "--model"),
    ] + ([] if torch.cuda.is_available() else [(["--model", str(tmp_path / "ok.toml"), "--device", "cuda"], "GPU")])


def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, capsys):
    out = tmp_path / "out.json"
    for args, needle in bad_inputs(tmp_path):
        p = run_cli(capsys, "profile", *args, "--out", str(out))
        assert p.returncode == 2, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr
        assert not out.exists(), args
    p = run_cli(capsys, "profile", "--model", str(tmp_path / "ok.toml"), "--out", str(tmp_path))
    assert p.returncode == 2 and "folder" in p.stderr


def test_bad_input_from_the_real_command_line(tmp_path):
    """The same through `python -m terapipe_cli` with PYTHONPATH=src: no traceback reaches the user."""
    proc = terapipe("profile", "--model", tmp_path / "missing.toml", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "missing.toml" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "profile.json").exists()


def test_micro_config_round_trip(tmp_path):
    from terapipe_cli.config.model import load_model_config

    assert load_model_config(write_model(tmp_path / "m.toml")) == MICRO
    assert replace(MICRO, layers=3).stage_layers(3) == 1


def test_analytic_flags_call_the_analytic_profile(tmp_path, capsys):
    out = tmp_path / "analytic.json"
    args = [
        "profile",
        "--analytic",
        "--hardware",
        str(ROOT / "configs/hardware/v100.toml"),
        "--model",
        str(ROOT / "configs/models/gpt3-1b.toml"),
        "--tensor-parallel",
        "8",
        "--out",
        str(out),
    ]
    p = run_cli(capsys, *args)
    assert p.returncode == 0, p.stderr
    prof = read_profile(out)
    assert prof.source == "analytic" and prof.model.name == "gpt3-1b" and prof.device["tensor_parallel"] == 8
    assert "held-out error" in p.stdout
    # The hardware file's peak is its fp16 peak: the profile is fp16, asked for or not.
    assert prof.precision == "fp16" and "fp16" in p.stdout
    p = run_cli(capsys, *args[:-2], "--precision", "fp16", "--out", str(tmp_path / "again.json"))
    assert p.returncode == 0, p.stderr
    assert read_profile(tmp_path / "again.json").precision == "fp16"


def test_profile_out_is_checked_before_measuring(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    p = run_cli(capsys, "profile", "--model", "tiny", "--quick", "--out", "notes.txt", cwd=tmp_path)
    assert_one_line_error(p, "notes.txt exists and is not a profile; pass --force")
    p = run_cli(capsys, "profile", "--model", "tiny", "--quick", "--out", str(tmp_path), cwd=tmp_path)
    assert_one_line_error(p, "names a folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_token_step_that_does_not_divide_the_sequence_is_refused_before_timing(tmp_path, capsys):
    p = run_cli(capsys, "profile", "--model", "tiny", "--quick", "--token-step", "7", "--out", str(tmp_path / "p.json"))
    assert_one_line_error(p, "--token-step", "1024", "multiple of 7")
    assert not (tmp_path / "p.json").exists()


def test_a_config_file_gives_the_profiles_settings_and_flags_override_it(tmp_path, capsys):
    """``terapipe profile --config FILE``: a ``[profile]`` table of the options (paths relative to the file) makes
    the profile the same flags make; a flag overrides the file; a key that is no option is one line naming the file
    and the key, and nothing is written."""
    hardware, model = ROOT / "configs/hardware/h100.toml", ROOT / "configs/models/tiny.toml"
    flags = run_cli(capsys, "profile", "--analytic", "--hardware", hardware, "--model", model, "-t", 2,
                    "--batch-sizes", "1,2", "--out", tmp_path / "flags.json")  # fmt: skip
    assert flags.returncode == 0, flags.stderr
    (tmp_path / "cfg").mkdir()
    config = tmp_path / "cfg" / "profile.toml"
    config.write_text(
        f'[profile]\nanalytic = true\nhardware = "{hardware}"\nmodel = "{model}"\ntensor_parallel = 2\n'
        'batch_sizes = "1,2"\nout = "file.json"\n'
    )
    by_file = run_cli(capsys, "profile", "--config", config)
    assert by_file.returncode == 0, by_file.stderr
    made = json.loads((tmp_path / "cfg" / "file.json").read_text())  # --out relative to the file
    same = json.loads((tmp_path / "flags.json").read_text())
    for key in ("forward_s", "backward_s", "context", "batch_sizes", "device", "model"):
        assert made[key] == same[key], key
    over = run_cli(capsys, "profile", "-c", config, "-t", 1, "--out", tmp_path / "t1.json")
    assert over.returncode == 0 and json.loads((tmp_path / "t1.json").read_text())["device"]["tensor_parallel"] == 1
    config.write_text("[profile]\nanalytik = true\n")
    p = run_cli(capsys, "profile", "--config", config, "--out", tmp_path / "bad.json")
    assert_one_line_error(p, "profile.toml", "profile.analytik", "not a profile setting")
    assert not (tmp_path / "bad.json").exists()
