#!/usr/bin/env python3
"""Schedule order, recomputation, and the maintained peer: one training step, interleaved in one torchrun job.

    python scripts/bench_schedules.py                  # tiny model, K = 2, B = 4, 10 rounds
    python scripts/bench_schedules.py --rounds 20 --markdown
    python scripts/bench_schedules.py --batch 2 --plan plan.json   # also the plan `terapipe plan` chose

Same model (configs/models/tiny.toml unless --model), same batch (B sequences), same two stage processes on CPU
(gloo, one thread each), one full training step (forward, backward, AdamW) per candidate, the candidates taken in
turn round after round so that drift in the machine's speed hits them all alike:

- terapipe with B microbatches of one whole sequence (GPipe's slicing) in GPipe order, in 1F1B order, in
  GPipe order with every tile recomputed, and in ZB-H1 order (each backward split into I and W);
- terapipe with each sequence also cut into 4 token slices (TeraPipe's slicing), the same three ways;
- the same eight with v = 2 interleaved chunks per process (``--virtual 2``, the default: process k runs chunks k and
  k + 2 of four; tiles wrap from the last process back to the first), and ZB-V on the V (process k runs chunks k
  and 3 − k);
- with ``--plan``, the plan `terapipe plan` chose (its slices, order, chunks and recomputation);
- the bound: the whole model's step in one process (rank 0, terapipe's runtime, B whole sequences; the other rank
  waits), timed in the same rounds — no pipeline of K processes can take less than its time / K, so the table's
  last column gives each candidate's share of that bound;
- ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` with B microbatches, on the same two
  stage modules (stage 0: embeddings and the first half of the layers; stage 1: the rest, the head and the loss),
  and its interleaved schedules ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS`` and
  ``ScheduleInterleavedZeroBubble`` on two stage modules per process (the same four chunks as terapipe's v = 2),
  and its V schedules ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (process k holds stages k and 3 − k). A
  peer schedule that refuses the setting (e.g. a batch it cannot divide) is reported and left out.

Prints the median step (min–max) of each, its ratio to ScheduleGPipe, to the best peer round by round, and
to the bound. A CPU with two cores and two stage
processes shows the cost of each choice, not a GPU's speed.
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
from bench_train import cpu_lock, join_bench_job, time_rounds  # noqa: E402  (one lock and one timing loop for both)

PEERS = ("torch ScheduleGPipe", "torch Schedule1F1B")
ONE_PROCESS = "one process, the whole model (not pipelined)"
INTERLEAVED_PEERS = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble")
V_PEERS = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # two stages per process in a V: k and 2K − 1 − k


def candidates(B: int, L: int, virtual: int) -> list[dict]:
    """terapipe's: (name, slices, order, recompute, virtual chunks per process)."""
    whole, sliced = [[1, [L]]] * B, [[1, [L // 4] * 4]] * B
    out = []
    for v in sorted({1, virtual}):
        tag = "" if v == 1 else f", v = {v}"
        for label, slices in (("microbatches", whole), ("4 token slices", sliced)):
            for what, order, recompute in (("GPipe order", "gpipe", False), ("1F1B order", "1f1b", False),
                                           ("recomputed", "gpipe", True), ("ZB-H1", "zb1p", False)):  # fmt: skip
                name = f"terapipe {label}, {what}{tag}"
                out.append({"name": name, "slices": slices, "order": order, "recompute": recompute, "virtual": v})
            if v == 2:
                name = f"terapipe {label}, ZB-V (the V), v = 2"
                out.append({"name": name, "slices": slices, "order": "zbv", "recompute": False, "virtual": 2})
    return out


# ----------------------------------------------------------------------------------------------- the worker


def worker(config_path: str) -> None:
    from terapipe_cli.engine.data import load_data, step_batch
    from terapipe_cli.plan.file import plan_from_dict
    from terapipe_cli.schedule.schedule import Schedule

    cfg, rank, stages, model = join_bench_job(config_path)
    B, L = cfg["batch_size"], model.seq_len
    batch = step_batch(load_data(None), seed=0, step=1, sequences=B, seq_len=L)
    steps = {}
    for c in cfg["candidates"]:
        schedule = _schedule(c, model, stages)
        steps[c["name"]] = _terapipe_step(schedule, model, rank, B, batch)
    if cfg.get("plan"):
        plan = plan_from_dict(cfg["plan"], "--plan")
        steps[cfg["plan_name"]] = _terapipe_step(Schedule.of_plan(plan), model, rank, B, batch)
    steps.update(_peer_steps(model, rank, stages, B, batch, cfg["virtual"]))
    steps[ONE_PROCESS] = _one_process_step(model, rank, B, batch)
    time_rounds(steps, cfg, rank)


def _one_process_step(model, rank: int, B: int, batch):
    """The whole model's step on rank 0 (one stage, B whole sequences); the other ranks do nothing."""
    from terapipe_cli.schedule.partition import Partition
    from terapipe_cli.schedule.schedule import Schedule

    if rank:
        return lambda: None
    one = Schedule.build([(1, [model.seq_len])] * B, 1, "gpipe", [False], Partition((model.layers,), 1))
    return _terapipe_step(one, model, 0, B, batch)


def _schedule(c: dict, model, stages: int):
    from terapipe_cli.schedule.partition import Partition
    from terapipe_cli.schedule.schedule import Schedule

    chunks = stages * c["virtual"]
    part = Partition((model.layers // chunks,) * chunks, stages)
    return Schedule.build(c["slices"], stages, c["order"], [c["recompute"]] * chunks, part)


def _terapipe_step(schedule, model, rank: int, B: int, batch):
    """One training step through terapipe's runtime (`engine.executor.StageExecutor`) in ``schedule``."""
    import torch

    from terapipe_cli.engine.executor import StageExecutor
    from terapipe_cli.engine.optim import make_optimizer
    from terapipe_cli.engine.p2p import Links
    from terapipe_cli.engine.stage import StageRunner

    stages, part = schedule.stages, schedule.partition
    chunks = part.chunks_on(rank)
    runner = StageRunner(
        model, rank, stages, seed=0, recompute={c: schedule.recompute[c] for c in chunks}, partition=part, chunks=chunks
    )
    runner.set_loss_scale(1.0 / (B * model.seq_len))
    optimizer = make_optimizer(runner.module, 1e-4)
    prev_rank, next_rank = (rank - 1 if rank else None), (rank + 1 if rank < stages - 1 else None)
    links = Links(
        prev_rank=prev_rank, next_rank=next_rank, ring=((rank - 1) % stages, (rank + 1) % stages),
        hidden=model.hidden, dtype=torch.float32, device=torch.device("cpu"), timeout_s=300,
    )  # fmt: skip
    executor = StageExecutor(runner, schedule, rank, links)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        executor.step(batch, step_start=time.perf_counter())
        optimizer.step()

    return step


def _peer_steps(model, rank: int, stages: int, B: int, batch, virtual: int) -> dict:
    """One training step of each of ``torch.distributed.pipelining``'s schedules on ``batch``; the interleaved ones
    with ``virtual`` stages per process. A schedule that refuses the setting is reported (rank 0) and left out."""
    import torch.distributed as dist

    out = {}
    kinds = [(name, kind, 1) for name, kind in zip(PEERS, ("ScheduleGPipe", "Schedule1F1B"), strict=True)]
    if virtual > 1:
        kinds += [(f"torch {kind}, v = {virtual}", kind, virtual) for kind in INTERLEAVED_PEERS]
    if virtual == 2:
        kinds += [(f"torch {kind}, v = 2 (the V)", kind, 2) for kind in V_PEERS]
    for name, kind, v in kinds:
        try:
            step, _ = peer_trainer(kind, model, rank, stages, B, lr=1e-4, virtual=v)
            step(batch)  # a schedule that cannot run this setting says so here, on every rank alike
        except Exception as e:  # noqa: BLE001  (the peer's own refusal, reported and skipped)
            if rank == 0:
                print(f"{name}: not run ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
            dist.barrier()
            continue
        out[name] = lambda step=step: step(batch)
    return out


def peer_trainer(kind: str, model, rank: int, stages: int, B: int, *, lr: float, virtual: int = 1):
    """``torch.distributed.pipelining``'s ``kind`` schedule (e.g. ``"ScheduleGPipe"``, ``"Schedule1F1B"``, or with
    ``virtual`` > 1 stages per process ``"ScheduleInterleaved1F1B"``) with B microbatches on this rank's stages of the
    same model (the same modules terapipe's chunks hold, run on whole sequences: process k holds stages k, k + K, …),
    and its AdamW (`engine.optim.make_optimizer`).

    Returns ``(step, optimizer)``: ``step(batch)`` is one training step (forward, backward, AdamW) on a (B, L + 1)
    token batch and returns the step's mean token loss on the last stage (None on the others)."""
    import torch
    import torch.distributed.pipelining as pipelining
    import torch.nn.functional as F

    from terapipe_cli.engine.optim import make_optimizer
    from terapipe_cli.models.gpt.module import GPT

    class Whole(torch.nn.Module):
        """A stage of the GPT on whole sequences (no K/V context: each microbatch is one whole sequence)."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.part = GPT(model, index, stages * virtual, seed=0)

        def forward(self, x):
            return self.part(x)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    # Interleaved: process k holds stages k, k + K, …; the V schedules: stages k and 2K − 1 − k.
    indices = [rank, 2 * stages - 1 - rank] if kind in V_PEERS else [rank + k * stages for k in range(virtual)]
    modules = torch.nn.ModuleList(Whole(i) for i in indices)
    optimizer = make_optimizer(modules, lr)
    pipe_stages = []
    for index, module in zip(indices, modules, strict=True):
        shape = (1, model.seq_len) if index == 0 else (1, model.seq_len, model.hidden)
        example = torch.zeros(shape, dtype=torch.long) if index == 0 else torch.zeros(shape)
        stage = pipelining.PipelineStage(module, index, stages * virtual, torch.device("cpu"), input_args=(example,))
        pipe_stages.append(stage)
    kwargs = {"n_microbatches": B, "loss_fn": loss_fn}
    schedule = getattr(pipelining, kind)(pipe_stages if virtual > 1 else pipe_stages[0], **kwargs)
    first, last = 0 in indices, stages * virtual - 1 in indices

    def step(batch: torch.Tensor) -> torch.Tensor | None:
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # the stage checks strides
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (inputs,) if first else ()
        kw = {"target": targets, "losses": losses} if last else {}
        schedule.step(*args, **kw)
        optimizer.step()
        return torch.stack(losses).mean().detach() if losses else None

    return step, optimizer


# ----------------------------------------------------------------------------------------------- the driver


def main() -> None:
    a = _parse_args()
    if a.worker:
        worker(a.worker)
        return
    sys.path.insert(0, str(ROOT / "src"))
    from terapipe_cli.config.model import load_model_config

    model = load_model_config(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="bench_schedules."))
    config = {
        "model": model.to_dict(),
        "batch_size": a.batch,
        "candidates": candidates(a.batch, model.seq_len, a.virtual),
        "virtual": a.virtual,
        **_plan_entry(a.plan, model),
        "rounds": a.rounds,
        "warmup": a.warmup,
        "out": str(tmp / "times.json"),
    }
    (tmp / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "0", __file__, "--worker", str(tmp / "config.json")]
    print(
        f"{model.name}: H={model.hidden}, {model.layers} layers, L={model.seq_len}, B={a.batch}, K=2 on CPU; "
        f"{len(config['candidates']) + bool(a.plan)} of terapipe's and torch's schedules, {a.rounds} interleaved "
        f"rounds (+{a.warmup} warm-up)",
        flush=True,
    )
    with cpu_lock():
        load = os.getloadavg()[0]
        subprocess.run(cmd, check=True, env=env)
    times = json.loads((tmp / "times.json").read_text())
    _print(times, markdown=a.markdown)
    print(f"\n1-minute load average before: {load:.2f} (the job adds ~2)")


def _plan_entry(path: str | None, model) -> dict:
    """The ``--plan`` candidate's config entries: the plan's dict and its row name (its slices, order and v)."""
    if not path:
        return {}
    plan = json.loads(Path(path).read_text())
    if plan["model"]["name"] != model.name or plan["stages"] != 2:
        sys.exit(f"--plan {path}: a plan of {plan['model']['name']} on {plan['stages']} stages, not {model.name} on 2")
    v = plan.get("virtual_stages", 1)
    shapes = sorted({(b, len(n)) for b, n in plan["slices"]})
    what = ", ".join(f"{b}×{k} slices" for b, k in shapes)
    return {"plan": plan, "plan_name": f"terapipe planner's plan ({what}, {plan.get('order', 'gpipe')}, v = {v})"}


def _print(times: dict, *, markdown: bool) -> None:
    """Median (min–max) of each, its speed against ScheduleGPipe's median, and against the best peer round by round:
    the peer with the lowest median's time over the candidate's in the same round, median (min–max) over the rounds
    (pairs within a round share the machine's load of the moment)."""
    med = {n: statistics.median(v) for n, v in times.items()}
    ref = med[PEERS[0]]
    best = min((n for n in times if n.startswith("torch ")), key=med.get)
    bound = times[ONE_PROCESS]  # per round: the whole model in one process; / K is what no K-stage pipeline beats
    rows = []
    for n, v in times.items():
        paired = [b / t for b, t in zip(times[best], v, strict=True)]
        share = [one / 2 / t for one, t in zip(bound, v, strict=True)]
        rows.append(
            (n, f"{med[n] * 1e3:.1f}", f"{min(v) * 1e3:.1f}–{max(v) * 1e3:.1f}", f"{ref / med[n]:.2f}×",
             f"{statistics.median(paired):.2f}× ({min(paired):.2f}–{max(paired):.2f})",
             "" if n == ONE_PROCESS else f"{statistics.median(share):.0%} ({min(share):.0%}–{max(share):.0%})")
        )  # fmt: skip
    head = ("candidate", "median ms", "min–max ms", "vs ScheduleGPipe", "vs best peer per round", "of the bound")
    print(f"\nbest peer (lowest median): {best}; the bound: {ONE_PROCESS}'s step / 2, round by round")
    if markdown:
        print("| " + " | ".join(head) + " |\n|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    print(f"\n{head[0]:<52} {head[1]:>10} {head[2]:>16} {head[3]:>17} {head[4]:>24} {head[5]:>18}")
    for r in rows:
        print(f"{r[0]:<52} {r[1]:>10} {r[2]:>16} {r[3]:>17} {r[4]:>24} {r[5]:>18}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "configs/models/tiny.toml"))
    parser.add_argument("--batch", type=int, default=4, help="Sequences per step B (= microbatches of the peers).")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--virtual", type=int, default=2, help="Chunks per process of the interleaved rows (1: none).")
    parser.add_argument("--plan", help="A plan of `terapipe plan` (this model, K = 2, this B), timed too.")
    parser.add_argument("--markdown", action="store_true", help="Print the table as markdown.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    main()
