"""The choice of a plan for a `PlanRequest` (`plan.request`): the TeraPipe scheme planned, its GPipe and uniform
baselines priced by the same cost model, all three replayed by the simulator, the schedule-aware re-ranking, and
the memory estimate checked against a limit — within which the fastest scheme that fits is searched exactly
(`plan_within_memory`). Imports no torch.

`terapipe plan` and `scripts/paper_table.py` both plan through `plan_for_profile`; the plan file is
`Planned.to_plan_dict` (docs/design.md §8).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import numpy as np

from terapipe_cli.errors import UserError
from terapipe_cli.plan.costmodel import CostModel, Profile
from terapipe_cli.plan.domain import domain_of, provenance_record
from terapipe_cli.plan.file import make_plan_dict
from terapipe_cli.plan.groupings import grouping_search
from terapipe_cli.plan.memory import (
    EqualSlices,
    MemoryCheck,
    check_memory,
    grouping_peaks,
    planned_loss_chunk_tokens,
    scheme_memory,
    stage_sizes,
)
from terapipe_cli.plan.mfu import Utilisation, utilisation
from terapipe_cli.plan.request import PlanRequest
from terapipe_cli.plan.search import PlanResult, divisors, gpipe_baseline, grid_tiles, solve, uniform_baseline
from terapipe_cli.plan.simulate import scheme_latency
from terapipe_cli.schedule import memo
from terapipe_cli.schedule.orders import order_of
from terapipe_cli.schedule.schedule import ORDERS, Schedule
from terapipe_cli.units import format_bytes, format_seconds, format_stages, utc_timestamp
from terapipe_cli.version import __version__

# The schemes a plan may run (`terapipe plan --scheme`): the TeraPipe plan, or one of its baselines.
SCHEMES = ("terapipe", "gpipe", "uniform")
# The schedule-aware choice (`request.RANKS`, "simulated"): the fastest in the simulator among the exact optimum
# and the schemes the search ranks next to it (within RERANK_WITHIN of it by the objective, at most RERANK_COUNT),
# so never slower in the simulator than the optimum.
RERANK_NEIGHBOURS = 4  # thresholds on either side of the optimum's largest tile (`search.solve(neighbours=…)`)
RERANK_WITHIN = 0.05
RERANK_COUNT = 8
# The plan line says so when the objective and the simulator differ by more than this on the plan's scheme.
DISAGREE = 0.05


@dataclass(frozen=True)
class Planned:
    """The TeraPipe plan and its baselines, each with its formula and simulated latency."""

    profile: Profile
    request: PlanRequest
    cost: CostModel
    terapipe: PlanResult
    gpipe: PlanResult
    uniform: PlanResult
    simulated_s: dict[str, float]  # by "terapipe", "gpipe", "uniform"
    memory: MemoryCheck | None
    recompute: tuple[bool, ...]  # per stage
    order: str
    formula_optimal: PlanResult | None = None  # the exact optimum of the objective (None: the plan's scheme is it)
    formula_optimal_simulated_s: float | None = None
    # Planned within the memory limit: the fastest scheme overall, which did not fit (None: it did, or no limit).
    unfitted: Planned | None = None
    # The orders planned within the memory limit over equal batch slices only (every batch grouping was too large a
    # search there); empty when every grouping was searched.
    equal_slices_only: tuple[str, ...] = ()
    # Every scheme's memory (by "terapipe", "gpipe", "uniform"), in the plan's order and recomputation; None values
    # where the profile lacks the sizes.
    scheme_memory: dict[str, MemoryCheck | None] = field(default_factory=dict)
    # The scheme the plan file runs (`SCHEMES`): the TeraPipe plan, or a baseline (`terapipe plan --scheme`).
    scheme: str = "terapipe"

    @property
    def chosen(self) -> PlanResult:
        """The scheme the plan runs: `terapipe`, or the baseline named by ``scheme``."""
        return getattr(self, self.scheme)

    def schedule(self) -> Schedule:
        """The schedule the plan runs in: its scheme, order and recomputation."""
        return Schedule.build(self.chosen.slices, self.request.stages, self.order, self.recompute, self.partition)

    @property
    def partition(self):
        """The layers of every chunk the plan runs (`schedule.partition`)."""
        return self.cost.partition

    def choice_text(self) -> str:
        """``GPipe order`` / ``1F1B order, recomputed on stages 0, 1``: how the plan's steps run (a split order: how
        its I and W are priced, `split_text`)."""
        split = split_text(self.profile, self.chosen.slices) if order_of(self.order).split else None
        return choice_text(self.order, self.recompute, split)

    def memory_choice(self) -> str | None:
        """One line when the plan was chosen to fit the memory limit; None otherwise."""
        if self.unfitted is None:
            return None
        m, before = self.memory, self.unfitted.memory
        only = ""
        if self.equal_slices_only:
            orders = " and ".join(choice_text(o, (False,)) for o in self.equal_slices_only)
            only = f" ({orders}: searched over equal batch slices only, every grouping of this batch is too large)"
        return (
            f"planned within {format_bytes(m.limit_bytes)} {m.limit_source}: {self.terapipe.short_form(fold=True)} "
            f"in {self.choice_text()}, {format_bytes(m.needed_bytes)} at most per stage; the fastest scheme "
            f"overall would need {format_bytes(before.needed_bytes)}{only}"
        )

    def rank_line(self) -> str | None:
        """One line when the simulator chose another scheme than the objective's optimum; None otherwise."""
        best = self.formula_optimal
        if best is None:
            return None
        return (
            f"schedule-aware choice (--rank simulated): simulated {format_seconds(self.simulated_s['terapipe'])} "
            f"against {format_seconds(self.formula_optimal_simulated_s)} for the objective's optimum "
            f"{best.short_form(fold=True)} (formula {format_seconds(self.terapipe.predicted_s)} against "
            f"{format_seconds(best.predicted_s)})"
        )

    def rank_record(self) -> dict:
        """The plan's ``rank`` (docs/design.md §8): how its scheme was chosen, and the formula's optimum."""
        out = {"by": self.request.rank}
        best = self.formula_optimal or self.terapipe
        sim = self.formula_optimal_simulated_s or self.simulated_s["terapipe"]
        out["formula_optimal"] = {"short_form": best.short_form(), "predicted_s": best.predicted_s, "simulated_s": sim}
        return out

    def memory_record(self, name: str) -> dict:
        """A baseline's ``peak_bytes`` (its fullest stage) and ``exceeds_limit`` in the plan file; {} unestimated."""
        check = self.scheme_memory.get(name)
        if check is None:
            return {}
        return {"peak_bytes": check.peak_bytes, "exceeds_limit": check.exceeded}

    def schemes(self) -> list[tuple[str, PlanResult]]:
        return [("terapipe", self.terapipe), ("gpipe", self.gpipe), ("uniform", self.uniform)]

    def speedup_vs_gpipe(self, name: str) -> float:
        """GPipe's step over scheme ``name``'s, both simulated: the one figure the plan ranks its schemes by."""
        return self.simulated_s["gpipe"] / self.simulated_s[name]

    def formula_speedup_vs_gpipe(self, name: str) -> float:
        """The same by the objective (docs/design.md §4), shown beside it."""
        return self.gpipe.predicted_s / getattr(self, name).predicted_s

    def ranked(self) -> list[tuple[str, PlanResult]]:
        """The plan's schemes, fastest in the simulator first (the plan's own first among equals)."""
        first = {"terapipe": 0, "gpipe": 1, "uniform": 2}
        return sorted(self.schemes(), key=lambda x: (self.simulated_s[x[0]], x[0] != self.scheme, first[x[0]]))

    def utilisation(self, name: str | None = None) -> Utilisation:
        """Predicted model TFLOP/s per device and MFU of scheme ``name`` (default: the plan's), by its simulated
        step (`plan.mfu`)."""
        r, prof = self.request, self.profile
        return utilisation(
            prof.model, seq_len=r.seq_len, sequences=r.batch_size, devices=r.stages * r.tensor_parallel,
            step_s=self.simulated_s[name or self.scheme], device=prof.device, precision=prof.precision,
        )  # fmt: skip

    def disagreement_line(self) -> str | None:
        """One line when the objective and the simulator differ by more than `DISAGREE` on the plan's scheme."""
        formula, simulated = self.chosen.predicted_s, self.simulated_s[self.scheme]
        gap = formula / simulated - 1
        if abs(gap) <= DISAGREE:
            return None
        return (
            f"the objective and the simulator disagree on this plan by {gap:+.0%} (formula {format_seconds(formula)}, "
            f"simulated {format_seconds(simulated)}): the schemes are ranked by the simulated step "
            "(the formula counts every transfer inside its tile and the bubble as (K − 1) · largest tile)"
        )

    def allreduce_warning(self) -> str | None:
        """One line when the plan has replicas whose gradient all-reduce the profile cannot price."""
        why = self.cost.allreduce_unpriced
        if why is None:
            return None
        return (
            f"{why}: planned without the gradient all-reduce of the {self.request.data_parallel} replicas "
            "(`terapipe profile` measures it; --analytic estimates it)"
        )

    def allreduce_record(self) -> dict | None:
        """The plan's ``data_parallel_allreduce`` (docs/design.md §8): how the replicas' gradient all-reduce
        was priced; None with one replica."""
        if self.request.data_parallel == 1:
            return None
        why = self.cost.allreduce_unpriced
        if why is not None:
            return {"priced": False, "seconds": None, "why": f"unknown — not priced: {why}"}
        p = self.profile
        link = {"latency_s": p.dp_latency_s, "bytes_per_s": p.dp_bytes_per_s}
        return {"priced": True, "seconds": self.cost.allreduce_s, "link": link}

    def to_plan_dict(self, profile_path: str | None, experiment: dict | None = None) -> dict:
        """The ``terapipe.plan/1`` object that `terapipe train` runs; ``profile_path`` None for a profile that is
        no file (estimated for ``experiment``, the plan's record of the experiment file it was made for)."""
        r, best, prof = self.request, self.chosen, self.profile
        allreduce = self.allreduce_record()
        extra = {} if allreduce is None else {"data_parallel_allreduce": allreduce}
        if experiment is not None:
            extra["experiment"] = experiment
        if self.scheme != "terapipe":  # a baseline to train (`terapipe plan --scheme`), as plan.baseline marks one
            extra.update(scheme=self.scheme, microbatch=best.extra["microbatch"])
        memory = self.scheme_memory.get(self.scheme, self.memory)
        return make_plan_dict(
            model=prof.model,
            stages=r.stages,
            batch_size=r.batch_size,
            seq_len=r.seq_len,
            token_step=r.token_step,
            slices=best.slices,
            predicted_s=best.predicted_s,
            data_parallel=r.data_parallel,
            precision=prof.precision,
            tensor_parallel=r.tensor_parallel,
            order=self.order,
            recompute=list(self.recompute),
            partition=self.partition,
            loss_chunk_tokens=planned_loss_chunk_tokens(prof),
            simulated_s=self.simulated_s[self.scheme],
            t_max_s=best.t_max_s,
            sum_s=best.sum_s,
            tiles=best.tiles,
            step_s=self.cost.step_s,
            speedup_vs_gpipe=self.speedup_vs_gpipe(self.scheme),
            speedup_vs_gpipe_formula=self.formula_speedup_vs_gpipe(self.scheme),
            **_utilisation_record(self.utilisation()),
            baselines={
                "gpipe": {
                    **self.gpipe.to_dict(),
                    "microbatch": self.gpipe.extra["microbatch"],
                    "simulated_s": self.simulated_s["gpipe"],
                    **_utilisation_record(self.utilisation("gpipe")),
                    **self.memory_record("gpipe"),
                },
                "uniform": {
                    **self.uniform.to_dict(),
                    **self.uniform.extra,
                    "simulated_s": self.simulated_s["uniform"],
                    **_utilisation_record(self.utilisation("uniform")),
                    **self.memory_record("uniform"),
                },
            },
            memory=None if memory is None else memory.to_dict(),
            rank=self.rank_record(),
            solver={"method": r.method, "epsilon": r.epsilon, "seconds": best.seconds, "candidates": best.candidates},
            profile={
                "path": profile_path,
                "sha256": prof.sha256,
                "source": prof.source,
                "device": prof.device.get("name"),
                "kind": prof.device.get("kind"),
                **provenance_record(prof),
            },
            created=utc_timestamp(),
            terapipe_version=__version__,
            **extra,
        )


def _utilisation_record(u: Utilisation) -> dict:
    """A plan file's ``model_tflops`` and ``mfu`` (null where the device's peak is unknown), and the peak used."""
    return {"model_tflops": u.model_tflops, "mfu": u.mfu, "peak_tflops": u.peak_tflops}


def choice_text(order: str, recompute: tuple[bool, ...], split: str | None = None) -> str:
    """``GPipe order``, ``1F1B order, recomputed``, ``GPipe order, recomputed on stage 0``, ``… on stages 0–33, 39``;
    a split order says how its I and W are priced where ``split`` says it (`split_text`)."""
    kind = order_of(order)
    text = kind.title
    if kind.split and split:
        text += f" ({split})"
    if all(recompute):
        return text + ", recomputed"
    if any(recompute):
        text += f", recomputed on {format_stages(recompute)}"
    return text


# How a profile of schema /2 has its I and W (`Profile.split_source`): only a measured one timed them
# (`plan.configs.split_timed`).
_SPLIT_SOURCES = {
    "measured": "timed apart (measured)",
    "analytic": "an estimate, not timed (analytic profile)",
    "operators": "an estimate from timed operators, not timed apart (operator profile)",
    "example": "an estimate, not timed (example profile)",
}


def split_text(profile: Profile, slices) -> str:
    """How a split order's I and W are priced, as shares of the backward of the tiles of ``slices`` (one layer,
    their context included): ``I 61%, W 47% of the tiles' backward, timed apart (measured)`` (a measured profile of
    schema /2, whose split can cost more than the whole backward), ``…, an estimate, not timed (analytic profile)``,
    or ``I 58% of the tiles' backward, an estimate by the architecture's analytic ratio (a profile of schema /1, not
    timed apart)`` (W the rest). Only the first is planned by ``--order auto`` (`plan.configs.split_timed`)."""
    b, i, j = (np.array(x, dtype=float) for x in zip(*_tiles(slices), strict=True))
    whole, inputs, weights = (
        float(np.sum(cost.no_context(b, i) + cost.context(b, i, j)))
        for cost in (CostModel(profile.only(part), 1) for part in ("backward", "input", "weight"))
    )
    share_i, share_w = inputs / whole, weights / whole
    if profile.split_source == "ratio":
        return (
            f"I {share_i:.0%} of the tiles' backward, an estimate by the architecture's analytic ratio (a profile of "
            "schema /1, not timed apart)"
        )
    return f"I {share_i:.0%}, W {share_w:.0%} of the tiles' backward, {_SPLIT_SOURCES[profile.split_source]}"


def _tiles(slices) -> list[tuple[int, int, int]]:
    """(b, i, j) of every tile of ``slices``."""
    out = []
    for b, lengths in slices:
        j = 0
        for i in lengths:
            out.append((b, i, j))
            j += i
    return out


@memo.sharing()  # the schemes' searches, layouts and tile prices, each made once within the plan (`schedule.memo`)
def plan_for_profile(profile: Profile, request: PlanRequest, *, ceiling: float = math.inf) -> Planned | None:
    """Plan ``request`` on ``profile``: the fastest scheme (`plan_one`), or, when it does not fit an enforced
    memory limit, the fastest that does (`plan_within_memory`). ``ceiling`` (seconds, by the objective): only a plan
    faster than it is wanted within the limit; None when there is none (never without a ceiling)."""
    planned = plan_one(profile, request)
    memory = planned.memory
    if memory is None or not memory.enforced or not memory.exceeded:
        return planned
    return plan_within_memory(profile, request, planned, ceiling=ceiling)


@memo.sharing()  # as `plan_for_profile`
def plan_one(
    profile: Profile,
    request: PlanRequest,
    best: PlanResult | None = None,
    *,
    order: str | None = None,
    recompute: tuple[bool, ...] | None = None,
) -> Planned:
    """Plan ``request`` on ``profile``: the exact (or enumerated) TeraPipe scheme (or ``best``, already chosen), GPipe
    and the best uniform slicing, each simulated, and the TeraPipe plan's memory per stage. ``order`` and
    ``recompute`` (per stage) default to the request's."""
    r = request
    order = order or r.order
    partition = r.fixed_partition(profile.model.layers)
    recompute = tuple(recompute) if recompute is not None else (r.recompute,) * partition.chunks
    # Tensor parallelism needs nothing more here: a profile at T holds the numbers of one device of a stage's T
    # (tile times with the tensor-parallel all-reduces inside them, params_per_layer and activation bytes of one
    # rank's shard). So the data-parallel all-reduce priced from params_per_layer is each rank's shard over the D
    # replicas, as the T ranks of a stage run it side by side; a tile's transfer is the full (b, i, H) activation
    # each rank sends to the same rank of the next stage; and the memory estimate is per device.
    # Recomputation on any stage prices every tile with one more forward: the formula's stages are alike, and the
    # slowest one sets the pace (the simulator below charges it on the recomputing stages only).
    cost = CostModel(
        profile, r.stages, r.data_parallel, recompute=any(recompute), within_profile=True, partition=partition
    )
    shape = {"seq_len": r.seq_len, "batch_size": r.batch_size, "stages": r.stages}
    if best is None:
        near = RERANK_NEIGHBOURS if r.rank == "simulated" else 0
        best = solve(cost, **shape, token_step=r.token_step, epsilon=r.epsilon, method=r.method, neighbours=near)
    if best is None:
        raise UserError(outside_profile(profile, r.batch_size, "no batch slicing"), where="--batch")
    gpipe = gpipe_baseline(cost, **shape)
    uniform = uniform_baseline(cost, **shape, token_step=r.token_step)
    if gpipe is None or uniform is None:  # the uniform schemes include GPipe's: both or neither
        raise UserError(outside_profile(profile, r.batch_size, "no GPipe microbatch dividing it"), where="--batch")
    # The formula prices every tile's transfers inside the tile; the simulator replays the schedule with
    # asynchronous sends, as the runtime runs it. Both are reported; the simulator judges (`_rerank`).
    # All three in the same order and recomputation: they differ only in how the batch is sliced.
    timed = _Timed(r, cost, order, recompute)
    optimum, optimum_sim = best, None
    if r.rank == "simulated":
        best, optimum_sim = _rerank(profile, r, best, timed, (gpipe, uniform))
        # The search that found the optimum: its time and candidates stay with the plan's scheme.
        best = replace(best, seconds=optimum.seconds, candidates=optimum.candidates, extra={}, alternatives=[])
        if best.slices == optimum.slices:
            best, optimum_sim = optimum, None
    simulated = {"terapipe": timed(best), "gpipe": timed(gpipe), "uniform": timed(uniform)}
    copies = r.data_parallel * r.tensor_parallel
    memory = {
        name: check_memory(timed.memory(res, profile), profile.device, r.memory_limit_gib, copies)
        for name, res in (("terapipe", best), ("gpipe", gpipe), ("uniform", uniform))
    }
    return Planned(
        profile, r, cost, best, gpipe, uniform, simulated, memory["terapipe"], recompute, order,
        formula_optimal=optimum if optimum is not best else None, formula_optimal_simulated_s=optimum_sim,
        scheme_memory=memory,
    )  # fmt: skip


def outside_profile(profile: Profile, batch_size: int, what: str) -> str:
    """The one line when the profile's batch sizes cannot make up the batch (`plan.domain`)."""
    d = domain_of(profile)
    return (
        f"{what} of {batch_size} sequences uses only batch slices of {d.smallest}–{d.largest} sequences, the sizes "
        f"{profile.path or 'the profile'} timed; profile smaller batch slices too (`terapipe profile --batch-sizes "
        f"1,{','.join(str(b) for b in d.grid if b > 1)}`)"
    )


class _Timed:
    """Schemes simulated and walked for memory in one order and recomputation on one cost model, each once (by its
    slices): the re-ranking, the memory checks and the plan ask for the same schemes. Neither builds the scheme's
    schedule (`simulate.scheme_latency`, `memory.scheme_memory`: the order's layout, shared within the plan, walked
    with the scheme's tiles) — building Megatron-LM's 1008B schedules took a third of its plan."""

    def __init__(self, r: PlanRequest, cost: CostModel, order: str, recompute: tuple[bool, ...]) -> None:
        self.r, self.cost, self.order, self.recompute = r, cost, order, recompute
        self._seconds: dict[tuple, float] = {}
        self._memory: dict[tuple, list] = {}

    def memory(self, res: PlanResult, profile: Profile) -> list:
        """`stage_memory` of the scheme's schedule."""
        key = _key(res)
        if key not in self._memory:
            self._memory[key] = scheme_memory(
                profile, res.slices, self.r.stages, self.order, self.recompute, self.cost.partition
            )
        return self._memory[key]

    def __call__(self, res: PlanResult) -> float:
        """`simulated_latency` of the scheme's schedule."""
        key = _key(res)
        if key not in self._seconds:
            self._seconds[key] = scheme_latency(
                self.cost, res.slices, self.r.stages, self.order, self.recompute, self.cost.partition
            )
        return self._seconds[key]


def _key(res: PlanResult) -> tuple:
    return tuple((b, tuple(lengths)) for b, lengths in res.slices)


def _rerank(
    profile: Profile, r: PlanRequest, optimum: PlanResult, timed: _Timed, baselines: tuple[PlanResult, ...]
) -> tuple[PlanResult, float]:
    """The schedule-aware choice (`RANKS`), one judge for the plan and its baselines: the fastest simulated among
    ``optimum``, its alternatives within `RERANK_WITHIN` by the objective and the ``baselines`` the plan shows (GPipe
    and the best uniform slicing are TeraPipe schemes too), keeping only those that fit an enforced memory limit when
    the optimum does; returns it and the optimum's simulated latency. Among equal times the earlier wins (the
    optimum first)."""
    close = [a for a in optimum.alternatives if a.predicted_s <= optimum.predicted_s * (1 + RERANK_WITHIN)]
    candidates = [optimum, *close[:RERANK_COUNT], *baselines]

    def fits(res: PlanResult) -> bool:
        per_stage = timed.memory(res, profile)
        check = check_memory(per_stage, profile.device, r.memory_limit_gib, r.data_parallel * r.tensor_parallel)
        return check is None or not (check.enforced and check.exceeded)

    if not fits(optimum):
        fits = lambda res: True  # noqa: E731  (the memory-aware search takes over from here)
    best_s, chosen = timed(optimum), optimum
    for res in candidates[1:]:
        seconds = timed(res)
        if seconds < best_s and fits(res):
            best_s, chosen = seconds, res
    return chosen, timed(optimum)


class _Forbidding:
    """A cost model under which tiles that do not fit the memory limit cost +inf (`planner.solve` skips them).
    ``key`` (hashable) names the tiles that fit, on the grid searched: the search shares its prices, tables and
    answers within one plan (`schedule.memo`, `CostModel.price_key`) with every other search of the same cost and
    fit."""

    def __init__(self, cost: CostModel, fits, key: tuple) -> None:
        self.cost, self.fits, self.step_s, self.max_batch_slice = cost, fits, cost.step_s, cost.max_batch_slice
        self.virtual = cost.virtual
        inner = cost.bubble
        self.bubble = None if inner is None else (lambda b, i, j: np.where(fits(i, j), inner(b, i, j), np.inf))
        self.price_key = (*cost.price_key, "fitting", key)

    def __call__(self, b, i, j):
        return np.where(self.fits(i, j), self.cost(b, i, j), np.inf)

    def grid_prices(self, sizes, i, j, grid: tuple) -> tuple[np.ndarray, np.ndarray]:
        """`CostModel.grid_prices`, +inf where a tile does not fit."""
        allowed = np.asarray(self.fits(i, j))
        total, bubble = self.cost.grid_prices(sizes, i, j, grid)
        fitted = np.where(allowed, total, np.inf)
        return fitted, (fitted if bubble is total else np.where(allowed, bubble, np.inf))


def plan_within_memory(
    profile: Profile, request: PlanRequest, fastest: Planned, *, ceiling: float = math.inf
) -> Planned | None:
    """The fastest scheme whose estimated peak fits the limit on every stage (docs/design.md §10), exactly:

    1. The fastest scheme overall without recomputation, in the other order (its price does not depend on the order).
    2. Otherwise, for each order: the fastest scheme without recomputation among the batch groupings that fit
       (the token slicing does not change a stage's peak then), and the fastest recomputed one, each batch slice's
       tiles restricted by its place in the grouping (`groupings.grouping_search`, `planner.solve(grouping=…)`). The
       formula prices recomputation alike whichever stages recompute, and recomputing never raises a stage's peak,
       so the recomputed search lets every stage recompute; the plan then recomputes only on the stages its scheme
       does not fit without. The fastest candidate by the formula wins, ties to the simulator.

    Where every batch grouping is too large a search (`groupings.MAX_GROUPING_STATES`, `MAX_GROUPING_CELLS`), the same
    search runs over equal batch slices (`_equal_slice_candidates`) and the plan says so. The order and the
    recomputation are searched only where the user left them free. Nothing fits: one line with the smallest peak
    any scheme could reach. ``ceiling``: every search prunes against it (`search.solve(ceiling=…)`, the search over
    partitions passes its runner-up) and None is returned when something fits but nothing below it.
    """
    r, limit = request, fastest.memory.limit_bytes
    partition = r.fixed_partition(profile.model.layers)
    if partition.virtual > 1:
        raise ValueError("the memory-aware search is for one chunk per device (`plan.configs` checks v > 1 alone)")
    orders = ORDERS if r.order_free else (r.order,)
    plain_ok = r.recompute_free or not r.recompute  # schemes without recomputation are allowed
    recompute_ok = r.recompute_free or r.recompute
    plain = (False,) * r.stages
    optimum = fastest.formula_optimal or fastest.terapipe
    if plain_ok:
        fit = [o for o in orders if _fits(profile, optimum.slices, partition, o, plain, limit)]
        if fit:
            planned = [plan_one(profile, r, optimum, order=o, recompute=plain) for o in fit]
            return replace(min(planned, key=lambda p: p.simulated_s["terapipe"]), unfitted=fastest)
    sizes = stage_sizes(profile, r.stages, partition)
    costs = {
        rerun: CostModel(profile, r.stages, r.data_parallel, recompute=rerun, within_profile=True, partition=partition)
        for rerun in (False, True)
    }
    shape = {"seq_len": r.seq_len, "batch_size": r.batch_size, "stages": r.stages, "token_step": r.token_step}
    search = {"epsilon": r.epsilon, "method": r.method, "neighbours": RERANK_NEIGHBOURS if r.rank == "simulated" else 0}
    search["ceiling"] = ceiling
    pruned = False  # a scheme fits, but none below the ceiling
    modes = [rerun for rerun, ok in ((False, plain_ok), (True, recompute_ok)) if ok]
    candidates: list[tuple[PlanResult, str, tuple[bool, ...]]] = []
    equal_only: list[str] = []
    # One batch slice runs the same actions in either order: search it once.
    for order in orders if r.batch_size > 1 else orders[:1]:
        for rerun in modes:
            grouping = grouping_search(sizes, r.batch_size, r.seq_len, r.token_step, order, limit, rerun)
            if grouping is None:
                equal_only += [order] if order not in equal_only else []
                found = _equal_slice_candidates(r, sizes, costs, order, rerun, limit, shape, search)
                pruned |= any(res.predicted_s >= ceiling for res, _, _ in found)
                candidates += [c for c in found if c[0].predicted_s < ceiling]
                continue
            res = solve(costs[rerun], **shape, **search, grouping=grouping) if grouping.moves else None
            if res is None:
                continue
            if res.predicted_s >= ceiling:
                pruned = True
                continue
            on = (True,) * r.stages
            if rerun and r.recompute_free:  # recompute only where the scheme does not fit without
                plain_peaks = grouping_peaks([b for b, _ in res.slices], None, sizes, r.seq_len, order, plain)
                on = tuple(peak > limit for peak in plain_peaks)
                if not any(on):  # it fits without: the search without recomputation has it, priced lower
                    continue
            candidates.append((res, order, on if rerun else plain))
    if not candidates:
        if pruned:
            return None
        raise _nothing_fits(profile, r, fastest.memory, plain_ok, recompute_ok)
    # The fastest by the formula; among equals (the same scheme in either order, say), the simulator decides.
    least = min(res.predicted_s for res, _, _ in candidates)
    tied = [c for c in candidates if c[0].predicted_s <= least * (1 + 1e-12)]
    if len(tied) > 1:
        tied.sort(key=lambda c: _simulated(profile, r, *c))
    res, order, on = tied[0]
    planned = plan_one(profile, r, res, order=order, recompute=on)
    return replace(planned, unfitted=fastest, equal_slices_only=tuple(equal_only))


def _equal_slice_candidates(
    r: PlanRequest, sizes, costs: dict, order: str, rerun: bool, limit: float, shape: dict, search: dict
) -> list[tuple[PlanResult, str, tuple[bool, ...]]]:
    """`plan_within_memory`'s search over D equal batch slices of every b dividing B (`memory.EqualSlices`), for
    one order, without or with recomputation (only on the stages that do not fit without)."""
    out = []
    for b in divisors(r.batch_size):
        eq = EqualSlices(sizes, b, r.batch_size // b, r.seq_len, order, limit)
        fits_plain = eq.fits_plain()
        if not rerun:
            res = solve(costs[False], **shape, **search, batch_slice=b) if all(fits_plain) else None
            on = (False,) * r.stages
        else:
            # With --recompute every stage recomputes; left free, exactly those that do not fit without.
            on = (True,) * r.stages if not r.recompute_free else tuple(not p for p in fits_plain)
            if not any(on):
                continue
            fits = lambda i, j, eq=eq, on=on: eq.tile_fits(i, j, stages=on)  # noqa: E731
            # Named by the tiles that fit: in either order, alike fits share one search (`_Forbidding`).
            allowed = np.asarray(fits(*grid_tiles(r.seq_len // r.token_step, r.token_step)))
            key = (allowed.shape, hashlib.sha256(np.packbits(allowed)).hexdigest())
            res = solve(_Forbidding(costs[True], fits, key), **shape, **search, batch_slice=b)
        if res is not None:
            out.append((res, order, on))
    return out


def _simulated(profile: Profile, r: PlanRequest, res: PlanResult, order: str, recompute: tuple[bool, ...]) -> float:
    partition = r.fixed_partition(profile.model.layers)
    cost = CostModel(profile, r.stages, r.data_parallel, within_profile=True, partition=partition)
    return scheme_latency(cost, res.slices, r.stages, order, recompute, partition)


def _fits(profile: Profile, slices, partition, order: str, recompute: tuple[bool, ...], limit: float) -> bool:
    per_stage = scheme_memory(profile, slices, partition.devices, order, recompute, partition)
    return max(m.total_bytes for m in per_stage) <= limit


def smallest_peak(
    profile: Profile, request: PlanRequest, limit_bytes: float, *, plain: bool = True, recomputed: bool = True
) -> tuple[float, str]:
    """The smallest peak any scheme could reach on its fullest stage (bytes), and how (``1F1B order, recomputed,
    batch slices of 1, tiles of 8 tokens``): without or with recomputation as allowed.

    Equal batch slices suffice: batch slices of one sequence reach the least of every stage's peak at once, since
    each open batch slice holds at least one sequence (W only grows with coarser groupings) and a recomputed
    tile's re-run grows with its batch slice (docs/design.md §10; the tests check it against every scheme)."""
    r = request
    sizes = stage_sizes(profile, r.stages, r.fixed_partition(profile.model.layers))
    least, how = math.inf, ""
    for b in divisors(r.batch_size):
        for order in ORDERS if r.order_free else (r.order,):
            eq = EqualSlices(sizes, b, r.batch_size // b, r.seq_len, order, limit_bytes)
            without = [eq.plain_bytes(k) if plain else math.inf for k in range(r.stages)]
            # Recomputed, the smallest peak has tiles of one token step (the last one's context is L − g).
            rerun = [
                float(eq.recomputed_bytes(k, r.token_step, r.seq_len - r.token_step)) if recomputed else math.inf
                for k in range(r.stages)
            ]
            per_stage = [min(p, q) for p, q in zip(without, rerun, strict=True)]
            if max(per_stage) < least:
                least = max(per_stage)
                on = tuple(q < p for p, q in zip(without, rerun, strict=True))
                how = f"{choice_text(order, on)}, batch slices of {b}, tiles of {r.token_step} tokens"
    return least, how


class NothingFits(UserError):
    """No scheme fits the memory limit (one line with the smallest peak any could reach, ``least_bytes``)."""

    def __init__(self, message: str, least_bytes: float) -> None:
        super().__init__(message, where="--memory-limit")
        self.least_bytes = least_bytes


def _nothing_fits(
    profile: Profile, r: PlanRequest, memory: MemoryCheck, plain_ok: bool, recompute_ok: bool
) -> NothingFits:
    """The one line when no scheme fits: the smallest peak any could reach, and how."""
    least, how = smallest_peak(profile, r, memory.limit_bytes, plain=plain_ok, recomputed=recompute_ok)
    layers = r.fixed_partition(profile.model.layers)
    cut = "" if layers.even else f", layers {layers.text()}"
    return NothingFits(
        f"no scheme fits the {format_bytes(memory.limit_bytes)} {memory.limit_source}: the smallest possible peak is "
        f"{format_bytes(least)} ({how}{cut}); use more stages, a smaller batch, or tensor parallelism",
        least,
    )
