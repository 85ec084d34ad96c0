"""Batch groupings under a memory limit as a state machine for the exact search (docs/design.md §10): the moves
place one batch slice at a time, and each state knows, through the closed form of the memory walk
(`plan.memory`), which batch slices are open on every stage — so every path is a grouping whose peak fits.
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from terapipe_cli.plan.memory import StageSizes, plain_bytes, tile_fits
from terapipe_cli.plan.search import Sequencing
from terapipe_cli.schedule.orders import order_of

# Beyond these the exact search over batch groupings is not run (`grouping_search` returns None): states of the
# 1F1B machine, and DP table cells (rows × (L/g + 1)²; the search keeps two float64 arrays of them).
MAX_GROUPING_STATES = 4096
MAX_GROUPING_CELLS = 2**25


def grouping_search(
    sizes: Sequence[StageSizes], batch_size: int, seq_len: int, token_step: int, order: str, limit: float,
    recompute: bool,
) -> Sequencing | None:  # fmt: skip
    """Every batch grouping (batch slices of any sizes, in any order) whose peak fits ``limit`` on every stage, as a
    `search.Sequencing` for the exact search (docs/design.md §10). Without recomputation a grouping fits or not
    whatever the token slicing; with it (on every stage) each batch slice's tiles are restricted by its place.

    GPipe order: states are the sequences placed so far (front to back), W_kd their number. 1F1B order: batch slices
    are placed back to front and a state is (sequences placed, the sizes of the next K − 1 batch slices), which gives
    every W_kd. None when the search would be too large (`MAX_GROUPING_STATES`, `MAX_GROUPING_CELLS`).
    """
    K, B, L = len(sizes), batch_size, seq_len
    # Stages of equal sizes (the middle ones) bind alike: only the most sequences open on any of them matters.
    alike = list(dict.fromkeys(sizes))
    members = [[k for k in range(K) if sizes[k] == s] for s in alike]
    rows: dict[tuple, int] = {}
    moves: list[tuple[int, int, int]] = []

    cells = (seq_len // token_step + 1) ** 2

    def row(b: int, opened: tuple[int, ...]) -> int:
        key = (b, opened) if recompute else (b,)
        return rows.setdefault(key, len(rows))

    def fits_plain(opened: tuple[int, ...]) -> bool:
        return recompute or all(plain_bytes(s, w, L) <= limit for s, w in zip(alike, opened, strict=True))

    # More sequences open never take fewer bytes (every per-token size non-negative): past the first batch slice size
    # that does not fit, none does, and the moves of a state stop there.
    growing = all(s.cache + s.tile >= 0 for s in alike)

    if order_of(order).all_open:
        for placed in range(B):
            for b in range(1, B - placed + 1):
                opened = (placed + b,) * len(alike)
                if not fits_plain(opened):
                    if growing:
                        break
                    continue
                moves.append((placed, placed + b, row(b, opened)))
                if len(rows) * cells > MAX_GROUPING_CELLS:  # rows only grow: too large whatever comes next
                    return None
        states, finals, last_first = B + 1, (B,), False
    else:
        index: dict[tuple[int, tuple[int, ...]], int] = {(0, ()): 0}
        todo = [(0, ())]
        fitting: dict[tuple[int, ...], bool] = {}
        for placed, after in todo:  # breadth-first: a state's moves lead to states placed later in `todo`
            # Stage k has b + Σ after[:K − k − 1] sequences open: the sum only grows with fewer stages before the
            # last, so of the stages of one size (which bind alike) the first has the most, whatever b.
            before = [sum(after[: K - ks[0] - 1]) for ks in members]
            for b in range(1, B - placed + 1):
                opened = tuple(b + n for n in before)
                if opened not in fitting:
                    fitting[opened] = fits_plain(opened)
                if not fitting[opened]:
                    if growing:
                        break
                    continue
                nxt = (placed + b, ((b,) + after)[: K - 1])
                if nxt not in index:
                    index[nxt] = len(index)
                    todo.append(nxt)
                    if len(index) > MAX_GROUPING_STATES:
                        return None
                moves.append((index[(placed, after)], index[nxt], row(b, opened)))
                if len(rows) * cells > MAX_GROUPING_CELLS:  # rows only grow: too large whatever comes next
                    return None
        # Number the states by sequences placed, so that every move goes forward.
        ranked = sorted(index, key=lambda st: (st[0], index[st]))
        renumber = {index[st]: n for n, st in enumerate(ranked)}
        moves = [(renumber[a], renumber[c], r) for a, c, r in moves]
        states, last_first = len(index), True
        finals = tuple(renumber[index[st]] for st in index if st[0] == B)
    if not finals:  # no grouping fits: a Sequencing without moves
        moves, finals = [], (0,)
    if len(rows) * cells > MAX_GROUPING_CELLS:
        return None
    keys = sorted(rows, key=rows.get)
    fits = tuple(tile_fits(alike, key, L, limit) if recompute else None for key in keys)
    return Sequencing(tuple(key[0] for key in keys), fits, tuple(moves), states, finals, last_first)
