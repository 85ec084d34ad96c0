"""`terapipe profile --tensor-parallel T` on this machine: the layer timed as one of a stage's T tensor ranks by T
torchrun processes (gloo on the CPU, wall time), and the plan made from it."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_one_line_error, run_cli
from local_world import LocalWorld

from terapipe_cli.engine.tensor import TensorGroup
from terapipe_cli.errors import UserError
from terapipe_cli.models import GptConfig
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.file import read_plan
from terapipe_cli.profile import ends, options
from terapipe_cli.profile.tiles import Settings
from terapipe_cli.profile.timer import CLOCK_NAMES

MICRO = GptConfig(name="micro", layers=2, hidden=32, heads=2, vocab=16, seq_len=64)


def write_micro(path: Path) -> Path:
    fields = {k: v for k, v in MICRO.to_dict().items() if k != "mlp_ratio"}
    body = "\n".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in fields.items())
    path.write_text("[model]\n" + body + "\n")
    return path


def test_a_t2_profile_is_timed_by_two_ranks_and_plans_at_t2(tmp_path: Path, capsys):
    model = write_micro(tmp_path / "micro.toml")
    out = tmp_path / "t2.json"
    args = ["profile", "--model", model, "--quick", "--tensor-parallel", "2", "--no-comm", "--no-allreduce"]
    p = run_cli(capsys, *args, "--batch-sizes", "1,2", "--out", out)  # the two ranks are torchrun processes
    assert p.returncode == 0, p.stdout + p.stderr
    assert "one of 2 tensor ranks" in p.stdout
    prof = read_profile(out)
    raw = json.loads(out.read_text())
    assert prof.source == "measured" and prof.tensor_parallel == 2 and raw["device"]["tensor_parallel"] == 2
    # Wall time: the waits inside the tensor-parallel all-reduces are part of a tile's cost.
    assert raw["device"]["clock"] == CLOCK_NAMES["wall"]
    # Per device: one rank's shard of the runtime's (bias-free) layer.
    assert prof.params_per_layer == MICRO.params_per_layer(2, bias=False) < MICRO.params_per_layer(bias=False)
    for table in (prof.forward_s, prof.backward_s):
        assert all(math.isfinite(t) and t > 0 for row in table for t in row)
    assert raw["optimizer_s_per_layer"] > 0 and raw["activation_bytes_per_token_per_layer"] > 0
    # The embedding and the head timed by the same two ranks, split by vocabulary rows as the runtime runs them:
    # rank 0's 8 of the 16 rows of each.
    assert raw["vocab_parallel"] is True and prof.vocab_parallel
    assert raw["ends"]["embed_params"] == 8 * 32 + 64 * 32 and raw["ends"]["head_params"] == 8 * 32 + 2 * 32
    assert all(t > 0 for key in ("embed_forward_s", "head_backward_s") for row in raw["ends"][key] for t in row)
    assert all(math.isfinite(raw["context"][w]["heldout_rel_err_mean"]) for w in ("forward", "backward"))

    plan = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", "--profile", out, "--stages", "2", "--batch", "2", "--out", plan)
    assert p.returncode == 0, p.stderr
    assert read_plan(plan).tensor_parallel == 2 and "T=2" in p.stdout

    # --check-profile times one process: it refuses a profile of two tensor ranks.
    assert_one_line_error(run_cli(capsys, "profile", "--check-profile", out), "tensor parallelism 2", "--check")


def test_the_ranks_agree_on_the_ends_heavy_tiles_whatever_their_own_clocks_say(monkeypatch):
    # A heavy tile (slower than HEAVY_S in the warm-up) runs no priming forward and fewer rounds. Two tensor ranks
    # (threads) whose clocks disagree on one tile: rank 1's first timed forward takes a second, rank 0's everything
    # a millisecond. Decided on each rank's own clock, rank 1 would leave out that tile's priming forward (and its
    # last round) and the ranks' all-reduces would stop pairing up: torchrun's ranks die of a collective mismatch.
    readings: dict[str, int] = {}

    def clock() -> float:
        me = threading.current_thread().name
        readings[me] = readings.get(me, 0) + 1
        return readings[me] * 1e-3 + (1.0 if me == "rank-1" and readings[me] >= 2 else 0.0)

    monkeypatch.setattr(ends, "time", SimpleNamespace(perf_counter=clock, process_time=clock))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # process-wide: the threads would race on it
    short = replace(MICRO, seq_len=16)  # 2 lengths on the grid and 2 held out: 8 visits a round
    settings = Settings.make(MICRO, [1], 4, quick=True, check=False, clock="wall")
    settings = replace(settings, token_lengths=(8, 16), repeats=1)
    monkeypatch.setattr(ends, "QUICK_ROUNDS", 2)  # the last round leaves the heavy tiles out
    world = LocalWorld(2, timeout_s=30)
    calls: list[list[tuple]] = [[], []]

    def rank(r: int) -> dict:
        group = world.group("tensor", range(2), r)
        reduce = group.all_reduce

        def all_reduce(tensor, op="sum", what="an all-reduce"):
            calls[r].append((tuple(tensor.shape), op))
            reduce(tensor, op=op, what=what)

        group.all_reduce = all_reduce
        return ends.time_ends(short, settings, torch.device("cpu"), tensor=TensorGroup(r, 2, group))

    first, second = world.run(rank)
    assert calls[0] == calls[1] and len(calls[0]) > 0
    assert first["embed_params"] == second["embed_params"] == 8 * 32 + 16 * 32


def test_bad_tensor_parallel_requests_are_one_line_before_any_timing(tmp_path: Path, capsys):
    model = write_micro(tmp_path / "micro.toml")
    out = tmp_path / "p.json"
    p = run_cli(capsys, "profile", "--model", model, "--quick", "-t", "3", "--out", out)
    assert_one_line_error(p, "--tensor-parallel", "3 does not divide the 2 heads")
    p = run_cli(capsys, "profile", "--model", model, "--quick", "-t", "2", "--clock", "cpu", "--out", out)
    assert_one_line_error(p, "--clock", "wall time")
    assert not out.exists()


def test_each_rank_needs_its_own_gpu_or_core(monkeypatch):
    # The tests see no GPU (conftest): two ranks on CUDA are refused.
    with pytest.raises(UserError, match="--tensor-parallel: 2 processes need one GPU each, and this machine has 0"):
        options.check_tensor_parallel(MICRO, 2, "cuda", None)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    with pytest.raises(UserError, match="--tensor-parallel: 2 processes need a core each"):
        options.check_tensor_parallel(MICRO, 2, "cpu", None)
    options.check_tensor_parallel(MICRO, 1, "cpu", "cpu")  # one process: any clock


def test_rank_0s_progress_lines_reach_the_parents_bar(tmp_path: Path):
    from terapipe_cli.profile.tensor_parallel import _pass_on, _ProgressFile, _relay_progress

    path = tmp_path / "progress.jsonl"
    seen: list[tuple[str, float, float]] = []
    with _relay_progress(path, lambda *update: seen.append(update), "starting"):
        write = _ProgressFile(str(path))
        write("timing tiles (warm-up)", 1, 10)
        write("timing tiles (warm-up)", 2, 10)  # within 0.2 s of the last line of its phase: left out
        write("timing tiles (round 1/3)", 10, 10)
    assert seen[0] == ("starting", 0, 1) and ("starting", 1, 1) in seen  # torchrun's start is over
    assert [s for s in seen if s[0] != "starting"] == [
        ("timing tiles (warm-up)", 1, 10),
        ("timing tiles (round 1/3)", 10, 10),
    ]
    # A line still being written is passed on only once it is whole.
    with open(path, "a") as f:
        f.write('{"phase": "x", "done": 1,')
    offset = path.stat().st_size - len('{"phase": "x", "done": 1,')
    assert _pass_on(path, offset, lambda *update: seen.append(update)) == offset
