"""A finished run directory, loaded and checked once, for the report (format: `terapipe_cli.train.rundir`).

Everything the report needs is read here through the runtime's own readers, and every way a folder can fail
to be a usable run (not a run at all, an unfinished run, a corrupt ``metrics.jsonl``, a missing timeline) is
one `UserError` naming the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from terapipe_cli.config.run import RunArguments, RunConfig, run_fields
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import Plan, plan_from_dict
from terapipe_cli.schedule.schedule import Schedule, plan_tiles
from terapipe_cli.schedule.timeline import Event, read_timeline
from terapipe_cli.train.rundir import (
    read_config,
    read_metrics,
    read_summary,
    run_schedule,
    segment_dirs,
    timeline_path,
)


@dataclass
class Segment:
    """Steps ``first_step``..``last_step`` of a run resumed under another plan, D or T, trained under an earlier
    one: its plan, arguments and ranks' events (`rundir.close_segment`). ``plan`` is None for steps whose plan a
    run from before segments were kept did not record (their timelines were removed at the resume)."""

    first_step: int
    last_step: int
    plan: Plan | None
    args: RunArguments | None
    events: dict[int, list[Event]]

    @property
    def layout(self) -> Layout:
        return Layout(self.args.data_parallel, self.plan.stages, self.args.tensor_parallel)


@dataclass
class Run:
    """One complete training run: its plan and arguments, one metrics record per step, every rank's events.

    ``plan``, ``args`` and ``events`` are those of the plan the run finished under; a run resumed under another
    plan, D or T trained its steps before ``first_step`` under the ``earlier`` segments'."""

    path: Path
    config: dict
    args: RunArguments
    plan: Plan
    metrics: list[dict]  # one per step, in step order, steps 1..args.steps
    events: dict[int, list[Event]]  # rank -> events of its steps under this plan (first_step..)
    summary: dict
    earlier: list[Segment] = field(default_factory=list)

    @property
    def first_step(self) -> int:
        """The first step trained under the run's own (last) plan."""
        return self.earlier[-1].last_step + 1 if self.earlier else 1

    @property
    def own_steps(self) -> list[int]:
        """The steps trained under the run's own plan: those its timings describe."""
        return [s for s in self.steps if s >= self.first_step]

    @property
    def stages(self) -> int:
        return self.plan.stages

    @property
    def schedule(self) -> Schedule:
        """The schedule the run walked: its own (``--schedule``) or its plan's."""
        return run_schedule(self.plan, self.args, where=str(self.path / "config.json"))

    @property
    def layout(self) -> Layout:
        """D replicas × K stages × T tensor ranks (T is 1 in runs from before tensor parallelism)."""
        return Layout(self.args.data_parallel, self.plan.stages, self.args.tensor_parallel)

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def tiles(self) -> int:
        """Tiles per pipeline per step (M in the bubble formula)."""
        return len(plan_tiles(self.plan.slices))

    @property
    def tokens_per_step(self) -> int:
        """Tokens trained on per step over all replicas."""
        return self.plan.batch_size * self.args.data_parallel * self.plan.seq_len

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.metrics]

    def step_events(self, step: int, replica: int | None = None) -> list[Event]:
        """The events of one step of the run's own plan (optionally of one replica), times from that step's start:
        every stage's, as its tensor rank 0 ran them (a stage's T ranks run the same tiles together, so one stands
        for the stage)."""
        layout, out = self.layout, []
        for rank, events in self.events.items():
            if layout.tensor_rank(rank) != 0 or (replica is not None and layout.replica(rank) != replica):
                continue
            out.extend(e for e in events if e.step == step)
        return sorted(out, key=lambda e: (e.stage, e.start_s))

    def metric(self, step: int) -> dict:
        return self.metrics[step - 1]


def load_run(path: str | Path) -> Run:
    """Load a finished run directory; raises UserError when it is not one (naming the file and what is wrong)."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise UserError("run directory not found", where=str(run_dir))
    if not run_dir.is_dir():
        raise UserError("is not a run directory (a file, not a folder)", where=str(run_dir))
    if not (run_dir / "config.json").exists():
        raise UserError("is not a run directory of `terapipe train` (no config.json)", where=str(run_dir))
    config, args, plan = _config(run_dir)
    if not (run_dir / "summary.json").exists():
        raise UserError(
            "the run did not finish (no summary.json); finish it with `terapipe train --resume`", where=str(run_dir)
        )
    summary = read_summary(run_dir)
    if summary.get("status") != "complete":
        raise UserError(
            f"field 'status' is {summary.get('status')!r}, expected 'complete'", where=str(run_dir / "summary.json")
        )
    metrics = _metrics(run_dir, args.steps)
    earlier = []
    for folder, first, last in segment_dirs(run_dir):  # each earlier plan's steps, read under that plan
        _, seg_args, seg_plan = _config(folder)
        layout = Layout(seg_args.data_parallel, seg_plan.stages, seg_args.tensor_parallel)
        earlier.append(Segment(first, last, seg_plan, seg_args, _events(folder, layout, first, last)))
    first = earlier[-1].last_step + 1 if earlier else 1
    layout = Layout(args.data_parallel, plan.stages, args.tensor_parallel)
    if not earlier:
        # A run resumed under another plan before segments were kept: its timelines start after the resume.
        start = _unrecorded_start(run_dir, layout, args.steps)
        if start > 1:
            earlier, first = [Segment(1, start - 1, None, None, {})], start
    events = _events(run_dir, layout, first, args.steps)
    return Run(run_dir, config, args, plan, metrics, events, summary, earlier)


def _config(run_dir: Path) -> tuple[dict, RunArguments, Plan]:
    config, args = read_config(run_dir)
    if not isinstance(config.get("plan"), dict):
        raise UserError("field 'plan' must be an object", where=str(run_dir / "config.json"))
    return config, args, plan_from_dict(config["plan"], f"{run_dir / 'config.json'}: field 'plan'")


def _events(run_dir: Path, layout: Layout, first: int, last: int) -> dict[int, list[Event]]:
    """Every rank's events of steps ``first``..``last`` (each step's, checked: busy/idle and the bubble are per
    step, and a step without this rank's actions would read as all idle)."""
    events: dict[int, list[Event]] = {}
    for rank in range(layout.world):
        tl = timeline_path(run_dir, rank)
        if not tl.exists():
            raise UserError(f"timeline of rank {rank} not found (the run has {layout.world} ranks)", where=str(tl))
        _, evs = read_timeline(tl)
        evs = [e for e in evs if first <= e.step <= last]
        stage = layout.stage(rank)
        wrong = next((e for e in evs if e.stage != stage), None)
        if wrong is not None:
            raise UserError(f"holds an event of stage {wrong.stage}, but rank {rank} runs stage {stage}", where=str(tl))
        have = {e.step for e in evs}
        lacking = next((s for s in range(first, last + 1) if s not in have), None)
        if lacking is not None:
            steps = f"the run has {last} steps" if first == 1 else f"its plan trained steps {first}–{last}"
            raise UserError(f"has no events of step {lacking} ({steps})", where=str(tl))
        events[rank] = evs
    return events


def _unrecorded_start(run_dir: Path, layout: Layout, steps: int) -> int:
    """The first step of every rank's timeline when all of them hold exactly the steps from there to the end and
    none before (how a run resumed under another plan by a terapipe that kept no segments looks); else 1."""
    starts = set()
    for rank in range(layout.world):
        tl = timeline_path(run_dir, rank)
        if not tl.exists():
            return 1
        have = {e.step for e in read_timeline(tl)[1]}
        if not have or have != set(range(min(have), steps + 1)):
            return 1
        starts.add(min(have))
    return starts.pop() if len(starts) == 1 else 1


def _metrics(run_dir: Path, steps: int) -> list[dict]:
    """Every step's record, validated: numbers where numbers belong, steps 1..steps once each, in order."""
    path = run_dir / "metrics.jsonl"
    where = str(path)
    if not path.exists():
        raise UserError("metrics file not found", where=where)
    records = read_metrics(run_dir)  # a corrupt line is a one-line UserError naming it
    by_step: dict[int, dict] = {}
    for rec in records:
        step = rec["step"]  # a positive integer (`read_metrics` checks it)
        for key in ("loss", "iteration_s", "memory_bytes"):
            v = rec.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UserError(f"step {step}: field '{key}' must be a finite number, got {v!r}", where=where)
        if not rec["iteration_s"] > 0:
            raise UserError(f"step {step}: field 'iteration_s' must be positive, got {rec['iteration_s']}", where=where)
        if step in by_step:
            raise UserError(f"step {step} appears twice", where=where)
        by_step[step] = rec
    missing = [s for s in range(1, steps + 1) if s not in by_step]
    if missing:
        raise UserError(
            f"has {len(by_step)} of the run's {steps} steps (first missing: step {missing[0]})", where=where
        )
    extra = sorted(s for s in by_step if s > steps)
    if extra:
        raise UserError(f"has step {extra[0]}, beyond the run's {steps} steps", where=where)
    return [by_step[s] for s in range(1, steps + 1)]


# What must agree between a run and its baseline for the comparison to mean anything: the same model trained
# on the same data, batches, seed, steps and process layout (only the slicing may differ).
SAME = ("model", "stages", "batch_size", "seq_len")


def same_settings() -> tuple[str, ...]:
    """The run settings a baseline must share, from their declaration (`RunConfig`, `Doc.resume`): every one a
    resumed run keeps, since they decide the numbers (data, seed, held-out part, lr schedule, clipping, precision,
    AdamW's settings, ...), but the schedule walked; the replicas D and tensor ranks T of its layout, but not the
    plan (the baseline's is GPipe's slicing of the same batch); and the steps."""
    fixed = [name for name, doc in run_fields().items() if doc.resume in ("keep", "layout", "announce")]
    return ("steps", *(name for name in fixed if name not in ("schedule", "plan")))


def check_comparable(run: Run, baseline: Run) -> None:
    """Raise UserError (naming the baseline's config) when the baseline is not the same training as the run."""
    where = str(baseline.path / "config.json")
    differs = run.plan.model.difference(baseline.plan.model)
    if differs is not None:
        key, theirs, ours = differs
        raise UserError(
            f"the baseline has a different model (its field 'model.{key}' is {theirs!r}, the run's {ours!r}): "
            "not comparable",
            where=where,
        )
    for key in SAME[1:]:
        a, b = getattr(run.plan, key), getattr(baseline.plan, key)
        if a != b:
            raise UserError(f"the baseline has {key} {b} ({b!r} vs the run's {a!r}): not comparable", where=where)
    # As `terapipe train` would train each again (a run from before the lr schedule: its constant lr written out).
    ours, theirs = RunConfig.of_run(run.args), RunConfig.of_run(baseline.args)
    for key in same_settings():
        a, b = getattr(ours, key), getattr(theirs, key)
        if a != b:
            raise UserError(
                f"the baseline was trained with {key} = {b!r}, the run with {a!r}: not comparable", where=where
            )
    if run.config.get("device") != baseline.config.get("device"):
        raise UserError(
            f"the baseline ran on {baseline.config.get('device')!r}, the run on "
            f"{run.config.get('device')!r}: not comparable",
            where=where,
        )


BASELINE_SUFFIX = "-gpipe"


def baseline_dir(run_dir: Path) -> Path:
    """Where the report trains a run's baseline: a sibling folder, ``RUN_DIR-gpipe``."""
    run_dir = Path(run_dir)
    if run_dir.name in ("", ".", ".."):  # "." has no name to extend; keep other paths as the user gave them
        run_dir = run_dir.resolve()
    return run_dir.with_name(run_dir.name + BASELINE_SUFFIX)
