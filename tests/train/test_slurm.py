"""`terapipe launch-script --slurm` under a real Slurm: a controller and two nodes on this machine's loopback
(tests/slurm_cluster.py, Debian's slurmctld, slurmd, slurm-client and munge). The sbatch file the README's example
writes is submitted unchanged: its K = 2 run, a task on each of the two nodes, is pre-empted mid-run by a job of a
higher partition, saves the step it is at, Slurm requeues the job, and the requeued job continues the run
(--resume-if-present) to the losses of a one-machine, uninterrupted run. Every wait polls a file
or the queue (the signalled worker waits for the signal at a known step: the fault hook "wait", train/worker.py),
so nothing depends on the machine's speed. The time limit (SIGUSR1 ahead of --time, in minutes) is
scripts/slurm_time_limit.py, not the suite."""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, LocalSetup, run_cli, train_locally, write_plan_file
from slurm_cluster import NODES, LoopbackSlurm, skip_reason

from terapipe_cli.config.controls import CONTROLS_ENV
from terapipe_cli.plan.file import read_plan
from terapipe_cli.train.rundir import read_config, read_metrics

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LoopbackSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def job_env(cluster: LoopbackSlurm, **extra: str) -> dict[str, str]:
    """What a user's shell gives sbatch (which passes it to the job): `terapipe` on PATH (this checkout's), no GPU."""
    bin_ = str(Path(sys.executable).absolute().parent)
    env = cluster.env(PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="", COLUMNS="200", NO_COLOR="1", TERM="dumb")
    return {**env, "PATH": f"{bin_}{os.pathsep}{env['PATH']}", **extra}


def wait_until_ended(cluster: LoopbackSlurm, job: str) -> dict[str, str]:
    state: dict[str, str] = {}

    def ended() -> bool:
        state.update(cluster.job(job))
        return state.get("JobState") in ENDED

    cluster.wait_for(ended, f"the end of job {job}", timeout_s=300)
    return state


def uninterrupted_losses(plan: Path, run: Path) -> list[float]:
    """The run's losses as one machine trains it: every rank a thread of this process, the same settings."""
    _, args = read_config(run)
    return train_locally(LocalSetup(read_plan(plan), replace(args, verify=False))).losses


def test_the_readme_sbatch_file_trains_across_two_nodes_survives_pre_emption_and_ends_as_one_machine(
    tmp_path, slurm, capsys
):
    """The README's `launch-script --slurm` line as it stands, on a K = 2 plan made for a CPU (the tests' tiny model:
    no GPU is asked for), then `sbatch` as it says: a task on each node. Pre-emption as a site has it: a job of the
    urgent partition takes both nodes while worker rank 1 waits in step 2, Slurm sends every process of the training
    job SIGTERM (twice: a notice, then its kill sequence) and requeues it; every rank saves step 2 and stops (exit
    143 on both nodes), and the requeued job continues from step 2 to the end with the losses of one machine's
    uninterrupted run."""
    readme = (ROOT / "README.md").read_text()
    (line,) = re.findall(r"^terapipe launch-script plan\.json .*--slurm.*$", readme, re.MULTILINE)
    write, submit = (shlex.split(part) for part in line.split("#")[0].split("&&"))
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2, profile={"kind": "cpu"})
    p = run_cli(capsys, *write[1:], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert submit[0] == "sbatch"
    sbatch = (tmp_path / submit[1]).read_text()
    assert "--gpus" not in sbatch and "#SBATCH --requeue" in sbatch and "--resume-if-present" in sbatch

    run = tmp_path / "runs" / "plan"
    env = job_env(slurm, **{CONTROLS_ENV: "fault=wait:1:2"})  # rank 1 waits in step 2 until a stop signal reaches it
    job = slurm.submit(tmp_path / submit[1], cwd=tmp_path, env=env)
    slurm.wait_for(lambda: len(read_metrics(run)) >= 1, "step 1 in metrics.jsonl", timeout_s=300)
    slurm.run("sbatch", "--partition=urgent", "--nodes=2", "--exclusive", f"--output={tmp_path / 'urgent.out'}",
              "--wrap=true")  # fmt: skip
    # One machine's losses, computed while Slurm requeues the job (its restart waits out the credential's lifetime).
    expected = uninterrupted_losses(plan, run)
    state = wait_until_ended(slurm, job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", log
    assert state["NodeList"] == ",".join(NODES) and log.count("done in") == 2, log  # a task on each node
    assert "DUE TO PREEMPTION" in log, log
    assert log.count("stopped by SIGTERM after step 2; the last complete checkpoint is step 2") == 2, log
    assert "(resuming after step 2)" in log and "requeueing job" not in log  # Slurm requeued it
    steps = read_config(run)[1].steps
    assert [r["step"] for r in read_metrics(run)] == list(range(1, steps + 1))
    assert [r["loss"] for r in read_metrics(run)] == pytest.approx(expected, rel=1e-6)
