"""The pipeline's ends, timed through the runtime's own code (docs/design.md §3): the first chunk's token and position
embedding, and the last chunk's final norm, LM head and cross-entropy, per (b, i) — the ``ends`` of a profile
(`plan.costmodel.Ends`). Neither attends, so neither has a context term.

Each end runs in a `StageRunner` holding that end alone: the first and the last chunk of a one-layer model cut
``(0, 1, 0)`` (`schedule.partition`), at the profile's precision, inside one ``StageRunner.step()`` as in training. A
tile is timed as a forward of another batch slice (untimed, as in a pipeline step), then the tile's forward and
backward; rounds visit every (b, i) in a fresh random order, medians kept, with the clock of the layer's tiles
(`profile.timer`). The grid is the profile's batch sizes × token lengths (cells above `Settings.ends_max_tokens`, with
``--quick`` more than one sequence's tokens, scaled by b from the largest b timed at their length); a few (b, i) off
the grid are timed in the same rounds and held out, to check the interpolation the cost model uses on them
(`held_out_errors`).

With tensor parallelism (``tensor``) both ends are split by vocabulary rows over the stage's T ranks, as the runtime
runs them (engine/tensor.py), with their all-reduces: every rank of the group times the same tiles in the same
order (the T torchrun processes of `profile.tensor_parallel`), and each end's numbers are one rank's.
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import numpy as np
import torch

from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.engine.tensor import TensorGroup
from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.costmodel import CostModel, Profile
from terapipe_cli.profile.tiles import Settings
from terapipe_cli.profile.timer import Progress, collector_paused
from terapipe_cli.schedule.partition import Partition

ENDS = ("embed", "head")
HELD_OUT = 8  # (b, i) points off the grid timed to check the interpolation
# Rounds at least (`--quick`: QUICK_ROUNDS): an end's tile is cheap next to a layer's (the tiny model's embedding
# takes milliseconds), and on a shared CPU its timings jitter from round to round; more rounds bring the embedding's
# held-out error down at a small share of the profile's time (docs/results.md, "The ends' held-out error").
MIN_ROUNDS, QUICK_ROUNDS = 15, 7
# A tile that takes longer than this in the warm-up round is timed only `Settings.repeats` rounds: the extra rounds are
# for the cheap tiles' jitter, and a large vocabulary's head tiles take up to a second each (a 128,256-token head,
# hidden 64, b·i = 1024 on one CPU thread), where the extra rounds were most of `profile --quick`'s time. Nor does
# such a tile follow another batch slice's forward: the allocator's state that priming reproduces is noise there.
# With tensor ranks the slowest rank's warm-up decides, the same on every rank (`_heavy`).
HEAVY_S = 0.05


class EndsTimer:
    """Times the embedding (chunk 0) and the head (chunk 2) of a one-layer model cut (0, 1, 0); with ``tensor``, this
    rank's share of them (every rank of the group must time the same tiles in the same order)."""

    def __init__(
        self,
        model: ModelConfig,
        device: torch.device,
        *,
        seed: int,
        clock: str,
        precision: str,
        tensor: TensorGroup | None = None,
    ) -> None:
        # The ends timed apart, so untied: a tied head runs the same products on the embedding's matrix (`params`
        # counts that matrix once, with the embedding).
        one = replace(model, layers=1, **({"tie_embeddings": False} if model.tie_embeddings else {}))
        self.tied = model.tie_embeddings
        part = Partition((0, 1, 0), 3)
        common = {"seed": seed, "device": device, "precision": precision, "partition": part, "tensor": tensor}
        self.runners = {"embed": StageRunner(one, 0, 3, **common), "head": StageRunner(one, 2, 3, **common)}
        self.device, self.hidden, self.vocab = device, model.hidden, model.vocab
        self._now = time.process_time if clock == "cpu" and device.type == "cpu" else time.perf_counter
        self._gen = torch.Generator(device="cpu").manual_seed(seed)

    def params(self, end: str) -> int:
        module = self.runners[end].module
        shared = module.lm_head.weight.numel() if end == "head" and self.tied else 0
        return sum(p.numel() for p in module.parameters()) - shared

    def time_tile(self, end: str, b: int, i: int, *, prime: bool = True) -> tuple[float, float]:
        """Seconds of the forward and of the backward of one (b, i) tile of ``end``; ``prime``: after a forward of
        another batch slice, as in a pipeline step (left out for a tile much longer than that state matters to)."""
        runner = self.runners[end]
        runner.reset()
        tokens = torch.randint(0, self.vocab, (b, i), generator=self._gen).to(self.device)
        if end == "embed":
            x, targets = tokens, None
            grad = torch.randn(b, i, self.hidden, generator=self._gen).mul_(1e-2).to(self.device)
        else:
            x, targets, grad = torch.randn(b, i, self.hidden, generator=self._gen).to(self.device), tokens, None
        runner.set_loss_scale(1.0 / (b * i))
        if prime:
            runner.forward_tile(1, 0, x, targets)  # a forward of another batch slice first, as in a pipeline step
            self._sync()
        t0 = self._now()
        runner.forward_tile(0, 0, x, targets)
        self._sync()
        t1 = self._now()
        runner.backward_tile(0, 0, grad)
        self._sync()
        t2 = self._now()
        runner.reset()
        return t1 - t0, t2 - t1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _timed(settings: Settings, b: int, n: int) -> bool:
    """Whether the ends are timed at (b, n) (`Settings.ends_max_tokens`); the smallest batch size always is."""
    cap = settings.ends_max_tokens
    return cap is None or b * n <= cap or b == min(settings.batch_sizes)


def held_out_points(settings: Settings, seq_len: int, count: int = HELD_OUT) -> list[tuple[int, int]]:
    """``count`` (b, i) off the grid — i a multiple of the token step between the grid's lengths, b any size from
    the smallest batch size to the largest — drawn from the profile's seed."""
    lengths = [
        n for n in range(settings.token_step, seq_len + 1, settings.token_step) if n not in settings.token_lengths
    ]
    sizes = range(min(settings.batch_sizes), max(settings.batch_sizes) + 1)
    candidates = [(b, n) for b in sizes for n in lengths]
    # Under a cap on the ends' tokens, held-out tiles of at most half of it where there are enough (a short model's
    # are cheap whatever their size): the cells above the cap are scaled, not interpolated.
    cap = settings.ends_max_tokens
    small = [(b, n) for b, n in candidates if cap is None or b * n <= cap // 2]
    candidates = small if len(small) >= count else candidates
    if not candidates:
        return []
    rng = np.random.default_rng(settings.seed + 7)
    picks = rng.choice(len(candidates), min(count, len(candidates)), replace=False)
    return sorted(candidates[k] for k in picks)


def time_ends(
    model: ModelConfig,
    settings: Settings,
    device: torch.device,
    progress: Progress | None = None,
    tensor: TensorGroup | None = None,
) -> dict:
    """The profile's ``ends`` entry: per end, forward and backward medians on the grid [batch size][token length],
    the parameters of each end (this rank's share with ``tensor``), and the held-out points' timings (``heldout``:
    b, i, and each end's total). With ``tensor`` every rank of the group must call this alike."""
    timer = EndsTimer(
        model, device, seed=settings.seed, clock=settings.clock, precision=settings.precision, tensor=tensor
    )
    grid = [(b, n) for b in settings.batch_sizes for n in settings.token_lengths if _timed(settings, b, n)]
    held = held_out_points(settings, model.seq_len)
    points = grid + held
    samples = {(end, p): ([], []) for end in ENDS for p in points}
    rng = np.random.default_rng(settings.seed + 11)
    visits = [(end, p) for end in ENDS for p in points]
    rounds = max(settings.repeats, QUICK_ROUNDS if settings.quick else MIN_ROUNDS)
    total, done = (rounds + 1) * len(visits), 0
    heavy: set = set()  # the visits slower than HEAVY_S in the warm-up round (`_heavy`), known after it
    warm_s = [0.0] * len(visits)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        with collector_paused():
            for r in range(rounds + 1):  # round 0 warms every shape up
                for k in rng.permutation(len(visits)):
                    end, (b, n) = visits[k]
                    if r > settings.repeats and visits[k] in heavy:
                        done += 1
                        continue
                    with timer.runners[end].step():
                        fwd, bwd = timer.time_tile(end, b, n, prime=visits[k] not in heavy)
                    if r == 0:
                        warm_s[k] = fwd + bwd
                    if r:
                        samples[(end, (b, n))][0].append(fwd)
                        samples[(end, (b, n))][1].append(bwd)
                    done += 1
                    if progress:
                        progress("embedding and head", done, total)
                if r == 0:
                    heavy = _heavy(visits, warm_s, device, tensor)
                gc.collect()
    finally:
        torch.set_num_threads(threads)
    med = {key: (float(np.median(f)), float(np.median(b))) for key, (f, b) in samples.items()}
    for b in settings.batch_sizes:  # the cells above ``ends_max_tokens``: scaled by b from the largest b timed
        for n in settings.token_lengths:
            if not _timed(settings, b, n):
                timed = max(c for c in settings.batch_sizes if (c, n) in grid)
                for end in ENDS:
                    med[(end, (b, n))] = tuple(x * b / timed for x in med[(end, (timed, n))])
    out: dict = {}
    for end in ENDS:
        for phase, which in (("forward", 0), ("backward", 1)):
            out[f"{end}_{phase}_s"] = [
                [med[(end, (b, n))][which] for n in settings.token_lengths] for b in settings.batch_sizes
            ]
    out["embed_params"] = timer.params("embed")
    out["head_params"] = timer.params("head")
    out["heldout"] = [{"b": b, "i": n, **{f"{end}_s": sum(med[(end, (b, n))]) for end in ENDS}} for b, n in held]
    return out


def _heavy(visits: list, warm_s: list[float], device: torch.device, tensor: TensorGroup | None) -> set:
    """The visits whose warm-up took longer than `HEAVY_S`; with ``tensor``, by the slowest rank's time, so the same
    set on every rank. A heavy visit runs no priming forward and fewer rounds, and the forwards' all-reduces must
    pair up: on a rank's own clock alone the ranks can disagree near the threshold (a rank held up just before a
    tile's clock starts makes the others wait inside theirs), and the ranks' collectives no longer match."""
    seconds = torch.tensor(warm_s, dtype=torch.float64, device=device)
    if tensor is not None and tensor.size > 1:
        tensor.all_reduce(seconds, op="max")
    return {visit for visit, s in zip(visits, seconds.tolist(), strict=True) if s > HEAVY_S}


def held_out_errors(profile: Profile, heldout: list[dict]) -> dict:
    """Relative error of the cost model's embedding and head (interpolated from the grid, `CostModel`) on the
    held-out timings: mean and max per end."""
    if not heldout:
        return {}
    cost = CostModel(profile, 1)
    b = np.array([p["b"] for p in heldout], dtype=float)
    i = np.array([p["i"] for p in heldout], dtype=float)
    out = {}
    for end, priced in (("embed", cost.embedding(b, i)), ("head", cost.head(b, i))):
        measured = np.array([p[f"{end}_s"] for p in heldout])
        err = np.abs(priced - measured) / measured
        out[end] = {"rel_err_mean": float(err.mean()), "rel_err_max": float(err.max()), "points": len(heldout)}
    return out
