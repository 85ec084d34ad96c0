"""Which tiles a profile times (docs/design.md §3): the token grid, the random context tiles the context term is
fitted on and checked against, tiles off the grids for ``--check``, and the settings that choose them
(`Settings`: the quick or the default preset). Imports no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig

CLOCKS = ("cpu", "wall")


def token_grid(seq_len: int, token_step: int, *, quick: bool = False) -> list[int]:
    """Token lengths to measure: a geometric subset of the multiples of ``token_step``, and ``seq_len``.

    Per-layer time is smooth in the token count (a per-call overhead, then linear and a small quadratic
    attention term), so ~4 points per octave and piecewise-linear interpolation (`costmodel`) reproduce the
    full grid to well within timing noise at a fraction of its cost; ``quick`` keeps one point per octave.
    """
    if token_step < 1:
        raise UserError(f"must be at least 1, got {token_step}", where="--token-step")
    if token_step > seq_len:
        raise UserError(f"{token_step} is longer than the model's sequence length {seq_len}", where="--token-step")
    factors = (1,) if quick else (1, 1.25, 1.5, 1.75)
    steps: set[int] = set()
    octave = 1
    while octave * token_step <= seq_len:
        for f in factors:
            k = int(round(octave * f))
            if k * token_step <= seq_len:
                steps.add(k)
        octave *= 2
    return sorted({k * token_step for k in steps} | {seq_len})


@dataclass(frozen=True)
class Point:
    """One tile to time: b sequences, i new tokens, j context tokens; ``role`` says what it is for."""

    b: int
    i: int
    j: int
    role: str  # "grid" (j = 0, on the token grid), "fit", "heldout" (context points), "check" (off the grids)

    @property
    def work(self) -> float:
        """Rough cost for the progress bar: the context tile's forward, the tile, and a per-call overhead."""
        return self.b * (self.j + 3 * self.i) + 64


def context_points(
    batch_sizes: Sequence[int],
    lengths: Sequence[int],
    seq_len: int,
    token_step: int,
    *,
    fit: int,
    heldout: int,
    seed: int,
) -> list[Point]:
    """Random (b, i, j) with i on the token grid and j a positive multiple of the token step, i + j ≤ L.

    i is drawn from the (geometric) grid, so short slices, where relative errors are largest, are well
    represented; j uniformly over what fits. The first ``fit`` points are for the fit, the rest held out.
    """
    candidates = [
        (b, i, j) for b in batch_sizes for i in lengths for j in range(token_step, seq_len - i + 1, token_step)
    ]
    need = fit + heldout
    if len(candidates) < need:
        raise UserError(
            f"the sequence length {seq_len} leaves only {len(candidates)} distinct context tiles at this token step, "
            f"{need} are needed to fit and check the context term; use a smaller --token-step",
            where="--token-step",
        )
    rng = np.random.default_rng(seed)
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for c in candidates:
        by_length.setdefault(c[1], []).append(c)
    chosen: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int, int]] = set()
    # Draw a length first, then a (b, j) for it: every grid length gets its share of points.
    usable = [n for n in lengths if n in by_length]
    while len(chosen) < need:
        pool = by_length[usable[rng.integers(len(usable))]]
        c = pool[rng.integers(len(pool))]
        if c not in seen:
            seen.add(c)
            chosen.append(c)
    return [Point(b, i, j, "fit" if k < fit else "heldout") for k, (b, i, j) in enumerate(chosen)]


def check_points(
    batch_sizes: Sequence[int], lengths: Sequence[int], seq_len: int, token_step: int, *, count: int, seed: int
) -> list[Point]:
    """Tiles off the measured grid: i between grid lengths, b between batch sizes where there is room.

    They test the profile as the planner uses it — interpolation in i and b plus the context fit — against
    direct timings.
    """
    off_lengths = [n for n in range(token_step, seq_len + 1, token_step) if n not in set(lengths)] or list(lengths)
    between = {(a + c) // 2 for a, c in zip(batch_sizes, batch_sizes[1:], strict=False) if c - a > 1}
    bs = sorted(set(batch_sizes) | between)
    rng = np.random.default_rng(seed + 1)
    out: list[Point] = []
    seen: set[tuple[int, int, int]] = set()
    tries = 0
    while len(out) < count and tries < 100 * count:
        tries += 1
        b = int(bs[len(out) % len(bs)])
        i = int(off_lengths[rng.integers(len(off_lengths))])
        room = (seq_len - i) // token_step
        # One point in every few without context checks the no-context interpolation alone.
        j = 0 if (len(out) % 4 == 3 or room == 0) else token_step * int(rng.integers(1, room + 1))
        if (b, i, j) not in seen:
            seen.add((b, i, j))
            out.append(Point(b, i, j, "check"))
    return out


@dataclass(frozen=True)
class Tiles:
    """The tiles one profile times. They share the same rounds, so a drift of the machine hits them alike."""

    grid: list[Point]  # j = 0 on the token grid: the no-context tables
    context: list[Point]  # random (b, i, j): the context term's fit and held-out points
    check: list[Point]  # off the grids, with --check; else empty

    @property
    def all(self) -> list[Point]:
        return self.grid + self.context + self.check


@dataclass(frozen=True)
class Settings:
    """What to measure. `Settings.make` builds it from the command's options; ``quick`` picks the coarse
    preset (`_QUICK`) instead of the default one (`_DEFAULT`)."""

    batch_sizes: tuple[int, ...]
    token_step: int
    token_lengths: tuple[int, ...]
    repeats: int
    warmup_all: bool
    fit_points: int
    heldout_points: int
    check_points: int  # 0: no check
    comm_sizes: int
    comm_rounds: int
    comm_iters: int
    seed: int = 0
    quick: bool = False
    clock: str = "cpu"
    precision: str = "fp32"  # one of `terapipe_cli.config.device.PRECISIONS`, already resolved for the device
    # The ends are timed on the grid's (b, i) of at most this many tokens; a larger cell is the cell of the same i
    # at the largest b timed, scaled by b (`ends.time_ends`). None: every cell timed. The quick preset caps at one
    # sequence (L tokens): an LM head's work is b·i rows against the whole vocabulary, so with a large vocabulary
    # the grid's largest cells cost minutes (a 128,256-token head on b·i = 8 × 1024 is 8 × 1024 × 128,256 logits in
    # fp32, 4 GiB), and at that size the time is the product's, proportional to b·i.
    ends_max_tokens: int | None = None

    @staticmethod
    def make(
        model: ModelConfig,
        batch_sizes: Sequence[int],
        token_step: int,
        *,
        quick: bool,
        check: bool,
        seed: int = 0,
        clock: str = "cpu",
        precision: str = "fp32",
    ) -> Settings:
        bs = tuple(sorted(set(batch_sizes)))
        if not bs or bs[0] < 1:
            raise UserError(f"must be positive integers, got {list(batch_sizes)}", where="--batch-sizes")
        if clock not in CLOCKS:
            raise UserError(f"must be one of {', '.join(CLOCKS)}, got {clock!r}", where="--clock")
        lengths = tuple(token_grid(model.seq_len, token_step, quick=quick))
        L = model.seq_len
        if L % token_step:  # before anything is timed: a plan cuts the sequence into multiples of the token step
            near = max(d for d in range(1, token_step + 1) if L % d == 0)
            raise UserError(
                f"the model's sequence length {L} is not a multiple of {token_step}, so no plan could use this "
                f"profile; take a divisor of {L} (e.g. {near})",
                where="--token-step",
            )
        preset = _QUICK if quick else _DEFAULT
        check_count = preset["fit_points"] // 4 if check else 0
        settings = Settings(
            bs,
            token_step,
            lengths,
            **preset,
            check_points=check_count,
            seed=seed,
            quick=quick,
            clock=clock,
            precision=precision,
            ends_max_tokens=L if quick else None,
        )
        # Fail now, not after the grid was timed, if the sequence is too short for the context points.
        settings.context_tiles(model.seq_len)
        return settings

    def context_tiles(self, seq_len: int) -> list[Point]:
        return context_points(
            self.batch_sizes,
            self.token_lengths,
            seq_len,
            self.token_step,
            fit=self.fit_points,
            heldout=self.heldout_points,
            seed=self.seed,
        )

    def tiles(self, seq_len: int) -> Tiles:
        grid = [Point(b, n, 0, "grid") for b in self.batch_sizes for n in self.token_lengths]
        check = (
            check_points(
                self.batch_sizes, self.token_lengths, seq_len, self.token_step, count=self.check_points, seed=self.seed
            )
            if self.check_points
            else []
        )
        return Tiles(grid, self.context_tiles(seq_len), check)


# Sized so that the tiny model (H = 256, L = 1024) takes under 30 s (quick) and 3 minutes (default) on a
# 2-core CPU, including torchrun's start-up (~10 s) for the link.
_QUICK = dict(repeats=3, warmup_all=False, fit_points=16, heldout_points=8, comm_sizes=5, comm_rounds=2, comm_iters=5)
_DEFAULT = dict(repeats=5, warmup_all=True, fit_points=48, heldout_points=16, comm_sizes=8, comm_rounds=4, comm_iters=8)
