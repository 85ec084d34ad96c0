"""One rank's training (docs/design.md §6, §6a): its stage of the model, its optimizer, and the step.

`Trainer.step` reads top to bottom as nanoGPT's loop does: the learning rate of the step (warm-up, cosine decay);
the schedule walked (`StageExecutor`: forward tiles in order, backward in reverse, through the `StageRunner`, under
autocast in bf16/fp16); the gradient all-reduce across the data-parallel replicas of this stage; the update
(`apply_update`: fp16's overflow check on all ranks, clipping by the global norm over this replica's stages, AdamW);
then one small all-reduce over all ranks that both sums the step's loss and serves as the barrier that starts the
next step on every rank together.

A trainer talks to the other ranks only through `Comms` — `torch.distributed` between torchrun processes
(`train.worker`), threads of one process in the tests (`engine.local`) — so the workers' own code is what the
tests run. The worker adds everything around it: start-up, checkpoints, records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from terapipe_cli.config.run import LRSchedule, RunArguments
from terapipe_cli.engine import peak_rss_bytes
from terapipe_cli.engine.comm import Group, Link
from terapipe_cli.engine.data import TokenData, step_batch, validation_batch
from terapipe_cli.engine.executor import StageExecutor
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.optim import LossScale, StepOutcome, make_optimizer, set_lr, take_step
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.engine.tensor import TensorGroup, full_state, gather_tensor, local_state, split_of
from terapipe_cli.plan.file import Plan
from terapipe_cli.plan.schedule import Schedule
from terapipe_cli.plan.timeline import Event


@dataclass(frozen=True)
class Comms:
    """A rank's links to the others: ``world`` (every rank), ``pipeline`` (its replica's K·T ranks, which hold the
    whole model once), ``replicas`` (its stage and tensor rank in every replica; None with one replica),
    ``tensor`` (its stage's T ranks; None without tensor parallelism) and its stage's point-to-point ``link``."""

    world: Group
    pipeline: Group
    replicas: Group | None
    tensor: Group | None
    link: Link


@dataclass(frozen=True)
class StepResult:
    """What one step did, as the rank that logs it needs it."""

    step: int
    loss: float  # the single-device mean over the step's B·D·L predicted tokens
    lr: float
    update: StepOutcome
    events: list[Event]  # this rank's actions, times from the step's start
    memory: list[int]  # per rank: its own peak memory (CUDA max allocated; CPU VmHWM, `peak_rss_bytes`)
    saved: list[int]  # per rank: the most its stage kept for the backward (`stage.SavedBytes`)
    seconds: float


class Trainer:
    """Rank ``rank`` of ``layout`` training ``plan`` by ``schedule`` with the run's resolved ``args``."""

    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        args: RunArguments,
        *,
        layout: Layout,
        rank: int,
        device: torch.device,
        comms: Comms,
        data: TokenData,
        held_out: TokenData | None,
    ) -> None:
        self.plan, self.schedule, self.args, self.layout, self.rank = plan, schedule, args, layout, rank
        self.device, self.comms, self.data, self.held_out = device, comms, data, held_out
        self.stage, self.replica = layout.stage(rank), layout.replica(rank)
        self.tensor = TensorGroup(
            layout.tensor_rank(rank),
            layout.tensor,
            comms.tensor,
            skip_allreduce=not args.tp_allreduce,
            skip_vocab_allreduce=not args.vocab_allreduce,
        )
        # This stage's part of the model — this tensor rank's share of it (`tensor.shard_module`), computing at the
        # run's precision — and its optimizer, over exactly the parameters this rank holds.
        # With interleaved chunks (docs/design.md §11) this stage holds chunks k, k + K, …: one module, one optimizer.
        partition = schedule.partition or plan.partition
        chunks = partition.chunks_on(self.stage)
        self.runner = StageRunner(
            plan.model,
            self.stage,
            plan.stages,
            seed=args.seed,
            device=device,
            kv_handback=args.kv_handback,
            precision=args.precision,
            tensor=self.tensor,
            recompute={c: schedule.recompute[c] for c in chunks},
            partition=partition,
            chunks=chunks,
        )
        self.optimizer = make_optimizer(self.runner.module, args.lr)
        self.executor = StageExecutor(self.runner, schedule, self.stage, comms.link)
        self.lr_schedule = LRSchedule.of_run(args)
        self.loss_scale = LossScale() if args.precision == "fp16" else None

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

    def step(self, step: int, *, after_forward: Callable[[], None] | None = None) -> StepResult:
        """One training step (the module docstring): the same on every rank, in lockstep."""
        batch = self.replica_batch(step)
        step_start = time.perf_counter()
        lr = self.lr_schedule(step)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        self.runner.set_loss_scale(self.loss_multiplier)
        loss, events = self.executor.step(
            batch, step_start=step_start, rank=self.rank, replica=self.replica, step=step, after_forward=after_forward
        )
        self.sum_replica_gradients()
        update = self.apply_update()
        step_loss, memory, saved = self.end_of_step(loss)
        return StepResult(step, step_loss, lr, update, events, memory, saved, time.perf_counter() - step_start)

    def replica_batch(self, step: int) -> torch.Tensor:
        """This replica's B token windows (B, L + 1) of the step's global batch of B·D, on the device."""
        sequences, L = self.plan.batch_size * self.args.data_parallel, self.plan.seq_len
        return self._replica_rows(step_batch(self.data, seed=self.args.seed, step=step, sequences=sequences, seq_len=L))

    def _replica_rows(self, batch: torch.Tensor) -> torch.Tensor:
        B = self.plan.batch_size
        return batch[self.replica * B : (self.replica + 1) * B].to(self.device)

    def _loss_share(self, loss: torch.Tensor | None) -> float:
        """What this rank adds to a step's mean loss: its summed token loss over B·D·L, on the last stage only, and
        there from tensor rank 0 only (a last stage's tensor ranks all compute the same loss)."""
        return float(loss.double()) / self.tokens_per_step if loss is not None and self.tensor.rank == 0 else 0.0

    def sum_replica_gradients(self) -> None:
        """With data parallelism, sum this stage's gradients over its replicas in one flat buffer (the loss is
        already scaled by the global token count, so the sum is the single-device gradient)."""
        if self.comms.replicas is None:
            return
        params = list(self.runner.module.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.comms.replicas.all_reduce(flat, what="the data-parallel gradient all-reduce")
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def apply_update(self) -> StepOutcome:
        """The update from the step's complete gradients (every tile, every replica): `optim.take_step`.

        The one place between the gradient all-reduce and the update, for what must see the whole step's
        gradients of every stage before the weights change — decisions all stages take together (§6a):

        - fp16: every stage unscales its gradients and checks them; one all-reduce (MAX) of the overflow flag over
          ALL ranks, so every stage of every replica skips the step together and halves the same loss scale.
        - clipping: each stage's sum of squares, summed over this replica's pipeline group (the replicas hold the
          same gradients after their all-reduce), is the whole model's norm; every stage scales by the same factor.
        """

        def sum_over_pipeline(squares: torch.Tensor) -> None:
            self.comms.pipeline.all_reduce(squares, what="the gradient-norm all-reduce")

        def overflow_anywhere(overflow: bool) -> bool:
            flag = torch.tensor([1.0 if overflow else 0.0], device=self.device)
            self.comms.world.all_reduce(flag, op="max", what="the fp16 overflow all-reduce")
            return bool(flag.item())

        # With tensor parallelism a parameter every tensor rank holds whole (the norms, the position embedding) has
        # the same gradient on all of them: tensor rank 0 alone adds its squares; each rank adds its own slices'.
        named = list(self.runner.module.named_parameters())
        counted = [p for n, p in named if self.tensor.rank == 0 or split_of(n) is not None]
        return take_step(
            self.optimizer,
            [p for _, p in named],
            max_norm=self.args.grad_clip,
            loss_scale=self.loss_scale,
            sum_across=sum_over_pipeline,
            overflow_anywhere=overflow_anywhere,
            counted=counted,
        )

    def end_of_step(self, loss: torch.Tensor | None) -> tuple[float, list[int], list[int]]:
        """One collective per step: sums the loss and everyone's peak memory, and lines the ranks up. Returns the
        step's loss (the single-device mean) and, per rank, the process's peak memory and the most its stage kept
        for the backward during the step (the measured side of the plan's activation estimate)."""
        world = self.world
        stats = torch.zeros(1 + 2 * world, dtype=torch.float64, device=self.device)
        stats[0] = self._loss_share(loss)
        stats[1 + self.rank] = float(peak_memory_bytes(self.device))
        stats[1 + world + self.rank] = float(self.runner.saved.take_peak())
        self.comms.world.all_reduce(stats, what="the end-of-step all-reduce")
        values = [int(m) for m in stats[1:].tolist()]
        return float(stats[0]), values[:world], values[world:]

    def evaluation_due(self, step: int) -> bool:
        """Validation every ``eval_every`` steps and after the last, when the run holds data out."""
        every = self.args.eval_every
        return self.held_out is not None and every > 0 and (step % every == 0 or step == self.args.steps)

    def evaluate(self) -> float:
        """The held-out loss (mean over B·D·L tokens): the fixed validation batch through the same pipeline and
        tiles, forward only, no graph kept. Every rank takes part; one all-reduce sums the last stages' losses."""
        sequences, L = self.plan.batch_size * self.args.data_parallel, self.plan.seq_len
        held = validation_batch(self.held_out, seed=self.args.seed, sequences=sequences, seq_len=L)
        loss = self.executor.forward_only(self._replica_rows(held))
        total = torch.tensor([self._loss_share(loss)], dtype=torch.float64, device=self.device)
        self.comms.world.all_reduce(total, what="the validation-loss all-reduce")
        return float(total[0])

    def gradients(self) -> dict[str, torch.Tensor]:
        """This stage's whole gradients by parameter name (gathered from its tensor ranks: a collective), on the
        CPU: what ``--verify`` compares (after the update, so unscaled and clipped)."""
        module = self.runner.module
        return {n: gather_tensor(n, p.grad.detach(), self.tensor).cpu() for n, p in module.named_parameters()}

    def full_state(self) -> tuple[dict, dict]:
        """(model state, optimizer state) of the whole stage, gathered from its tensor ranks (a collective); the
        fp16 loss scale rides in the optimizer state (`LOSS_SCALE_KEY`)."""
        model, optimizer = full_state(self.runner.module, self.optimizer, self.tensor)
        if self.loss_scale is not None:
            optimizer[LOSS_SCALE_KEY] = self.loss_scale.state_dict()
        return model, optimizer

    def load_full_state(self, model: dict, optimizer: dict) -> None:
        """Continue from a whole stage's state (`full_state`): this tensor rank keeps its part."""
        optimizer = dict(optimizer)
        loss_scale = optimizer.pop(LOSS_SCALE_KEY, None)
        model, optimizer = local_state(self.runner.module, self.optimizer, model, optimizer, self.tensor)
        self.runner.module.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        if self.loss_scale is not None and loss_scale is not None:
            self.loss_scale.load_state_dict(loss_scale)


# fp16's loss scale travels in the checkpoint next to the optimizer's own state (one value, the same on all stages).
LOSS_SCALE_KEY = "loss_scale"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's own peak: CUDA's max allocated, or on the CPU the peak resident set (`peak_rss_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
