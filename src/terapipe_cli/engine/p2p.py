"""Point-to-point messages between neighbouring stages, pre-posted from the plan's shapes.

Every tile's activation (forward) and gradient (backward) has a shape known from the plan, (b, i, H), so a
stage posts an ``irecv`` for each one up front and starts a tile the moment its input has arrived — no
shape exchange, no polling. Why pre-post: gloo's ``send`` does not complete until the receiver has posted
the matching receive, and a gloo request's ``is_completed()`` stays False until ``wait()`` is called.

Forward receives are posted at the start of a step, backward receives at the stage's first backward, each in the
order the neighbour sends them. On NCCL, which ignores tags and runs the messages between two ranks in order on one
stream per process group, each channel (phase and direction, `comm.channel`) has a group of its own
(`comm.make_p2p_groups`); on gloo one group serves all and the tags pair them.

Every wait has a timeout; a failed or timed-out wait raises `PeerLost`, naming the peer, so the launcher
can tell a consequence (this rank lost its neighbour) from a root cause.

Stages that share a GPU (more workers on a machine than GPUs, `train.placement.backend_for`) talk over gloo, because
NCCL refuses two ranks on one device; gloo cannot send a CUDA tensor, so every message then goes through host
memory: a send copies the tensor to the CPU first, a receive lands in a CPU buffer and is copied to the GPU
after its wait. `comm.host_all_reduce` does the same for the workers' collectives. With a GPU per worker (NCCL) or
on the CPU nothing is copied.
"""

from __future__ import annotations

from collections.abc import Hashable
from datetime import timedelta

import torch
import torch.distributed as dist

from terapipe_cli.engine.comm import Message, PeerLost, channel, host_staged, short_error


class Links:
    """A stage's messages to and from its neighbours in one pipeline replica (a `comm.Link`)."""

    def __init__(
        self,
        *,
        prev_rank: int | None,
        next_rank: int | None,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        timeout_s: float,
        ring: tuple[int, int] | None = None,
        channels: dict[str, object] | None = None,
        staged: bool | None = None,
    ) -> None:
        """``channels``: a process group per `comm.channel` (NCCL, `comm.make_p2p_groups`; None: the default group).
        ``staged``: whether messages go through host memory (None: when CUDA tensors travel on gloo; True on the
        CPU runs that path's copies there, for tests)."""
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.prev_rank, self.next_rank = prev_rank, next_rank
        # The neighbours around the ring (interleaved chunks wrap from the last stage to the first).
        self.ring_prev, self.ring_next = ring if ring is not None else (prev_rank, next_rank)
        self.hidden, self.dtype, self.device = hidden, dtype, device
        self.timeout = timedelta(seconds=timeout_s)
        self._sends: list[tuple[dist.Work, torch.Tensor, str]] = []
        self.channels = channels
        self.staged = host_staged(device) if staged is None else staged  # through host memory (stages sharing a GPU)
        self._buffers = torch.device("cpu") if self.staged else device

    def _group(self, phase: str, src: int, dst: int) -> object | None:
        return self.channels[channel(phase, src, dst)] if self.channels is not None else None

    def post_recvs(self, messages: list[Message], src: int) -> dict[Hashable, tuple[torch.Tensor, dist.Work]]:
        """A receive from rank ``src`` for every message (key, tile, tag), into a buffer of the tile's shape."""
        posted = {}
        for key, t, tag in messages:
            buf = torch.empty(t.batch_size, t.tokens, self.hidden, dtype=self.dtype, device=self._buffers)
            posted[key] = (buf, dist.irecv(buf, src=src, tag=tag, group=self._group(key[0], src, self.rank)))
        return posted

    def wait(self, posted: tuple[torch.Tensor, dist.Work], what: str, peer: int) -> torch.Tensor:
        buf, work = posted
        self._wait(work, what, peer)
        return buf.to(self.device, copy=True) if self.staged else buf

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str, *, phase: str) -> None:
        """Send ``tensor`` (a message of ``phase``) to rank ``dst`` (asynchronously: `finish_sends` waits for it)."""
        if self.staged:
            # A copy of its own in host memory (on the CPU too, where `staged` is forced: the same copies run).
            tensor = tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        else:
            tensor = tensor.contiguous()
        group = self._group(phase, self.rank, dst)
        # Keep the tensor alive until the send completes.
        self._sends.append((dist.isend(tensor, dst=dst, tag=tag, group=group), tensor, f"sending {what} to rank {dst}"))

    def finish_sends(self) -> None:
        """Wait for every send of the step (the receivers have posted them all, so this is quick)."""
        sends, self._sends = self._sends, []
        for work, _, what in sends:
            self._wait(work, what, None)

    def _wait(self, work: dist.Work, what: str, peer: int | None) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as e:  # gloo raises on a closed connection or a timeout
            who = f" rank {peer}" if peer is not None else ""
            raise PeerLost(f"lost{who or ' a peer'} while {what}: {short_error(e)}") from None
        if ok is False:
            raise PeerLost(f"timed out after {self.timeout.total_seconds():.0f} s while {what}")
