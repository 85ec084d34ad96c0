"""One rank's training (docs/design.md §6, §6a): its stage of the model, its optimizer, and the step.

`Trainer.step` reads top to bottom as nanoGPT's loop does: the learning rate of the step (warm-up, cosine decay);
the schedule walked (`StageExecutor`: forward tiles in order, backward in reverse, through the `StageRunner`, under
autocast in bf16/fp16); the gradient all-reduce across the data-parallel replicas of this stage; the update
(`apply_update`: fp16's overflow check on all ranks, clipping by the global norm over this replica's stages, AdamW);
then one small all-reduce over all ranks that both sums the step's loss and serves as the barrier that starts the
next step on every rank together.

A trainer talks to the other ranks only through `Comms` — `torch.distributed` between torchrun processes
(`train.worker`), threads of one process in the tests (tests/local_world.py) — so the workers' own code is what the
tests run. The worker adds everything around it: start-up, checkpoints, records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from terapipe_cli.config.run import LRSchedule, RunArguments
from terapipe_cli.engine import peak_rss_bytes
from terapipe_cli.engine.comm import Group, Link
from terapipe_cli.engine.data import (
    TokenData,
    epochs_done,
    step_batch,
    step_documents,
    validation_batch,
    validation_documents,
)
from terapipe_cli.engine.executor import StageExecutor
from terapipe_cli.engine.live import LiveBytes
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.optim import LossScale, StepOutcome, make_optimizer, set_lr, take_step
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.engine.tensor import (
    TensorGroup,
    gather_tensor,
    local_state,
    parameter_names,
    shard_tensor,
    split_of,
)
from terapipe_cli.plan.file import Plan
from terapipe_cli.schedule.schedule import Schedule
from terapipe_cli.schedule.timeline import Event


@dataclass(frozen=True)
class Comms:
    """A rank's links to the others: ``world`` (every rank), ``pipeline`` (its replica's K·T ranks, which hold the
    whole model once), ``replicas`` (its stage and tensor rank in every replica; None with one replica),
    ``tensor`` (its stage's T ranks; None without tensor parallelism), its stage's point-to-point ``link`` and, for
    tied embeddings whose ends are on different stages, ``tied``: its replica's and tensor rank's first and last
    stage (Megatron-LM's embedding group; None elsewhere)."""

    world: Group
    pipeline: Group
    replicas: Group | None
    tensor: Group | None
    link: Link
    tied: Group | None = None


def _unflatten(params: list, flat: torch.Tensor) -> None:
    """Each parameter's gradient from its place in ``flat`` (the order ``params`` were flattened in)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


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
    live: list[int] | None = None  # per rank: the most bytes live during the step (`Trainer.step`); None: not tracked


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
        self._started: list = []  # the data-parallel sums started during a step (`start_chunk_sum`)
        # With --track-memory the first step on a CPU runs under a tracker of the bytes live (`step`); on a GPU
        # CUDA's max allocated says it.
        self._track_live = args.track_memory and device.type == "cpu"
        self.stage, self.replica = layout.stage(rank), layout.replica(rank)
        self.tensor = TensorGroup(
            layout.tensor_rank(rank),
            layout.tensor,
            comms.tensor,
            skip_allreduce=not args.switches.tp_allreduce,
            skip_vocab_allreduce=not args.switches.vocab_allreduce,
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
            controls=args.switches,
            precision=args.precision,
            tensor=self.tensor,
            recompute={c: schedule.recompute[c] for c in chunks},
            partition=partition,
            chunks=chunks,
            loss_chunk_tokens=args.loss_chunk_tokens if args.loss_chunk_tokens is not None else plan.loss_chunk_tokens,
        )
        self.optimizer = make_optimizer(self.runner.module, args.lr, args.optimizer)
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

    def step(
        self,
        step: int,
        *,
        after_forward: Callable[[], None] | None = None,
        before_update: Callable[[], None] | None = None,
    ) -> StepResult:
        """One training step (the module docstring): the same on every rank, in lockstep. ``before_update`` is
        called before the update changes the weights and the optimizer state (a checkpoint's copy of them being made
        meanwhile: train/saving.py).

        With ``track_memory``, the first step a process runs on a CPU walks its schedule under `LiveBytes` (the
        tracker the memory estimate is traced with, here on real tensors): the most bytes live at once — what the
        stage keeps for the backward, the transients on top, the K/V caches, the messages — with the gradients made
        beforehand as zeros, so that they count as state, as in the estimate (adding into zeros gives the same
        gradients). Every op of that step goes through the tracker, which slows it: one step only."""
        batch = self.replica_batch(step)
        step_start = time.perf_counter()
        lr = self.lr_schedule(step)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        self.runner.set_loss_scale(self.loss_multiplier)
        tracked, self._track_live = self._track_live, False
        if tracked:
            for p in self.runner.module.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        with LiveBytes() if tracked else nullcontext() as live:
            loss, events = self.executor.step(
                batch,
                step_start=step_start,
                rank=self.rank,
                replica=self.replica,
                step=step,
                after_forward=after_forward,
                documents=self.replica_documents(step),
                chunk_done=self.start_chunk_sum if self.comms.replicas is not None else None,
            )
        self.sum_replica_gradients()
        self.sum_tied_gradients()
        if before_update is not None:
            before_update()
        update = self.apply_update()
        step_loss, memory, saved, live_peaks = self.end_of_step(loss, live.peak if tracked else 0)
        seconds = time.perf_counter() - step_start
        return StepResult(step, step_loss, lr, update, events, memory, saved, seconds, live_peaks if tracked else None)

    def replica_batch(self, step: int) -> torch.Tensor:
        """This replica's B token windows (B, L + 1) of the step's global batch of B·D, on the device."""
        sequences, L = self.plan.batch_size * self.args.data_parallel, self.plan.seq_len
        batch = step_batch(
            self.data, seed=self.args.seed, step=step, sequences=sequences, seq_len=L, sampling=self.args.sampling
        )
        return self._replica_rows(batch)

    def consumed(self, step: int) -> tuple[int, float]:
        """(tokens trained on, epochs of the training data drawn) after step ``step``, all replicas."""
        sequences = self.plan.batch_size * self.args.data_parallel
        epochs = epochs_done(self.data, step=step, sequences=sequences, seq_len=self.plan.seq_len)
        return step * self.tokens_per_step, epochs

    def replica_documents(self, step: int, *, held_out: bool = False) -> torch.Tensor | None:
        """With a document mask: where each input token's document begins, (B, L) on the CPU, for this replica's
        windows of step ``step`` (or of the validation batch); None without one."""
        if not self.args.document_mask:
            return None
        sequences, L, B = self.plan.batch_size * self.args.data_parallel, self.plan.seq_len, self.plan.batch_size
        if held_out:
            docs = validation_documents(
                self.held_out, seed=self.args.seed, sequences=sequences, seq_len=L, eos=self.args.eos_id
            )
        else:
            docs = step_documents(
                self.data,
                seed=self.args.seed,
                step=step,
                sequences=sequences,
                seq_len=L,
                eos=self.args.eos_id,
                sampling=self.args.sampling,
            )
        return docs[self.replica * B : (self.replica + 1) * B]

    def _replica_rows(self, batch: torch.Tensor) -> torch.Tensor:
        B = self.plan.batch_size
        return batch[self.replica * B : (self.replica + 1) * B].to(self.device)

    def _loss_share(self, loss: torch.Tensor | None) -> float:
        """What this rank adds to a step's mean loss: its summed token loss over B·D·L, on the last stage only, and
        there from tensor rank 0 only (a last stage's tensor ranks all compute the same loss)."""
        return float(loss.double()) / self.tokens_per_step if loss is not None and self.tensor.rank == 0 else 0.0

    def sum_tied_gradients(self) -> None:
        """Tied embeddings on two stages: the first stage's copy (the embedding) and the last's (the head) each
        hold half of the tied matrix's gradient; both take the sum, so both copies take the same update and stay
        bit-identical (the single-device gradient of the one matrix is that sum)."""
        name = self.runner.module.tied_copy
        if name is None:
            return
        if self.comms.tied is None:
            raise RuntimeError("tied embeddings on two stages need the embedding group (Comms.tied)")
        p = dict(self.runner.module.named_parameters())[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        self.comms.tied.all_reduce(p.grad, what="the tied embeddings' gradient all-reduce")

    def start_chunk_sum(self, chunk: int) -> None:
        """Chunk ``chunk``'s layers have their whole step's gradients (its last B or W has run): start their sum over
        the replicas now, in one flat buffer, while the stage runs its other actions (zero-bubble's W's at the end
        of the step, the other chunks of an interleaved device); `sum_replica_gradients` waits for it."""
        module = self.runner.module
        prefixes = tuple(f"blocks.{n}." for n in module.chunk_layers[chunk])
        params = [p for name, p in module.named_parameters() if name.startswith(prefixes)]
        if params:
            self._started.append(self._replica_sum(params, start=True))

    def sum_replica_gradients(self) -> None:
        """With data parallelism, sum this stage's gradients over its replicas: the chunks' layers' sums started
        as each chunk finished (`start_chunk_sum`) are waited for, and the rest (the embedding, the head, the final
        norm) summed now, each in one flat buffer (the loss is already scaled by the global token count, so the sum
        is the single-device gradient)."""
        if self.comms.replicas is None:
            return
        started, self._started = self._started, []
        for params, flat, pending in started:
            pending.wait()
            _unflatten(params, flat)
        seen = {id(p) for params, _, _ in started for p in params}
        rest = [p for p in self.runner.module.parameters() if id(p) not in seen]
        if rest:
            params, flat, _ = self._replica_sum(rest, start=False)
            _unflatten(params, flat)

    def _replica_sum(self, params: list, *, start: bool) -> tuple[list, torch.Tensor, object]:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        what = "the data-parallel gradient all-reduce"
        if start:
            return params, flat, self.comms.replicas.all_reduce_start(flat, what=what)
        self.comms.replicas.all_reduce(flat, what=what)
        return params, flat, None

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
        # The tied matrix's copy on the last stage is the first stage's, counted there once.
        named = list(self.runner.module.named_parameters())
        skip = "lm_head.weight" if self.runner.module.tied_copy == "lm_head.weight" else None
        counted = [p for n, p in named if (self.tensor.rank == 0 or split_of(n) is not None) and n != skip]
        return take_step(
            self.optimizer,
            [p for _, p in named],
            max_norm=self.args.grad_clip,
            loss_scale=self.loss_scale,
            sum_across=sum_over_pipeline,
            overflow_anywhere=overflow_anywhere,
            counted=counted,
        )

    def end_of_step(self, loss: torch.Tensor | None, live: int = 0) -> tuple[float, list[int], list[int], list[int]]:
        """One collective per step: sums the loss and everyone's peak memory, and lines the ranks up. Returns the
        step's loss (the single-device mean) and, per rank, the process's peak memory, the most its stage kept
        for the backward during the step (the measured side of the plan's activation estimate) and ``live``, the
        most bytes live during the step when it was tracked (0 when not)."""
        world = self.world
        stats = torch.zeros(1 + 3 * world, dtype=torch.float64, device=self.device)
        stats[0] = self._loss_share(loss)
        stats[1 + self.rank] = float(peak_memory_bytes(self.device))
        stats[1 + world + self.rank] = float(self.runner.saved.take_peak())
        stats[1 + 2 * world + self.rank] = float(live)
        self.comms.world.all_reduce(stats, what="the end-of-step all-reduce")
        values = [int(m) for m in stats[1:].tolist()]
        return float(stats[0]), values[:world], values[world : 2 * world], values[2 * world :]

    def evaluation_due(self, step: int) -> bool:
        """Validation every ``eval_every`` steps and after the last, when the run holds data out."""
        every = self.args.eval_every
        return self.held_out is not None and every > 0 and (step % every == 0 or step == self.args.steps)

    def evaluate(self) -> float:
        """The held-out loss (mean over B·D·L tokens): the fixed validation batch through the same pipeline and
        tiles, forward only, no graph kept. Every rank takes part; one all-reduce sums the last stages' losses."""
        sequences, L = self.plan.batch_size * self.args.data_parallel, self.plan.seq_len
        held = validation_batch(self.held_out, seed=self.args.seed, sequences=sequences, seq_len=L)
        loss = self.executor.forward_only(self._replica_rows(held), self.replica_documents(0, held_out=True))
        total = torch.tensor([self._loss_share(loss)], dtype=torch.float64, device=self.device)
        self.comms.world.all_reduce(total, what="the validation-loss all-reduce")
        return float(total[0])

    def gradients(self) -> dict[str, torch.Tensor]:
        """This stage's whole gradients by parameter name (gathered from its tensor ranks: a collective), on the
        CPU: what ``--verify`` compares (after the update, so unscaled and clipped)."""
        module = self.runner.module
        named = module.named_parameters(remove_duplicate=False)  # a tied matrix under both its names, as the reference
        return {n: gather_tensor(n, p.grad.detach(), self.tensor).cpu() for n, p in named}

    def full_state(self) -> tuple[dict, dict]:
        """(model state, optimizer state) of the whole stage under the whole model's names, gathered from its tensor
        ranks (a collective): what any plan of the same model can continue from (docs/design.md §6e).

        The optimizer state is ``{"by_name": {parameter name: AdamW's state of it (step, exp_avg, exp_avg_sq)}}``,
        not torch's per-index state (an index means a place in this stage's optimizer only); the fp16 loss scale
        rides along (`LOSS_SCALE_KEY`)."""
        module = self.runner.module
        by_id = {id(p): n for n, p in module.named_parameters()}
        model = {name: gather_tensor(name, t, self.tensor) for name, t in module.state_dict().items()}
        by_name = {
            by_id[id(p)]: {
                key: gather_tensor(by_id[id(p)], v, self.tensor) if torch.is_tensor(v) and v.dim() > 0 else v
                for key, v in self.optimizer.state[p].items()
            }
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p in self.optimizer.state
        }
        optimizer: dict = {BY_NAME_KEY: by_name}
        if self.loss_scale is not None:
            optimizer[LOSS_SCALE_KEY] = self.loss_scale.state_dict()
        return model, optimizer

    def load_full_state(self, model: dict, optimizer: dict) -> None:
        """Continue from whole-model state under whole-model names (`full_state`; it may hold other stages' tensors
        too, which are left): this rank takes its own parameters and its tensor rank's share of each. A state from
        before the names (torch's per-index optimizer state) is this very stage's, as it was saved."""
        optimizer = dict(optimizer)
        loss_scale = optimizer.pop(LOSS_SCALE_KEY, None)
        module = self.runner.module
        if BY_NAME_KEY not in optimizer:  # terapipe.checkpoint/1: the stage's own state, optimizer by index
            model, optimizer = local_state(module, self.optimizer, model, optimizer, self.tensor)
            module.load_state_dict(model)
            self.optimizer.load_state_dict(optimizer)
        else:
            own = module.state_dict()
            missing = [name for name in own if name not in model]
            if missing:
                raise KeyError(f"the checkpoint holds no tensor {missing[0]!r} (of {len(missing)} this stage needs)")
            module.load_state_dict({name: shard_tensor(name, model[name], self.tensor) for name in own})
            state = self.optimizer.state_dict()
            names = parameter_names(module, self.optimizer)
            by_name = optimizer[BY_NAME_KEY]
            state["state"] = {
                index: {
                    key: shard_tensor(name, v, self.tensor) if torch.is_tensor(v) and v.dim() > 0 else v
                    for key, v in by_name[name].items()
                }
                for index, name in enumerate(names)
                if name in by_name
            }
            self.optimizer.load_state_dict(state)
        if self.loss_scale is not None and loss_scale is not None:
            self.loss_scale.load_state_dict(loss_scale)

    def state_names(self) -> list[str]:
        """The whole-model names of the tensors this rank's stage holds (what `load_full_state` takes)."""
        return list(self.runner.module.state_dict())


# fp16's loss scale travels in the checkpoint next to the optimizer's own state (one value, the same on all stages).
LOSS_SCALE_KEY = "loss_scale"
BY_NAME_KEY = "by_name"  # the optimizer state keyed by the whole model's parameter names


def peak_memory_bytes(device: torch.device) -> int:
    """This process's own peak: CUDA's max allocated, or on the CPU the peak resident set (`peak_rss_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
