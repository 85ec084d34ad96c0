#!/usr/bin/env python3
"""`terapipe train` itself against torch.distributed.pipelining's schedules, 20 training steps each, in rounds.

    python scripts/bench_peer_train.py                     # 2 rounds: A B C D, then D C B A
    python scripts/bench_peer_train.py --rounds 4 --markdown
    python scripts/bench_peer_train.py --src before=/tmp/old/src --src after=src   # two versions of the package
    python scripts/bench_peer_train.py --rounds 0 --profile   # only where a step's time goes, under cProfile
    python scripts/bench_peer_train.py --tune 2               # and the plan `terapipe plan --tune 2` measured here

The tiny model (configs/models/tiny.toml), B = 4 sequences, K = 2 stage processes on CPU (gloo, one thread each):

- terapipe's candidates are whole runs of ``terapipe train --plan P --steps 20 --grad-clip 0 --val-fraction 0``
  (workers, checkpoints, metrics and timelines included), with P the GPipe scheme ``[(1, [1024])] * 4`` and the
  planner's plan (both from ``terapipe plan --profile configs/profiles/tiny-cpu-measured.json -k 2 -b 4``); their
  step times are the ``iteration_s`` of the run's metrics.jsonl.
- the peers are a torchrun job of the same size running ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and
  ``Schedule1F1B`` (B microbatches, `bench_schedules.peer_trainer`) on the same stage modules, the same batches
  (the embedded data, `engine.data.step_batch`, seed 0), the same AdamW and learning rate per step, timed as a
  worker times its step: from the step's start to the end of one all-reduce of the loss that lines the ranks up.

With ``--src LABEL=DIR`` (repeatable) every terapipe candidate runs once per package source folder, with
``PYTHONPATH=DIR`` (e.g. the last commit's package, written out by ``git archive``), so older and newer code meet
the same machine in the same rounds; ``--base-src DIR`` writes the plans and runs the peers' model and data code.

Each candidate's time in a round is the median of its steps after the warm-up (steps 3..20); the table gives the
median over rounds, the min–max of the rounds, and the speed against ScheduleGPipe (> 1: faster than the peer),
as the ratio of the medians and round by round (median and range of the per-round ratios). The rounds alternate
the order (A B C D, D C B A, ...) so that drift in the machine's speed hits all alike.
Timing holds /tmp/terapipe-cpu.lock (`bench_train.cpu_lock`).

``--profile`` then runs each terapipe candidate once more with every rank under cProfile (the worker's
``TERAPIPE_PROFILE_DIR``) and prints the milliseconds per step spent in each part of the per-step path: the tiles,
the waits, the saved-bytes hooks, the gradient norm, AdamW, the end-of-step all-reduce, and around the step the
metrics line, checkpoints, timelines and the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_schedules import peer_trainer  # noqa: E402  (the peer's step, written once)
from bench_train import cpu_lock  # noqa: E402

PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
PEER_REFERENCE = "torch ScheduleGPipe"


# ----------------------------------------------------------------------------------------------- the peers' worker


def peer_worker(config_path: str) -> None:
    """One rank of the peer's torchrun job: ``cfg["steps"]`` training steps of ``cfg["schedule"]``; rank 0 writes
    the seconds of each step to ``cfg["out"]``."""
    import torch
    import torch.distributed as dist

    from terapipe_cli.config.run import LRSchedule
    from terapipe_cli.engine.data import load_data, step_batch
    from terapipe_cli.engine.optim import set_lr
    from terapipe_cli.models import ModelConfig

    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    model = ModelConfig.from_dict(cfg["model"], config_path)
    B, L = cfg["batch_size"], model.seq_len
    lr = LRSchedule.default(cfg["lr"], cfg["steps"])  # terapipe train's defaults for this many steps
    step, optimizer = peer_trainer(cfg["schedule"], model, rank, stages, B, lr=cfg["lr"])
    data = load_data(None)
    loss = torch.zeros(1, dtype=torch.float64)
    dist.all_reduce(loss)  # start-up
    seconds, losses = [], []
    for s in range(1, cfg["steps"] + 1):
        batch = step_batch(data, seed=0, step=s, sequences=B, seq_len=L)
        start = time.perf_counter()
        set_lr(optimizer, lr(s))
        mean = step(batch)
        loss[0] = float(mean) if mean is not None else 0.0
        dist.all_reduce(loss)  # as a worker's end-of-step all-reduce: the ranks start the next step together
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss[0]))
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps({"iteration_s": seconds, "loss": losses}))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- the driver


def main() -> None:
    a = _parse_args()
    if a.worker:
        peer_worker(a.worker)
        return
    sys.path.insert(0, str(ROOT / "src"))
    tmp = Path(tempfile.mkdtemp(prefix="bench_peer_train."))
    plans = {"GPipe": tmp / "gpipe.json", "planner": tmp / "planner.json"}
    base = Path(a.base_src).resolve() if a.base_src else ROOT / "src"
    _plan(plans["GPipe"], a.batch, base, "--scheme", "gpipe")
    _plan(plans["planner"], a.batch, base)
    if a.tune:
        plans["tuned"] = tmp / "tuned.json"
        started = time.perf_counter()
        with cpu_lock():
            _plan(plans["tuned"], a.batch, base, "--tune", str(a.tune))
        tuned = json.loads(plans["tuned"].read_text())
        print(f"plan --tune {a.tune}: {time.perf_counter() - started:.0f} s, chose {tuned.get('short_form', '?')} "
              f"({tuned.get('order', '?')}, v = {tuned.get('virtual_stages', '?')})", flush=True)  # fmt: skip
    sources = _sources(a.src)
    candidates = [
        {"name": f"terapipe {what}{f' ({label})' if label else ''}", "plan": str(plans[what]), "src": str(src)}
        for label, src in sources.items()
        for what in plans
    ]
    candidates += [
        {"name": f"torch {kind}", "schedule": kind, "src": str(base)} for kind in ("ScheduleGPipe", "Schedule1F1B")
    ]
    print(
        f"tiny: K=2, B={a.batch}, {a.steps} steps per run, median of steps {a.warmup + 1}..{a.steps}; "
        f"{len(candidates)} candidates, {a.rounds} rounds in alternating order; runs in {tmp}",
        flush=True,
    )
    if a.rounds:
        _time_rounds(candidates, a, tmp)
    if a.profile:
        with cpu_lock():
            for c in candidates:
                if "plan" in c:
                    _profile(c, a, tmp / f"profile-{_slug(c['name'])}")


def _time_rounds(candidates: list[dict], a: argparse.Namespace, tmp: Path) -> None:
    """Every candidate once per round, the order reversed every other round; prints the table."""
    rounds: dict[str, list[float]] = {c["name"]: [] for c in candidates}
    losses: dict[str, float] = {}
    with cpu_lock():
        load_before = os.getloadavg()[0]
        for r in range(a.rounds):
            for c in candidates if r % 2 == 0 else candidates[::-1]:
                out = tmp / f"{len(rounds[c['name']])}-{_slug(c['name'])}"
                step_s, loss = _run_train(c, a, out) if "plan" in c else _run_peer(c, a, out)
                rounds[c["name"]].append(statistics.median(step_s[a.warmup :]))
                losses[c["name"]] = loss
                print(f"  round {r + 1}: {c['name']:<36} {rounds[c['name']][-1] * 1e3:8.1f} ms", flush=True)
        load_after = os.getloadavg()[0]
    _print(rounds, losses, markdown=a.markdown)
    print(f"\n1-minute load average {load_before:.2f} before, {load_after:.2f} after (a run adds ~2)")


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src)}


def _sources(specs: list[str] | None) -> dict[str, Path]:
    """``LABEL=DIR`` (or a bare DIR, unlabelled) per package source folder to run; default: this checkout's."""
    if not specs:
        return {"": ROOT / "src"}
    pairs = [spec.split("=", 1) if "=" in spec else ["", spec] for spec in specs]
    return {label: Path(folder).resolve() for label, folder in pairs}


def _plan(out: Path, batch: int, src: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "terapipe_cli", "plan", "--profile", str(PROFILE), "-k", "2", "-b", str(batch)]
    subprocess.run([*cmd, *extra, "--out", str(out)], check=True, env=_env(src), stdout=subprocess.DEVNULL)


def _run_train(c: dict, a: argparse.Namespace, out: Path) -> tuple[list[float], float]:
    """One ``terapipe train`` run: the seconds of each step (metrics.jsonl's ``iteration_s``) and the last loss."""
    cmd = [sys.executable, "-m", "terapipe_cli", "train", "--plan", c["plan"], "--steps", str(a.steps)]
    cmd += ["--grad-clip", "0", "--val-fraction", "0", "--out", str(out)]
    subprocess.run(cmd, check=True, env=_env(Path(c["src"])), stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["iteration_s"] for r in records], records[-1]["loss"]


# Where a step's time goes, by the functions of the per-step path (matched by file and name, so that older
# package layouts match too): seconds per step inside each, cumulative, as cProfile counts them (it slows Python
# code, such as the saved-bytes hooks, several-fold more than the torch calls it brackets).
PROFILED = {
    "the step (Trainer.step / the worker's loop)": [("trainer.py", "step"), ("worker.py", "run_schedule")],
    "  forward tiles": [("stage.py", "forward_tile")],
    "  backward tiles": [("stage.py", "backward_tile")],
    "  waits for a neighbour's tile": [("p2p.py", "wait")],
    "  saved-bytes hooks (SavedBytes.keep)": [("stage.py", "keep")],
    "  gradient norm (+ its all-reduce)": [("optim.py", "clip_global_norm")],
    "  AdamW": [("adam.py", "step")],
    "  end-of-step all-reduce": [("trainer.py", "end_of_step"), ("worker.py", "end_of_step")],
    "between steps: metrics record and line": [("worker.py", "log_step")],
    "  checkpoints (with their timelines)": [("worker.py", "save_checkpoint")],
    "  timelines (also at the end)": [("worker.py", "save_timeline")],
    "  the step's batch": [("data.py", "step_batch")],
}


def _profile(c: dict, a: argparse.Namespace, out: Path) -> None:
    """One more run of a terapipe candidate, each rank under cProfile (the worker's ``TERAPIPE_PROFILE_DIR``), and
    the milliseconds per step of the per-step path's parts (`PROFILED`) on each rank."""
    import pstats

    folder = out / "profile"
    folder.mkdir(parents=True)
    cmd = [sys.executable, "-m", "terapipe_cli", "train", "--plan", c["plan"], "--steps", str(a.steps)]
    cmd += ["--grad-clip", "0", "--val-fraction", "0", "--out", str(out)]
    env = {**_env(Path(c["src"])), "TERAPIPE_PROFILE_DIR": str(folder)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    files = sorted(folder.glob("rank_*.prof"))
    if not files:
        print(f"\n{c['name']}: no profile written (a package without TERAPIPE_PROFILE_DIR)")
        return
    cumulative = []
    for f in files:
        by_name: dict[tuple[str, str], float] = {}
        for (path, _, name), (_, _, _, cum, _) in pstats.Stats(str(f)).stats.items():
            key = (Path(path).name, name)
            by_name[key] = by_name.get(key, 0.0) + cum
        cumulative.append({part: sum(by_name.get(k, 0.0) for k in keys) for part, keys in PROFILED.items()})
    print(f"\n{c['name']} under cProfile, ms per step over {a.steps} steps (rank 0, rank 1, ...; cumulative):")
    for part in PROFILED:
        values = "  ".join(f"{rank[part] / a.steps * 1e3:8.2f}" for rank in cumulative)
        print(f"  {part:<46} {values}")


def _run_peer(c: dict, a: argparse.Namespace, out: Path) -> tuple[list[float], float]:
    """One torchrun job of the peer's schedule: the seconds of each step and the last loss."""
    from terapipe_cli.config.model import load_model_config
    from terapipe_cli.config.run import DEFAULT_LR
    from terapipe_cli.engine.torchrun import rendezvous_args, torchrun_argv

    out.mkdir(parents=True)
    config = {
        "model": load_model_config(ROOT / "configs" / "models" / "tiny.toml").to_dict(),
        "schedule": c["schedule"],
        "batch_size": a.batch,
        "steps": a.steps,
        "lr": DEFAULT_LR,
        "out": str(out / "times.json"),
    }
    (out / "config.json").write_text(json.dumps(config))
    cmd = torchrun_argv([*rendezvous_args(2), __file__, "--worker", str(out / "config.json")])
    job = subprocess.run(cmd, env=_env(Path(c["src"])), stdout=subprocess.DEVNULL)
    if not (out / "times.json").exists():
        raise SystemExit(f"{c['name']}: the torchrun job failed (exit code {job.returncode}) before its times")
    if job.returncode:  # seen once on a loaded machine: gloo aborting in the teardown, after the times were written
        print(f"  ({c['name']}: the job exited with {job.returncode} after writing its times)", flush=True)
    times = json.loads((out / "times.json").read_text())
    return times["iteration_s"], times["loss"][-1]


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")


def _print(rounds: dict[str, list[float]], losses: dict[str, float], *, markdown: bool) -> None:
    """The table: each round's time, their median and range, and the speed against ScheduleGPipe — of the medians,
    and round by round (the peer's time in the same round over the candidate's: load that comes and goes during
    the rounds hits neighbours in time alike)."""
    med = {n: statistics.median(v) for n, v in rounds.items()}
    ref = rounds[PEER_REFERENCE]
    head = ("candidate", "each round ms", "median ms", "min–max ms", "vs ScheduleGPipe", "per round", "final loss")
    rows = []
    for n, v in rounds.items():
        per_round = [p / x for p, x in zip(ref, v, strict=True)]
        rows.append(
            (
                n,
                " / ".join(f"{x * 1e3:.0f}" for x in v),
                f"{med[n] * 1e3:.1f}",
                f"{min(v) * 1e3:.1f}–{max(v) * 1e3:.1f}",
                f"{med[PEER_REFERENCE] / med[n]:.2f}×",
                f"{statistics.median(per_round):.2f}× ({min(per_round):.2f}–{max(per_round):.2f})",
                f"{losses[n]:.4f}",
            )
        )
    if markdown:
        print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    print()
    for r in [head, *rows]:
        print(f"{r[0]:<36} {r[1]:>28} {r[2]:>10} {r[3]:>16} {r[4]:>17} {r[5]:>20} {r[6]:>11}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="Sequences per step B (= microbatches of the peers).")
    parser.add_argument("--steps", type=int, default=20, help="Training steps per run.")
    parser.add_argument("--warmup", type=int, default=2, help="Steps left out of each run's median.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds, in alternating order.")
    parser.add_argument(
        "--src", action="append", metavar="LABEL=DIR", help="A package source folder to run (repeatable; default: src)."
    )
    parser.add_argument(
        "--base-src", metavar="DIR", help="The package source folder that plans and runs the peers (default: src)."
    )
    parser.add_argument(
        "--tune", type=int, metavar="N",
        help="Also a candidate planned with `terapipe plan --tune N` (the simulator's N best and GPipe trained here).",
    )  # fmt: skip
    parser.add_argument("--markdown", action="store_true", help="Print the table as markdown.")
    parser.add_argument(
        "--profile", action="store_true", help="Then one run of each terapipe candidate per rank under cProfile."
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    main()
