#!/usr/bin/env python3
"""A Slurm job at its time limit (not in CI: it takes minutes, as `--time` counts in minutes).

    python scripts/slurm_time_limit.py                 # --time 3: the warning after about two minutes
    python scripts/slurm_time_limit.py --time 2 --grace-s 30

Starts the two-node loopback Slurm of the tests (tests/slurm_cluster.py: Debian's slurmctld, slurmd, slurm-client
and munge, as root), writes `terapipe launch-script --slurm --time T` for a K = 2 plan of the tests' tiny model that
trains far longer than T, and submits it. Slurm warns the job's shell with SIGUSR1 the sbatch file's --signal lead
before the limit (it may come up to a minute early: Slurm checks the limits about once a minute); the shell
forwards it, the run saves the step it is at, and the job requeues itself. Once the requeued job has trained a few
steps past the saved one, the job is cancelled, and the script checks: a stop by SIGUSR1 before the time limit;
the job requeued and continued from the saved step (no step lost, none repeated); the losses of every step equal
an uninterrupted run's (every rank a thread of this process). Prints when each thing happened and one verdict.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AFTER_RESUME_STEPS = 5  # the requeued job trains this many steps past the saved one before the job is cancelled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", type=int, default=3, help="the job's time limit in minutes (Slurm's --time)")
    parser.add_argument("--grace-s", type=float, default=60.0, help="train's --grace-s (the warning's lead)")
    a = parser.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from conftest import LocalSetup, train_locally, write_plan_file  # noqa: I001 - tests/ first on the path
    from slurm_cluster import LoopbackSlurm, skip_reason

    from terapipe_cli.plan.file import read_plan
    from terapipe_cli.train.rundir import read_config, read_metrics

    reason = skip_reason()
    if reason is not None:
        sys.exit(f"slurm_time_limit: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="slurm_time_limit."))
    cluster = LoopbackSlurm(tmp / "slurm")
    (tmp / "slurm").mkdir()
    plan = write_plan_file(tmp / "plan.json", [(1, [16, 16])], stages=2)
    run = tmp / "run"
    bin_ = str(Path(sys.executable).absolute().parent)
    start = time.monotonic()

    def say(text: str) -> None:
        print(f"{time.monotonic() - start:7.1f} s  {text}", flush=True)

    try:
        cluster.start()
        say(f"cluster up in {tmp / 'slurm'}")
        env = cluster.env(PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="", NO_COLOR="1", TERM="dumb")
        env["PATH"] = f"{bin_}{os.pathsep}{env['PATH']}"
        write = ["launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--device", "cpu", "--steps", 1_000_000, "--time",
                 a.time, "--grace-s", a.grace_s, "--run-out", run, "--out", tmp / "launch"]  # fmt: skip
        p = subprocess.run([sys.executable, "-m", "terapipe_cli", *map(str, write)], env=env, cwd=tmp,
                           capture_output=True, text=True)  # fmt: skip
        if p.returncode != 0:
            sys.exit(f"slurm_time_limit: launch-script failed: {p.stderr.strip()}")
        sbatch = (tmp / "launch" / "launch.sbatch").read_text()
        lead = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)", sbatch).group(1))
        job = cluster.submit(tmp / "launch" / "launch.sbatch", cwd=tmp, env=env)
        say(f"job {job} submitted: --time {a.time} (minutes), SIGUSR1 {lead} s before it")
        cluster.wait_for(lambda: cluster.job(job).get("JobState") == "RUNNING", "the job running", 120)
        first_start = time.monotonic()
        say("running")
        cluster.wait_for(lambda: cluster.job(job).get("Restarts", "0") != "0", "a requeue", a.time * 60 + 120)
        stopped_after = time.monotonic() - first_start
        log = (tmp / f"slurm-{job}.out").read_text()
        saved = re.search(r"stopped by (SIG\w+) after step (\d+)", log)
        say(f"requeued {stopped_after:.0f} s after the job started (limit {a.time * 60} s): {saved and saved.group(0)}")
        step = int(saved.group(2)) if saved else 0
        cluster.wait_for(lambda: len(read_metrics(run)) >= step + AFTER_RESUME_STEPS, "the requeued job training",
                         a.time * 60 + 120)  # fmt: skip
        say(f"the requeued job trained past step {step}; cancelling it")
        cluster.run("scancel", job)
        cluster.wait_for(lambda: cluster.job(job).get("JobState") in ("CANCELLED", "COMPLETED", ""), "the end", 120)
        log = (tmp / f"slurm-{job}.out").read_text()
        records = read_metrics(run)
        _, args = read_config(run)
        local = LocalSetup(read_plan(plan), replace(args, steps=len(records), decay_steps=args.steps, verify=False))
        losses = train_locally(local).losses
        checks = {
            "stopped by SIGUSR1 on both nodes": log.count("stopped by SIGUSR1") == 2,
            "before the time limit": stopped_after < a.time * 60,
            "requeued itself": "requeueing job" in log,
            f"continued after step {step}": f"(resuming after step {step})" in log,
            "every step once": [r["step"] for r in records] == list(range(1, len(records) + 1)),
            "an uninterrupted run's losses": all(
                abs(r["loss"] - x) <= 1e-6 * abs(x) for r, x in zip(records, losses, strict=True)
            ),
        }
        for what, ok in checks.items():
            say(f"{'ok  ' if ok else 'FAIL'} {what}")
        print(f"slurm_time_limit: {'PASS' if all(checks.values()) else 'FAIL'} (files in {tmp})")
        sys.exit(0 if all(checks.values()) else 1)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
