"""Build the report of a run against its baseline: report.json, report.md, timeline.png, loss.png, trace.json.

The command (`terapipe_cli.cli.report`) first checks everything that can fail: `load_run`, `check_warmup`,
`report_dir` and `check_report_dir`, `find_cost_model`, `find_baseline`, and `load_baseline` for a baseline that
exists or `train.baseline.check_baseline` for one to train. Only then does the command train it
(`train.baseline.train_baseline`, never this library), load the baseline, and `write_report` into the report
folder. With ``--no-baseline`` there is no baseline: the same
files describe the run alone (loss curve, measured and predicted timeline, prediction error). The words and
tables are `terapipe_cli.report.text`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic, write_text_atomic
from terapipe_cli.plan.costmodel import CostModel, read_profile
from terapipe_cli.plan.simulate import simulate
from terapipe_cli.report.compare import compare
from terapipe_cli.report.figures import TimelinePanel, draw_losses, draw_timelines
from terapipe_cli.report.runs import Run, baseline_dir, check_comparable, load_run
from terapipe_cli.report.text import shape, to_markdown
from terapipe_cli.report.trace import TraceRun, chrome_trace
from terapipe_cli.schedule.schedule import plan_tiles
from terapipe_cli.schedule.timeline import stage_times
from terapipe_cli.units import format_seconds, utc_timestamp

FILES = ("report.json", "report.md", "timeline.png", "loss.png", "trace.json")


def check_warmup(run: Run, warmup: int) -> None:
    """Raise UserError (naming --warmup) unless ``warmup`` leaves at least one of the run's steps to time."""
    if warmup < 0:
        raise UserError(f"must be at least 0, got {warmup}", where="--warmup")
    if warmup >= len(run.steps):
        raise UserError(f"leaves none of the run's {len(run.steps)} steps to time; use fewer", where="--warmup")


def report_dir(run: Run, out: Path | None) -> Path:
    """Where the report goes: ``out`` if given, else ``RUN_DIR/report``."""
    return Path(out) if out is not None else run.path / "report"


def check_report_dir(path: Path) -> None:
    """Raise UserError unless the report folder ``path`` is, or can be made, a writable folder (checked without
    creating anything)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError("is a file; the report needs a folder here (pass another --out)", where=str(path))
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot be created: {probe} is a file (pass another --out)", where=str(path))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"cannot be written: no write permission in {probe} (pass another --out)", where=str(path))


def loss_mismatch(report: dict) -> str | None:
    """Why the report must fail (the two runs' losses differ beyond tolerance), or None when they match."""
    loss = report["loss"]
    if loss is None or loss["match"]:
        return None
    return (
        "the losses of the run and its baseline differ beyond fp32 tolerance "
        f"(max relative {loss['max_rel_diff']:.3g} at step {loss['worst_step']})"
    )


@dataclass(frozen=True)
class BaselineChoice:
    path: Path
    exists: bool  # a finished run is there already (given with --baseline, or trained by an earlier report)
    given: bool


def find_baseline(run: Run, baseline: Path | None) -> BaselineChoice:
    """The baseline to compare with: the one given, else the run's sibling ``RUN_DIR-gpipe`` (trained there by an
    earlier report, or to be trained now)."""
    if baseline is not None:
        return BaselineChoice(Path(baseline), True, True)
    sibling = baseline_dir(run.path)
    if (sibling / "config.json").exists():
        if not (sibling / "summary.json").exists():
            raise UserError(
                "holds an unfinished baseline run (no summary.json): " + _instead(sibling), where=str(sibling)
            )
        return BaselineChoice(sibling, True, False)
    return BaselineChoice(sibling, False, False)


def _instead(sibling: Path) -> str:
    """What to do about a baseline folder the report cannot use: the folder to delete, or the flags to pass."""
    return f"delete {sibling} to have the report train it again, or pass --baseline RUN_DIR or --no-baseline"


def load_baseline(run: Run, choice: BaselineChoice) -> Run:
    """Load a baseline and check it is the same training as the run. A sibling that is not (an earlier report's
    baseline of a run since trained again with other settings) is refused naming the folder to delete."""
    try:
        baseline = load_run(choice.path)
        check_comparable(run, baseline)
    except UserError as e:
        if choice.given:
            raise
        raise UserError(f"{e.message}; {_instead(choice.path)}", where=e.where) from None
    return baseline


def find_cost_model(run: Run, profile: Path | None):
    """The cost model the plan was made with, for the simulator's predicted timelines: ``profile`` if given,
    else the profile the plan names (when it is still there, unchanged, and for the run's T). Returns
    (CostModel | None, info)."""

    if profile is None:
        prof, why = _plans_profile(run)
        if prof is None:
            return None, {"used": False, "why": why}
    else:
        prof = read_profile(profile)
        differs = run.plan.model.difference(prof.model)
        if differs is not None:
            key, theirs, ours = differs
            raise UserError(
                f"is a profile of model {prof.model.name!r}, the run trains {run.plan.model.name!r}: its field "
                f"'model.{key}' is {theirs!r}, the run's {ours!r}",
                where=str(profile),
            )
        if prof.tensor_parallel != run.args.tensor_parallel:
            raise UserError(
                f"was measured at T={prof.tensor_parallel}, the run used T={run.args.tensor_parallel}",
                where=str(profile),
            )
    cost = CostModel(prof, run.stages, run.args.data_parallel, partition=run.plan.partition)
    info = {"used": True, "profile": prof.path, "source": prof.source, "sha256": prof.sha256}
    info["device"] = prof.device.get("name")
    if cost.allreduce_unpriced:
        info["data_parallel_allreduce"] = f"unknown — not priced: {cost.allreduce_unpriced}"
    return cost, info


def _plans_profile(run: Run):
    """The profile the plan names, if it is here, unchanged, and for the run's T: (Profile, None), or (None, why)."""

    named = run.plan.raw.get("profile") if isinstance(run.plan.raw.get("profile"), dict) else {}
    path = named.get("path")
    if not path:
        return None, "the plan names no profile (pass one with --profile)"
    # The plan records the path absolute (older plans: as given to `terapipe plan`, relative to where it ran);
    # the file is also looked for beside the run, should the folders have moved together (as `terapipe run`
    # lays them out). The checksum below makes any match safe.
    name = Path(path).name
    found = next((p for p in (Path(path), run.path / name, run.path.parent / name) if p.is_file()), None)
    if found is None:
        return None, f"the plan's profile {path} is not here (pass it with --profile)"
    prof = read_profile(found)
    if named.get("sha256") and prof.sha256 != named["sha256"]:
        return None, f"the profile {found} changed since the plan was made (pass it with --profile)"
    if prof.tensor_parallel != run.args.tensor_parallel:
        return None, (
            f"the plan's profile {found} is for T={prof.tensor_parallel}, the run used T={run.args.tensor_parallel} "
            "(pass a profile at the run's T with --profile)"
        )
    return prof, None


def _held_out(run: Run) -> list[tuple[int, float]]:
    """(step, validation loss) of the run's evaluated steps."""
    return [(r["step"], r["val_loss"]) for r in run.metrics if r.get("val_loss") is not None]


def simulate_runs(runs: dict[str, Run], cost) -> dict:
    """Predicted timelines of each run's scheme (``{"run": ..., "baseline": ...}``) under the same cost model
    (`terapipe_cli.plan.simulate`)."""

    # Each run's own schedule: its order, and its recomputation on the stages that recompute.
    return {key: simulate(r.schedule, cost) for key, r in runs.items()}


def write_report(
    run: Run, baseline: Run | None, out: Path, *, warmup: int, cost=None, cost_info: dict | None = None, progress=None
) -> dict:
    """Compute the comparison and write every file into ``out``; returns the report object (as in report.json).
    Without a baseline (None) the same files describe the run alone."""
    step = progress or (lambda what: None)
    runs = {"run": run} | ({"baseline": baseline} if baseline is not None else {})
    sims = simulate_runs(runs, cost) if cost is not None else {}
    report = compare(run, baseline, warmup=warmup, sims=sims, cost_model=cost_info)
    out = Path(out)
    report["files"] = {name: str(out / name) for name in FILES}
    report["created"] = utc_timestamp()
    step("timeline.png")
    draw_timelines(_timeline_grid(runs, report, sims), out / "timeline.png", title=_timeline_title(report))
    step("loss.png")
    draw_losses(
        [(report[key]["label"], report[key]["losses"]) for key in runs],
        out / "loss.png",
        untimed=report["run"]["compared_steps"][0] - 1,
        title=_loss_title(report),
        held_out=[(report[key]["label"], _held_out(r)) for key, r in runs.items()],
    )
    step("trace.json")
    trace = chrome_trace([part for key, r in runs.items() for part in _trace_runs(report[key]["label"], r)])
    write_json_atomic(out / "trace.json", trace)
    step("report.md")
    write_text_atomic(out / "report.md", to_markdown(report))
    write_json_atomic(out / "report.json", report)  # last: its presence means the report is complete
    return report


def _trace_runs(label: str, run: Run) -> list[TraceRun]:
    """A run in the trace: each plan it trained under, one group of processes (its own ranks) per plan."""
    iteration_s = [m["iteration_s"] for m in run.metrics]
    if not run.earlier:
        return [TraceRun(label, run.events, iteration_s, run.layout, run.plan.slices)]
    parts = [
        TraceRun(f"{label} steps {s.first_step}–{s.last_step}", s.events, iteration_s, s.layout, s.plan.slices,
                 steps=(s.first_step, s.last_step))
        for s in run.earlier if s.plan is not None
    ]  # fmt: skip
    last = (run.first_step, run.steps[-1])
    own = TraceRun(f"{label} steps {last[0]}–{last[1]}", run.events, iteration_s, run.layout, run.plan.slices, last)
    return [*parts, own]


def _timeline_title(report: dict) -> str:
    r, b = report["run"], report["baseline"]
    if b is None:
        return f"{report['model']}: {shape(report)} — {r['label']}, one typical step (no baseline run)"
    return (
        f"{report['model']}: {shape(report)} — {r['label']} {report['speedup']['median']:.2f}× the speed of "
        f"{b['label']} (median step); one typical step of each, same time axis"
    )


def _loss_title(report: dict) -> str:
    loss = report["loss"]
    if loss is None:
        return f"training loss of {report['run']['label']} (no baseline run to compare with)"
    return (
        f"same training, two schedules: max |Δloss| = {loss['max_abs_diff']:.2g} "
        f"(max relative {loss['max_rel_diff']:.2g})"
    )


def _timeline_grid(runs: dict[str, Run], report: dict, sims: dict) -> list[list[TimelinePanel | None]]:
    grid = []
    for key, r in runs.items():
        s = report[key]
        order = {(t.batch_slice, t.token_slice): n for n, t in enumerate(plan_tiles(r.plan.slices))}
        step = s["representative_step"]
        events = r.step_events(step, replica=0)
        measured_s = r.metric(step)["iteration_s"]
        bubble = stage_times([events], r.stages).bubble_fraction
        row = [
            TimelinePanel(
                f"{s['label']} {s['short_form']}\nmeasured, step {step}: "
                f"{format_seconds(measured_s, digits=0)} per step, bubble {bubble:.0%}",
                events,
                r.stages,
                order,
                step_end_s=measured_s,
            )
        ]
        if key in sims:
            sim = sims[key]
            row.append(
                TimelinePanel(
                    f"{s['label']}\npredicted by the simulator: {format_seconds(sim.latency_s, digits=0)} per "
                    f"step, bubble {s['simulated']['bubble_fraction']:.0%}",
                    sim.events,
                    r.stages,
                    order,
                    step_end_s=sim.latency_s,
                )
            )
        grid.append(row)
    return grid
