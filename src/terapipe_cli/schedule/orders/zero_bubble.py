"""Zero-bubble orders (Qi et al., "Zero Bubble Pipeline Parallelism", 2024), on tiles: every backward split into I,
which the previous chunk and the earlier token slices wait for, and W, which nobody waits for, so W can fill the
gaps where a device would wait.

``zb1p`` (ZB-H1): 1F1B's order of forwards and I's — so as many batch slices open as 1F1B, any v — with each device's
W's held back by a lag: device k runs a tile's W once more than ``lag(k)`` W's are due, and the last ``lag(k)`` at
the end, where 1F1B's device k waits longest for gradients (`with_weights_delayed`). The gradient goes back after I,
half a backward sooner, so the chain of I's from the last chunk to the first is shorter than 1F1B's chain of B's.

``zbv`` (ZB-V): two chunks per device placed in a V (`ZeroBubbleV`).
"""

from __future__ import annotations

from terapipe_cli.schedule.actions import Action, Phase, Tile, completes, waits_for
from terapipe_cli.schedule.orders.base import Order
from terapipe_cli.schedule.orders.one_f_one_b import ONE_F_ONE_B


def with_weights_delayed(row: list[Action], lag: int) -> list[Action]:
    """A row with each B split into I and W, each W run once more than ``lag`` W's are due (oldest first), the rest
    at the end — legal wherever the row was: a W waits for nothing but its own I."""
    out: list[Action] = []
    due: list[Action] = []
    for a in row:
        if a.phase is not Phase.B:
            out.append(a)
            continue
        out.append(Action(Phase.I, a.tile, a.stage))
        due.append(Action(Phase.W, a.tile, a.stage))
        while len(due) > lag:
            out.append(due.pop(0))
    return out + due


class ZeroBubbleH1(Order):
    name, title, split = "zb1p", "ZB-H1 order", True
    summary = "ZB-H1: 1F1B with each backward split into I and W, the W's filling the bubble"

    def lag(self, k: int, devices: int) -> int:
        """W's device k holds back: the stages nearest the loss finish their I's first and wait longest for the rest
        of the step, so they keep the most W's for the end."""
        return k

    def rows(self, tiles: list[Tile], slices: int, devices: int, virtual: int) -> list[list[Action]]:
        base = ONE_F_ONE_B.rows(tiles, slices, devices, virtual)
        return [with_weights_delayed(row, self.lag(k, devices)) for k, row in enumerate(base)]


ZB_H1 = ZeroBubbleH1()


class ZeroBubbleV(Order):
    """``zbv`` (ZB-V, Qi et al. 2024): two chunks per device in a V (`Partition` placement ``v``: device k holds
    chunks k and 2K − 1 − k), each backward split into I and W. The rows come from a greedy walk with every action
    one step long (`v_rows`): at each step a device runs a ready I if it has one (the chunk nearer the loss first),
    else a ready forward (the up arm's first; a new batch slice on its down arm only while fewer than K of its batch
    slices are open there, which bounds the activations as 1F1B does), else its oldest W due — so W fills every step
    a device would otherwise wait, and the walk is legal by construction (it only ever takes a ready action)."""

    name, title, split, placement = "zbv", "ZB-V order", True, "v"
    summary = "ZB-V: two chunks per device in a V, the backward split"

    def rows(self, tiles: list[Tile], slices: int, devices: int, virtual: int) -> list[list[Action]]:
        if virtual != 2:
            raise ValueError(f"ZB-V runs two chunks per device (virtual stages 2), not {virtual}")
        return v_rows(tiles, slices, devices)


def v_rows(tiles: list[Tile], slices: int, devices: int) -> list[list[Action]]:
    """Each device's row of the ZB-V order (`ZeroBubbleV`), by a greedy walk in unit steps under `actions.waits_for`."""
    K, chunks = devices, 2 * devices
    counts = {d: sum(1 for t in tiles if t.batch_slice == d) for d in range(slices)}
    backward_order = [t for d in range(slices) for t in reversed([t for t in tiles if t.batch_slice == d])]
    down = list(range(K))  # device k's first chunk (the V's down arm); its second is 2K − 1 − k
    mine = [(k, chunks - 1 - k) for k in range(K)]
    next_f = [0] * chunks  # per chunk: the next tile (pipeline order) to run forward
    next_i = [0] * chunks  # per chunk: the next tile (backward order) to run I
    finished: dict = {}  # key (`actions.completes`) -> the step it ended
    open_slices = [set() for _ in range(K)]  # per device: batch slices begun on its down arm, not yet all W'd there
    w_left: dict = {}  # (device, batch slice) -> W's left on its down arm
    due: list[list[Action]] = [[] for _ in range(K)]
    rows: list[list[Action]] = [[] for _ in range(K)]
    total = 3 * chunks * len(tiles)
    placed, step = 0, 0

    def ready(a: Action) -> bool:
        return all(finished.get(key, step + 1) <= step for key in waits_for(a, chunks, counts[a.tile.batch_slice]))

    while placed < total:
        if step > 4 * total + 4 * chunks:
            raise AssertionError("the greedy ZB-V walk made no progress")  # unreachable: every tile can move on
        taken = []
        for k in range(K):
            action = None
            for c in sorted(mine[k], reverse=True):  # I: the chunk nearer the loss first
                if next_i[c] < len(backward_order):
                    a = Action(Phase.I, backward_order[next_i[c]], c)
                    if ready(a):
                        action = a
                        next_i[c] += 1
                        break
            if action is None:
                for c in sorted(mine[k], reverse=True):  # F: the up arm first, the down arm within the intake bound
                    if next_f[c] >= len(tiles):
                        continue
                    t = tiles[next_f[c]]
                    if c == down[k] and t.batch_slice not in open_slices[k] and len(open_slices[k]) >= K:
                        continue
                    a = Action(Phase.F, t, c)
                    if ready(a):
                        action = a
                        next_f[c] += 1
                        if c == down[k] and t.batch_slice not in open_slices[k]:
                            open_slices[k].add(t.batch_slice)
                            w_left[(k, t.batch_slice)] = counts[t.batch_slice]
                        break
            if action is None and due[k]:
                action = due[k].pop(0)
                if action.stage == down[k]:
                    w_left[(k, action.tile.batch_slice)] -= 1
                    if not w_left[(k, action.tile.batch_slice)]:
                        open_slices[k].discard(action.tile.batch_slice)
            if action is not None:
                rows[k].append(action)
                taken.append(action)
                if action.phase is Phase.I:
                    due[k].append(Action(Phase.W, action.tile, action.stage))
        for a in taken:
            for key in completes(a):
                finished[key] = step + 1
        placed += len(taken)
        step += 1
    return rows


ZB_V = ZeroBubbleV()
