"""One torchrun worker: stage ``rank % K`` of pipeline replica ``rank // K``; walks the schedule every step.

Launched by `terapipe_cli.runtime.launch` as ``python -m terapipe_cli.runtime.worker --run-dir DIR``; all
settings come from ``DIR/config.json``, written and validated by the launcher before any worker starts.

Per step: pre-post the receives of the step's tiles, walk this stage's actions (forward tiles in order,
backward in reverse, see schedule.py) through the `StageRunner`, all-reduce gradients across the
data-parallel replicas of this stage, take the AdamW step, then one small all-reduce over all ranks that
both sums the step's loss and serves as the barrier that starts the next step on every rank together.

A failure writes the traceback to ``DIR/errors/rank_N.txt`` and torchrun's error file, prints one line,
and exits 1; torchrun then stops the other workers and the launcher names the rank and the cause.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from terapipe_cli.model import optimizer_for
from terapipe_cli.plan import plan_from_dict
from terapipe_cli.runtime import checkpoint
from terapipe_cli.runtime.data import check_data, load_data, step_batch
from terapipe_cli.runtime.p2p import Links, PeerLost, short_error
from terapipe_cli.runtime.rundir import (
    append_metrics,
    keep_metrics_until,
    read_config,
    read_metrics,
    timeline_path,
    write_summary,
)
from terapipe_cli.runtime.stage import StageRunner
from terapipe_cli.schedule import Action, Event, build_schedule, read_timeline, write_timeline

# Test-only fault injection, in the middle of step STEP (after its forward tiles) on rank RANK, to exercise
# failure handling and --resume: "kill:RANK:STEP" (SIGKILL itself), "raise:RANK:STEP" (an exception) or
# "hang:RANK:STEP" (stop responding, so the neighbours' waits time out).
FAULT_ENV = "TERAPIPE_TEST_FAULT"


def run_schedule(
    runner: StageRunner,
    actions: list[Action],
    links: Links,
    batch: torch.Tensor,
    *,
    step_start: float,
    stage: int,
    rank: int = 0,
    replica: int = 0,
    step: int = 0,
    after_forward: Callable[[], None] | None = None,
) -> tuple[torch.Tensor | None, list[Event]]:
    """Run one step's actions on this stage. ``batch``: (B, L + 1) token windows of this replica.

    Returns the summed token loss (last stage; unscaled) and one Event per action (times from step_start).
    """
    tiles = [a.tile for a in actions if a.phase == "F"]
    index = {t: n for n, t in enumerate(tiles)}
    forward_in = links.post_forward_recvs(tiles)
    backward_in: dict = {}
    cuda = batch.device.type == "cuda"
    sync = torch.cuda.current_stream(batch.device).synchronize if cuda else None  # tile times on the GPU
    forwards_left = len(tiles)
    loss: torch.Tensor | None = None
    events: list[Event] = []
    for action in actions:
        t = action.tile
        rows = slice(t.batch_start, t.batch_start + t.batch_size)
        if action.phase == "F":
            if runner.first:
                x = batch[rows, t.token_start : t.token_start + t.tokens]
            else:
                x = links.wait(forward_in.pop(t), f"receiving the activation of tile {index[t]}", links.prev_rank)
            targets = batch[rows, t.token_start + 1 : t.token_start + t.tokens + 1] if runner.last else None
            if sync:
                sync()
            start = time.perf_counter()
            out = runner.forward_tile(t.batch_slice, t.token_slice, x, targets)
            if runner.last:
                loss = out if loss is None else loss + out
            else:
                links.send_forward(out, index[t])
            forwards_left -= 1
            if forwards_left == 0:
                # Only now: on NCCL these receives would otherwise block the activation sends queued above.
                backward_in = links.post_backward_recvs(tiles)
                if after_forward is not None:
                    after_forward()
        else:
            grad = None
            if not runner.last:
                grad = links.wait(backward_in.pop(t), f"receiving the gradient of tile {index[t]}", links.next_rank)
            if sync:
                sync()
            start = time.perf_counter()
            grad_x = runner.backward_tile(t.batch_slice, t.token_slice, grad)
            if not runner.first:
                links.send_backward(grad_x, index[t], len(tiles))
        if sync:
            sync()
        end = time.perf_counter()
        events.append(
            Event(
                stage,
                action.phase,
                t.batch_slice,
                t.token_slice,
                start - step_start,
                end - step_start,
                rank,
                replica,
                step,
            )
        )
    links.finish_sends()
    return loss, events


def collective(fn: Callable[[], object], what: str) -> None:
    """A blocking collective (bounded by the process group's timeout); failures become PeerLost."""
    try:
        fn()
    except Exception as e:
        raise PeerLost(f"lost a peer during {what}: {short_error(e)}") from None


def allreduce_grads(module: torch.nn.Module, group) -> None:
    """Sum gradients over the data-parallel replicas of this stage (the loss is already scaled by the
    global token count, so the sum is the single-device gradient)."""
    params = [p for p in module.parameters()]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    collective(lambda: dist.all_reduce(flat, group=group), "the data-parallel gradient all-reduce")
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _fault(rank: int, step: int) -> Callable[[], None] | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    kind, fault_rank, fault_step = spec.split(":")
    if int(fault_rank) != rank or int(fault_step) != step:
        return None
    if kind == "kill":
        return lambda: os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        return lambda: time.sleep(10**6)

    def fail() -> None:
        raise RuntimeError(f"injected failure at step {step} ({FAULT_ENV})")

    return fail


def train(run_dir: Path, resume_step: int | None) -> None:
    cfg, args = read_config(run_dir)
    plan = plan_from_dict(cfg["plan"], f"{run_dir / 'config.json'}: field 'plan'")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stages, replicas = plan.stages, args.data_parallel
    if world != stages * replicas:
        raise RuntimeError(f"world size {world} is not stages {stages} x data-parallel {replicas}")
    stage, replica = rank % stages, rank // stages
    if cfg["device"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    dist.init_process_group(cfg["backend"], timeout=timedelta(seconds=args.timeout_s))
    dp_groups = None
    if replicas > 1:  # every rank must create every group
        dp_groups = [dist.new_group([r * stages + s for r in range(replicas)]) for s in range(stages)]

    runner = StageRunner(plan.model, stage, stages, seed=args.seed, device=device, kv_handback=args.kv_handback)
    optimizer = optimizer_for(runner.module, args.lr)
    start_step = 0
    events: list[Event] = []
    if resume_step is not None:
        state = checkpoint.load_stage(run_dir, resume_step, stage, map_location=device)
        runner.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = resume_step
        if timeline_path(run_dir, rank).exists():
            events = [e for e in read_timeline(timeline_path(run_dir, rank))[1] if e.step <= start_step]
        if rank == 0:
            keep_metrics_until(run_dir, start_step)

    data = load_data(args.data)
    check_data(data, vocab=plan.model.vocab, seq_len=plan.seq_len)
    B, L = plan.batch_size, plan.seq_len
    runner.set_loss_scale(1.0 / (B * replicas * L))
    links = Links(
        prev_rank=rank - 1 if stage > 0 else None,
        next_rank=rank + 1 if stage < stages - 1 else None,
        hidden=plan.model.hidden,
        dtype=torch.float32,
        device=device,
        timeout_s=args.timeout_s,
    )
    actions = build_schedule(plan.slices, stages)[stage]
    meta = {
        "source": "measured",
        "rank": rank,
        "stage": stage,
        "replica": replica,
        "stages": stages,
        "data_parallel": replicas,
        "device": _device_name(device),
        "slices": plan.short_form(),
    }

    def save_timeline() -> None:
        write_timeline(timeline_path(run_dir, rank), events, **meta)

    iteration_s: list[float] = []
    ready = torch.zeros(1, device=device)
    collective(lambda: dist.all_reduce(ready), "start-up")
    run_start = time.perf_counter()
    for step in range(start_step + 1, args.steps + 1):
        batch = step_batch(data, seed=args.seed, step=step, sequences=B * replicas, seq_len=L)
        batch = batch[replica * B : (replica + 1) * B].to(device)
        step_start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss, step_events = run_schedule(
            runner,
            actions,
            links,
            batch,
            step_start=step_start,
            stage=stage,
            rank=rank,
            replica=replica,
            step=step,
            after_forward=_fault(rank, step),
        )
        events.extend(step_events)
        if dp_groups is not None:
            allreduce_grads(runner.module, dp_groups[stage])
        if args.verify and step == 1 and replica == 0:
            grads = {n: p.grad.detach().cpu() for n, p in runner.module.named_parameters()}
            (run_dir / "verify").mkdir(exist_ok=True)
            torch.save(grads, run_dir / "verify" / f"grads_step1_stage_{stage:03d}.pt")
        optimizer.step()
        # One collective per step: sums the loss and everyone's peak memory, and lines the ranks up.
        stats = torch.zeros(1 + world, dtype=torch.float64, device=device)
        if loss is not None:
            stats[0] = loss.double() * runner.loss_scale
        stats[1 + rank] = float(peak_memory_bytes(device))
        collective(lambda stats=stats: dist.all_reduce(stats), "the end-of-step all-reduce")
        dt = time.perf_counter() - step_start
        iteration_s.append(dt)
        step_loss = float(stats[0])
        if rank == 0:
            memory = [int(m) for m in stats[1:].tolist()]
            tokens = B * replicas * L
            append_metrics(
                run_dir,
                {
                    "step": step,
                    "loss": step_loss,
                    "iteration_s": dt,
                    "tokens_per_s": tokens / dt,
                    "memory_bytes": max(memory),
                    "memory_bytes_per_rank": memory,
                },
            )
            print(
                f"step {step:>5}/{args.steps}  loss {step_loss:8.4f}  iter {dt * 1e3:9.1f} ms  "
                f"{tokens / dt:10,.0f} tok/s  mem {max(memory) / 2**20:7.1f} MiB",
                flush=True,
            )
        if step % args.checkpoint_every == 0 or step == args.steps:
            if replica == 0:
                checkpoint.save_stage(run_dir, step, stage, stages, runner.module.state_dict(), optimizer.state_dict())
            save_timeline()
            done = torch.zeros(1, device=device)
            collective(lambda done=done: dist.all_reduce(done), f"the checkpoint of step {step}")
            if rank == 0:
                checkpoint.mark_complete(run_dir, step, stages)
    save_timeline()
    if rank == 0:
        records = read_metrics(run_dir)
        write_summary(
            run_dir,
            {
                "status": "complete",
                "steps": args.steps,
                "resumed_from": resume_step,
                "first_loss": records[0]["loss"] if records else None,
                "final_loss": records[-1]["loss"] if records else None,
                "median_iteration_s": statistics.median(iteration_s) if iteration_s else None,
                "tokens_per_s": (B * replicas * L / statistics.median(iteration_s)) if iteration_s else None,
                "wall_s": time.perf_counter() - run_start,
                "slices": plan.short_form(),
                "stages": stages,
                "data_parallel": replicas,
                "device": _device_name(device),
            },
        )
    dist.destroy_process_group()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s))"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="terapipe pipeline worker (started by `terapipe train`)")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume-step", type=int, default=None)
    a = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        train(a.run_dir, a.resume_step)
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        cause = f"{type(e).__name__}: {' '.join(str(e).split())}"
        try:
            errors = a.run_dir / "errors"
            errors.mkdir(parents=True, exist_ok=True)
            (errors / f"rank_{rank:05d}.txt").write_text(traceback.format_exc())
        except OSError:
            pass
        # torchrun's error file carries the cause to the launcher.
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
        sys.stderr.write(f"terapipe worker rank {rank}: {cause[:500]}\n")
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
