"""The launcher's one line for a failed job names the rank's place in the D × K × T mesh and its cause (no torchrun
run here)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.train.launch import Launch, describe_failure, describe_unreadable_failure
from terapipe_cli.train.worker import ERROR_FILE_ENV, record_for_torchrun


@dataclass
class Failure:
    """What torchrun reports of a failed rank (the fields `describe_failure` reads)."""

    exitcode: int
    message: str
    timestamp: int
    error_file: str = "error.json"

    def signal_name(self) -> str:
        return "SIGKILL"


def test_the_failed_rank_is_placed_in_the_mesh(tmp_path: Path):
    # D = 1, K = 2, T = 2: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1; rank 3 raised, rank 1 was stopped after it.
    spec = Launch(run_dir=tmp_path, nproc_per_node=4, stages=2, tensor_parallel=2)
    failures = {3: Failure(1, "RuntimeError: boom", 1), 1: Failure(-15, "", 2)}
    line = describe_failure(failures, spec)
    assert line.startswith("worker rank 3 (stage 1, replica 0, tensor rank 1) failed: RuntimeError: boom")
    assert line.endswith("; ranks [1] then failed too")
    one = Launch(run_dir=tmp_path, nproc_per_node=4, stages=2)  # T = 1: two replicas of two stages
    assert describe_failure({3: Failure(1, "RuntimeError: boom", 1)}, one).startswith(
        "worker rank 3 (stage 1, replica 1) failed"
    )


def test_a_worker_writes_torchruns_error_file_whole(tmp_path: Path, monkeypatch):
    """The cause reaches the launcher through torchrun's JSON error file, renamed into place, so a rank stopped
    half-way through writing it never leaves torchrun a JSONDecodeError."""
    target = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(target))
    try:
        raise RuntimeError("injected failure")
    except RuntimeError as e:
        record_for_torchrun(e)
    assert json.loads(target.read_text())["message"]["message"] == "RuntimeError: injected failure"
    assert os.environ[ERROR_FILE_ENV] == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]  # no partial file left


def test_an_unreadable_error_file_still_names_the_rank_and_cause(tmp_path: Path):
    spec = Launch(run_dir=tmp_path, nproc_per_node=2, stages=2)
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank_00001.txt").write_text("Traceback ...\nRuntimeError: injected failure\n")
    line = describe_unreadable_failure(spec)
    assert line.startswith("worker rank 1 (stage 1, replica 0) failed: RuntimeError: injected failure")
    assert "JSONDecodeError" not in line
    (tmp_path / "errors" / "rank_00001.txt").unlink()
    assert "torchrun.log" in describe_unreadable_failure(spec)
