"""The launcher's one line for a failed job names the rank's place in the D × K × T mesh and its cause (no torchrun
run here)."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.train.launch import Launch, describe_failure, describe_unreadable_failure, stopped_at_once
from terapipe_cli.train.rundir import has_trained
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


def test_the_root_cause_is_a_raised_exception_then_a_lost_peer_then_a_stopped_rank(tmp_path: Path):
    """A rank that raised is named before one that lost its peer (a consequence), even when it failed later; a rank
    that torchrun stopped with SIGTERM comes last."""
    spec = Launch(run_dir=tmp_path, nproc_per_node=3, stages=3)
    failures = {
        0: Failure(1, "PeerLost: lost rank 1 (Timed out)", 1),
        1: Failure(1, "RuntimeError: injected failure", 2),
        2: Failure(-15, "", 0),
    }
    assert describe_failure(failures, spec).startswith("worker rank 1 (stage 1, replica 0) failed: RuntimeError")
    del failures[1]
    assert describe_failure(failures, spec).startswith("worker rank 0 (stage 0, replica 0) failed: PeerLost")


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


def test_a_worker_ended_by_sigterm_during_start_up_is_a_stop_not_a_crash(tmp_path: Path, capsys, monkeypatch):
    """`terapipe train` whose worker a SIGTERM ended before its handler was installed (torchrun reports exit code
    -15, no error file): one line saying it was stopped, exit 143; the folder, never trained, takes the same command.
    torchrun itself is replaced by its answer (no workers start)."""
    from conftest import run_cli, write_plan_file
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from terapipe_cli.train import launch as launching

    def stopped_at_start_up(args, method, log_before):
        raise ChildFailedError("worker", {1: ProcessFailure(1, 4242, -signal.SIGTERM, "<N/A>")})

    monkeypatch.setattr(launching, "run_workers", stopped_at_start_up)
    plan, out = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2), tmp_path / "run"
    p = run_cli(capsys, "train", "--plan", plan, "--out", out, "--device", "cpu", "--steps", "2")
    assert p.returncode == 143, p.stdout + p.stderr
    assert p.stderr.strip() == (
        "terapipe: stopped by SIGTERM during start-up: worker rank 1 (stage 1, replica 0) ended on it before the "
        f"first step; nothing was trained, and the same command starts the run again in {out}"
    )
    assert not has_trained(out)


def test_workers_ended_by_a_stop_signal_are_a_stop_naming_the_checkpoint_kept(tmp_path: Path):
    from fake_runs import checkpointed_run

    run = checkpointed_run(tmp_path / "run", step=3)
    spec = Launch(run_dir=run, nproc_per_node=2, stages=2)
    stopped = stopped_at_once({0: Failure(-signal.SIGUSR1, "", 2), 1: Failure(-signal.SIGTERM, "", 1)}, spec)
    assert stopped.exit_code == 143 and str(stopped) == (
        "stopped by SIGTERM: worker rank 1 (stage 1, replica 0) ended on it at once (during start-up, or at a second "
        f"signal); the last complete checkpoint is step 3; continue with: terapipe train --resume --out {run} --steps 3"
    )
    # A rank that raised, or one killed otherwise (SIGKILL: the kernel's OOM killer), is a failure with a cause.
    assert stopped_at_once({0: Failure(1, "RuntimeError: boom", 1), 1: Failure(-signal.SIGTERM, "", 2)}, spec) is None
    assert stopped_at_once({0: Failure(-signal.SIGKILL, "", 1)}, spec) is None
