"""Where the workers compute and how they talk: a GPU per worker (NCCL), or stages sharing a GPU (gloo through
host memory), or the CPU (gloo). The decision is pure and tested here on any machine; the GPU tests at the end
train on one GPU shared by two stages and run the demo on a machine with a GPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import CUDA_VISIBLE_DEVICES, ROOT, assert_one_line_error, gpu_test, run_cli, terapipe, write_plan_file

from terapipe_cli.engine.comm import host_all_reduce, host_staged
from terapipe_cli.engine.mesh import Layout, gpu_of
from terapipe_cli.engine.p2p import Links
from terapipe_cli.errors import UserError
from terapipe_cli.train import placement, worker
from terapipe_cli.train.rundir import read_summary

sys.path.insert(0, str(ROOT / "scripts"))
import bench_gpu  # noqa: E402


@pytest.mark.parametrize(
    "device, workers, gpus, backend",
    [
        ("cpu", 2, 0, "gloo"),
        ("cpu", 2, 8, "gloo"),
        ("cuda", 1, 1, "nccl"),
        ("cuda", 4, 4, "nccl"),
        ("cuda", 2, 8, "nccl"),
        ("cuda", 2, 1, "gloo"),
        ("cuda", 8, 4, "gloo"),
    ],
)
def test_backend_nccl_only_with_a_gpu_per_worker(device, workers, gpus, backend):
    assert placement.backend_for(device, workers, gpus) == backend


def test_backend_counts_this_machines_gpus_by_default(monkeypatch):
    monkeypatch.setattr(placement, "gpu_count", lambda: 1)
    assert placement.backend_for("cuda", 2) == "gloo"
    assert placement.backend_for("cuda", 1) == "nccl"
    monkeypatch.setattr(placement, "gpu_count", lambda: 2)
    assert placement.backend_for("cuda", 2) == "nccl"


@pytest.mark.parametrize(
    "workers, gpus, placed",
    [(2, 1, [0, 0]), (4, 2, [0, 1, 0, 1]), (3, 2, [0, 1, 0]), (2, 4, [0, 1]), (4, 4, [0, 1, 2, 3])],
)
def test_each_worker_gets_its_own_gpu_while_there_are_enough_then_shares(workers, gpus, placed):
    assert [gpu_of(r, gpus) for r in range(workers)] == placed


def test_the_launch_line_says_which_mode(monkeypatch):
    assert placement.placement_note("cuda", 2, 1) == "2 workers share 1 GPU: gloo through host memory"
    assert placement.placement_note("cuda", 8, 4) == "8 workers share 4 GPUs: gloo through host memory"
    assert placement.placement_note("cuda", 2, 2) == "nccl, one GPU per worker"
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert placement.placement_note("cpu", 2, 0) == "gloo on cpu"
    assert placement.placement_note("cpu", 8, 0) == "gloo on cpu, 8 workers sharing 2 cores: each slower than alone"


def test_more_workers_than_gpus_is_allowed_on_cuda(monkeypatch):
    """The measured failure on a 1-GPU machine: K = 2 used to be refused ("more than allowed here (1: 1 GPU(s))")."""
    monkeypatch.setattr(placement, "gpu_count", lambda: 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert placement.workers_per_node(Layout(1, 2), 1, "cuda") == 2
    assert placement.workers_per_node(Layout(2, 2), 1, "cuda") == 4
    allowed, why = placement.max_workers_per_node("cuda")
    assert allowed == placement.CPU_WORKERS_PER_CORE * 2 and "beyond the 1 GPU share them" in why


def test_workers_beyond_the_cores_are_still_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(placement, "gpu_count", lambda: 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(UserError) as e:
        placement.workers_per_node(Layout(2, 4), 1, "cuda")
    msg = str(e.value)
    assert "= 8 workers" in msg and "4 x 1 CPU cores" in msg and "\n" not in msg


def test_a_worker_sharing_the_gpu_uses_gpu_local_rank_mod_gpus(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert worker._use_device("cuda", threads=1) == torch.device("cuda", 0) == chosen[0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert worker._use_device("cuda", threads=1) == torch.device("cuda", 1)


@pytest.fixture
def gloo_group(tmp_path):
    """A one-rank gloo process group in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _links(device: torch.device) -> Links:
    return Links(prev_rank=None, next_rank=None, hidden=8, dtype=torch.float32, device=device, timeout_s=5)


def test_cuda_tensors_on_gloo_go_through_host_memory(gloo_group):
    assert host_staged(torch.device("cuda", 0)) is True
    assert host_staged(torch.device("cpu")) is False
    links = _links(torch.device("cuda", 0))
    assert links.staged and links._buffers == torch.device("cpu")
    links = _links(torch.device("cpu"))
    assert not links.staged and links._buffers == torch.device("cpu")


def test_without_a_process_group_nothing_is_staged():
    """One process (scripts/bench_gpu.py: K = 1) sends nothing, so its links need no process group."""
    assert not dist.is_initialized()
    assert host_staged(torch.device("cuda", 0)) is False
    assert _links(torch.device("cuda", 0)).staged is False


def test_host_all_reduce_on_the_cpu_reduces_in_place(gloo_group):
    t = torch.tensor([1.0, -2.0, 3.5], dtype=torch.float64)
    host_all_reduce(t)
    assert t.tolist() == [1.0, -2.0, 3.5]  # one rank: the sum is itself, in place
    host_all_reduce(t, op=dist.ReduceOp.MAX, group=dist.new_group([0]))
    assert t.tolist() == [1.0, -2.0, 3.5]


def test_tests_see_no_gpu_unless_they_ask():
    """conftest hides the GPU from every test but a GPU one, here and in the processes tests start."""
    from terapipe_cli.config.device import resolve_device

    assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0
    assert resolve_device("auto") == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_bench_gpu_refuses_a_machine_without_a_gpu_in_one_line(capsys):
    # The script's own main, in this process (conftest hides the GPU): no second interpreter to import torch again.
    assert not torch.cuda.is_available()
    assert bench_gpu.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "bench_gpu.py needs a CUDA GPU; none here\n"


def test_bench_gpu_model_flops_are_the_plans_count():
    """bench_gpu counts what `terapipe plan` and `terapipe report` count (`plan.mfu.step_flops`): 6·N·B·L with N the
    layers' matrices and the LM head, plus 12·layers·B·L²·H (the whole L × L rectangle, PaLM's count) — twice the
    causal tiles' attention summed over any slicing."""
    from terapipe_cli.models import GptConfig

    layers, H, V, L = 24, 2048, 50257, 2048
    model = GptConfig("gpt3-1b", layers, H, 16, V, L)
    for B, slices in ((1, [2048]), (8, [512] * 4), (1, [1000, 600, 448])):
        matrices, attention, j = 0.0, 0.0, 0
        for i in slices:
            matrices += 3 * 24 * B * i * H * H
            attention += 3 * 4 * B * i * (j + i / 2) * H
            j += i
        expected = layers * (matrices + 2 * attention) + 6 * H * V * B * L
        assert bench_gpu.model_flops(model, B) == pytest.approx(expected, rel=1e-12)


def test_bench_gpu_schemes_and_table(tmp_path):
    schemes = bench_gpu.candidates([(1, [1024, 1024])], 1, 2048)
    assert [n for n, _ in schemes] == ["whole sequence", "uniform/4", "uniform/8", "planner"]
    assert all(sum(sum(t) * b for b, t in s) == 2048 for _, s in schemes)
    peak, source = bench_gpu.peak_flops("NVIDIA H100 80GB HBM3", None)
    assert peak == 989e12 and "h100.toml" in source
    assert bench_gpu.peak_flops("NVIDIA A10G", None)[0] is None
    assert bench_gpu.peak_flops("NVIDIA A10G", 125.0)[0] == 125e12
    cell = bench_gpu.Cell("bf16", 1, "whole sequence", [(1, [2048])], 0.05, times=[0.1, 0.2, 0.3], peak_bytes=2**31)
    oom = bench_gpu.Cell("bf16", 8, "uniform/8", [(8, [256] * 8)], 0.5, failed="out of memory")
    rows = bench_gpu.table_rows([cell, oom], lambda batch: 1e14 * batch, 1e15)
    assert rows[0][4:8] == ["200.0 (100.0–300.0)", "500.0", "50.0%", "2.0"]
    assert rows[1][4] == "out of memory"
    assert rows[2][2] == "CUDA graphs on" and "not implemented" in rows[2][4]
    text = bench_gpu.render(bench_gpu.HEADERS, rows, markdown=True).splitlines()
    assert len(text) == 2 + len(rows) and all(line.count("|") == len(bench_gpu.HEADERS) + 1 for line in text)


def test_bench_gpu_dry_run_says_no_cuda_and_refuses_another_models_profile():
    """--device cpu (scripts/gpu_bringup.sh's dry run): no MFU or CUDA peak there; a profile plans only its model."""
    from terapipe_cli.plan.costmodel import read_profile

    cell = bench_gpu.Cell("fp32", 1, "whole sequence", [(1, [64])], 0.05, times=[0.1])
    assert bench_gpu.table_rows([cell], lambda batch: 1e9, None, cuda=False)[0][6:8] == ["no CUDA", "no CUDA"]
    example = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"
    tiny = bench_gpu.load_model("tiny", None)
    assert bench_gpu.profile_mismatch(read_profile(example), tiny, "p.json") is None
    why = bench_gpu.profile_mismatch(read_profile(example), bench_gpu.load_model("tiny", 128), "p.json")
    assert why == "bench_gpu.py: p.json profiles another model: seq_len 1024 (the model's 128)"


# ----------------------------------------------------------------------------------------------- on a GPU


@gpu_test
def test_gpu_tests_see_the_gpu():
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == CUDA_VISIBLE_DEVICES


def _one_gpu() -> dict:
    """The environment that shows a command exactly one GPU (the first this process may use)."""
    first = (CUDA_VISIBLE_DEVICES or "0").split(",")[0]
    return {"CUDA_VISIBLE_DEVICES": first}


@gpu_test
@pytest.mark.parametrize("precision, data_parallel", [("fp32", 1), ("bf16", 1), ("fp32", 2)])
def test_stages_share_one_gpu_and_verify(tmp_path, precision, data_parallel):
    """K = 2 stages (x D replicas) on one GPU: gloo with every message through host memory, same mathematics."""
    plan = write_plan_file(tmp_path / "plan.json", [(2, [8, 8, 16])], stages=2)
    out = tmp_path / "run"
    args = ["train", "--plan", plan, "--steps", "3", "--out", out, "--verify", "--device", "cuda"]
    args += ["--precision", precision, "--data-parallel", str(data_parallel)]
    if precision != "fp32":
        args.append("--accept-precision")  # the hand-made plan is priced in fp32
    p = terapipe(*args, gpu=True, env=_one_gpu(), timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    workers = 2 * data_parallel
    assert f"{workers} workers share 1 GPU: gloo through host memory" in p.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["device"], config["backend"]) == ("cuda", "gloo")
    summary = read_summary(out)
    assert summary["verify"]["ok"] is True
    assert "cpu" not in summary["device"].lower()  # the workers computed on the GPU


@gpu_test
def test_the_demo_runs_on_the_cpu_on_a_machine_with_a_gpu(tmp_path):
    """What `bash scripts/demo.sh --quick` runs: on a machine with one GPU it must not fail, and it says CPU."""
    p = terapipe("run", "--quick", "--out", tmp_path / "runs", cwd=tmp_path, gpu=True, env=_one_gpu(), timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (root,) = list((tmp_path / "runs").iterdir())
    assert json.loads((root / "run" / "config.json").read_text())["device"] == "cpu"
    assert "--device cpu" in p.stdout and "gloo on cpu" in p.stdout


@gpu_test
def test_the_demo_on_the_gpu_when_asked(tmp_path):
    """`terapipe run --device cuda` on a machine with one GPU: the two stages share it."""
    args = ["run", "--quick", "--device", "cuda", "--out", tmp_path / "runs"]
    p = terapipe(*args, cwd=tmp_path, gpu=True, env=_one_gpu(), timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (root,) = list((tmp_path / "runs").iterdir())
    assert json.loads((root / "run" / "config.json").read_text())["device"] == "cuda"
    assert "2 workers share 1 GPU" in p.stdout


def test_asking_for_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    """Without a GPU (as every test but a GPU one sees it), --device cuda stops before any worker starts."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    p = run_cli(capsys, "train", "--plan", plan, "--out", tmp_path / "run", "--device", "cuda")
    assert_one_line_error(p, "--device", "no CUDA GPU")
    assert not (tmp_path / "run").exists()
