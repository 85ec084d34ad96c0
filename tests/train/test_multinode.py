"""Two "nodes" on loopback: two real processes running `terapipe train` with --nnodes 2, one stage each (docs/design.md
§6): node 1 a `terapipe train` process of its own, node 0 this one (as `terapipe run` runs the command).

Each node is its own launcher and torchrun agent, exactly as on two machines; only the rendezvous address is
127.0.0.1. One --out per node, with a killed node and the resume of both: node 1's folder gets node 0's config, and
each folder its own stage's checkpoints. Who writes what in one folder both nodes share, and how a node tells a
shared folder from its own, are `test_folder_roles` and `test_join_run_folder`, in this process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, LocalSetup, run_cli, train_locally, write_plan_file

from terapipe_cli.config.controls import CONTROLS_ENV
from terapipe_cli.config.run import RunConfig
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.train import checkpoint
from terapipe_cli.train.prepare import prepare_run
from terapipe_cli.train.rundir import read_metrics, read_summary, timeline_path
from terapipe_cli.train.worker import folder_roles

STEPS = ("--steps", "4", "--checkpoint-every", "2", "--device", "cpu", "--seed", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(node: int, port: int, out, *args, env: dict | None = None, nnodes: int = 2) -> subprocess.Popen:
    """`terapipe train ... --nnodes 2 --node-rank NODE` as its own process, in the environment conftest's
    `terapipe` gives (this checkout's package, no GPU, a wide dumb terminal)."""
    base = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    base.update(CUDA_VISIBLE_DEVICES="", **(env or {}))
    command = [sys.executable, "-m", "terapipe_cli", "train", "--out", str(out), *map(str, args)]
    command += ["--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return subprocess.Popen(command, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_nodes(capfd, outs, *args, env: dict | None = None) -> list[tuple[int, str, str]]:
    """Both nodes of one launch, their (exit code, stdout, stderr): node 1 its own process, started first; node 0
    in this process (its launcher and agent, as `terapipe run` runs them), which hosts the rendezvous."""
    port = free_port()
    node1 = start_node(1, port, outs[1], *args, env=env)
    try:
        endpoint = ("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}")
        p = run_cli(capfd, "train", "--out", outs[0], *args, *endpoint, env=env)
        stdout, stderr = node1.communicate(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
    return [(p.returncode, p.stdout, p.stderr), (node1.returncode, stdout, stderr)]


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plan (K = 2) and the losses of its 4 steps on one node (trained in one process through the workers'
    own code, with the settings `terapipe train` resolves for STEPS)."""
    tmp = tmp_path_factory.mktemp("one-node")
    plan = write_plan_file(tmp / "plan.json", [(2, [8, 8, 16])], stages=2)
    prepared = prepare_run(RunConfig(plan=str(plan), steps=4, checkpoint_every=2, device="cpu", seed=1), write=False)
    return plan, train_locally(LocalSetup(prepared.plan, prepared.args)).losses


def test_two_nodes_with_folders_of_their_own_train_like_one_and_resume(tmp_path, reference, capfd):
    """Node 1 is killed in step 3; both nodes then resume from step 2's checkpoint, each folder holding its node's
    stage (node 0's the metrics). The losses of all 4 steps equal one node's."""
    plan, expected = reference
    outs = [tmp_path / "node0", tmp_path / "node1"]
    first = run_nodes(capfd, outs, "--plan", plan, *STEPS, env={CONTROLS_ENV: "fault=kill:1:3"})
    assert [code for code, _, _ in first] == [1, 1], first
    node1_error = first[1][2].strip().splitlines()
    assert "rank 1 (stage 1, replica 0) failed: killed by signal SIGKILL" in node1_error[-1], first[1][2]
    assert "Traceback" not in first[0][2] + first[1][2]
    for node, out in enumerate(outs):
        assert checkpoint.latest_complete(out) == 2
        marker = json.loads((checkpoint.step_dir(out, 2) / checkpoint.MARKER).read_text())
        assert [f["name"] for f in marker["files"]] == [f"stage_{node:03d}.pt"]  # each folder marks its node's stage
    assert (outs[0] / "errors" / "rank_00000.txt").is_file()  # rank 0's traceback: it lost rank 1
    resumed = run_nodes(capfd, outs, "--resume", *STEPS)
    assert [code for code, _, _ in resumed] == [0, 0], resumed
    assert not (outs[0] / "errors").exists()  # a successful resume clears the failed attempt's tracebacks
    assert "step     4/4" in resumed[0][1] and " loss " not in resumed[1][1]  # node 0 prints the steps
    assert losses(outs[0]) == pytest.approx(expected, rel=1e-6, abs=0)
    assert read_summary(outs[0])["resumed_from"] == 2
    assert all(checkpoint.latest_complete(out) == 4 for out in outs)
    assert timeline_path(outs[1], 1).is_file()
    config = [json.loads((out / "config.json").read_text()) for out in outs]
    assert config[0] == config[1]  # node 1 holds node 0's config
    assert not (outs[1] / "metrics.jsonl").exists() and not timeline_path(outs[1], 0).exists()


def test_a_node_that_never_joins_is_named_in_one_line(tmp_path, reference, capsys):
    """Node 0 alone: it names node 1 within --rdzv-timeout. Node 1 alone: it says node 0's rendezvous is absent.
    (Each launcher in this process, as `terapipe run` runs one: what is tested is the launcher's rendezvous.)"""
    plan, _ = reference
    alone = ("--plan", plan, *STEPS, "--rdzv-timeout", "1", "--nnodes", "2")
    results = []
    for node in (0, 1):
        endpoint = f"127.0.0.1:{free_port()}"
        out = tmp_path / f"n{node}"
        p = run_cli(capsys, "train", *alone, "--node-rank", node, "--rdzv-endpoint", endpoint, "--out", out)
        assert p.returncode == 1, p.stdout + p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("terapipe: error: "), p.stderr
        results.append(lines[0])
    assert "node 1 of 2 did not join within 1 s at 127.0.0.1:" in results[0]
    assert "node 1 of 2 found no rendezvous at 127.0.0.1:" in results[1]


def test_folder_roles():
    """Who writes checkpoint files: the lowest rank of each stage in each folder; the folder's lowest marks it."""
    # K = 2, D = 2 on two nodes, node-local folders: node 1 holds replica 1 and writes both its stages.
    owners = [0, 0, 1, 1]
    assert [folder_roles(r, Layout(2, 2), owners) for r in range(4)] == [
        {"writes_shard": True, "marks_stages": [0, 1]},
        {"writes_shard": True, "marks_stages": None},
        {"writes_shard": True, "marks_stages": [0, 1]},
        {"writes_shard": True, "marks_stages": None},
    ]
    # The same run in one shared folder: replica 0 writes, rank 0 marks.
    shared = [folder_roles(r, Layout(2, 2), [0, 0, 0, 0]) for r in range(4)]
    assert [x["writes_shard"] for x in shared] == [True, True, False, False]
    assert [x["marks_stages"] for x in shared] == [[0, 1], None, None, None]
    # K = 2, D = 1, node-local: each node marks its own stage.
    assert folder_roles(1, Layout(1, 2), [0, 1]) == {"writes_shard": True, "marks_stages": [1]}
    # K = 2, T = 2 in one folder: tensor rank 0 of each stage writes the stage's whole (gathered) file.
    tensor = [folder_roles(r, Layout(1, 2, 2), [0, 0, 0, 0]) for r in range(4)]
    assert [x["writes_shard"] for x in tensor] == [True, False, True, False]
    assert tensor[0]["marks_stages"] == [0, 1]


def test_join_run_folder(tmp_path):
    """Node 0's launch id in the folder: shared. None: node-local, node 0's config copied in. Another run's:
    replaced when it never trained there, else refused for a new run and replaced by node 0's on --resume."""
    from terapipe_cli.errors import UserError
    from terapipe_cli.files import read_json, write_json_atomic
    from terapipe_cli.train.rundir import RUN_SCHEMA, join_run_folder

    config = {"schema": RUN_SCHEMA, "plan": {"stages": 2}, "arguments": {}, "launch_id": "new"}
    shared, local = tmp_path / "shared", tmp_path / "local"
    write_json_atomic(shared / "config.json", config)
    assert join_run_folder(shared, config, node_rank=1, resuming=False) is True
    assert join_run_folder(local, config, node_rank=1, resuming=False) is False
    assert read_json(local / "config.json") == config and read_json(local / "plan.json") == {"stages": 2}
    write_json_atomic(local / "config.json", {**config, "launch_id": "old"})
    assert join_run_folder(local, config, node_rank=1, resuming=False) is False  # the old one never trained here
    write_json_atomic(local / "config.json", {**config, "launch_id": "old"})
    (local / "checkpoints" / "step_000002").mkdir(parents=True)  # ... this one did
    with pytest.raises(UserError, match="already holds another run"):
        join_run_folder(local, config, node_rank=1, resuming=False)
    assert join_run_folder(local, config, node_rank=1, resuming=True) is False
    assert read_json(local / "config.json")["launch_id"] == "new"
