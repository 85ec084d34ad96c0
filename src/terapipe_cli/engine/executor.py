"""The executor: one stage walks its actions of a schedule (`schedule.schedule.Schedule`) for one step — the object
torchtitan's trainer calls as ``pp_schedule.step(...)``. It knows the schedule and a `comm.Link`, nothing else: the
same walk runs between torchrun processes (`engine.p2p.Links`) and between threads (the tests' tests/local_world.py).

A step pre-posts the receives of the activations of every tile this stage runs forward, then runs the actions in
the schedule's order through the `StageRunner` (forward: wait for the activation, run, send it on; backward: wait
for the gradient, back-propagate, send the input's gradient back), all inside one ``StageRunner.step()`` so the
tiles share one low-precision copy of each weight. Each action becomes an `Event` (times from the step's start).

With interleaved chunks (a device runs chunks k, k + K, …) an action names its chunk; a tile's activation goes
from chunk c to chunk c + 1 on the device `Schedule.device` names — the next one around the ring (device K − 1 hands
it back to device 0), or on the V of ZB-V the next one down the V's first arm and the previous one up its second —
and when both chunks are on this device (one device, v chunks; the V's bottom) it is handed over in memory. A split
backward's gradient goes back after its I; its W sends nothing. Every message is tagged by its
chunk and the tile's place in the pipeline order (`message_tag`), the same on every stage whatever order each one
runs its tiles in (a hand-written schedule may differ from stage to stage).

Receives are posted in the order the neighbour sends, read from the neighbour's own actions in the schedule. gloo
pairs a send with a receive by tag, so there the order only has to be some order; NCCL ignores tags and pairs the
n-th send of one rank to another with the n-th receive posted there (pytorch#94819), so a receive posted out of the
sender's order would take another tile's tensor. The tests run the executor under NCCL's rules on the CPU
(tests/local_world.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from terapipe_cli.engine.comm import Link
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.schedule.schedule import Phase, Schedule, Tile
from terapipe_cli.schedule.timeline import Event


def message_tag(phase: str, chunk: int, tile: int, tiles: int, chunks: int) -> int:
    """The tag of the message into chunk ``chunk`` (forward: its input activation; backward: its output's gradient)
    of tile number ``tile``: one number per (phase, chunk, tile), the same on sender and receiver."""
    return (0 if phase == "F" else chunks * tiles) + chunk * tiles + tile


class StageExecutor:
    """Stage ``stage`` of ``schedule``: its actions walked through ``runner`` over ``link``."""

    def __init__(self, runner: StageRunner, schedule: Schedule, stage: int, link: Link) -> None:
        self.runner, self.schedule, self.stage, self.link = runner, schedule, stage, link
        self.actions = schedule[stage]
        self.tiles = list(schedule.tiles)
        # Where each chunk's weight gradients are complete: the position of its last B or W -> the chunk.
        last = {a.stage: n for n, a in enumerate(self.actions) if a.phase in (Phase.B, Phase.W)}
        self.chunk_ends = {n: c for c, n in last.items()}

    def step(
        self,
        batch: torch.Tensor,
        *,
        step_start: float,
        rank: int = 0,
        replica: int = 0,
        step: int = 0,
        after_forward: Callable[[], None] | None = None,
        documents: torch.Tensor | None = None,
        chunk_done: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor | None, list[Event]]:
        """Run one step's actions in their order. ``batch``: (B, L + 1) token windows of this replica;
        ``documents``: packed documents, (B, L) on the CPU, where each input token's document begins
        (`data.step_documents`; None: causal over the whole window).

        Returns the summed token loss (last chunk; unscaled) and one Event per action (times from step_start);
        ``after_forward`` runs once this stage's last forward has been issued (fault injection in tests);
        ``chunk_done(c)`` once chunk c's weight gradients are complete (after its last B or W, in this stage's order:
        the trainer starts that chunk's data-parallel all-reduce there).
        """
        walk = _StepWalk(self, batch, after_forward, documents=documents)
        events: list[Event] = []
        interleaved = self.schedule.virtual > 1
        done_at = self.chunk_ends if chunk_done is not None else {}
        with self.runner.step():  # one low-precision copy of each weight for all the step's tiles
            for n, action in enumerate(self.actions):
                t, c = action.tile, action.stage
                if action.phase is Phase.F:
                    start = walk.forward(c, t)
                elif action.phase is Phase.W:
                    start = walk.weights(c, t)
                else:
                    start = walk.backward(c, t, split=action.phase is Phase.I)
                end = walk.now()
                phase, b, k = action.phase, t.batch_slice, t.token_slice
                chunk = c if interleaved else None
                events.append(
                    Event(self.stage, phase, b, k, start - step_start, end - step_start, rank, replica, step, chunk)
                )
                if n in done_at:
                    chunk_done(done_at[n])
        self.link.finish_sends()
        return walk.loss, events

    def forward_only(self, batch: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's forwards alone, in this stage's order, no graph kept (an evaluation); the summed token loss on
        the last stage."""
        walk = _StepWalk(self, batch, None, train=False, documents=documents)
        with self.runner.step():
            for action in self.actions:
                if action.phase == "F":
                    walk.forward(action.stage, action.tile)
        self.link.finish_sends()
        self.runner.reset()
        return walk.loss


class _StepWalk:
    """One step's tiles on this stage: their messages to and from the neighbours, and the summed loss.

    `forward` and `backward` each run one tile of one chunk and return the moment its compute began (after its
    input arrived); the caller takes the end with `now`, so a tile's time includes issuing its send. With ``train``
    False the walk is an evaluation: forwards only, no graph kept, no gradients expected.
    """

    def __init__(
        self,
        executor: StageExecutor,
        batch: torch.Tensor,
        after_forward: Callable[[], None] | None,
        *,
        train: bool = True,
        documents: torch.Tensor | None = None,
    ) -> None:
        schedule = executor.schedule
        self.runner, self.link, self.batch, self.schedule = executor.runner, executor.link, batch, schedule
        self.documents = documents
        self.stage, self.devices, self.chunks = executor.stage, schedule.stages, schedule.chunks
        self.train = train
        tiles = executor.tiles
        self.index = {t: n for n, t in enumerate(tiles)}
        self.count = len(tiles)
        mine = [c for c in range(self.chunks) if schedule.device(c) == self.stage]
        self.local: dict[tuple[str, int, Tile], torch.Tensor] = {}  # hand-overs between chunks of this device
        # Receives of every activation this stage's chunks take from another device — the one before around the ring
        # when interleaved, either neighbour on the V (`Partition.device`) — from each in the order it sends them.
        self.forward_in: dict = {}
        for device in self._senders("F"):
            incoming = self._messages_from(device, "F")
            self.forward_in.update(self.link.post_recvs(incoming, self.peer(device)) if incoming else {})
        # Backward receives, posted at the first backward (see `backward`), in the order each sender sends them.
        self.outgoing_grads = [(d, self._messages_from(d, "B")) for d in self._senders("B")] if train else []
        self.backward_in: dict | None = None
        self.forwards_left = len(mine) * len(tiles)
        self.after_forward = after_forward
        self.loss: torch.Tensor | None = None
        cuda = batch.device.type == "cuda"
        # Tile times on the GPU: wait for the stream before reading the clock.
        self._sync = torch.cuda.current_stream(batch.device).synchronize if cuda else None

    def _senders(self, phase: str) -> list[int]:
        """The other devices that send this stage messages of ``phase``: those of the chunks before (activations)
        or after (gradients) this stage's chunks."""
        step = -1 if phase == "F" else 1
        mine = [c for c in range(self.chunks) if self.schedule.device(c) == self.stage]
        return sorted({self.schedule.device(c + step) for c in mine if self._remote(c, c + step)})

    def peer(self, device: int) -> int:
        """The rank of a neighbouring device: the next or the previous one around the ring (on the V, only those)."""
        if device == (self.stage + 1) % self.devices:
            return self.link.ring_next
        if device == (self.stage - 1) % self.devices:
            return self.link.ring_prev
        raise ValueError(f"device {device} is not a neighbour of device {self.stage}")

    def _messages_from(self, device: int, phase: str) -> list[tuple[tuple[str, int, Tile], Tile, int]]:
        """The messages of ``phase`` that ``device`` sends to this stage in a step, in the order it sends them (its
        actions' order): an activation into chunk c + 1 after its forward of chunk c, a gradient into chunk c − 1
        after its backward of chunk c. Each is (key, tile, tag)."""
        step = 1 if phase == "F" else -1
        messages = []
        for a in self.schedule[device] if device != self.stage else ():
            to = a.stage + step
            sends = a.phase is Phase.F if phase == "F" else a.phase.sends_gradient  # the gradient goes after I (or B)
            if sends and 0 <= to < self.chunks and self.schedule.device(to) == self.stage:
                messages.append(((phase, to, a.tile), a.tile, self._tag(phase, to, a.tile)))
        return messages

    def _remote(self, chunk: int, other: int) -> bool:
        """Whether chunk ``other`` (a neighbour of ``chunk``) exists and runs on another device."""
        return 0 <= other < self.chunks and self.schedule.device(other) != self.stage

    def _tag(self, phase: str, chunk: int, t: Tile) -> int:
        return message_tag(phase, chunk, self.index[t], self.count, self.chunks)

    def now(self) -> float:
        if self._sync:
            self._sync()
        return time.perf_counter()

    def forward(self, c: int, t: Tile) -> float:
        runner, link, n = self.runner, self.link, self.index[t]
        rows = slice(t.batch_start, t.batch_start + t.batch_size)
        if c == 0:
            x = self.batch[rows, t.token_start : t.token_start + t.tokens]
        elif self._remote(c, c - 1):
            peer = self.peer(self.schedule.device(c - 1))
            x = link.wait(self.forward_in.pop(("F", c, t)), f"receiving the activation of tile {n}", peer)
        else:
            x = self.local.pop(("F", c, t))
        last = c == self.chunks - 1
        targets = self.batch[rows, t.token_start + 1 : t.token_start + t.tokens + 1] if last else None
        docs = None if self.documents is None else self.documents[rows, t.token_start : t.token_start + t.tokens]
        start = self.now()
        out = runner.forward_tile(t.batch_slice, t.token_slice, x, targets, grad=self.train, chunk=c, doc_starts=docs)
        if last:
            self.loss = out if self.loss is None else self.loss + out
        elif self._remote(c, c + 1):
            link.send(out, self.peer(self.schedule.device(c + 1)), self._tag("F", c + 1, t), "an activation", phase="F")
        else:
            self.local[("F", c + 1, t)] = out
        self.forwards_left -= 1
        if self.forwards_left == 0 and self.train and self.after_forward is not None:
            self.after_forward()
        return start

    def weights(self, c: int, t: Tile) -> float:
        """W of a tile (its I ran before): the weights' gradients; nothing is sent."""
        start = self.now()
        self.runner.backward_weight(t.batch_slice, t.token_slice, chunk=c)
        return start

    def backward(self, c: int, t: Tile, *, split: bool = False) -> float:
        """B of a tile, or with ``split`` its I (the weights' gradients wait for its W): the input's gradient is sent
        back either way."""
        runner, link, n = self.runner, self.link, self.index[t]
        if self.backward_in is None:
            # At the first backward (in GPipe order, after the last forward), so the step's gradient buffers are
            # not held through its forwards. On NCCL gradients travel on process groups of their own
            # (`comm.channel`): a receive pending there never holds up an activation sent to the same rank.
            self.backward_in = {}
            for device, messages in self.outgoing_grads:
                self.backward_in.update(link.post_recvs(messages, self.peer(device)) if messages else {})
        if c == self.chunks - 1:
            grad = None
        elif self._remote(c, c + 1):
            what = f"receiving the gradient of tile {n}"
            grad = link.wait(self.backward_in.pop(("B", c, t)), what, self.peer(self.schedule.device(c + 1)))
        else:
            grad = self.local.pop(("B", c, t))
        start = self.now()
        run = runner.backward_input if split else runner.backward_tile
        grad_x = run(t.batch_slice, t.token_slice, grad, chunk=c)
        if c > 0:
            if self._remote(c, c - 1):
                link.send(
                    grad_x, self.peer(self.schedule.device(c - 1)), self._tag("B", c - 1, t), "a gradient", phase="B"
                )
            else:
                self.local[("B", c - 1, t)] = grad_x
        return start
