"""Measured tuning (`terapipe plan --tune N`): where the simulator is uncertain, train its best few plans on this
machine and keep the one measured fastest — as Triton's and cuBLAS's autotuners time their candidate kernels rather
than trust a model. Imports no torch: the training is a function handed in (`Measure`; `train.tune` runs
`terapipe train`), so the choice is the same under a test's fake clock.

The candidates are the simulator's top N among every configuration the planner planned (`plan.configs`: each v,
order and partition it compared) and the chosen configuration's uniform scheme, plus its GPipe scheme, always (the
baseline a plan must beat). Each round trains every candidate once, in the same order (A B C, A B C, ...), so
drift in the machine's speed hits all alike; a run's first `WARMUP_STEPS` steps are not timed. The plan is the
candidate with the least median step over all rounds; the plan file's ``tuning`` records each candidate's
predicted (simulated) step and what was measured (median, min, max, steps timed).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from terapipe_cli.config.device import same_device_name
from terapipe_cli.errors import UserError
from terapipe_cli.plan.choice import Planned
from terapipe_cli.plan.configs import Configured, describe
from terapipe_cli.plan.costmodel import Profile

ROUNDS = 3  # every candidate trained once per round
STEPS = 3  # steps of each run
WARMUP_STEPS = 1  # the first steps of a run, not timed (allocations, first-touch pages, the workers' start)

# Trains the plan (a plan file's object) for ``steps`` steps on this machine: the seconds of every step, in order.
Measure = Callable[[dict, int], list[float]]

_SCHEMES = {"terapipe": "TeraPipe", "gpipe": "GPipe", "uniform": "uniform"}


def check_tunable(profile: Profile, here: dict, *, count: int, scheme: str, data: bool = False) -> None:
    """Refuse, in one line, what cannot be tuned here: a count below 1, a fixed ``--scheme``, ``--data`` (``data``:
    the candidates train on the embedded text, whose attention is not what the plan prices), a profile that was not
    measured (an analytic or example one predicts a device it never timed) or one measured on another device than
    ``here`` (this machine's device of the profile's kind: ``{"kind", "name"}``, as a profile records it)."""
    if count < 1:
        raise UserError(f"must be at least 1 (the simulator's best plans to train), got {count}", where="--tune")
    if scheme != "terapipe":
        raise UserError(f"and --scheme {scheme} contradict each other: --tune chooses the scheme", where="--tune")
    if data:
        raise UserError(
            "and --data contradict each other: the candidates train on the embedded text, not on the corpus whose "
            "documents price the plan's attention; tune without --data",
            where="--tune",
        )
    where = profile.path or "the profile"
    if profile.source != "measured":
        raise UserError(
            f"{where} is an {profile.source!r} profile, timed on no device: --tune trains where a measured "
            "profile was made; make one here with `terapipe profile`",
            where="--tune",
        )
    kind, name = profile.device.get("kind"), str(profile.device.get("name"))
    if kind != here.get("kind") or not same_device_name(name, str(here.get("name"))):
        raise UserError(
            f"{where} was measured on {name} ({kind}), but this machine trains on {here.get('name')} "
            f"({here.get('kind')}): tune where the profile was made, or profile this machine",
            where="--tune",
        )


def candidates(configured: Configured, count: int) -> list[Planned]:
    """The simulator's ``count`` fastest distinct plans (module docstring), then the chosen configuration's GPipe
    scheme unless it is among them."""
    chosen = configured.planned
    pool = [*(configured.considered or (chosen,)), replace(chosen, scheme="uniform")]
    pool.sort(key=_simulated)  # stable: among equals, the planner's own first
    out: list[Planned] = []
    for planned in pool:
        if len(out) < count and _key(planned) not in {_key(p) for p in out}:
            out.append(planned)
    gpipe = replace(chosen, scheme="gpipe")
    return out if _key(gpipe) in {_key(p) for p in out} else [*out, gpipe]


@dataclass(frozen=True)
class Measured:
    """One candidate: the plan, its predicted (simulated) step and the steps timed on this machine."""

    planned: Planned
    step_s: tuple[float, ...]

    @property
    def label(self) -> str:
        """``TeraPipe [(4, [64] + [192]*5)], 1F1B order, 2 virtual stages, layers 1 1 | 1 1``."""
        p = self.planned
        return f"{_SCHEMES[p.scheme]} {p.chosen.short_form(fold=True)}, {describe(p)}"

    @property
    def predicted_s(self) -> float:
        return _simulated(self.planned)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    def record(self, chosen: bool) -> dict:
        p = self.planned
        return {
            "label": self.label,
            "scheme": p.scheme,
            "short_form": p.chosen.short_form(),
            "order": p.order,
            "virtual_stages": p.partition.virtual,
            "layers_per_stage": list(p.partition.layers),
            "predicted_s": self.predicted_s,
            "measured": {
                "median_s": self.median_s,
                "min_s": min(self.step_s),
                "max_s": max(self.step_s),
                "steps": len(self.step_s),
            },
            "chosen": chosen,
        }


@dataclass(frozen=True)
class Tuned:
    """The candidates as measured, and the plan: the least median step."""

    measured: tuple[Measured, ...]
    device: str  # where they were measured
    rounds: int
    steps: int

    @property
    def chosen(self) -> Measured:
        return min(self.measured, key=lambda m: m.median_s)  # among equals, the simulator's order

    def record(self) -> dict:
        """The plan file's ``tuning``."""
        return {
            "by": "the least median step measured",
            "device": self.device,
            "rounds": self.rounds,
            "steps_per_run": self.steps,
            "warmup_steps": WARMUP_STEPS,
            "candidates": [m.record(m is self.chosen) for m in self.measured],
        }

    def lines(self) -> list[str]:
        """Each candidate, predicted against measured (the plan marked), and what the plan is."""
        out = [f"tuned on {self.device}: {self.rounds} rounds of {self.steps} steps per candidate, the first of each "
               "not timed; median step (min–max) against the simulated step:"]  # fmt: skip
        for m in sorted(self.measured, key=lambda m: m.median_s):
            s = m.step_s
            mark = "*" if m is self.chosen else " "
            out.append(
                f" {mark} {m.median_s * 1e3:9.1f} ms ({min(s) * 1e3:.1f}–{max(s) * 1e3:.1f}, {len(s)} steps), "
                f"predicted {m.predicted_s * 1e3:.1f} ms: {m.label}"
            )
        first = min(self.measured, key=lambda m: m.predicted_s)
        if first is not self.chosen:
            gain = first.median_s / self.chosen.median_s - 1
            out.append(f"the plan is the measured fastest (*), {gain:.1%} faster here than the simulator's first")
        others = [m for m in self.measured if m is not self.chosen]
        if any(min(m.step_s) <= max(self.chosen.step_s) for m in others):
            out.append(
                "its steps' range overlaps another's: the difference is within this machine's noise (an idle one "
                "tells better)"
            )
        return out


def tune(
    plans: list[Planned],
    to_dict: Callable[[Planned], dict],
    measure: Measure,
    *,
    device: str,
    rounds: int = ROUNDS,
    steps: int = STEPS,
    progress: Callable[[str], None] | None = None,
) -> Tuned:
    """Train every plan of ``plans`` ``steps`` steps (``measure`` on its plan file's object, ``to_dict``) once per
    round, in the same order each round; the steps after the warm-up, per plan."""
    if steps <= WARMUP_STEPS:
        raise ValueError(f"a run of {steps} steps times none after the {WARMUP_STEPS} of warm-up")
    objects = [to_dict(p) for p in plans]
    timed: list[list[float]] = [[] for _ in plans]
    for r in range(rounds):
        for n, obj in enumerate(objects):
            seconds = measure(obj, steps)
            if len(seconds) < steps:
                raise UserError(
                    f"a run of {plans[n].chosen.short_form(fold=True)} recorded {len(seconds)} of its {steps} steps",
                    where="--tune",
                )
            timed[n] += seconds[WARMUP_STEPS:]
            if progress is not None:
                median = statistics.median(seconds[WARMUP_STEPS:]) * 1e3
                progress(f"round {r + 1} of {rounds}, plan {n + 1} of {len(plans)}: {median:.1f} ms a step")
    measured = tuple(Measured(p, tuple(t)) for p, t in zip(plans, timed, strict=True))
    return Tuned(measured, device, rounds, steps)


def _simulated(planned: Planned) -> float:
    return planned.simulated_s[planned.scheme]


def _key(planned: Planned) -> tuple:
    """What makes two plans train alike: the slicing run, the order, the recomputation and the layers' chunks."""
    slices = tuple((b, tuple(lengths)) for b, lengths in planned.chosen.slices)
    return slices, planned.order, tuple(planned.recompute), planned.partition
