"""The executor: one stage walks its actions of a schedule (`plan.schedule.Schedule`) for one step — the object
torchtitan's trainer calls as ``pp_schedule.step(...)``. It knows the schedule and a `comm.Link`, nothing else: the
same walk runs between torchrun processes (`engine.p2p.Links`) and between threads (`engine.local`).

A step pre-posts the receives of the activations of every tile this stage runs forward, then runs the actions in
the schedule's order through the `StageRunner` (forward: wait for the activation, run, send it on; backward: wait
for the gradient, back-propagate, send the input's gradient back), all inside one ``StageRunner.step()`` so the
tiles share one low-precision copy of each weight. Each action becomes an `Event` (times from the step's start).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from terapipe_cli.engine.comm import Link
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.plan.schedule import Schedule, Tile
from terapipe_cli.plan.timeline import Event


class StageExecutor:
    """Stage ``stage`` of ``schedule``: its actions walked through ``runner`` over ``link``."""

    def __init__(self, runner: StageRunner, schedule: Schedule, stage: int, link: Link) -> None:
        self.runner, self.schedule, self.stage, self.link = runner, schedule, stage, link
        self.actions = schedule[stage]
        # Messages are tagged by a tile's place in the pipeline order, the same on every stage whatever order each
        # one runs its tiles in (a hand-written schedule may differ from stage to stage).
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

        Returns the summed token loss (last stage; unscaled) and one Event per action (times from step_start);
        ``after_forward`` runs once this stage's last forward has been issued (fault injection in tests).
        """
        walk = _StepWalk(self.runner, self.link, batch, self.tiles, after_forward)
        events: list[Event] = []
        with self.runner.step():  # one low-precision copy of each weight for all the step's tiles
            for action in self.actions:
                t = action.tile
                start = walk.forward(t) if action.phase == "F" else walk.backward(t)
                end = walk.now()
                phase, b, k = action.phase, t.batch_slice, t.token_slice
                events.append(Event(self.stage, phase, b, k, start - step_start, end - step_start, rank, replica, step))
        self.link.finish_sends()
        return walk.loss, events

    def forward_only(self, batch: torch.Tensor) -> torch.Tensor | None:
        """The step's forwards alone, in pipeline order, no graph kept (an evaluation); the summed token loss on the
        last stage."""
        walk = _StepWalk(self.runner, self.link, batch, self.tiles, None, train=False)
        with self.runner.step():
            for t in self.tiles:
                walk.forward(t)
        self.link.finish_sends()
        self.runner.reset()
        return walk.loss


class _StepWalk:
    """One step's tiles on this stage: their messages to and from the neighbours, and the summed loss.

    `forward` and `backward` each run one tile and return the moment its compute began (after its input
    arrived); the caller takes the end with `now`, so a tile's time includes issuing its send. With ``train``
    False the walk is an evaluation: forwards only, no graph kept, no gradients expected.
    """

    def __init__(
        self,
        runner: StageRunner,
        link: Link,
        batch: torch.Tensor,
        tiles: list[Tile],
        after_forward: Callable[[], None] | None,
        *,
        train: bool = True,
    ) -> None:
        self.runner, self.link, self.batch, self.tiles = runner, link, batch, tiles
        self.train = train
        self.index = {t: n for n, t in enumerate(tiles)}
        self.forward_in = link.post_forward_recvs(tiles)
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
        runner, link, n = self.runner, self.link, self.index[t]
        rows = slice(t.batch_start, t.batch_start + t.batch_size)
        if runner.first:
            x = self.batch[rows, t.token_start : t.token_start + t.tokens]
        else:
            x = link.wait(self.forward_in.pop(t), f"receiving the activation of tile {n}", link.prev_rank)
        targets = self.batch[rows, t.token_start + 1 : t.token_start + t.tokens + 1] if runner.last else None
        start = self.now()
        out = runner.forward_tile(t.batch_slice, t.token_slice, x, targets, grad=self.train)
        if runner.last:
            self.loss = out if self.loss is None else self.loss + out
        else:
            link.send_forward(out, n)
        self.forwards_left -= 1
        if self.forwards_left == 0 and self.train and self.after_forward is not None:
            self.after_forward()
        return start

    def backward(self, t: Tile) -> float:
        runner, link, n = self.runner, self.link, self.index[t]
        if self.backward_in is None:
            # At the first backward (in GPipe order, after the last forward): on NCCL, receives posted earlier
            # would block the activation sends queued before them. In 1F1B order forwards still follow; their
            # sends go to the next stage, these receives come from it, and gloo pairs them by tag.
            self.backward_in = link.post_backward_recvs(self.tiles)
        grad = None
        if not runner.last:
            grad = link.wait(self.backward_in.pop(t), f"receiving the gradient of tile {n}", link.next_rank)
        start = self.now()
        grad_x = runner.backward_tile(t.batch_slice, t.token_slice, grad)
        if not runner.first:
            link.send_backward(grad_x, n, len(self.tiles))
        return start
