"""The launcher's one line for a failed job names the rank's place in the D × K × T mesh (no torchrun run here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.train.launch import Launch, describe_failure


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
