#!/usr/bin/env python3
"""Training-step latency of GPipe, the planner's plan and uniform slicings, interleaved in one torchrun job.

    python scripts/bench_train.py                      # profile this machine (terapipe profile --quick), plan, time
    python scripts/bench_train.py --profile configs/profiles/example-tiny-cpu.json --rounds 20

The tiny model (configs/models/tiny.toml: H = 256, 4 layers, L = 1024), B = 1, K = 2 stages on CPU, one thread
per stage process. The candidates run in rounds — GPipe, planner, uniform/4, uniform/8, single process,
GPipe, ... — in the same two worker processes, so drift in the machine's speed hits them all alike. Every
candidate is a full training step through the runtime's own code (`worker.run_schedule`: pre-posted
receives, StageRunner tiles, AdamW). "single process" is the whole model on one process (rank 0, the other
rank idle), whose time / K is the perfect-overlap bound. Prints the median iteration latency (min–max), the
speed-up over GPipe, and the planner's own prediction for each scheme.

    python scripts/bench_train.py --checkpoints        # the stall of a step that checkpoints (tiny, small)

--checkpoints times `terapipe train` itself on CPU (K = --stages, B = 1, L = 256, one thread per stage), the tiny and
the small model, checkpointing every 8th step, with the stage files written in the background (the default for
stages of 4 MiB and more, train/saving.py) and, in alternating runs, synchronously. Rank 0 notes when each step's
boundary ends (`worker.BOUNDARIES_ENV`), so a step's wall time includes what follows it: the 4 steps from a
checkpoint's (its boundary starts the save, which the next boundaries complete once written) are compared with
the 4 clean steps after them, interleaved within every run. Prints the extra time a checkpoint costs as a share
of a clean step: median (min-max) over the checkpoints (target <= 10%).

Timing holds /tmp/terapipe-cpu.lock (flock) so no other measurement on this machine runs at the same time.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = "/tmp/terapipe-cpu.lock"


@contextmanager
def cpu_lock():
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------- the worker


def join_bench_job(config_path: str):
    """A benchmark worker's start: its config, one thread, the gloo group; returns (config, rank, stages, model)."""
    import torch
    import torch.distributed as dist

    from terapipe_cli.engine.hostmem import retain_freed_memory
    from terapipe_cli.models import ModelConfig

    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    retain_freed_memory()  # as terapipe's workers: every candidate, terapipe's and the peers', runs in this process
    dist.init_process_group("gloo")
    return cfg, dist.get_rank(), dist.get_world_size(), ModelConfig.from_dict(cfg["model"], config_path)


def time_rounds(steps: dict, cfg: dict, rank: int) -> None:
    """Every step function in turn, round after round (alternately forwards and backwards), all ranks starting each
    together; rank 0 writes the seconds of each (from the common start to the slowest rank's end) after the warm-up
    rounds to ``cfg["out"]``."""
    import torch
    import torch.distributed as dist

    flag = torch.zeros(1)
    times: dict[str, list[float]] = {n: [] for n in steps}
    for round_ in range(cfg["warmup"] + cfg["rounds"]):
        for name, step in list(steps.items())[:: 1 if round_ % 2 == 0 else -1]:  # A B C …, then … C B A
            dist.all_reduce(flag)  # start together
            start = time.perf_counter()
            step()
            dist.all_reduce(flag)  # the step ends when the slowest rank is done
            if rank == 0 and round_ >= cfg["warmup"]:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(times))
    dist.destroy_process_group()


def worker(config_path: str) -> None:
    import torch

    from terapipe_cli.engine.data import load_data, step_batch
    from terapipe_cli.engine.executor import StageExecutor
    from terapipe_cli.engine.loss import token_loss_sum
    from terapipe_cli.engine.optim import make_optimizer
    from terapipe_cli.engine.p2p import Links
    from terapipe_cli.engine.stage import StageRunner
    from terapipe_cli.models.gpt.module import GPT
    from terapipe_cli.schedule.schedule import Schedule

    cfg, rank, stages, model = join_bench_job(config_path)
    B, L = cfg["batch_size"], model.seq_len
    runner = StageRunner(model, rank, stages, seed=0)
    runner.set_loss_scale(1.0 / (B * L))
    optimizer = make_optimizer(runner.module, 1e-4)
    links = Links(
        prev_rank=rank - 1 if rank else None,
        next_rank=rank + 1 if rank < stages - 1 else None,
        hidden=model.hidden,
        dtype=torch.float32,
        device=torch.device("cpu"),
        timeout_s=300,
    )
    executors = {
        c["name"]: StageExecutor(runner, Schedule.build(c["slices"], stages), rank, links) for c in cfg["candidates"]
    }
    batch = step_batch(load_data(None), seed=0, step=1, sequences=B, seq_len=L)
    full = GPT(model, seed=0) if rank == 0 else None
    full_optimizer = make_optimizer(full, 1e-4) if full is not None else None

    def pipelined(name: str):
        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            executors[name].step(batch, step_start=time.perf_counter())
            optimizer.step()

        return step

    def single_process() -> None:  # the whole model on rank 0; the other ranks wait
        if full is not None:
            full_optimizer.zero_grad(set_to_none=True)
            (token_loss_sum(full(batch[:, :-1]), batch[:, 1:]) / (B * L)).backward()
            full_optimizer.step()

    steps = {c["name"]: pipelined(c["name"]) for c in cfg["candidates"]} | {"single process": single_process}
    time_rounds(steps, cfg, rank)


# ----------------------------------------------------------------------------------------------- the driver


def main() -> None:
    a = _parse_args()
    if a.worker:
        worker(a.worker)
        return
    if a.checkpoints:
        with cpu_lock():
            checkpoint_stall(a)
        return

    sys.path.insert(0, str(ROOT / "src"))
    from terapipe_cli.config.model import load_model_config
    from terapipe_cli.plan.costmodel import CostModel, read_profile
    from terapipe_cli.plan.file import short_form
    from terapipe_cli.plan.search import solve

    model = load_model_config(a.model)
    L, B, K = model.seq_len, a.batch, a.stages
    tmp = Path(tempfile.mkdtemp(prefix="bench_train."))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    with cpu_lock():
        profile_path, source = _profile(a, tmp, env)
        profile = read_profile(profile_path)
        cost = CostModel.from_profile(profile_path, stages=K)
        planned = solve(cost, seq_len=L, batch_size=B, stages=K, token_step=profile.token_step)
        candidates = _candidates(planned.slices, B, L)
        print(f"planner's plan: {short_form(planned.slices)} (profile: {source})", flush=True)
        print(
            f"timing {len(candidates)} schemes + single process, {a.rounds} rounds (+{a.warmup} warm-up), "
            f"K={K}, B={B}, L={L}, H={model.hidden}, {model.layers} layers ...",
            flush=True,
        )
        times, load_before, load_after = _time(a, model, candidates, tmp, env)
    _print_table(times, candidates, cost, K, a.rounds)
    med = {n: statistics.median(v) for n, v in times.items()}
    best_uniform = min(med["uniform/4"], med["uniform/8"])
    print(
        f"\n1-minute load average {load_before:.2f} before, {load_after:.2f} after (the job itself adds ~{K}); "
        "other work on the machine takes cores from the stages and shrinks every speed-up"
    )
    print(
        f"planner vs GPipe: {med['GPipe'] / med['planner']:.2f}x (target >= 1.5x); "
        f"planner vs best uniform: {best_uniform / med['planner']:.2f}x (target >= 1 within noise)"
    )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="Profile JSON to plan with (default: measure with terapipe profile --quick)")
    parser.add_argument("--model", default=str(ROOT / "configs/models/tiny.toml"))
    parser.add_argument("--rounds", type=int, help="default: 15; with --checkpoints 3 (each: 2 runs per model)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", action="store_true", help="Time the stall of a step that checkpoints.")
    parser.add_argument("--steps", type=int, default=25, help="--checkpoints: steps per run")
    a = parser.parse_args()
    a.rounds = a.rounds or (3 if a.checkpoints else 15)
    return a


# ------------------------------------------------------------------------------------ --checkpoints: the stall

CHECKPOINT_SEQ = 256  # L of the --checkpoints runs: a step of the small model takes about a second on one thread
EVERY = 8  # a checkpoint every 8th step: the 4 steps from it (the write overlaps them), then 4 clean ones
WINDOW = EVERY // 2


def checkpoint_stall(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from terapipe_cli.config.model import load_model_config
    from terapipe_cli.files import write_json_atomic
    from terapipe_cli.plan.file import make_plan_dict
    from terapipe_cli.train.saving import SYNC_ENV
    from terapipe_cli.train.worker import BOUNDARIES_ENV

    steps = a.steps if a.steps % EVERY == 1 else EVERY * (a.steps // EVERY) + 1  # ends just after a checkpoint
    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoints."))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    print(
        f"checkpoint stall: K={a.stages}, B=1, L={CHECKPOINT_SEQ}, {steps} steps per run, a checkpoint every {EVERY}; "
        f"{a.rounds} rounds, background / synchronous alternating in each"
    )
    for name in ("tiny", "small"):
        model = load_model_config(ROOT / f"configs/models/{name}.toml")
        plan = tmp / f"{name}.json"
        write_json_atomic(plan, make_plan_dict(
            model=model, stages=a.stages, batch_size=1, seq_len=CHECKPOINT_SEQ, token_step=1, slices=[(1, [64] * 4)],
        ))  # fmt: skip
        pairs: dict[str, list[tuple[float, float]]] = {"background": [], "synchronous": []}
        sizes: list[int] = []
        for r in range(a.rounds):
            for mode in ("background", "synchronous") if r % 2 == 0 else ("synchronous", "background"):
                out = tmp / f"{name}-{mode}-{r}"
                run_env = {**env, BOUNDARIES_ENV: str(tmp / f"{name}-{mode}-{r}.json")}
                if mode == "synchronous":
                    run_env[SYNC_ENV] = "1"
                cmd = [sys.executable, "-m", "terapipe_cli", "train", "--plan", str(plan), "--steps", str(steps)]
                cmd += ["--out", str(out), "--checkpoint-every", str(EVERY), "--val-fraction", "0"]
                cmd += ["--device", "cpu", "--keep-checkpoints", "1"]
                subprocess.run(cmd, check=True, env=run_env, stdout=subprocess.DEVNULL)
                pairs[mode] += _checkpoint_pairs(json.loads(Path(run_env[BOUNDARIES_ENV]).read_text()))
                sizes = [p.stat().st_size for p in sorted(out.glob("checkpoints/step_*/stage_*.pt"))]
        for mode, measured in pairs.items():
            step_s = statistics.median(clean / WINDOW for _, clean in measured)
            stalls = [(with_checkpoint - clean) / (clean / WINDOW) for with_checkpoint, clean in measured]
            print(
                f"{name:5} {mode:11}  stage files {', '.join(f'{b / 2**20:.0f} MiB' for b in sizes)}  step "
                f"{step_s * 1e3:7.1f} ms  the step that checkpoints: +{statistics.median(stalls):.1%} "
                f"({min(stalls):+.1%} to {max(stalls):+.1%}, {len(stalls)} checkpoints)",
                flush=True,
            )


def _checkpoint_pairs(boundaries: dict) -> list[tuple[float, float]]:
    """(the wall time of the `WINDOW` steps from a checkpoint's, of the `WINDOW` clean steps after them) for every
    checkpoint the run's boundary times (`worker.BOUNDARIES_ENV`) cover: the save starts at its step's boundary and
    is completed at the first boundary where no file is still being written (at once, synchronously), within the
    window here, so the window carries all it costs."""
    first, at = boundaries["first_step"], boundaries["at_s"]
    wall = {first + n: at[n] - at[n - 1] for n in range(1, len(at))}  # step s: from boundary s - 1 to boundary s
    out = []
    for c in range(EVERY, first + len(at), EVERY):
        if all(s in wall for s in range(c, c + EVERY)):
            out.append((sum(wall[s] for s in range(c, c + WINDOW)), sum(wall[s] for s in range(c + WINDOW, c + EVERY))))
    return out


def _profile(a: argparse.Namespace, tmp: Path, env: dict) -> tuple[Path, str]:
    """The profile to plan with and where it came from: the one given, or one measured now."""
    if a.profile:
        return Path(a.profile), a.profile
    profile_path = tmp / "profile.json"
    print(f"measuring a profile: terapipe profile --model {a.model} --quick", flush=True)
    subprocess.run(
        [sys.executable, "-m", "terapipe_cli", "profile", "--model", a.model, "--quick", "--out", str(profile_path)],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return profile_path, "measured now with `terapipe profile --quick`"


def _candidates(planned_slices, B: int, L: int) -> list[dict]:
    return [
        {"name": "GPipe", "slices": [[B, [L]]]},
        {"name": "planner", "slices": [[b, list(s)] for b, s in planned_slices]},
        {"name": "uniform/4", "slices": [[B, [L // 4] * 4]]},
        {"name": "uniform/8", "slices": [[B, [L // 8] * 8]]},
    ]


def _time(a: argparse.Namespace, model, candidates: list[dict], tmp: Path, env: dict) -> tuple[dict, float, float]:
    """Run the interleaved rounds in one torchrun job; returns seconds per step of each candidate, and the
    1-minute load average before and after."""
    config = {
        "model": model.to_dict(),
        "batch_size": a.batch,
        "candidates": candidates,
        "rounds": a.rounds,
        "warmup": a.warmup,
        "out": str(tmp / "times.json"),
    }
    (tmp / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    cmd += ["--nproc-per-node", str(a.stages), "--max-restarts", "0", __file__, "--worker", str(tmp / "config.json")]
    load_before = os.getloadavg()[0]
    subprocess.run(cmd, check=True, env=env)
    load_after = os.getloadavg()[0]
    return json.loads((tmp / "times.json").read_text()), load_before, load_after


def _print_table(times: dict, candidates: list[dict], cost, K: int, rounds: int) -> None:
    from terapipe_cli.plan.file import short_form
    from terapipe_cli.plan.search import evaluate

    med = {n: statistics.median(v) for n, v in times.items()}
    bound = med["single process"] / K
    print(f"\nmedian iteration latency over {rounds} interleaved rounds (min-max), 2-core CPU, one thread per stage")
    print(f"{'scheme':<16} {'slices':<34} {'median ms':>10} {'min-max ms':>16} {'vs GPipe':>9} {'predicted ms':>13}")
    for c in candidates + [{"name": "single process", "slices": None}]:
        n, v = c["name"], times[c["name"]]
        pred = f"{evaluate(cost, c['slices'], K) * 1e3:.1f}" if c["slices"] else ""
        slices = short_form(c["slices"]) if c["slices"] else "whole model, one process"
        print(
            f"{n:<16} {slices[:34]:<34} {med[n] * 1e3:>10.1f} {min(v) * 1e3:>7.1f}-{max(v) * 1e3:<8.1f} "
            f"{med['GPipe'] / med[n]:>8.2f}x {pred:>13}"
        )
    print(
        f"{'perfect overlap':<16} {'single process / K':<34} {bound * 1e3:>10.1f} {'':>16} "
        f"{med['GPipe'] / bound:>8.2f}x"
    )


if __name__ == "__main__":
    main()
