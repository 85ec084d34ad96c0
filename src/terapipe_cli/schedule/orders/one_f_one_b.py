"""1F1B: device k runs the forwards of at most K − k batch slices ahead of their backwards, then alternates a
backward (the oldest open batch slice's, in reverse token order) with a forward, so the activations of fewer batch
slices are alive at once than in GPipe order.

With v > 1 chunks per device it is Megatron-LM's interleaved 1F1B on tiles — a warm-up of forwards, then one
forward and one backward in turn — with the backwards in groups of batch slices of at least K tiles
(`alternating_1f1b`)."""

from __future__ import annotations

from terapipe_cli.schedule import memo
from terapipe_cli.schedule.actions import Action, KeyCodes, Phase, Tile, token_slice_counts, walk_codes
from terapipe_cli.schedule.orders.base import Order, by_slice, interleaved_forwards


class OneFOneB(Order):
    name, title = "1f1b", "1F1B order"
    summary = "a batch slice's backward as soon as the pipeline allows: fewer batch slices' activations alive at once"

    def rows(self, tiles: list[Tile], slices: int, devices: int, virtual: int) -> list[list[Action]]:
        groups = by_slice(tiles, slices)
        if virtual == 1:
            return [one_f_one_b(groups, k, warmup=min(devices - k, slices)) for k in range(devices)]
        forward = [interleaved_forwards(k, tiles, devices, virtual) for k in range(devices)]
        backward = interleaved_backwards(groups, devices, virtual)
        # The extra warm-up depends only on how many token slices each batch slice has, not on their lengths: the
        # schemes a plan compares share it (`schedule.memo`), and finding it takes hundreds of walks where the batch
        # slices do not make whole groups of K tiles (Table 2 of Megatron-LM's paper, docs/results.md).
        key = ("1f1b extra warm-up", devices, virtual, tuple(len(ts) for ts in groups))
        extra = memo.remembered(key, lambda: least_extra(forward, backward, devices * virtual, virtual))
        return alternating_1f1b(forward, backward, virtual, extra)

    def places(self, counts, devices: int, virtual: int) -> list[list[tuple]] | None:
        if virtual > 1:  # the extra warm-up is found by walking actions (`least_extra`)
            return None
        first = [sum(counts[:d]) for d in range(len(counts))]
        groups = [range(first[d], first[d] + n) for d, n in enumerate(counts)]
        return [one_f_one_b_places(groups, k, warmup=min(devices - k, len(counts))) for k in range(devices)]


ONE_F_ONE_B = OneFOneB()


def interleaved_backwards(by_slice: list[list[Tile]], devices: int, virtual: int) -> list[list[Action]]:
    """Each device's backwards with v chunks per device, by groups of batch slices of at least K tiles (Megatron's
    groups of K microbatches when every batch slice is one tile), oldest group first; within a group the device's
    chunks from the last, each running the group's batch slices oldest first, every batch slice in reverse token
    order."""
    chunks = devices * virtual
    groups: list[list[list[Tile]]] = []
    for ts in by_slice:
        if not groups or sum(len(x) for x in groups[-1]) >= devices:
            groups.append([])
        groups[-1].append(ts)
    return [
        [
            Action("B", t, c)
            for group in groups
            for c in reversed(range(k, chunks, devices))
            for ts in group
            for t in ts[::-1]
        ]
        for k in range(devices)
    ]


def alternating_1f1b(
    forward: list[list[Action]], backward: list[list[Action]], virtual: int, extra: int
) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B over these forwards and backwards: device k first runs
    (K − k − 1)·2 + (v − 1)·K + e forwards (its warm-up, in tiles), then one forward and one backward in turn, then
    the backwards left; e = ``extra`` is the smallest extra warm-up, the same on every device, that leaves no deadlock
    (`least_extra`: 0 when every batch slice is one tile and the groups are K of them — Megatron-LM's own case, whose
    order this then is exactly; with token slices a group can hold more than K tiles, and its first backward waits for
    more forwards).

    A greedy replay that takes any ready backward before the next batch slice's forward runs backwards in bursts
    that starve the next device of forwards; the simulator prices it slower on every case compared (docs/results.md,
    the interleaved 1F1B order)."""
    devices = len(forward)
    rows = []
    for k in range(devices):
        f, b = forward[k], backward[k]
        warmup = min(len(f), (devices - k - 1) * 2 + (virtual - 1) * devices + extra)
        both = [None] * (2 * (len(f) - warmup))  # one forward and one backward in turn
        both[::2], both[1::2] = f[warmup:], b[: len(f) - warmup]
        rows.append(f[:warmup] + both + b[len(f) - warmup :])
    return rows


def least_extra(forward: list[list[Action]], backward: list[list[Action]], chunks: int, virtual: int) -> int:
    """The smallest extra warm-up e of `alternating_1f1b` whose rows never deadlock. With e as large as the forwards
    every device runs all its forwards first, which is legal, so e exists."""
    rows = _Rows(forward, backward, chunks, virtual)
    # A backward placed before its own forward can never run: device k's n-th backward comes after its
    # (warm-up + n)-th forward, so the warm-up must reach the forward's position less n. The smallest extra meeting
    # that on every device is a lower bound; from it, the first extra whose rows walk to the end (one or two walks
    # in practice, where a walk per extra from zero would take one per value below the bound).
    low = 0
    for k in range(len(forward)):
        at = {(a.tile, a.stage): i for i, a in enumerate(forward[k])}
        low = max([low] + [at[(b.tile, b.stage)] - n - rows.base[k] for n, b in enumerate(backward[k])])
    # Where the batch slices do not make whole groups of K tiles the first legal extra can lie hundreds above the
    # bound (Megatron-LM's largest settings). A deadlock's cycle often stays a cycle for the next extras, which are
    # then skipped without a walk.
    extra, top = low, max(len(f) for f in forward)
    while extra <= top:
        found = rows.deadlock(extra)
        if found is None:
            return extra
        extra += 1
        while extra <= top and rows.still_cycle(found, extra):
            extra += 1
    raise AssertionError("every forward first cannot deadlock")  # unreachable: the last extra is GPipe-like


# An action of `least_extra`'s rows: (device, 0 for a forward or 1 for a backward, its number among them).
Place = tuple[int, int, int]


class _Rows:
    """The rows of `alternating_1f1b` for every extra, their actions coded once (`KeyCodes`), and what a deadlock
    among them is."""

    def __init__(self, forward: list[list[Action]], backward: list[list[Action]], chunks: int, virtual: int) -> None:
        devices = len(forward)
        self.codes = KeyCodes(chunks, token_slice_counts(forward))
        self.forward = [[self.codes.of(a) for a in f] for f in forward]
        self.backward = [[self.codes.of(a) for a in b] for b in backward]
        self.virtual = virtual
        self.base = [(devices - k - 1) * 2 + (virtual - 1) * devices for k in range(devices)]
        self.by_key: dict[int, Place] = {}  # the action that completes each key
        for kind, rows in enumerate((self.forward, self.backward)):
            for k, row in enumerate(rows):
                for n, (_, done) in enumerate(row):
                    for key in done:
                        self.by_key[key] = (k, kind, n)

    def at(self, place: Place, extra: int) -> int:
        """Where the action lies in its device's row with this extra."""
        k, kind, n = place
        total = len(self.forward[k])
        warmup = min(total, self.base[k] + extra)
        if kind == 0:
            return n if n < warmup else 2 * n - warmup
        return warmup + 2 * n + 1 if n < total - warmup else total + n

    def place(self, k: int, at: int, extra: int) -> Place:
        """The action at place ``at`` of device k's row with this extra (`at`'s inverse)."""
        total = len(self.forward[k])
        warmup = min(total, self.base[k] + extra)
        if at < warmup:
            return (k, 0, at)
        if at >= 2 * total - warmup:
            return (k, 1, at - total)
        q = at - warmup
        return (k, 0, warmup + q // 2) if q % 2 == 0 else (k, 1, q // 2)

    def deadlock(self, extra: int) -> list[tuple[Place, Place]] | None:
        """None when the rows with this extra walk to the end. Else a cycle of waits that stops them: pairs (the
        next action of a stuck device, an action it waits for, not run), each waited-for action on the device of
        the next pair, at or after its next action — none of them can ever run."""
        rows = alternating_1f1b(self.forward, self.backward, self.virtual, extra)
        _, pos = walk_codes(rows, self.codes.size)
        if all(p == len(row) for p, row in zip(pos, rows, strict=True)):
            return None
        # Every stuck device waits for an action of a stuck device: following the waits from one comes round.
        waits: dict[int, tuple[Place, Place]] = {}
        k = next(k for k, row in enumerate(rows) if pos[k] < len(row))
        while k not in waits:
            waited = next(
                self.by_key[key]
                for key in rows[k][pos[k]][0]
                if self.at(self.by_key[key], extra) >= pos[self.by_key[key][0]]
            )
            waits[k] = (self.place(k, pos[k], extra), waited)
            k = waited[0]
        devices = list(waits)
        return [waits[d] for d in devices[devices.index(k) :]]

    def still_cycle(self, cycle: list[tuple[Place, Place]], extra: int) -> bool:
        """Whether the cycle of `deadlock` is one with this extra too (what waits for what does not change; where
        the actions lie in their rows does)."""
        return all(
            self.at(waited, extra) >= self.at(cycle[(n + 1) % len(cycle)][0], extra)
            for n, (_, waited) in enumerate(cycle)
        )


def one_f_one_b_places(by_slice: list[range], stage: int, warmup: int) -> list[tuple]:
    """`one_f_one_b` of batch slices given by their tile numbers, as (kind, chunk, tile number) (`Order.places`)."""
    forward = [[(Phase.F, stage, n) for n in ns] for ns in by_slice]
    backward = [[(Phase.B, stage, n) for n in reversed(ns)] for ns in by_slice]
    return _interleaved(forward, backward, warmup)


def one_f_one_b(by_slice: list[list[Tile]], stage: int, warmup: int) -> list[Action]:
    """One stage's 1F1B order over batch slices, ``warmup`` forwards ahead."""
    forward = [[Action("F", t, stage) for t in ts] for ts in by_slice]
    backward = [[Action("B", t, stage) for t in reversed(ts)] for ts in by_slice]
    return _interleaved(forward, backward, warmup)


def _interleaved(forward: list[list], backward: list[list], warmup: int) -> list:
    """``warmup`` batch slices' forwards, then each next slice's forward after the backward ``warmup`` slices back,
    then the last backwards: one stage's 1F1B of the slices' forward and backward actions (each slice's in order)."""
    out = [a for d in range(warmup) for a in forward[d]]
    for d in range(warmup, len(forward)):
        out += backward[d - warmup] + forward[d]
    for d in range(len(forward) - warmup, len(forward)):
        out += backward[d]
    return out
