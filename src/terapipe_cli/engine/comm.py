"""What a rank says to the others, behind two small interfaces, so the engine runs the same code between
torchrun processes and between threads of one process (the tests' tests/local_world.py):

* `Group` — the collectives of a set of ranks: ``all_reduce`` (in place: sum, max or min), ``all_reduce_start``
  (a sum started now and waited for later: a chunk's data-parallel gradient sum overlaps the rest of the step) and
  ``all_gather``.
  `DistGroup` is a ``torch.distributed`` process group (None: all ranks).
* `Link` — one stage's point-to-point messages to its neighbours, pre-posted from the plan's shapes
  (`engine.p2p.Links` between processes).

A collective or message that fails or times out raises `PeerLost`, naming what was being waited for, so the
launcher can tell a consequence (this rank lost its neighbour) from a root cause.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.schedule.schedule import Tile

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class PeerLost(RuntimeError):
    """A distributed wait failed or timed out: most likely another rank died first."""


def short_error(e: BaseException) -> str:
    """gloo's messages start with a source path in brackets and end with advice; keep the middle."""
    text = " ".join(str(e).split())
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ")[0][:300]


class Group(Protocol):
    """The collectives of a set of ranks; every member calls each one, in the same order."""

    size: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str = "an all-reduce") -> None:
        """``tensor`` becomes the reduction (``op``: sum, max or min) over the members, in place."""

    def all_reduce_start(self, tensor: torch.Tensor, what: str = "an all-reduce") -> Pending:
        """Start summing ``tensor`` over the members in place and return at once; ``wait()`` on the result before
        reading it. Every member starts the same sums in the same order."""

    def all_gather(self, tensor: torch.Tensor, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Every member's ``tensor`` concatenated along ``dim``, in member order. ``sizes``: each member's length
        along ``dim`` when they differ (the other dimensions alike; None: every member's is ``tensor``'s)."""


class Pending(Protocol):
    """A started collective (`Group.all_reduce_start`): ``wait`` returns once its tensor holds the result."""

    def wait(self) -> None: ...


class Done:
    """A collective that finished when it was started."""

    def wait(self) -> None:
        return None


class _DistPending:
    """``torch.distributed``'s work of an asynchronous all-reduce; a lost peer becomes `PeerLost` at the wait."""

    def __init__(self, work, what: str) -> None:
        self.work, self.what = work, what

    def wait(self) -> None:
        try:
            self.work.wait()
        except Exception as e:
            raise PeerLost(f"lost a peer during {self.what}: {short_error(e)}") from None


# Posted receives of a step: per message key, whatever the link's ``wait`` takes.
Posted = dict[Hashable, object]
# A message to receive: its key, the tile whose (b, i, H) shape it has, its tag.
Message = tuple[Hashable, Tile, int]


class Link(Protocol):
    """One stage's messages to and from its neighbours in one pipeline replica: ``prev_rank`` and ``next_rank``
    (None past either end) and, for interleaved chunks, ``ring_prev`` and ``ring_next`` (wrapping around)."""

    prev_rank: int | None
    next_rank: int | None
    ring_prev: int | None
    ring_next: int | None

    def post_recvs(self, messages: list[Message], src: int) -> Posted: ...

    def wait(self, posted: object, what: str, peer: int | None) -> torch.Tensor: ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str, *, phase: str) -> None: ...

    def finish_sends(self) -> None: ...


# NCCL's point-to-point rules (pytorch#94819, NVIDIA/nccl#479): tags are ignored — the n-th send from one rank to
# another meets the n-th receive posted there — and the sends and receives between two ranks run in the order they
# were issued on one stream per process group, each waiting for its partner. A receive pending there (a gradient
# the next stage sends later) would hold up an activation sent to that stage after it was posted; a deadlock in 1F1B
# order. So on NCCL every (phase, direction) of message has a process group of its own: on each, only one rank of a
# pair sends, and it sends in the order the other posted its receives (`executor._StepWalk._messages_from`).
CHANNELS = ("F+", "F-", "B+", "B-")


def channel(phase: str, src: int, dst: int) -> str:
    """The channel a message travels on: its phase ("F": an activation, "B": a gradient) and direction ("+" to a
    higher rank, "-" to a lower one)."""
    return phase + ("+" if dst > src else "-")


def make_p2p_groups(backend: str) -> dict[str, object] | None:
    """The process group of each channel on NCCL (None on gloo, which pairs messages by tag on one group); every
    rank must call it, in the same order."""
    if backend != "nccl":
        return None
    return {name: dist.new_group(backend="nccl") for name in CHANNELS}


class DistGroup:
    """A ``torch.distributed`` process group (``group`` None: every rank). CUDA tensors on a gloo group (stages
    sharing a GPU) go through host memory (`host_all_reduce`)."""

    def __init__(self, group: object | None = None, size: int | None = None, *, staged: bool | None = None) -> None:
        """``staged``: whether tensors go through host memory (None: CUDA tensors on gloo; True on the CPU runs
        that path's copies there, for tests)."""
        self.group = group
        self.size = size if size is not None else dist.get_world_size(group)
        self.staged = staged

    def _staged(self, tensor: torch.Tensor) -> bool:
        return host_staged(tensor.device, self.group) if self.staged is None else self.staged

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str = "an all-reduce") -> None:
        try:
            host_all_reduce(tensor, group=self.group, op=OPS[op], staged=self._staged(tensor))
        except Exception as e:
            raise PeerLost(f"lost a peer during {what}: {short_error(e)}") from None

    def all_reduce_start(self, tensor: torch.Tensor, what: str = "an all-reduce") -> Pending:
        if self._staged(tensor):  # through host memory: copies on this thread, so it runs now
            self.all_reduce(tensor, what=what)
            return Done()
        try:
            return _DistPending(dist.all_reduce(tensor, op=OPS["sum"], group=self.group, async_op=True), what)
        except Exception as e:
            raise PeerLost(f"lost a peer during {what}: {short_error(e)}") from None

    def all_gather(self, tensor: torch.Tensor, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
        on = tensor.to("cpu", copy=True) if self._staged(tensor) else tensor
        if sizes is not None and len(set(sizes)) > 1:
            # ``dist.all_gather`` takes equal shapes: pad every part to the longest, gather, cut each back.
            padded = [*on.shape[:dim], max(sizes), *on.shape[dim + 1 :]]
            parts = [on.new_empty(padded) for _ in range(self.size)]
            mine = on.new_zeros(padded)
            mine.narrow(dim, 0, on.shape[dim]).copy_(on)
            dist.all_gather(parts, mine, group=self.group)
            whole = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)
            return whole.to(tensor.device)
        parts = [torch.empty_like(on) for _ in range(self.size)]
        dist.all_gather(parts, on.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim).to(tensor.device)


def host_staged(device: torch.device, group: object | None = None) -> bool:
    """True when tensors on ``device`` must go through host memory: CUDA tensors on a gloo process group
    (False without a process group: nothing is sent then)."""
    return device.type == "cuda" and dist.is_initialized() and dist.get_backend(group) == "gloo"


def host_all_reduce(
    tensor: torch.Tensor, *, group: object | None = None, op=dist.ReduceOp.SUM, staged: bool | None = None
) -> None:
    """``dist.all_reduce`` in place; a CUDA tensor on a gloo group (``staged`` None), or any tensor with ``staged``
    True, is reduced in a host copy and copied back."""
    if not (host_staged(tensor.device, group) if staged is None else staged):
        dist.all_reduce(tensor, op=op, group=group)
        return
    host = tensor.detach().to("cpu", copy=True)
    dist.all_reduce(host, op=op, group=group)
    tensor.copy_(host)


@dataclass(frozen=True)
class Groups:
    """The collectives one rank needs besides the world's (`comm.DistGroup`s).

    ``replicas``: the rank's stage and tensor rank in every replica (the data-parallel gradient all-reduce; None
    with one replica); ``tensor``: its stage's T ranks (the tensor-parallel all-reduces; None without tensor
    parallelism); ``model``: its replica's K·T ranks, which together hold the whole model once (the global
    gradient norm; every rank with one replica)."""

    replicas: DistGroup | None
    tensor: DistGroup | None
    model: DistGroup
    tied: DistGroup | None = None  # tied embeddings on two stages: this rank's first and last stage (or None)


def tied_pairs(layout: Layout) -> list[tuple[int, int]]:
    """Megatron-LM's embedding groups: per replica and tensor rank, the ranks of the first and the last stage (the
    two copies of a tied embedding matrix; none with one stage)."""
    if layout.stages == 1:
        return []
    last = layout.stages - 1
    return [(layout.rank(d, 0, t), layout.rank(d, last, t)) for d in range(layout.data) for t in range(layout.tensor)]


def make_groups(layout: Layout, rank: int, device_type: str, *, tied: bool = False) -> Groups:
    """The process groups of ``layout`` for this rank; every rank must call it, in the same order.

    ``device_type``: "cuda" on NCCL, else "cpu" (gloo, also when CUDA tensors go through host memory). ``tied``: the
    model ties its embeddings (the embedding groups, `tied_pairs`)."""
    mesh = init_device_mesh(
        device_type, (layout.data, layout.stages, layout.tensor), mesh_dim_names=("data", "pipeline", "tensor")
    )
    per_replica = layout.stages * layout.tensor
    model = DistGroup(None, layout.world)
    if layout.data > 1:
        # The (pipeline, tensor) sub-mesh of every replica, as one group: new_group on every rank, in order.
        groups = [dist.new_group(list(range(d * per_replica, (d + 1) * per_replica))) for d in range(layout.data)]
        model = DistGroup(groups[layout.replica(rank)], per_replica)
    embedding = None
    for pair in tied_pairs(layout) if tied else ():
        group = dist.new_group(list(pair))  # on every rank, in order
        if rank in pair:
            embedding = DistGroup(group, 2)
    return Groups(
        replicas=DistGroup(mesh.get_group("data"), layout.data) if layout.data > 1 else None,
        tensor=DistGroup(mesh.get_group("tensor"), layout.tensor) if layout.tensor > 1 else None,
        model=model,
        tied=embedding,
    )
