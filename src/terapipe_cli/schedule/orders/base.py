"""What an order is: a builder of each device's row of actions, and the closed form of its memory (`Order`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from terapipe_cli.schedule.actions import Action, Tile


class Order:
    """A schedule order. ``rows`` builds each device's actions; ``open_slices`` is the closed form the memory
    estimate and the planner use (`plan.memory`): how many batch slices are open on device k when one runs its
    backward. ``all_open``: every batch slice is open at the first backward (GPipe-like), which the planner's
    grouping search treats as one structure; otherwise the open batch slices are a window of ``open_slices``.
    ``split``: the backward runs as I then W (zero-bubble orders). ``placement``: the chunks' placement it needs.
    ``summary``: what it does, in a few words (`terapipe plan --order`'s help lists every order with it)."""

    name: str = ""
    title: str = ""
    summary: str = ""
    all_open: bool = False
    split: bool = False
    placement: str = "interleaved"  # where the chunks go (`partition.Partition`): the V for ZB-V

    def rows(self, tiles: list[Tile], slices: int, devices: int, virtual: int) -> list[list[Action]]:
        raise NotImplementedError

    def places(self, counts: Sequence[int], devices: int, virtual: int) -> list[list[tuple]] | None:
        """`rows` for batch slices of ``counts`` token slices, each action as (kind, chunk, tile number) — the
        tile's place in pipeline order — made without an `Action` (`schedule.layout`); None where the order makes
        them only through `rows`."""
        return None

    def open_slices(self, k: int, devices: int, slices: int) -> int:
        """Batch slices open on device k at the backward of one, of D = ``slices`` in all (at most)."""
        return slices if self.all_open else min(devices - k, slices)

    def in_flight(self, batch_sizes: Sequence[int], devices: int) -> list[list[int]]:
        """``W[k][d]``: the sequences of the batch slices open on device k while batch slice d runs its backward."""
        prefix = np.cumsum([0, *batch_sizes])
        D = len(batch_sizes)
        if self.all_open:
            return [[int(prefix[d + 1]) for d in range(D)] for _ in range(devices)]
        return [[int(prefix[min(d + self.open_slices(k, devices, D), D)] - prefix[d]) for d in range(D)]
                for k in range(devices)]  # fmt: skip

    def __repr__(self) -> str:
        return f"Order({self.name!r})"


def by_slice(tiles: list[Tile], slices: int) -> list[list[Tile]]:
    """The tiles of each batch slice, in token order."""
    return [[t for t in tiles if t.batch_slice == d] for d in range(slices)]


def interleaved_forwards(k: int, tiles: list[Tile], devices: int, virtual: int) -> list[Action]:
    """Device k's forwards with v chunks per device (Megatron-LM's interleaving): the tiles in groups of K, each
    group through the device's chunks in turn (a tile comes back round after K chunk-times, just when the group is
    done)."""
    return [Action("F", tiles[n], c) for c, n in interleaved_forward_places(k, len(tiles), devices, virtual)]


def interleaved_forward_places(k: int, tiles: int, devices: int, virtual: int) -> list[tuple[int, int]]:
    """`interleaved_forwards` of ``tiles`` tiles as (chunk, tile number)."""
    chunks = devices * virtual
    return [
        (c, n)
        for g in range(0, tiles, devices)
        for c in range(k, chunks, devices)
        for n in range(g, min(g + devices, tiles))
    ]
