"""Where every worker sits: the (data, pipeline, tensor) grid of D × K × T processes (docs/design.md §6b).

Ranks fill the grid with the tensor dimension innermost, then the pipeline, then the data-parallel replicas:
``rank = (replica · K + stage) · T + tensor_rank``. A stage's T tensor ranks are neighbours (on one machine,
behind its fastest links), and a replica's K·T ranks are consecutive. Point-to-point messages go between the
same tensor rank of neighbouring stages: ``rank ± T``.

`Layout` is the arithmetic (no torch); `comm.make_groups` builds the process groups of those three named
dimensions, and `local.local_comms` the same groups over threads of one process.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def ring(self, rank: int) -> tuple[int, int]:
        """(previous stage's, next stage's) rank of the same replica and tensor rank, wrapping around: interleaved
        chunks pass a tile from the last stage back to the first (docs/design.md §11)."""
        replica, stage, t = self.replica(rank), self.stage(rank), self.tensor_rank(rank)
        return self.rank(replica, (stage - 1) % self.stages, t), self.rank(replica, (stage + 1) % self.stages, t)

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
