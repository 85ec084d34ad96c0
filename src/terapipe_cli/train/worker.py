"""One torchrun worker: one tensor rank of one stage of one pipeline replica (`mesh.Layout`: rank =
(replica · K + stage) · T + tensor rank); walks the schedule every step.

Launched by `terapipe_cli.train.launch` as ``python -m terapipe_cli.train.worker --run-dir DIR ...``
(the rest of the command line: how to join the process group, and its node's settings digest); all settings
come from node 0's ``config.json``, written and validated by node 0's launcher before any worker starts and
sent to every rank at start-up (`join_node_0`, docs/design.md §6).

`train` is the whole loop, one step after the other (as nanoGPT's): the learning rate of the step (warm-up,
cosine decay); the step's schedule (`run_schedule`: pre-post the receives of the step's tiles, walk this
stage's actions in the order schedule.py decided — forward tiles in order, backward in reverse — through the
`StageRunner`, under autocast in bf16/fp16); the gradient all-reduce across the data-parallel replicas of
this stage; the update (`apply_update`: fp16's overflow check on all ranks, clipping by the global norm over
this replica's stages, AdamW); then one small all-reduce over all ranks that both sums the step's loss and
serves as the barrier that starts the next step on every rank together; the metrics line; the checkpoint
when one is due.

A failure writes the traceback to ``DIR/errors/rank_N.txt`` and torchrun's error file, prints one line,
and exits 1; torchrun then stops the other workers and the launcher names the rank and the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from terapipe_cli.engine.data import TokenData, check_data, load_data, split_data, step_batch, validation_batch
from terapipe_cli.engine.mesh import Layout, make_groups
from terapipe_cli.engine.optim import LossScale, LRSchedule, StepOutcome, make_optimizer, set_lr, take_step
from terapipe_cli.engine.p2p import Links, PeerLost, host_all_reduce, short_error
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.engine.tensor import TensorGroup, full_state, gather_tensor, local_state, split_of
from terapipe_cli.plan.file import Plan, plan_from_dict
from terapipe_cli.plan.schedule import Action, Tile, build_schedule
from terapipe_cli.plan.timeline import Event, read_timeline, write_timeline
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import (
    RunArguments,
    append_metrics,
    join_run_folder,
    keep_metrics_until,
    read_config,
    read_metrics,
    settings_digest,
    timeline_path,
    verify_grads_path,
    write_summary,
)
from terapipe_cli.units import format_duration

# Test-only fault injection, in the middle of step STEP (after its forward tiles) on rank RANK, to exercise
# failure handling and --resume: "kill:RANK:STEP" (SIGKILL itself), "raise:RANK:STEP" (an exception) or
# "hang:RANK:STEP" (stop responding, so the neighbours' waits time out).
FAULT_ENV = "TERAPIPE_TEST_FAULT"
# fp16's loss scale travels in the checkpoint next to the optimizer's own state (one value, the same on all stages).
LOSS_SCALE_KEY = "loss_scale"


@dataclass
class Worker:
    """What one rank holds for the whole run, built once by `start_worker`."""

    run_dir: Path
    plan: Plan
    args: RunArguments
    rank: int
    layout: Layout
    device: torch.device
    runner: StageRunner
    optimizer: torch.optim.Optimizer
    links: Links
    actions: list[Action]  # this stage's part of the schedule, in schedule.py's order
    data: TokenData  # the training part of the data
    held_out: TokenData | None  # the validation part (None: no validation)
    replica_group: object | None  # this stage's data-parallel group; None with one replica
    pipeline_group: object | None  # this replica's K·T ranks (the gradient norm's sum); None: all ranks (D = 1)
    tensor: TensorGroup  # this stage's tensor ranks (size 1 without tensor parallelism)
    schedule: LRSchedule
    loss_scale: LossScale | None  # fp16 only: the one dynamic loss scale of the whole pipeline
    # Checkpoints (`folder_roles`): whether this rank writes its stage's file into its run folder, and, for the
    # one rank per folder that marks checkpoints complete there, the stages whose files the folder holds.
    writes_shard: bool = True
    marks_stages: list[int] | None = None

    @property
    def stage(self) -> int:
        return self.layout.stage(self.rank)

    @property
    def replica(self) -> int:
        return self.layout.replica(self.rank)

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def tokens_per_step(self) -> int:
        """Predicted tokens of one step over all replicas: B·D·L."""
        return self.plan.batch_size * self.args.data_parallel * self.plan.seq_len

    @property
    def loss_multiplier(self) -> float:
        """What the last stage multiplies its summed token loss by: 1 / (B·D·L), which makes the gradient the
        single-device mean's, times the fp16 loss scale."""
        return (self.loss_scale.scale if self.loss_scale is not None else 1.0) / self.tokens_per_step


@dataclass(frozen=True)
class NodeRequest:
    """What this node's launcher passed on the worker's command line: how to join the process group, and the
    digest of the plan and settings it was asked for (`rundir.settings_digest`)."""

    device: str
    backend: str
    timeout_s: float
    settings: str


def train(run_dir: Path, resume_step: int | None, request: NodeRequest) -> None:
    """The worker's whole run: set up, continue from a checkpoint if asked, one iteration per step, summary."""
    w = start_worker(run_dir, request, resuming=resume_step is not None)
    start_step, events = restore(w, resume_step)
    iteration_s: list[float] = []
    ready = torch.zeros(1, device=w.device)
    collective(lambda: host_all_reduce(ready), "start-up")
    run_start = time.perf_counter()
    grads_saved = False  # --verify: each stage's gradients of the first step not skipped
    for step in range(start_step + 1, w.args.steps + 1):
        batch = replica_batch(w, step)
        step_start = time.perf_counter()
        lr = w.schedule(step)
        set_lr(w.optimizer, lr)
        w.optimizer.zero_grad(set_to_none=True)
        w.runner.set_loss_scale(w.loss_multiplier)
        loss, step_events = run_schedule(
            w.runner,
            w.actions,
            w.links,
            batch,
            step_start=step_start,
            stage=w.stage,
            rank=w.rank,
            replica=w.replica,
            step=step,
            after_forward=_fault(w.rank, step),
        )
        events.extend(step_events)
        sum_replica_gradients(w)
        update = apply_update(w)
        if w.args.verify and w.replica == 0 and not grads_saved and not update.skipped:
            grads = gradients(w)  # a collective over the stage's tensor ranks; the first of them writes
            if w.tensor.rank == 0:
                checkpoint.save_torch_atomic(verify_grads_path(run_dir, w.stage), {"step": step, "grads": grads})
            grads_saved = True
        step_loss, memory = end_of_step(w, loss)
        iteration_s.append(time.perf_counter() - step_start)
        val_loss = evaluate(w) if evaluation_due(w, step) else None
        if w.rank == 0:
            log_step(w, step, step_loss, lr, update, iteration_s, memory, val_loss)
        if step % w.args.checkpoint_every == 0 or step == w.args.steps:
            save_checkpoint(w, step, events)
    save_timeline(w, events)
    if w.rank == 0:
        write_run_summary(w, resume_step, iteration_s, wall_s=time.perf_counter() - run_start)
    dist.destroy_process_group()


def start_worker(run_dir: Path, request: NodeRequest, *, resuming: bool) -> Worker:
    """Join the process group, settle the run folder (`join_node_0`), read the run's config, and build this
    rank's stage, links and schedule."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _use_device(request.device, int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(request.backend, timeout=timedelta(seconds=request.timeout_s))
    owners = join_node_0(run_dir, request, device, resuming=resuming)
    cfg, args = read_config(run_dir)
    plan = plan_from_dict(cfg["plan"], f"{run_dir / 'config.json'}: field 'plan'")
    layout = Layout(args.data_parallel, plan.stages, args.tensor_parallel)
    if world != layout.world:
        raise RuntimeError(f"world size {world} is not {layout.shape_text()}")
    stage = layout.stage(rank)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    groups = make_groups(layout, rank, "cuda" if request.backend == "nccl" else "cpu")
    tensor = TensorGroup(layout.tensor_rank(rank), layout.tensor, groups.tensor, skip_allreduce=not args.tp_allreduce)
    runner, optimizer = build_stage(plan, stage, args, device, tensor)
    data = load_data(args.data)
    check_data(data, vocab=plan.model.vocab, seq_len=plan.seq_len)
    data, held_out = split_data(data, args.val_fraction, plan.seq_len)
    prev_rank, next_rank = layout.neighbours(rank)
    links = Links(
        prev_rank=prev_rank,
        next_rank=next_rank,
        hidden=plan.model.hidden,
        dtype=torch.float32,
        device=device,
        timeout_s=args.timeout_s,
    )
    return Worker(
        run_dir=run_dir,
        plan=plan,
        args=args,
        rank=rank,
        layout=layout,
        device=device,
        runner=runner,
        optimizer=optimizer,
        links=links,
        actions=build_schedule(plan.slices, plan.stages, plan.order)[stage],
        data=data,
        held_out=held_out,
        replica_group=groups.replicas,
        pipeline_group=groups.model,
        tensor=tensor,
        schedule=LRSchedule.of_run(args),
        loss_scale=LossScale() if args.precision == "fp16" else None,
        **folder_roles(rank, layout, owners),
    )


def join_node_0(run_dir: Path, request: NodeRequest, device: torch.device, *, resuming: bool) -> list[int]:
    """Every rank takes node 0's config (rank 0 reads it from its folder and sends it to all), checks that its
    own node was asked for the same plan and settings, and learns whose run folder every rank writes into:
    the returned list holds, per rank, 0 for node 0's folder (node 0, or a node sharing its folder) or the
    node's own rank for a node-local folder. The first worker of each node settles the folder
    (`rundir.join_run_folder`); docs/design.md §6."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank, per_node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = rank // per_node
    config = _from_rank_0(json.loads((run_dir / "config.json").read_text()) if rank == 0 else None, device)
    if settings_digest(config["plan"], config["arguments"]) != request.settings:
        raise RuntimeError(
            f"node {node} was started with another plan or other settings than node 0: the same command must run "
            "on every node, only --node-rank differs"
        )
    slots = torch.zeros(world, dtype=torch.int64, device=device)
    if local_rank == 0:
        shared = join_run_folder(run_dir, config, node_rank=node, resuming=resuming)
        slots[rank] = 1 + (0 if shared else node)
    collective(lambda: host_all_reduce(slots), "joining node 0's run")
    return [int(slots[(r // per_node) * per_node]) - 1 for r in range(world)]


def _from_rank_0(obj: object, device: torch.device) -> object:
    """Rank 0's ``obj`` on every rank (`dist.broadcast_object_list`; through host memory on gloo)."""
    box = [obj]
    on = torch.device("cpu") if dist.get_backend() == "gloo" else device
    collective(lambda: dist.broadcast_object_list(box, src=0, device=on), "start-up")
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
    per worker, else one it shares, `prepare.backend_for`), or the CPU with ``threads`` threads."""
    if device == "cuda":
        from terapipe_cli.engine.mesh import gpu_of

        cuda = torch.device("cuda", gpu_of(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()))
        torch.cuda.set_device(cuda)
        return cuda
    torch.set_num_threads(threads)
    return torch.device("cpu")


def build_stage(
    plan: Plan, stage: int, args: RunArguments, device: torch.device, tensor: TensorGroup
) -> tuple[StageRunner, torch.optim.Optimizer]:
    """This stage's part of the model — this tensor rank's share of it (`tensor.shard_module`), computing at
    the run's precision — and its optimizer (over exactly the parameters this rank holds)."""
    runner = StageRunner(
        plan.model,
        stage,
        plan.stages,
        seed=args.seed,
        device=device,
        kv_handback=args.kv_handback,
        precision=args.precision,
        tensor=tensor,
        recompute=plan.recompute[stage],
    )
    return runner, make_optimizer(runner.module, args.lr)


def restore(w: Worker, resume_step: int | None) -> tuple[int, list[Event]]:
    """(the last step done, the timeline so far): step 0 and none, or a resumed run's checkpoint."""
    if resume_step is None:
        return 0, []
    # Each node's launcher found the last checkpoint complete in its own folder; all resume from the oldest.
    agreed = torch.tensor([resume_step], dtype=torch.int64, device=w.device)
    collective(lambda: host_all_reduce(agreed, op=dist.ReduceOp.MIN), "agreeing on the checkpoint to resume")
    resume_step = int(agreed.item())
    if not checkpoint.stage_file(w.run_dir, resume_step, w.stage).is_file():
        raise RuntimeError(f"no checkpoint of stage {w.stage} at step {resume_step} in {w.run_dir}")
    state = checkpoint.load_stage(w.run_dir, resume_step, w.stage, map_location=w.device)
    optimizer_state = dict(state["optimizer"])
    loss_scale = optimizer_state.pop(LOSS_SCALE_KEY, None)
    # The file holds the whole stage: this tensor rank keeps its part.
    model_state, optimizer_state = local_state(w.runner.module, w.optimizer, state["model"], optimizer_state, w.tensor)
    w.runner.module.load_state_dict(model_state)
    w.optimizer.load_state_dict(optimizer_state)
    if w.loss_scale is not None and loss_scale is not None:
        w.loss_scale.load_state_dict(loss_scale)
    events: list[Event] = []
    if timeline_path(w.run_dir, w.rank).exists():
        events = [e for e in read_timeline(timeline_path(w.run_dir, w.rank))[1] if e.step <= resume_step]
    if w.rank == 0:
        keep_metrics_until(w.run_dir, resume_step)
    return resume_step, events


def replica_batch(w: Worker, step: int) -> torch.Tensor:
    """This replica's B token windows (B, L + 1) of the step's global batch of B·D, on the device."""
    sequences, L = w.plan.batch_size * w.args.data_parallel, w.plan.seq_len
    return _replica_rows(w, step_batch(w.data, seed=w.args.seed, step=step, sequences=sequences, seq_len=L))


def _replica_rows(w: Worker, batch: torch.Tensor) -> torch.Tensor:
    """This replica's B rows of a global batch of B·D windows, on the device."""
    B = w.plan.batch_size
    return batch[w.replica * B : (w.replica + 1) * B].to(w.device)


def _loss_share(w: Worker, loss: torch.Tensor | None) -> float:
    """What this rank adds to a step's mean loss: its summed token loss over B·D·L, on the last stage only, and
    there from tensor rank 0 only (a last stage's tensor ranks all compute the same loss)."""
    return float(loss.double()) / w.tokens_per_step if loss is not None and w.tensor.rank == 0 else 0.0


def evaluation_due(w: Worker, step: int) -> bool:
    """Validation every ``eval_every`` steps and after the last, when the run holds data out."""
    every = w.args.eval_every
    return w.held_out is not None and every > 0 and (step % every == 0 or step == w.args.steps)


def evaluate(w: Worker) -> float:
    """The held-out loss (mean over B·D·L tokens): the fixed validation batch through the same pipeline and
    tiles, forward only, no graph kept. Every rank takes part; one all-reduce sums the last stages' losses."""
    sequences, L = w.plan.batch_size * w.args.data_parallel, w.plan.seq_len
    batch = _replica_rows(w, validation_batch(w.held_out, seed=w.args.seed, sequences=sequences, seq_len=L))
    forwards = [a.tile for a in w.actions if a.phase == "F"]
    walk = _StepWalk(w.runner, w.links, batch, forwards, None, train=False)
    with w.runner.step():
        for t in forwards:
            walk.forward(t)
    w.links.finish_sends()
    w.runner.reset()
    total = torch.tensor([_loss_share(w, walk.loss)], dtype=torch.float64, device=w.device)
    collective(lambda: host_all_reduce(total), "the validation-loss all-reduce")
    return float(total[0])


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
    """Run one step's actions on this stage, in their order. ``batch``: (B, L + 1) token windows of this replica.

    Returns the summed token loss (last stage; unscaled) and one Event per action (times from step_start).
    """
    walk = _StepWalk(runner, links, batch, [a.tile for a in actions if a.phase == "F"], after_forward)
    events: list[Event] = []
    with runner.step():  # one low-precision copy of each weight for all the step's tiles
        for action in actions:
            t = action.tile
            start = walk.forward(t) if action.phase == "F" else walk.backward(t)
            end = walk.now()
            phase, b, k = action.phase, t.batch_slice, t.token_slice
            events.append(Event(stage, phase, b, k, start - step_start, end - step_start, rank, replica, step))
    links.finish_sends()
    return walk.loss, events


class _StepWalk:
    """One step's tiles on this stage: their messages to and from the neighbours, and the summed loss.

    `forward` and `backward` each run one tile and return the moment its compute began (after its input
    arrived); the caller takes the end with `now`, so a tile's time includes issuing its send. With ``train``
    False the walk is an evaluation: forwards only, no graph kept, no gradients expected.
    """

    def __init__(
        self,
        runner: StageRunner,
        links: Links,
        batch: torch.Tensor,
        tiles: list[Tile],
        after_forward: Callable[[], None] | None,
        *,
        train: bool = True,
    ) -> None:
        self.runner, self.links, self.batch, self.tiles = runner, links, batch, tiles
        self.train = train
        self.index = {t: n for n, t in enumerate(tiles)}
        self.forward_in = links.post_forward_recvs(tiles)
        self.backward_in: dict | None = None  # posted at the first backward
        self.forwards_left = len(tiles)
        self.after_forward = after_forward
        self.loss: torch.Tensor | None = None
        cuda = batch.device.type == "cuda"
        # Tile times on the GPU: wait for the stream before reading the clock.
        self._sync = torch.cuda.current_stream(batch.device).synchronize if cuda else None

    def now(self) -> float:
        if self._sync:
            self._sync()
        return time.perf_counter()

    def forward(self, t: Tile) -> float:
        runner, links, n = self.runner, self.links, self.index[t]
        rows = slice(t.batch_start, t.batch_start + t.batch_size)
        if runner.first:
            x = self.batch[rows, t.token_start : t.token_start + t.tokens]
        else:
            x = links.wait(self.forward_in.pop(t), f"receiving the activation of tile {n}", links.prev_rank)
        targets = self.batch[rows, t.token_start + 1 : t.token_start + t.tokens + 1] if runner.last else None
        start = self.now()
        out = runner.forward_tile(t.batch_slice, t.token_slice, x, targets, grad=self.train)
        if runner.last:
            self.loss = out if self.loss is None else self.loss + out
        else:
            links.send_forward(out, n)
        self.forwards_left -= 1
        if self.forwards_left == 0 and self.train and self.after_forward is not None:
            self.after_forward()
        return start

    def backward(self, t: Tile) -> float:
        runner, links, n = self.runner, self.links, self.index[t]
        if self.backward_in is None:
            # At the first backward (in GPipe order, after the last forward): on NCCL, receives posted earlier
            # would block the activation sends queued before them. In 1F1B order forwards still follow; their
            # sends go to the next stage, these receives come from it, and gloo pairs them by tag.
            self.backward_in = links.post_backward_recvs(self.tiles)
        grad = None
        if not runner.last:
            grad = links.wait(self.backward_in.pop(t), f"receiving the gradient of tile {n}", links.next_rank)
        start = self.now()
        grad_x = runner.backward_tile(t.batch_slice, t.token_slice, grad)
        if not runner.first:
            links.send_backward(grad_x, n, len(self.tiles))
        return start


def collective(fn: Callable[[], object], what: str) -> None:
    """A blocking collective (bounded by the process group's timeout); failures become PeerLost."""
    try:
        fn()
    except Exception as e:
        raise PeerLost(f"lost a peer during {what}: {short_error(e)}") from None


def sum_replica_gradients(w: Worker) -> None:
    """With data parallelism, sum this stage's gradients over its replicas (`allreduce_grads`)."""
    if w.replica_group is not None:
        allreduce_grads(w.runner.module, w.replica_group)


def allreduce_grads(module: torch.nn.Module, group) -> None:
    """Sum gradients over the data-parallel replicas of this stage (the loss is already scaled by the
    global token count, so the sum is the single-device gradient)."""
    params = [p for p in module.parameters()]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    collective(lambda: host_all_reduce(flat, group=group), "the data-parallel gradient all-reduce")
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def gradients(w: Worker) -> dict[str, torch.Tensor]:
    """This stage's whole gradients by parameter name (gathered from its tensor ranks: a collective), on the CPU:
    what ``--verify`` compares (after the update, so unscaled and clipped, at the first step not skipped)."""
    return {n: gather_tensor(n, p.grad.detach(), w.tensor).cpu() for n, p in w.runner.module.named_parameters()}


def apply_update(w: Worker) -> StepOutcome:
    """The update from the step's complete gradients (every tile, every replica): `optim.take_step`.

    The one place between the gradient all-reduce and the update, for what must see the whole step's gradients
    of every stage before the weights change — decisions all stages take together (docs/design.md §6a):

    - fp16: every stage unscales its gradients and checks them; one all-reduce (MAX) of the overflow flag over
      ALL ranks, so every stage of every replica skips the step together and halves the same loss scale.
    - clipping: each stage's sum of squares, summed over this replica's pipeline group (the replicas hold the
      same gradients after their all-reduce), is the whole model's norm; every stage scales by the same factor.
    """

    def sum_over_pipeline(squares: torch.Tensor) -> None:
        collective(lambda: host_all_reduce(squares, group=w.pipeline_group), "the gradient-norm all-reduce")

    def overflow_anywhere(overflow: bool) -> bool:
        flag = torch.tensor([1.0 if overflow else 0.0], device=w.device)
        collective(lambda: host_all_reduce(flag, op=dist.ReduceOp.MAX), "the fp16 overflow all-reduce")
        return bool(flag.item())

    # With tensor parallelism a parameter every tensor rank holds whole (norms, embeddings, head) has the same
    # gradient on all of them: tensor rank 0 alone adds its squares.
    named = list(w.runner.module.named_parameters())
    counted = [p for n, p in named if w.tensor.rank == 0 or split_of(n) is not None]
    return take_step(
        w.optimizer,
        [p for _, p in named],
        max_norm=w.args.grad_clip,
        loss_scale=w.loss_scale,
        sum_across=sum_over_pipeline,
        overflow_anywhere=overflow_anywhere,
        counted=counted,
    )


def end_of_step(w: Worker, loss: torch.Tensor | None) -> tuple[float, dict[str, list[int]]]:
    """One collective per step: sums the loss and everyone's peak memory, and lines the ranks up.

    Returns the step's loss (the single-device mean) and, per rank in bytes, the process's peak memory
    (``memory``) and the most its stage kept for the backward during the step (``saved``, counted by
    `runtime.stage.SavedBytes`: the measured side of the plan's activation estimate).
    """
    stats = torch.zeros(1 + 2 * w.world, dtype=torch.float64, device=w.device)
    stats[0] = _loss_share(w, loss)
    stats[1 + w.rank] = float(peak_memory_bytes(w.device))
    stats[1 + w.world + w.rank] = float(w.runner.saved.take_peak())
    collective(lambda: host_all_reduce(stats), "the end-of-step all-reduce")
    values = [int(m) for m in stats[1:].tolist()]
    return float(stats[0]), {"memory": values[: w.world], "saved": values[w.world :]}


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def log_step(
    w: Worker,
    step: int,
    loss: float,
    lr: float,
    update: StepOutcome,
    iteration_s: list[float],
    memory: dict[str, list[int]],
    val_loss: float | None = None,
) -> None:
    """The step's record in metrics.jsonl and its line on the console (rank 0), with the held-out loss when
    evaluated and the time left: the steps to go at the median of this launch's last ten iterations."""
    tokens, dt = w.tokens_per_step, iteration_s[-1]
    eta = format_duration((w.args.steps - step) * statistics.median(iteration_s[-10:]))
    record = {"step": step, "loss": loss, "lr": lr, "grad_norm": update.grad_norm, "skipped": update.skipped}
    if update.loss_scale is not None:
        record["loss_scale"] = update.loss_scale
    peaks = memory["memory"]
    record.update(iteration_s=dt, tokens_per_s=tokens / dt, memory_bytes=max(peaks), memory_bytes_per_rank=peaks)
    record["saved_bytes_per_rank"] = memory["saved"]
    if val_loss is not None:
        record["val_loss"] = val_loss
    append_metrics(w.run_dir, record)
    norm = "skipped" if update.grad_norm is None else f"{update.grad_norm:7.3f}"
    scale = f"  scale {update.loss_scale:g}" if update.loss_scale is not None else ""
    val = f"  val {val_loss:8.4f}" if val_loss is not None else ""
    print(
        f"step {step:>5}/{w.args.steps}  loss {loss:8.4f}{val}  lr {lr:.2e}  |g| {norm}{scale}  "
        f"iter {dt * 1e3:9.1f} ms  {tokens / dt:10,.0f} tok/s  mem {max(peaks) / 2**20:7.1f} MiB  eta {eta}",
        flush=True,
    )


def save_checkpoint(w: Worker, step: int, events: list[Event]) -> None:
    """Every stage's file in every run folder (`folder_roles`) and every rank's timeline; once the all-reduce
    says all ranks are past that, one rank per folder marks the checkpoint complete there."""
    # The whole stage, gathered from its tensor ranks (every rank takes part in the collective).
    model_state, optimizer_state = full_state(w.runner.module, w.optimizer, w.tensor)
    if w.writes_shard:
        if w.loss_scale is not None:
            optimizer_state[LOSS_SCALE_KEY] = w.loss_scale.state_dict()
        checkpoint.save_stage(w.run_dir, step, w.stage, w.plan.stages, model_state, optimizer_state)
    save_timeline(w, events)
    done = torch.zeros(1, device=w.device)
    collective(lambda: host_all_reduce(done), f"the checkpoint of step {step}")
    if w.marks_stages is not None:
        checkpoint.mark_complete(w.run_dir, step, w.plan.stages, w.marks_stages)


def save_timeline(w: Worker, events: list[Event]) -> None:
    meta = {
        "source": "measured",
        "rank": w.rank,
        "stage": w.stage,
        "replica": w.replica,
        "tensor_rank": w.tensor.rank,
        "stages": w.plan.stages,
        "data_parallel": w.args.data_parallel,
        "tensor_parallel": w.tensor.size,
        "device": _device_name(w.device),
        "slices": w.plan.short_form(),
    }
    write_timeline(timeline_path(w.run_dir, w.rank), events, **meta)


def write_run_summary(w: Worker, resume_step: int | None, iteration_s: list[float], *, wall_s: float) -> None:
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
            "tokens_per_s": w.tokens_per_step / median_s if median_s is not None else None,
            "wall_s": wall_s,
            "slices": w.plan.short_form(),
            "stages": w.plan.stages,
            "data_parallel": w.args.data_parallel,
            "tensor_parallel": w.tensor.size,
            "device": _device_name(w.device),
        },
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s))"


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
    try:
        train(a.run_dir, a.resume_step, NodeRequest(a.device, a.backend, a.timeout_s, a.settings))
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
