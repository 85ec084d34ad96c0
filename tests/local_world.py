"""Ranks as threads of one process: the in-process `comm.Group` and `comm.Link` (`LocalWorld`), and a whole run
trained that way (`train_in_process`).

The engine's trainer and executor run unchanged on them, so the tests walk a plan's schedule over K stages (and
D replicas, T tensor ranks) in one process, through the workers' own code, in a fraction of a second instead of
the seconds torchrun needs to start processes. Messages are copies of the tensors put in per-(sender, receiver,
tag) queues; a collective waits until every member has brought its tensor, then each takes the reduction, summed
in member order (so the result does not depend on which thread came first). When one thread fails, every wait of
the others raises `comm.PeerLost` at once instead of hanging.

``rules="nccl"`` passes messages as NCCL does (`NcclLink`), which no CPU can otherwise run: tags ignored, the n-th
send from one rank to another meeting the n-th receive posted there, and the sends and receives between two ranks
on one process group run in issue order, each waiting for its partner (a rendezvous). A send meeting a receive
posted for another message fails the run naming both; ranks that all wait with nothing able to move are a
deadlock, reported as such at once (no time-out involved).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from terapipe_cli.config.run import RunArguments
from terapipe_cli.engine.comm import Message, PeerLost, Posted, channel, tied_pairs
from terapipe_cli.engine.data import TokenData
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.trainer import Comms, Trainer
from terapipe_cli.plan.file import Plan
from terapipe_cli.schedule.schedule import Schedule

T = TypeVar("T")
_POLL_S = 0.05


class LocalWorld:
    """``size`` ranks, each a thread of this process (`run`), and what they share: mailboxes and collectives."""

    def __init__(
        self,
        size: int,
        *,
        timeout_s: float = 120.0,
        rules: str = "gloo",
        group_of: Callable[[str], str] = lambda channel_name: channel_name,
    ) -> None:
        """``rules``: "gloo" (messages paired by tag, a send completes at once) or "nccl" (`NcclLink`).
        ``group_of``: under NCCL's rules, the process group each `comm.channel` travels on (as `comm.make_p2p_groups`
        gives them: one each)."""
        if rules not in ("gloo", "nccl"):
            raise ValueError(f"rules must be gloo or nccl, got {rules!r}")
        self.size, self.timeout_s, self.rules, self.group_of = size, timeout_s, rules, group_of
        self._mail: dict[tuple[int, int, int], queue.Queue] = {}
        self._cond = threading.Condition()
        self._rounds: dict[tuple, dict] = {}
        self.failed: BaseException | None = None
        self.alive = size  # ranks whose function has not returned
        self._waiting: dict[int, Callable[[], bool]] = {}  # thread -> what it waits for (deadlock detection)
        self._streams: dict[tuple[str, int, int], list[_Op]] = {}  # (group, rank, peer) -> its unfinished ops

    def group(self, name: str, ranks: Sequence[int], rank: int) -> LocalGroup:
        """Rank ``rank``'s handle on the collectives of the group ``name`` of ``ranks`` (groups of the same ranks
        but another name, as the world and a single replica's pipeline, are separate, as process groups are)."""
        return LocalGroup(self, name, tuple(ranks), rank)

    def link(
        self, rank: int, prev_rank: int | None, next_rank: int | None, ring: tuple[int, int]
    ) -> LocalLink | NcclLink:
        kind = NcclLink if self.rules == "nccl" else LocalLink
        return kind(self, rank, prev_rank, next_rank, ring)

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(rank)`` for every rank, each in its own thread; their results by rank. The first exception of any
        rank is raised here once all threads have ended (the others fail fast with `PeerLost`)."""
        results: list = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            torch.set_grad_enabled(True)
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors.append((rank, e))
                self.abort(e)
            finally:
                with self._cond:
                    self.alive -= 1
                    self._cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            root = next((e for _, e in errors if not isinstance(e, PeerLost)), errors[0][1])
            raise root
        return results

    def abort(self, error: BaseException) -> None:
        with self._cond:
            self.failed = self.failed or error
            self._cond.notify_all()

    def mailbox(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._cond:
            return self._mail.setdefault((src, dst, tag), queue.Queue())

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Block (holding the condition) until ``ready()``; `PeerLost` if another rank failed or time runs out, or
        (NCCL's rules) when every live rank waits and none can move: a deadlock."""
        waited = 0.0
        me = threading.get_ident()
        self._waiting[me] = ready
        try:
            while not ready():
                if self.failed is not None:
                    raise PeerLost(f"lost a peer during {what}: another rank failed")
                if self.rules == "nccl" and self._deadlocked():
                    self.failed = PeerLost(f"deadlock: every rank waits and none can move ({self._heads()})")
                    self._cond.notify_all()
                    raise self.failed
                if waited > self.timeout_s:
                    raise PeerLost(f"timed out after {self.timeout_s:.0f} s during {what}")
                self._cond.wait(_POLL_S)
                waited += _POLL_S
        finally:
            del self._waiting[me]

    def _deadlocked(self) -> bool:
        return len(self._waiting) >= self.alive and not any(r() for r in self._waiting.values())

    # NCCL's point-to-point rules (`NcclLink`), under the condition.

    def issue(self, op: _Op) -> None:
        """Queue ``op`` on its rank's stream to its peer and let every stream move as far as it can."""
        self._streams.setdefault((op.group, op.rank, op.peer), []).append(op)
        try:
            self._progress(op.group, op.rank, op.peer)
        finally:
            self._cond.notify_all()

    def _progress(self, group: str, a: int, b: int) -> None:
        """Pair the heads of the two ranks' streams while one is a send and the other a receive (in issue order;
        tags are not looked at for pairing, only to say what went wrong)."""
        ours, theirs = self._streams.get((group, a, b), []), self._streams.get((group, b, a), [])
        while ours and theirs and ours[0].send != theirs[0].send:
            send, recv = (ours[0], theirs[0]) if ours[0].send else (theirs[0], ours[0])
            if send.tag != recv.tag or tuple(send.tensor.shape[:2]) != recv.shape:
                self.failed = PeerLost(
                    f"NCCL pairs rank {send.rank}'s send of {send.what} (tag {send.tag}, {tuple(send.tensor.shape)}) "
                    f"with rank {recv.rank}'s receive posted for tag {recv.tag} {tuple(recv.shape)}: another message"
                )
                raise self.failed
            recv.tensor, send.done, recv.done = send.tensor, True, True
            ours.pop(0)
            theirs.pop(0)

    def _heads(self) -> str:
        heads = [
            f"rank {r} {'sends' if ops[0].send else 'receives'} tag {ops[0].tag} {'to' if ops[0].send else 'from'} "
            f"rank {p} on {g}"
            for (g, r, p), ops in self._streams.items()
            if ops
        ]
        return "; ".join(heads) or "no message pending"

    def collective(self, key: tuple, rank: int, tensor: torch.Tensor, combine, what: str) -> torch.Tensor:
        """Bring ``tensor`` to round ``key`` of a group and take back ``combine(tensors in member order)``."""
        members = key[1]
        with self._cond:
            state = self._rounds.setdefault(key, {"in": {}, "out": None, "taken": 0})
            state["in"][rank] = tensor.detach().clone()
            if len(state["in"]) == len(members):
                state["out"] = combine([state["in"][r] for r in members])
                self._cond.notify_all()
            self.wait_until(lambda: state["out"] is not None, what)
            state["taken"] += 1
            if state["taken"] == len(members):
                del self._rounds[key]
            return state["out"]


_REDUCE = {
    "sum": lambda ts: torch.stack(ts).sum(dim=0),
    "max": lambda ts: torch.stack(ts).amax(dim=0),
    "min": lambda ts: torch.stack(ts).amin(dim=0),
}


class _Deferred:
    """`LocalGroup.all_reduce_start`'s handle: the collective runs at the wait."""

    def __init__(self, run) -> None:
        self.run = run

    def wait(self) -> None:
        self.run()


class LocalGroup:
    """A `comm.Group` of threads: the members' n-th calls meet in the same round."""

    def __init__(self, world: LocalWorld, name: str, ranks: tuple[int, ...], rank: int) -> None:
        self.world, self.name, self.ranks, self.rank, self.size = world, name, ranks, rank, len(ranks)
        self._calls = 0

    def _round(self) -> tuple:
        self._calls += 1
        return (self.name, self.ranks, self._calls)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str = "an all-reduce") -> None:
        out = self.world.collective(self._round(), self.rank, tensor, _REDUCE[op], what)
        tensor.copy_(out)

    def all_reduce_start(self, tensor: torch.Tensor, what: str = "an all-reduce") -> _Deferred:
        """Deferred to its ``wait`` (members wait in the order they started, so the rounds still meet): the sum is
        the same whenever it runs, and threads that block here could not run their pipeline meanwhile."""
        return _Deferred(lambda: self.all_reduce(tensor, what=what))

    def all_gather(self, tensor: torch.Tensor, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
        if sizes is not None and tensor.shape[dim] != sizes[self.ranks.index(self.rank)]:
            raise ValueError(f"a part of {tensor.shape[dim]} along dim {dim}, {sizes} were announced")
        return self.world.collective(self._round(), self.rank, tensor, lambda ts: torch.cat(ts, dim=dim), "gather")


class LocalLink:
    """A `comm.Link` of threads: sends put copies in the receiver's queue; receives are taken when waited on."""

    def __init__(
        self, world: LocalWorld, rank: int, prev_rank: int | None, next_rank: int | None, ring: tuple[int, int]
    ) -> None:
        self.world, self.rank, self.prev_rank, self.next_rank = world, rank, prev_rank, next_rank
        self.ring_prev, self.ring_next = ring

    def post_recvs(self, messages: list[Message], src: int) -> Posted:
        return {key: self.world.mailbox(src, self.rank, tag) for key, _, tag in messages}

    def wait(self, posted: object, what: str, peer: int | None) -> torch.Tensor:
        box: queue.Queue = posted
        waited = 0.0
        while True:
            try:
                return box.get(timeout=_POLL_S)
            except queue.Empty:
                waited += _POLL_S
                if self.world.failed is not None:
                    raise PeerLost(f"lost rank {peer} while {what}: it failed") from None
                if waited > self.world.timeout_s:
                    raise PeerLost(f"timed out after {self.world.timeout_s:.0f} s while {what}") from None

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str, *, phase: str) -> None:
        self.world.mailbox(self.rank, dst, tag).put(tensor.detach().clone())

    def finish_sends(self) -> None:
        """Sends complete at once here."""


@dataclass(eq=False)
class _Op:
    """A send or a receive on one rank's stream to ``peer`` in process group ``group``, under NCCL's rules."""

    send: bool
    group: str
    rank: int
    peer: int
    tag: int
    what: str
    shape: tuple[int, ...] = ()
    tensor: torch.Tensor | None = None  # a send's copy; a receive's message once paired
    done: bool = False


class NcclLink:
    """A `comm.Link` of threads under NCCL's rules (the module's docstring): every send and receive is queued on
    the stream of (its channel's process group, this rank, the peer) and completes only when paired, in order,
    with the peer's; `wait` and `finish_sends` block until theirs are."""

    def __init__(
        self, world: LocalWorld, rank: int, prev_rank: int | None, next_rank: int | None, ring: tuple[int, int]
    ) -> None:
        self.world, self.rank, self.prev_rank, self.next_rank = world, rank, prev_rank, next_rank
        self.ring_prev, self.ring_next = ring
        self._sends: list[_Op] = []

    def _op(self, send: bool, phase: str, peer: int, tag: int, what: str) -> _Op:
        src, dst = (self.rank, peer) if send else (peer, self.rank)
        return _Op(send, self.world.group_of(channel(phase, src, dst)), self.rank, peer, tag, what)

    def post_recvs(self, messages: list[Message], src: int) -> Posted:
        posted = {}
        with self.world._cond:
            for key, t, tag in messages:
                op = self._op(False, key[0], src, tag, f"the message of tag {tag}")
                op.shape = (t.batch_size, t.tokens)
                self.world.issue(op)
                posted[key] = op
        return posted

    def wait(self, posted: object, what: str, peer: int | None) -> torch.Tensor:
        op: _Op = posted
        with self.world._cond:
            self.world.wait_until(lambda: op.done, what)
        return op.tensor

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str, *, phase: str) -> None:
        op = self._op(True, phase, dst, tag, what)
        op.tensor = tensor.detach().clone()
        with self.world._cond:
            self.world.issue(op)
        self._sends.append(op)

    def finish_sends(self) -> None:
        sends, self._sends = self._sends, []
        with self.world._cond:
            self.world.wait_until(lambda: all(op.done for op in sends), "finishing the step's sends")


def local_comms(world: LocalWorld, layout: Layout, rank: int) -> Comms:
    """This rank's `trainer.Comms` over ``world`` (threads of one process): the groups `comm.make_groups` makes
    between processes."""
    replica, stage, tensor_rank = layout.replica(rank), layout.stage(rank), layout.tensor_rank(rank)
    per_replica = layout.stages * layout.tensor
    model = world.group("pipeline", range(replica * per_replica, (replica + 1) * per_replica), rank)
    replicas = [layout.rank(d, stage, tensor_rank) for d in range(layout.data)]
    tensors = [layout.rank(replica, stage, t) for t in range(layout.tensor)]
    prev_rank, next_rank = layout.neighbours(rank)
    ring = layout.ring(rank)
    pair = next((p for p in tied_pairs(layout) if rank in p), None)
    return Comms(
        world=world.group("world", range(layout.world), rank),
        pipeline=model,
        replicas=world.group("replicas", replicas, rank) if layout.data > 1 else None,
        tensor=world.group("tensor", tensors, rank) if layout.tensor > 1 else None,
        link=world.link(rank, prev_rank, next_rank, ring),
        tied=world.group("tied", pair, rank) if pair is not None else None,
    )


def continued_in_new_trainers(make_trainer: Callable, world_size: int, after: Callable | None = None):
    """What ``--resume`` relies on, in one process: steps 1 and 2 on trainers ``make_trainer(world, rank)`` of one
    world, each rank's whole state (`Trainer.full_state`) loaded into the trainers of a second world, steps 3 and 4
    there. By rank: the losses of steps 1-2, the state saved after them, the losses of steps 3-4, and what
    ``after(trainer)`` returns once they are taken (None without it)."""
    first = LocalWorld(world_size)

    def two_steps(rank):
        t = make_trainer(first, rank)
        return [t.step(s).loss for s in (1, 2)], t.full_state()

    saved = first.run(two_steps)
    second = LocalWorld(world_size)

    def two_more(rank):
        t = make_trainer(second, rank)
        t.load_full_state(*saved[rank][1])
        losses = [t.step(s).loss for s in (3, 4)]
        return losses, after(t) if after is not None else None

    rest = second.run(two_more)
    return [(*saved[rank], *rest[rank]) for rank in range(world_size)]


@dataclass
class LocalRun:
    """What `train_in_process` returns: the loss of every step (and the held-out loss where evaluated, and what each
    rank's stage kept for its backward), each stage's gradients at the first step not skipped, and the whole
    model's weights after the last step (both gathered from the tensor ranks, by parameter name, on the CPU)."""

    losses: list[float] = field(default_factory=list)
    val_losses: list[float | None] = field(default_factory=list)
    saved: list[list[int]] = field(default_factory=list)  # per step, per rank: the most its stage kept for backward
    live: list[list[int] | None] = field(default_factory=list)  # per step, per rank: the most bytes live (tracked)
    grads_step: int | None = None
    grads: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)


def train_in_process(
    plan: Plan,
    schedule: Schedule,
    args: RunArguments,
    *,
    data: TokenData,
    held_out: TokenData | None = None,
    device: str = "cpu",
    timeout_s: float = 120.0,
    rules: str = "gloo",
    group_of: Callable[[str], str] | None = None,
    start: Callable[[Trainer], None] | None = None,
) -> LocalRun:
    """Train ``plan`` for ``args.steps`` steps with every rank of its D × K × T layout a thread of this process:
    the workers' own `Trainer` (and so the executor, the collectives, the update) over `LocalWorld` (``rules`` and
    ``group_of``: how its messages pair, `LocalWorld`). ``start``: called with each rank's trainer before its first
    step, as a worker starts its weights (`train.worker.start_weights`: ``--init-from``'s)."""
    layout = Layout(args.data_parallel, plan.stages, args.tensor_parallel)
    extra = {"group_of": group_of} if group_of is not None else {}
    world = LocalWorld(layout.world, timeout_s=timeout_s, rules=rules, **extra)

    def rank_run(rank: int) -> tuple[Trainer, LocalRun]:
        comms = local_comms(world, layout, rank)
        trainer = Trainer(
            plan, schedule, args, layout=layout, rank=rank, device=torch.device(device), comms=comms, data=data,
            held_out=held_out,
        )  # fmt: skip
        if start is not None:
            start(trainer)
        out = LocalRun()
        for step in range(1, args.steps + 1):
            result = trainer.step(step)
            out.losses.append(result.loss)
            out.saved.append(result.saved)
            out.live.append(result.live)
            out.val_losses.append(trainer.evaluate() if trainer.evaluation_due(step) else None)
            if out.grads_step is None and not result.update.skipped:
                out.grads_step, out.grads = step, trainer.gradients()  # a collective over the tensor ranks
        out.weights = trainer.full_state()[0]  # the same
        return trainer, out

    ranks = world.run(rank_run)
    run = ranks[0][1]
    for trainer, out in ranks:
        if trainer.replica == 0 and trainer.tensor.rank == 0:
            run.grads.update(out.grads)
            run.weights.update({n: w.cpu() for n, w in out.weights.items()})
    return run
