#!/usr/bin/env python3
"""SIGTERM at a random moment of a K = 4 CPU run of the tiny model, many times (the stop path's target: every trial
resumable; not in CI).

    python scripts/sigterm_trials.py                 # 20 trials
    python scripts/sigterm_trials.py --trials 5 --steps 12

Each trial starts `terapipe train` (configs/models/tiny.toml, K = 4 stages, B = 1, L = 64, one thread per
worker, checkpoints every 5 steps) in its own process group, waits until its first step is logged, then sends
SIGTERM to the launcher after a random delay drawn uniformly over the rest of the run (at the median step time
of a first, uninterrupted run). It checks: the job exits within 60 s of the signal, with exit 143; the step
saved is at least the one running when the signal came (rank 0 notes when each step's boundary ends on the
system's monotonic clock, `worker.BOUNDARIES_ENV`: the step running is the first whose boundary ended after the
signal); and `terapipe train --resume` finishes the run with the losses of the uninterrupted run. A run that
ended before its signal counts apart.
Prints one line per trial and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXIT_LIMIT_S = 60.0  # the target: a scheduler's grace period commonly lies between 30 and 120 s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="of the random moments")
    a = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from terapipe_cli.config.model import load_model_config
    from terapipe_cli.files import write_json_atomic
    from terapipe_cli.plan.file import make_plan_dict
    from terapipe_cli.train.worker import BOUNDARIES_ENV

    tmp = Path(tempfile.mkdtemp(prefix="sigterm_trials."))
    model = load_model_config(ROOT / "configs/models/tiny.toml")
    plan = tmp / "plan.json"
    write_json_atomic(
        plan, make_plan_dict(model=model, stages=4, batch_size=1, seq_len=64, token_step=1, slices=[(1, [32, 32])])
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    train = [sys.executable, "-m", "terapipe_cli", "train"]
    flags = ["--steps", str(a.steps), "--checkpoint-every", "5", "--val-fraction", "0", "--device", "cpu"]

    reference = tmp / "reference"
    subprocess.run([*train, "--plan", str(plan), "--out", str(reference), *flags], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    ref_losses = losses(reference)
    step_s = statistics.median(r["iteration_s"] for r in metrics(reference))
    print(f"uninterrupted: {a.steps} steps, median step {step_s * 1e3:.0f} ms; {a.trials} trials", flush=True)

    rng = random.Random(a.seed)
    rows = []
    for trial in range(a.trials):
        out = tmp / f"trial{trial}"
        argv = [*train, "--plan", str(plan), "--out", str(out), *flags]
        boundaries = tmp / f"trial{trial}.boundaries.json"
        proc = subprocess.Popen(
            argv, env={**env, BOUNDARIES_ENV: str(boundaries)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        while not metrics(out) and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, (a.steps - 1) * step_s))
        signalled = time.monotonic()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=2 * EXIT_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        exit_s = time.monotonic() - signalled
        saved = latest_saved(out)
        running = running_at(boundaries, signalled)
        row = {"trial": trial, "running": running, "exit": proc.returncode, "exit_s": exit_s, "saved": saved}
        if proc.returncode == 0:
            row["note"] = "ended before the signal"
            row["same"] = losses(out) == ref_losses
        else:
            resumed = subprocess.run([*train, "--resume", "--out", str(out)], env=env, capture_output=True, text=True)
            row["same"] = resumed.returncode == 0 and losses(out) == ref_losses
            row["line"] = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        row["ok"] = (
            row["same"]
            and exit_s <= EXIT_LIMIT_S
            and (proc.returncode == 0 or (proc.returncode == 143 and None not in (saved, running) and saved >= running))
        )
        rows.append(row)
        print(
            f"trial {trial:2}: signalled in step {running!s:>2}, exit {proc.returncode} after {exit_s:5.1f} s, "
            f"saved step {saved}, resumed losses {'identical' if row['same'] else 'DIFFERENT'}"
            f"{'  (' + row['note'] + ')' if 'note' in row else ''}{'' if row['ok'] else '  FAILED'}",
            flush=True,
        )
    exits = [r["exit_s"] for r in rows]
    stopped = [r for r in rows if r["exit"] == 143]
    print(
        f"summary: {sum(r['ok'] for r in rows)}/{len(rows)} trials ok; {len(stopped)} stopped by the signal "
        f"(exit 143), {sum(r['exit'] == 0 for r in rows)} ended before it; exit after the signal median "
        f"{statistics.median(exits):.1f} s "
        f"(max {max(exits):.1f} s, limit {EXIT_LIMIT_S:g} s); saved step - running step: "
        f"{sorted(r['saved'] - r['running'] for r in stopped if None not in (r['saved'], r['running']))}; "
        f"resumed losses identical in "
        f"{sum(r['same'] for r in rows)}/{len(rows)}"
    )
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


def metrics(run: Path) -> list[dict]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if record.get("schema") == "terapipe.metrics/1":
            out.append(record)
    return out


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run)]


def running_at(boundaries: Path, t: float) -> int | None:
    """The step running at ``t`` (time.monotonic, the clock rank 0 wrote with): the first whose boundary (the step,
    its record, its checkpoint and the stop check) ended after ``t``."""
    try:
        record = json.loads(boundaries.read_text())
    except (OSError, ValueError):
        return None
    ends = record["at_s"]
    return next((record["first_step"] + n for n, end in enumerate(ends) if end > t), None)


def latest_saved(run: Path) -> int | None:
    from terapipe_cli.train.checkpoint import latest_complete

    return latest_complete(run)


if __name__ == "__main__":
    main()
