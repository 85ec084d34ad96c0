"""One torchrun worker: one tensor rank of one stage of one pipeline replica (`mesh.Layout`: rank =
(replica · K + stage) · T + tensor rank), running the engine's `Trainer` over the run.

Launched by `terapipe_cli.train.launch` as ``python -m terapipe_cli.train.worker --run-dir DIR ...``
(the rest of the command line: how to join the process group, and its node's settings digest); all settings
come from node 0's ``config.json``, written and validated by node 0's launcher before any worker starts and
sent to every rank at start-up (`join_node_0`, docs/design.md §6).

`train` is the whole run: start-up (the process group, node 0's config, this rank's trainer over
``torch.distributed``), a checkpoint to continue from, then one `Trainer.step` after the other with what a run
keeps around them — the metrics line, the held-out loss when due, ``--verify``'s gradients, checkpoints,
timelines — and the summary.

A failure writes the traceback to ``DIR/errors/rank_N.txt`` and torchrun's error file, prints one line,
and exits 1; torchrun then stops the other workers and the launcher names the rank and the cause.

With ``TERAPIPE_PROFILE_DIR`` set (`PROFILE_ENV`; scripts/bench_peer_train.py --profile), each rank runs under
cProfile and writes its statistics to ``rank_N.prof`` there.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from terapipe_cli.config.run import DEFAULT_GRACE_S, RunArguments
from terapipe_cli.ending import entry_point
from terapipe_cli.engine.comm import DistGroup, PeerLost, make_groups, make_p2p_groups, short_error
from terapipe_cli.engine.data import run_data
from terapipe_cli.engine.hostmem import retain_freed_memory
from terapipe_cli.engine.mesh import Layout, gpu_of
from terapipe_cli.engine.p2p import Links
from terapipe_cli.engine.trainer import BY_NAME_KEY, LOSS_SCALE_KEY, Comms, StepResult, Trainer
from terapipe_cli.errors import UserError
from terapipe_cli.files import write_text_atomic
from terapipe_cli.plan.file import plan_from_dict
from terapipe_cli.schedule.timeline import Event, read_timeline, write_timeline
from terapipe_cli.train import checkpoint
from terapipe_cli.train.init_from import initial_weights
from terapipe_cli.train.metrics import MetricsLog
from terapipe_cli.train.rundir import (
    append_event,
    join_run_folder,
    keep_metrics_until,
    read_config,
    read_metrics,
    run_schedule,
    settings_digest,
    timeline_path,
    verify_grads_path,
    write_summary,
)
from terapipe_cli.train.saving import SaveFailed, Saves, layout_of
from terapipe_cli.train.stop import DIVERGED_FILE, SaveTimeout, WorkerSignals, failed_since, write_stopped
from terapipe_cli.units import format_duration

# Test-only fault injection, in the middle of step STEP (after its forward tiles) on rank RANK, to exercise
# failure handling and --resume: "kill:RANK:STEP" (SIGKILL itself), "raise:RANK:STEP" (an exception),
# "hang:RANK:STEP" (stop responding, so the neighbours' waits time out), "wait:RANK:STEP" (wait there for a stop
# signal, at most WAIT_FAULT_S), or "nospace:RANK:STEP" (its checkpoint write of that step fails as on a full disk).
# Only in a launch's first attempt: the workers torchrun restarts (--max-restarts) run clean. Set as the test switch
# ``fault`` (`config.controls.Controls`, e.g. TERAPIPE_TEST_CONTROLS=fault=kill:1:3).
WAIT_FAULT_S = 60.0  # a test's signal comes within this (its own timeout is longer than the run it waits on)
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: how many times it restarted the workers

# A folder: each rank's whole run goes through cProfile and its statistics are written there as rank_N.prof (where
# a step's time goes, measured inside `terapipe train` itself; scripts/bench_peer_train.py --profile).
PROFILE_ENV = "TERAPIPE_PROFILE_DIR"

# A file: rank 0 writes there when each step's boundary ended, so that a step's whole wall time (its compute and
# what follows it: the record, a checkpoint, the stop check) is known (scripts/bench_train.py --checkpoints).
BOUNDARIES_ENV = "TERAPIPE_BOUNDARIES_FILE"

# "0": rank 0 records every step but prints no step line; the report draws a progress bar over its baseline's
# training instead (train/baseline.py).
STEP_LINES_ENV = "TERAPIPE_STEP_LINES"


@dataclass(frozen=True)
class NodeRequest:
    """What this node's launcher passed on the worker's command line: how to join the process group, and the
    digest of the plan and settings it was asked for (`rundir.settings_digest`)."""

    device: str
    backend: str
    timeout_s: float
    settings: str


@dataclass
class Worker:
    """This rank's trainer and what the run keeps around it."""

    run_dir: Path
    trainer: Trainer
    # Checkpoints (`folder_roles`): whether this rank writes its stage's file into its run folder, and, for the
    # one rank per folder that marks checkpoints complete there, the stages whose files the folder holds.
    writes_shard: bool = True
    marks_stages: list[int] | None = None
    metrics: MetricsLog | None = None  # rank 0's: where each step's record goes (--log)
    folder: int = 0  # whose run folder this rank writes into (`join_node_0`): ranks with the same write to one

    @property
    def args(self) -> RunArguments:
        return self.trainer.args

    @property
    def rank(self) -> int:
        return self.trainer.rank


def train(run_dir: Path, resume_step: int | None, request: NodeRequest) -> None:
    """The worker's whole run: set up, continue from a checkpoint if asked (or after a restart), one step after the
    other, checkpoints written while the next step runs, a stop at a step boundary on a signal (train/stop.py),
    summary."""
    started = time.time()
    signals = WorkerSignals(run_dir, DEFAULT_GRACE_S, on_expiry=_end_now, failed=lambda: failed_since(run_dir, started))
    signals.install()  # first: a SIGTERM during start-up is noted, not fatal
    restarts = int(os.environ.get(RESTART_ENV, "0"))
    if restarts and diverged_file(run_dir).is_file():  # a restart would only diverge again from the same checkpoint
        raise Diverged(diverged_file(run_dir).read_text(errors="replace").strip())
    w = start_worker(run_dir, request, resuming=resume_step is not None or restarts > 0)
    signals.grace_s = w.args.grace_s
    if restarts:
        resume_step = restart_point(w, restarts)
    start_step, events = restore(w, resume_step)
    w.metrics = MetricsLog(run_dir, w.args.log, first_step=start_step + 1) if w.rank == 0 else None
    saves = Saves(w, on_begin=lambda: save_timeline(w, events), fault=lambda step: _full_disk_fault(w, step))
    try:
        run_steps(w, start_step, events, saves, signals, resume_step)
    finally:
        saves.close(w.args.grace_s)  # never gone while a checkpoint file is half-way through its rename
    dist.destroy_process_group()


def run_steps(
    w: Worker, start_step: int, events: list[Event], saves: Saves, signals: WorkerSignals, resume_step: int | None
) -> None:
    """Steps ``start_step + 1`` onwards, to the run's end or to the boundary where the ranks agree to stop."""
    t = w.trainer
    iteration_s: list[float] = []
    t.comms.world.all_reduce(torch.zeros(1, device=t.device), what="start-up")
    run_start = time.perf_counter()
    boundaries: list[float] = []  # when each step's boundary work (log, checkpoint, stop check) ended
    grads_saved = False  # --verify: each stage's gradients of the first step not skipped
    for step in range(start_step + 1, w.args.steps + 1):
        result = t.step(step, after_forward=_fault(w, step, signals), before_update=saves.copied)
        events.extend(result.events)
        if w.args.verify and t.replica == 0 and not grads_saved and not result.update.skipped:
            grads = t.gradients()  # a collective over the stage's tensor ranks; the first of them writes
            if t.tensor.rank == 0:
                checkpoint.save_torch_atomic(verify_grads_path(w.run_dir, t.stage), {"step": step, "grads": grads})
            grads_saved = True
        iteration_s.append(result.seconds)
        val_loss = t.evaluate() if t.evaluation_due(step) else None
        if w.rank == 0:
            log_step(w, result, iteration_s, val_loss)
        try:
            stop_if_diverged(result)
        except Diverged:
            saves.finish()  # the checkpoint being written holds the last finite weights: completed first
            raise
        if step % w.args.checkpoint_every == 0 or step == w.args.steps:
            saves.begin(step)  # completes the one before first
        # One all-reduce per step: a signal any rank knows of, and whether any rank's checkpoint file is still being
        # written (the checkpoint is completed, by another collective, at the first boundary where none is).
        stop, writing = _all_reduce_max(t, [signals.requested(), int(saves.writing)], step)
        if not writing:
            saves.finish()
        if stop and step < w.args.steps:
            if saves.pending != step and saves.saved != step:
                saves.begin(step)
            saves.finish()
            if w.marks_stages is not None:
                write_stopped(w.run_dir, stop, step)
            signals.done()
            if w.rank == 0:
                w.metrics.close()  # its TensorBoard events flushed before the process ends
            _write_boundaries(w, start_step, [*boundaries, time.perf_counter()], run_start)
            return
        boundaries.append(time.perf_counter())
    saves.finish()
    signals.done()
    save_timeline(w, events)
    if w.rank == 0:
        write_run_summary(w, resume_step, iteration_s, wall_s=time.perf_counter() - run_start)
        w.metrics.close()
    _write_boundaries(w, start_step, boundaries, run_start)


def _write_boundaries(w: Worker, start_step: int, at_s: list[float], started_s: float) -> None:
    """`BOUNDARIES_ENV`: rank 0's `time.perf_counter` (the system's monotonic clock on Linux, comparable between
    processes) when each step's boundary ended, and when start-up had ended on every rank (``started_s``: after the
    start-up all-reduce; scripts/bench_init_from.py times start-up by it)."""
    if w.rank == 0 and os.environ.get(BOUNDARIES_ENV):
        record = {"first_step": start_step + 1, "at_s": at_s, "started_s": started_s}
        Path(os.environ[BOUNDARIES_ENV]).write_text(json.dumps(record))


def _all_reduce_max(t: Trainer, values: list[int], step: int) -> list[int]:
    flags = torch.tensor(values, dtype=torch.int64, device=t.device)
    t.comms.world.all_reduce(flags, op="max", what=f"the stop check after step {step}")
    return flags.tolist()


def restart_point(w: Worker, restarts: int) -> int:
    """After torchrun restarted the workers (``--max-restarts``): the checkpoint to continue from, the newest whose
    own stage file matches its manifest in this rank's folder (0: none, start again), logged by rank 0."""
    step, _ = checkpoint.latest_verified(w.run_dir, stages=[w.trainer.stage])
    agreed = torch.tensor([step or 0], dtype=torch.int64, device=w.trainer.device)
    w.trainer.comms.world.all_reduce(agreed, op="min", what="agreeing on the checkpoint to restart from")
    step = int(agreed.item())
    if w.rank == 0:
        where = f"the checkpoint of step {step}" if step else "step 1 (no complete checkpoint yet)"
        print(f"restart {restarts} of {w.args.max_restarts}: a worker failed; all workers continue from {where}")
        append_event(w.run_dir, {"event": "restart", "restart": restarts, "resumed_from": step})
    return step


class Diverged(Exception):
    """The run diverged: a step's loss is not finite, or its gradient norm where no loss scale skips the step."""

    exit_code = 3  # the launcher's too (`launch.RunDiverged`): not 1 (a worker failed), not 2 (bad input)


def diverged_file(run_dir: Path) -> Path:
    """Where a diverged run's cause waits for --max-restarts' restarts (torchrun restarts after any failure): they
    stop at once with it instead of training into the same divergence again. The launcher clears it at its start
    (`stop.clear`)."""
    return Path(run_dir) / DIVERGED_FILE


def stop_if_diverged(result: StepResult) -> None:
    """Stop on a non-finite loss or gradient norm, before the step's checkpoint: the weights its update made are never
    saved. Both numbers are all-reduced (the same on every rank), so every rank stops at the same step and none waits
    for another. fp16 first skips a step with an inf/nan gradient and halves its loss scale (`optim.LossScale`): such
    a step (no norm) is the loss scale at work, not a divergence; a non-finite loss is."""
    norm = result.update.grad_norm
    if math.isfinite(result.loss) and (norm is None or math.isfinite(norm)):
        return
    shown = "skipped" if norm is None else f"{norm:g}"
    raise Diverged(f"step {result.step} (loss {result.loss:g}, gradient norm {shown}, lr {result.lr:.3g})")


def start_worker(run_dir: Path, request: NodeRequest, *, resuming: bool) -> Worker:
    """Join the process group, settle the run folder (`join_node_0`), read the run's config, and build this
    rank's trainer over ``torch.distributed``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _use_device(request.device, int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(request.backend, timeout=timedelta(seconds=request.timeout_s))
    owners = join_node_0(run_dir, request, device, resuming=resuming)
    cfg, args = read_config(run_dir)
    plan = plan_from_dict(cfg["plan"], f"{run_dir / 'config.json'}: field 'plan'")
    layout = Layout(args.data_parallel, plan.stages, args.tensor_parallel)
    if world != layout.world:
        raise RuntimeError(f"world size {world} is not {layout.shape_text()}")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    groups = make_groups(layout, rank, "cuda" if request.backend == "nccl" else "cpu", tied=plan.model.tie_embeddings)
    prev_rank, next_rank = layout.neighbours(rank)
    link = Links(
        prev_rank=prev_rank,
        next_rank=next_rank,
        ring=layout.ring(rank),
        channels=make_p2p_groups(request.backend),
        hidden=plan.model.hidden,
        dtype=torch.float32,
        device=device,
        timeout_s=args.timeout_s,
    )
    comms = Comms(DistGroup(None, world), groups.model, groups.replicas, groups.tensor, link, groups.tied)
    data, held_out, _ = run_data(args, seq_len=plan.seq_len, vocab=plan.model.vocab)
    schedule = run_schedule(plan, args, where=str(run_dir / "config.json"))
    trainer = Trainer(
        plan, schedule, args, layout=layout, rank=rank, device=device, comms=comms, data=data, held_out=held_out
    )
    return Worker(run_dir, trainer, folder=owners[rank], **folder_roles(rank, layout, owners))


def join_node_0(run_dir: Path, request: NodeRequest, device: torch.device, *, resuming: bool) -> list[int]:
    """Every rank takes node 0's config (rank 0 reads it from its folder and sends it to all), checks that its
    own node was asked for the same plan and settings, and learns whose run folder every rank writes into:
    the returned list holds, per rank, 0 for node 0's folder (node 0, or a node sharing its folder) or the
    node's own rank for a node-local folder. The first worker of each node settles the folder
    (`rundir.join_run_folder`); docs/design.md §6."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank, per_node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = rank // per_node
    config = _from_rank_0(read_config(run_dir)[0] if rank == 0 else None, device)
    if settings_digest(config["plan"], config["arguments"]) != request.settings:
        raise RuntimeError(
            f"node {node} was started with another plan or other settings than node 0: the same command must run "
            "on every node, only --node-rank differs"
        )
    slots = torch.zeros(world, dtype=torch.int64, device=device)
    if local_rank == 0:
        shared = join_run_folder(run_dir, config, node_rank=node, resuming=resuming)
        slots[rank] = 1 + (0 if shared else node)
    DistGroup(None, world).all_reduce(slots, what="joining node 0's run")
    return [int(slots[(r // per_node) * per_node]) - 1 for r in range(world)]


def _from_rank_0(obj: object, device: torch.device) -> object:
    """Rank 0's ``obj`` on every rank (`dist.broadcast_object_list`; through host memory on gloo)."""
    box = [obj]
    on = torch.device("cpu") if dist.get_backend() == "gloo" else device
    try:
        dist.broadcast_object_list(box, src=0, device=on)
    except Exception as e:
        raise PeerLost(f"lost a peer during start-up: {short_error(e)}") from None
    return box[0]


def folder_roles(rank: int, layout: Layout, owners: list[int]) -> dict:
    """Who writes what into each run folder at a checkpoint (``owners``: `join_node_0`'s list). In each
    folder the lowest rank of every stage writes that stage's file (replicas hold the same weights, and the
    stage's tensor ranks all hold its whole state once gathered, `tensor.full_state`), and the lowest rank
    writing there marks the checkpoint complete, listing the stages the folder holds."""
    stage = layout.stage
    mine = [r for r in range(len(owners)) if owners[r] == owners[rank]]
    writers = [r for r in mine if not any(q < r and stage(q) == stage(r) for q in mine)]
    return {
        "writes_shard": rank in writers,
        "marks_stages": sorted(stage(r) for r in writers) if rank == mine[0] else None,
    }


def _use_device(device: str, threads: int) -> torch.device:
    """This rank's device: GPU LOCAL_RANK % GPUs (torchrun's LOCAL_RANK; its own GPU when the machine has one
    per worker, else one it shares, `placement.backend_for`), or the CPU with ``threads`` threads."""
    if device == "cuda":
        cuda = torch.device("cuda", gpu_of(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()))
        torch.cuda.set_device(cuda)
        return cuda
    torch.set_num_threads(threads)
    return torch.device("cpu")


def restore(w: Worker, resume_step: int | None) -> tuple[int, list[Event]]:
    """(the last step done, the timeline so far): step 0 and none — the weights of ``--init-from`` or the seed's —, or
    a resumed run's checkpoint."""
    if resume_step is None:
        start_weights(w.trainer)
        return 0, []
    t = w.trainer
    # Each node's launcher found the last checkpoint complete in its own folder; all resume from the oldest.
    agreed = torch.tensor([resume_step], dtype=torch.int64, device=t.device)
    t.comms.world.all_reduce(agreed, op="min", what="agreeing on the checkpoint to resume")
    resume_step = int(agreed.item())
    if w.marks_stages is not None:
        checkpoint.discard_after(w.run_dir, resume_step)  # the abandoned attempt's (its steps run again)
    if resume_step == 0:  # restarted before the first checkpoint: from the start
        start_weights(w.trainer)
        if w.rank == 0:
            keep_metrics_until(w.run_dir, 0)
        return 0, []
    same_layout = load_checkpoint(w.run_dir, resume_step, w.trainer)
    events: list[Event] = []
    if same_layout and timeline_path(w.run_dir, w.rank).exists():  # another layout's ranks ran other stages
        events = [e for e in read_timeline(timeline_path(w.run_dir, w.rank))[1] if e.step <= resume_step]
    if w.rank == 0:
        keep_metrics_until(w.run_dir, resume_step)
    return resume_step, events


def start_weights(t: Trainer) -> None:
    """A new run's first weights: ``--init-from``'s when the run names one (this rank's own tensors, its tensor rank's
    share: `init_from.initial_weights`), else the seed's, as built."""
    initial_weights(t.args, t.runner.module, t.tensor.size, t.tensor.rank)


def load_checkpoint(run_dir: Path, step: int, t: Trainer) -> bool:
    """Trainer ``t``'s weights and optimizer state from the checkpoint of ``step``, whatever layout wrote it (its
    tensors are under whole-model names: `checkpoint.read_state`); whether that layout is ``t``'s."""
    stored = checkpoint.read_state(run_dir, step, set(t.state_names()), model_config=t.plan.model.to_dict())
    if stored.by_index:  # terapipe.checkpoint/1: each file is its stage's, the optimizer state by index
        if t.stage not in stored.by_index or len(stored.layouts) != t.plan.stages:
            raise RuntimeError(
                f"the checkpoint of step {step} is from before checkpoints held whole-model names: it continues "
                f"only under the plan that wrote it ({len(stored.layouts)} stages)"
            )
        state = stored.by_index[t.stage]
        t.load_full_state(state["model"], state["optimizer"])
        return True
    optimizer: dict = {BY_NAME_KEY: stored.optimizer_by_name}
    if stored.loss_scale is not None:
        optimizer[LOSS_SCALE_KEY] = stored.loss_scale
    t.load_full_state(stored.model, optimizer)
    return all(layout == layout_of(t) for layout in stored.layouts)


def log_step(w: Worker, result: StepResult, iteration_s: list[float], val_loss: float | None) -> None:
    """The step's record in metrics.jsonl and its line on the console (rank 0), with the held-out loss when
    evaluated and the time left: the steps to go at the median of this launch's last ten iterations."""
    step, loss, lr, update = result.step, result.loss, result.lr, result.update
    tokens, dt = w.trainer.tokens_per_step, iteration_s[-1]
    eta = format_duration((w.args.steps - step) * statistics.median(iteration_s[-10:]))
    record = {"step": step, "loss": loss, "lr": lr, "grad_norm": update.grad_norm, "skipped": update.skipped}
    if update.loss_scale is not None:
        record["loss_scale"] = update.loss_scale
    peaks = result.memory
    record.update(iteration_s=dt, tokens_per_s=tokens / dt, memory_bytes=max(peaks), memory_bytes_per_rank=peaks)
    record["saved_bytes_per_rank"] = result.saved
    if result.live is not None:
        record["live_bytes_per_rank"] = result.live
    record["tokens"], record["epoch"] = w.trainer.consumed(step)
    if val_loss is not None:
        record["val_loss"] = val_loss
    w.metrics.write(record)
    norm = "skipped" if update.grad_norm is None else f"{update.grad_norm:7.3f}"
    scale = f"  scale {update.loss_scale:g}" if update.loss_scale is not None else ""
    val = f"  val {val_loss:8.4f}" if val_loss is not None else ""
    if os.environ.get(STEP_LINES_ENV) == "0":
        return
    print(
        f"step {step:>5}/{w.args.steps}  loss {loss:8.4f}{val}  lr {lr:.2e}  |g| {norm}{scale}  "
        f"iter {dt * 1e3:9.1f} ms  {tokens / dt:10,.0f} tok/s  mem {max(peaks) / 2**20:7.1f} MiB  eta {eta}",
        flush=True,
    )


def save_timeline(w: Worker, events: list[Event]) -> None:
    t = w.trainer
    meta = {
        "source": "measured",
        "rank": w.rank,
        "stage": t.stage,
        "replica": t.replica,
        "tensor_rank": t.tensor.rank,
        "stages": t.plan.stages,
        "data_parallel": w.args.data_parallel,
        "tensor_parallel": t.tensor.size,
        "device": _device_name(t.device),
        "slices": t.plan.short_form(),
    }
    write_timeline(timeline_path(w.run_dir, w.rank), events, **meta)


def write_run_summary(w: Worker, resume_step: int | None, iteration_s: list[float], *, wall_s: float) -> None:
    t = w.trainer
    records = read_metrics(w.run_dir)
    median_s = statistics.median(iteration_s) if iteration_s else None
    write_summary(
        w.run_dir,
        {
            "status": "complete",
            "steps": w.args.steps,
            "resumed_from": resume_step,
            "first_loss": records[0]["loss"] if records else None,
            "final_loss": records[-1]["loss"] if records else None,
            "final_val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
            "skipped_steps": sum(1 for r in records if r.get("skipped")),
            "precision": w.args.precision,
            "median_iteration_s": median_s,
            "tokens_per_s": t.tokens_per_step / median_s if median_s is not None else None,
            "wall_s": wall_s,
            "slices": t.plan.short_form(),
            "stages": t.plan.stages,
            "data_parallel": w.args.data_parallel,
            "tensor_parallel": t.tensor.size,
            "device": _device_name(t.device),
        },
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s))"


def _fault_at(w: Worker, step: int) -> str | None:
    """The kind of fault the run's ``fault`` switch (`config.controls.Controls`) injects on this worker's rank at
    ``step`` (only before any restart), or None."""
    spec = w.args.switches.fault
    if not spec or int(os.environ.get(RESTART_ENV, "0")) > 0:
        return None
    kind, fault_rank, fault_step = spec.split(":")
    return kind if int(fault_rank) == w.rank and int(fault_step) == step else None


def _full_disk_fault(w: Worker, step: int) -> bool:
    return _fault_at(w, step) == "nospace"


def _fault(w: Worker, step: int, signals: WorkerSignals | None = None) -> Callable[[], None] | None:
    kind = _fault_at(w, step)
    if kind is None or kind == "nospace":
        return None
    if kind == "kill":
        return lambda: os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        return lambda: time.sleep(10**6)
    if kind == "wait" and signals is not None:

        def wait_for_a_signal() -> None:  # the step a stop signal reaches, whatever the machine's speed
            deadline = time.monotonic() + WAIT_FAULT_S
            while not signals.requested() and time.monotonic() < deadline:
                time.sleep(0.01)

        return wait_for_a_signal

    def fail() -> None:
        raise RuntimeError(f"injected failure at step {step} (the test switch fault={w.args.switches.fault})")

    return fail


def record_for_torchrun(e: BaseException) -> None:
    """Write torchrun's error file, which carries the cause to the launcher, whole or not at all: torchrun stops
    the other ranks with SIGTERM after the first failure, and a rank stopped half-way through the file would leave
    the launcher a JSONDecodeError instead of its cause. The JSON is torch's own (ErrorHandler), renamed into place."""
    target = os.environ.get(ERROR_FILE_ENV)
    if not target:
        return
    partial = f"{target}.partial"
    os.environ[ERROR_FILE_ENV] = partial
    try:
        ErrorHandler().record_exception(e)
        os.replace(partial, target)
    except OSError:
        pass  # the launcher then names the exit code, and the traceback is in errors/rank_N.txt
    finally:
        os.environ[ERROR_FILE_ENV] = target


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each worker


def _end_now(message: str) -> None:
    """The stop signal's --grace-s ran out before the checkpoint was saved (`stop.WorkerSignals`' timer thread):
    end this process at once, the cause in torchrun's error file; the previous complete checkpoint is intact."""
    record_for_torchrun(SaveTimeout(message))
    sys.stderr.write(f"terapipe worker rank {os.environ.get('RANK', '0')}: {message}\n")
    sys.stderr.flush()
    os._exit(1)


@contextmanager
def profiled(rank: int) -> Iterator[None]:
    """Within: this rank under cProfile when `PROFILE_ENV` names a folder (its statistics go to rank_N.prof)."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(Path(folder) / f"rank_{rank:05d}.prof")


PROCESS_NAME = "terapipe-r"  # + the rank: a worker's name in ps and top


def name_process(name: str) -> None:
    """This process's name as ps, top and /proc/PID/comm show it (Linux, at most 15 bytes; elsewhere nothing): a
    worker forked from the launcher (`launch.start_method`) has the launcher's command line, so its name says
    which rank it is."""
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_PR_SET_NAME = 15  # linux/prctl.h


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="terapipe pipeline worker (started by `terapipe train`)")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume-step", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--settings", required=True, help="this node's `rundir.settings_digest`")
    a = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    name_process(f"{PROCESS_NAME}{rank}")
    retain_freed_memory()  # freed tile buffers are reused, not faulted in again (engine/hostmem.py)
    try:
        with profiled(rank):
            train(a.run_dir, a.resume_step, NodeRequest(a.device, a.backend, a.timeout_s, a.settings))
    except Diverged as e:  # every rank stops so: the launcher says it once (`launch.diverged_message`)
        try:
            write_text_atomic(diverged_file(a.run_dir), str(e))
        except (OSError, UserError):
            pass  # a restart then trains into it again, and stops there the same way
        record_for_torchrun(e)
        os._exit(Diverged.exit_code)
    except SaveFailed:  # another rank's checkpoint write failed; that rank names the cause
        sys.stdout.flush()
        os._exit(0)
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
        record_for_torchrun(e)
        if not isinstance(e, checkpoint.WriteFailed):  # a full disk: the launcher's line says it all
            sys.stderr.write(f"terapipe worker rank {rank}: {cause[:500]}\n")
            sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    entry_point(main)
