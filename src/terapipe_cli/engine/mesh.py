"""Where every worker sits: the (data, pipeline, tensor) grid of D × K × T processes (docs/design.md §6b).

Ranks fill the grid with the tensor dimension innermost, then the pipeline, then the data-parallel replicas:
``rank = (replica · K + stage) · T + tensor_rank``. A stage's T tensor ranks are neighbours (on one machine,
behind its fastest links), and a replica's K·T ranks are consecutive. Point-to-point messages go between the
same tensor rank of neighbouring stages: ``rank ± T``.

`Layout` is the arithmetic; `make_groups` builds the process groups through
``torch.distributed.device_mesh.init_device_mesh`` with those three named dimensions, and `local_comms` the same
groups over threads of one process (`engine.local.local_comms`). Only `make_groups` imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from terapipe_cli.engine.comm import DistGroup


@dataclass(frozen=True)
class Layout:
    """D replicas × K stages × T tensor ranks."""

    data: int
    stages: int
    tensor: int = 1

    @property
    def world(self) -> int:
        return self.data * self.stages * self.tensor

    def replica(self, rank: int) -> int:
        return rank // (self.stages * self.tensor)

    def stage(self, rank: int) -> int:
        return (rank // self.tensor) % self.stages

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor

    def rank(self, replica: int, stage: int, tensor_rank: int = 0) -> int:
        return (replica * self.stages + stage) * self.tensor + tensor_rank

    def neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """(previous stage's, next stage's) rank of the same replica and tensor rank; None past either end."""
        stage = self.stage(rank)
        return (
            rank - self.tensor if stage > 0 else None,
            rank + self.tensor if stage < self.stages - 1 else None,
        )

    def describe(self, rank: int) -> str:
        """``stage 1, replica 0`` (and ``, tensor rank 1`` with T > 1): a rank's place, in words."""
        where = f"stage {self.stage(rank)}, replica {self.replica(rank)}"
        return where + (f", tensor rank {self.tensor_rank(rank)}" if self.tensor > 1 else "")

    def shape_text(self) -> str:
        """``D × K × T = 2 × 2 × 2 = 8 workers``."""
        return f"D × K × T = {self.data} × {self.stages} × {self.tensor} = {self.world} workers"


def gpu_of(local_rank: int, n_gpus: int) -> int:
    """The GPU index of the worker with this local rank: its own while there are enough, else shared in turn."""
    return local_rank % n_gpus


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


def make_groups(layout: Layout, rank: int, device_type: str) -> Groups:
    """The process groups of ``layout`` for this rank; every rank must call it, in the same order.

    ``device_type``: "cuda" on NCCL, else "cpu" (gloo, also when CUDA tensors go through host memory)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from terapipe_cli.engine.comm import DistGroup

    mesh = init_device_mesh(
        device_type, (layout.data, layout.stages, layout.tensor), mesh_dim_names=("data", "pipeline", "tensor")
    )
    per_replica = layout.stages * layout.tensor
    model = DistGroup(None, layout.world)
    if layout.data > 1:
        # The (pipeline, tensor) sub-mesh of every replica, as one group: new_group on every rank, in order.
        groups = [dist.new_group(list(range(d * per_replica, (d + 1) * per_replica))) for d in range(layout.data)]
        model = DistGroup(groups[layout.replica(rank)], per_replica)
    return Groups(
        replicas=DistGroup(mesh.get_group("data"), layout.data) if layout.data > 1 else None,
        tensor=DistGroup(mesh.get_group("tensor"), layout.tensor) if layout.tensor > 1 else None,
        model=model,
    )
