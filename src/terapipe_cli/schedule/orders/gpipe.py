"""GPipe: every forward, then every backward in the exact reverse (the last batch slice's first), on every device.

With v > 1 chunks per device the forwards go in Megatron-LM's groups of K tiles (`base.interleaved_forwards`)."""

from __future__ import annotations

from terapipe_cli.schedule.actions import Action, Phase, Tile
from terapipe_cli.schedule.orders.base import Order, interleaved_forward_places, interleaved_forwards


class GPipe(Order):
    name, title, all_open = "gpipe", "GPipe order", True
    summary = "every forward, then every backward"

    def rows(self, tiles: list[Tile], slices: int, devices: int, virtual: int) -> list[list[Action]]:
        if virtual == 1:
            return [[Action("F", t, k) for t in tiles] + [Action("B", t, k) for t in reversed(tiles)]
                    for k in range(devices)]  # fmt: skip
        rows = []
        for k in range(devices):
            f = interleaved_forwards(k, tiles, devices, virtual)
            rows.append(f + [Action("B", a.tile, a.stage) for a in reversed(f)])
        return rows

    def places(self, counts, devices: int, virtual: int) -> list[list[tuple]]:
        rows = []
        for k in range(devices):
            # `interleaved_forwards` (with v = 1: every tile on chunk k), then the backwards in the exact reverse.
            f = interleaved_forward_places(k, sum(counts), devices, virtual)
            rows.append([(Phase.F, c, n) for c, n in f] + [(Phase.B, c, n) for c, n in reversed(f)])
        return rows


GPIPE = GPipe()
