"""The executor: one stage walks its actions of a schedule (`plan.schedule.Schedule`) for one step — the object
torchtitan's trainer calls as ``pp_schedule.step(...)``. It knows the schedule and a `comm.Link`, nothing else: the
same walk runs between torchrun processes (`engine.p2p.Links`) and between threads (`engine.local`).

A step pre-posts the receives of the activations of every tile this stage runs forward, then runs the actions in
the schedule's order through the `StageRunner` (forward: wait for the activation, run, send it on; backward: wait
for the gradient, back-propagate, send the input's gradient back), all inside one ``StageRunner.step()`` so the
tiles share one low-precision copy of each weight. Each action becomes an `Event` (times from the step's start).

With interleaved chunks (a device runs chunks k, k + K, …) an action names its chunk; a tile's activation goes
from chunk c to chunk c + 1 on the next device around the ring (device K − 1 hands it back to device 0), and when
both chunks are on this device (one device, v chunks) it is handed over in memory. Every message is tagged by its
chunk and the tile's place in the pipeline order (`message_tag`), the same on every stage whatever order each one
runs its tiles in (a hand-written schedule may differ from stage to stage).

Receives are posted in the order the neighbour sends, read from the neighbour's own actions in the schedule. gloo
pairs a send with a receive by tag, so there the order only has to be some order; NCCL ignores tags and pairs the
n-th send of one rank to another with the n-th receive posted there (pytorch#94819), so a receive posted out of the
sender's order would take another tile's tensor. `engine.local` runs the executor under NCCL's rules on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from terapipe_cli.engine.comm import Link
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.plan.schedule import Schedule, Tile
from terapipe_cli.plan.timeline import Event


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

    def step(
        self,
        batch: torch.Tensor,
        *,
        step_start: float,
        rank: int = 0,
        replica: int = 0,
        step: int = 0,
        after_forward: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor | None, list[Event]]:
        """Run one step's actions in their order. ``batch``: (B, L + 1) token windows of this replica.

        Returns the summed token loss (last chunk; unscaled) and one Event per action (times from step_start);
        ``after_forward`` runs once this stage's last forward has been issued (fault injection in tests).
        """
        walk = _StepWalk(self, batch, after_forward)
        events: list[Event] = []
        interleaved = self.schedule.virtual > 1
        with self.runner.step():  # one low-precision copy of each weight for all the step's tiles
            for action in self.actions:
                t, c = action.tile, action.stage
                start = walk.forward(c, t) if action.phase == "F" else walk.backward(c, t)
                end = walk.now()
                phase, b, k = action.phase, t.batch_slice, t.token_slice
                chunk = c if interleaved else None
                events.append(
                    Event(self.stage, phase, b, k, start - step_start, end - step_start, rank, replica, step, chunk)
                )
        self.link.finish_sends()
        return walk.loss, events

    def forward_only(self, batch: torch.Tensor) -> torch.Tensor | None:
        """The step's forwards alone, in this stage's order, no graph kept (an evaluation); the summed token loss on
        the last stage."""
        walk = _StepWalk(self, batch, None, train=False)
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
    ) -> None:
        schedule = executor.schedule
        self.runner, self.link, self.batch, self.schedule = executor.runner, executor.link, batch, schedule
        self.stage, self.devices, self.chunks = executor.stage, schedule.stages, schedule.chunks
        self.train = train
        tiles = executor.tiles
        self.index = {t: n for n, t in enumerate(tiles)}
        self.count = len(tiles)
        mine = [c for c in range(self.chunks) if schedule.device(c) == self.stage]
        self.local: dict[tuple[str, int, Tile], torch.Tensor] = {}  # hand-overs between chunks of this device
        # Receives of every activation this stage's chunks take from the stage before (around the ring), in the
        # order that stage sends them.
        incoming = self._messages_from((self.stage - 1) % self.devices, "F")
        self.forward_in = self.link.post_recvs(incoming, self.link.ring_prev) if incoming else {}
        # Backward receives, posted at the first backward (see `backward`), in the order the next stage sends them.
        self.outgoing_grads = self._messages_from((self.stage + 1) % self.devices, "B") if train else []
        self.backward_in: dict | None = None
        self.forwards_left = len(mine) * len(tiles)
        self.after_forward = after_forward
        self.loss: torch.Tensor | None = None
        cuda = batch.device.type == "cuda"
        # Tile times on the GPU: wait for the stream before reading the clock.
        self._sync = torch.cuda.current_stream(batch.device).synchronize if cuda else None

    def _messages_from(self, device: int, phase: str) -> list[tuple[tuple[str, int, Tile], Tile, int]]:
        """The messages of ``phase`` that ``device`` sends to this stage in a step, in the order it sends them (its
        actions' order): an activation into chunk c + 1 after its forward of chunk c, a gradient into chunk c − 1
        after its backward of chunk c. Each is (key, tile, tag)."""
        step = 1 if phase == "F" else -1
        messages = []
        for a in self.schedule[device] if device != self.stage else ():
            to = a.stage + step
            if a.phase == phase and 0 <= to < self.chunks and self.schedule.device(to) == self.stage:
                messages.append(((phase, to, a.tile), a.tile, self._tag(phase, to, a.tile)))
        return messages

    def _remote(self, chunk: int, other: int) -> bool:
        """Whether chunk ``other`` (a neighbour of ``chunk``) exists and runs on another device."""
        return 0 <= other < self.chunks and other % self.devices != self.stage

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
            x = link.wait(self.forward_in.pop(("F", c, t)), f"receiving the activation of tile {n}", link.ring_prev)
        else:
            x = self.local.pop(("F", c, t))
        last = c == self.chunks - 1
        targets = self.batch[rows, t.token_start + 1 : t.token_start + t.tokens + 1] if last else None
        start = self.now()
        out = runner.forward_tile(t.batch_slice, t.token_slice, x, targets, grad=self.train, chunk=c)
        if last:
            self.loss = out if self.loss is None else self.loss + out
        elif self._remote(c, c + 1):
            link.send(out, link.ring_next, self._tag("F", c + 1, t), "an activation", phase="F")
        else:
            self.local[("F", c + 1, t)] = out
        self.forwards_left -= 1
        if self.forwards_left == 0 and self.train and self.after_forward is not None:
            self.after_forward()
        return start

    def backward(self, c: int, t: Tile) -> float:
        runner, link, n = self.runner, self.link, self.index[t]
        if self.backward_in is None:
            # At the first backward (in GPipe order, after the last forward), so the step's gradient buffers are
            # not held through its forwards. On NCCL gradients travel on process groups of their own
            # (`comm.channel`): a receive pending there never holds up an activation sent to the same rank.
            messages = self.outgoing_grads
            self.backward_in = link.post_recvs(messages, link.ring_next) if messages else {}
        if c == self.chunks - 1:
            grad = None
        elif self._remote(c, c + 1):
            what = f"receiving the gradient of tile {n}"
            grad = link.wait(self.backward_in.pop(("B", c, t)), what, link.ring_next)
        else:
            grad = self.local.pop(("B", c, t))
        start = self.now()
        grad_x = runner.backward_tile(t.batch_slice, t.token_slice, grad, chunk=c)
        if c > 0:
            if self._remote(c, c - 1):
                link.send(grad_x, link.ring_prev, self._tag("B", c - 1, t), "a gradient", phase="B")
            else:
                self.local[("B", c - 1, t)] = grad_x
        return start
