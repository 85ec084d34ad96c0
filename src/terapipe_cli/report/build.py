"""Build the report of a run against its baseline: report.json, report.md, timeline.png, loss.png, trace.json.

The command (`terapipe_cli.cli.report`) first checks everything that can fail: `load_run`, `check_warmup`,
`report_dir` and `check_report_dir`, `find_baseline`, `find_cost_model`, and `load_baseline` for a baseline that
exists or `baseline.check_baseline` for one to train. Only then does it train (`baseline.train_baseline`), load
the baseline, and `write_report` into the report folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic, write_text_atomic
from terapipe_cli.report.baseline import baseline_dir
from terapipe_cli.report.compare import compare
from terapipe_cli.report.figures import TimelinePanel, draw_losses, draw_timelines
from terapipe_cli.report.runs import Run, check_comparable, load_run
from terapipe_cli.report.trace import TraceRun, chrome_trace
from terapipe_cli.schedule import plan_tiles, stage_times
from terapipe_cli.units import format_bytes, format_seconds, utc_timestamp

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
    if loss["match"]:
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
                "holds an unfinished baseline run (no summary.json): delete the folder to train it "
                "again, or pass another run with --baseline",
                where=str(sibling),
            )
        return BaselineChoice(sibling, True, False)
    return BaselineChoice(sibling, False, False)


def load_baseline(run: Run, path: Path) -> Run:
    """Load a baseline and check it is the same training as the run."""
    baseline = load_run(path)
    check_comparable(run, baseline)
    return baseline


def find_cost_model(run: Run, profile: Path | None):
    """The cost model the plan was made with, for the simulator's predicted timelines: ``profile`` if given,
    else the profile the plan names (when it is still there, unchanged). Returns (CostModel | None, info)."""
    from terapipe_cli.costmodel import CostModel, read_profile

    named = (run.plan.raw.get("profile") or {}) if isinstance(run.plan.raw.get("profile"), dict) else {}
    if profile is None:
        path = named.get("path")
        if not path:
            return None, {"used": False, "why": "the plan names no profile (pass one with --profile)"}
        # The plan records the path as given to `terapipe plan`, relative to where it ran; the file is also looked
        # for beside the run (as `terapipe run` lays it out). The checksum below makes any match safe.
        name = Path(path).name
        candidates = [Path(path), run.path / name, run.path.parent / name]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            return None, {"used": False, "why": f"the plan's profile {path} is not here (pass it with --profile)"}
        prof = read_profile(found)
        if named.get("sha256") and prof.sha256 != named["sha256"]:
            return None, {
                "used": False,
                "why": f"the profile {found} changed since the plan was made (pass it with --profile)",
            }
    else:
        prof = read_profile(profile)
        if prof.model != run.plan.model:
            raise UserError(
                f"is a profile of model {prof.model.name!r}, the run trains {run.plan.model.name!r}", where=str(profile)
            )
    cost = CostModel(prof, run.stages, run.args.data_parallel)
    info = {"used": True, "profile": prof.path, "source": prof.source, "sha256": prof.sha256}
    info["device"] = prof.device.get("name")
    if cost.allreduce_unpriced:
        info["data_parallel_allreduce"] = f"unknown — not priced: {cost.allreduce_unpriced}"
    return cost, info


def simulate_runs(run: Run, baseline: Run, cost) -> dict:
    """Predicted timelines of both schemes under the same cost model (`terapipe_cli.simulate`)."""
    from terapipe_cli.simulate import simulate

    return {
        "run": simulate(run.plan.slices, cost, run.stages),
        "baseline": simulate(baseline.plan.slices, cost, baseline.stages),
    }


def write_report(
    run: Run, baseline: Run, out: Path, *, warmup: int, cost=None, cost_info: dict | None = None, progress=None
) -> dict:
    """Compute the comparison and write every file into ``out``; returns the report object (as in report.json)."""
    step = progress or (lambda what: None)
    sims = simulate_runs(run, baseline, cost) if cost is not None else {}
    report = compare(run, baseline, warmup=warmup, sims=sims, cost_model=cost_info)
    out = Path(out)
    files = {name: str(out / name) for name in FILES}
    report["files"] = files
    report["created"] = utc_timestamp()

    step("timeline.png")
    draw_timelines(
        _timeline_grid(run, baseline, report, sims),
        out / "timeline.png",
        title=f"{report['model']}: K={run.stages} stages, B={run.plan.batch_size}, L={run.plan.seq_len} — "
        f"{report['run']['label']} {report['speedup']['median']:.2f}× the speed of "
        f"{report['baseline']['label']} (median step); one typical step of each, same time axis",
    )
    step("loss.png")
    loss = report["loss"]
    draw_losses(
        [
            (report["run"]["label"], report["run"]["losses"]),
            (report["baseline"]["label"], report["baseline"]["losses"]),
        ],
        out / "loss.png",
        warmup=report["warmup_steps"],
        title=f"same training, two schedules: max |Δloss| = {loss['max_abs_diff']:.2g} "
        f"(max relative {loss['max_rel_diff']:.2g})",
    )
    step("trace.json")
    trace = chrome_trace(
        [
            TraceRun(report[key]["label"], r.events, [m["iteration_s"] for m in r.metrics], r.stages, r.plan.slices)
            for key, r in (("run", run), ("baseline", baseline))
        ]
    )
    write_json_atomic(out / "trace.json", trace)
    step("report.md")
    write_text_atomic(out / "report.md", to_markdown(report))
    write_json_atomic(out / "report.json", report)  # last: its presence means the report is complete
    return report


def _timeline_grid(run: Run, baseline: Run, report: dict, sims: dict) -> list[list[TimelinePanel | None]]:
    grid = []
    for key, r in (("run", run), ("baseline", baseline)):
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


def _seconds(s: float | None) -> str:
    """The report's times: tenths of a millisecond."""
    return format_seconds(s, digits=1)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1%}"


def latency_rows(report: dict) -> list[list[str]]:
    """The main table, one row per quantity and one column per run (shared by the terminal and report.md)."""
    r, b = report["run"], report["baseline"]

    def row(name: str, f) -> list[str]:
        return [name, f(r), f(b)]

    def sim(s: dict, key: str):
        return s["simulated"][key] if s["simulated"] else None

    return [
        row("tiles per step (M)", lambda s: str(s["tiles"])),
        row("iteration, median", lambda s: _seconds(s["latency_s"]["median"])),
        row(
            "iteration, mean ± std", lambda s: f"{_seconds(s['latency_s']['mean'])} ± {_seconds(s['latency_s']['std'])}"
        ),
        row("iteration, min – max", lambda s: f"{_seconds(s['latency_s']['min'])} – {_seconds(s['latency_s']['max'])}"),
        row("tokens/s", lambda s: f"{s['tokens_per_s']:,.0f}"),
        row(
            "predicted by the plan (error)", lambda s: f"{_seconds(s['predicted_s'])} ({_pct(s['predicted_rel_err'])})"
        ),
        row(
            "predicted by the simulator (error)",
            lambda s: f"{_seconds(sim(s, 'latency_s'))} ({_pct(sim(s, 'rel_err'))})" if s["simulated"] else "–",
        ),
        row("bubble, measured", lambda s: f"{s['bubble_fraction']:.1%}"),
        row("bubble, simulated", lambda s: f"{sim(s, 'bubble_fraction'):.1%}" if s["simulated"] else "–"),
        row("bubble, (K−1)/(M+K−1)", lambda s: f"{s['bubble_formula']:.1%}"),
        row("peak memory (largest rank)", lambda s: format_bytes(s["peak_memory_bytes"], "MiB")),
    ]


def latency_header(report: dict) -> list[str]:
    return ["", report["run"]["label"], report["baseline"]["label"]]


STAGE_HEADER = ["schedule", "stage", "busy per step", "idle per step", "busy share"]


def stage_rows(report: dict) -> list[list[str]]:
    rows = []
    for key in ("run", "baseline"):
        s = report[key]
        for st in s["stage_times"]:
            rows.append(
                [
                    s["label"],
                    str(st["stage"]),
                    _seconds(st["busy_s"]),
                    _seconds(st["idle_s"]),
                    f"{st['busy_fraction']:.0%}",
                ]
            )
    return rows


def headline(report: dict) -> str:
    sp = report["speedup"]
    r, b = report["run"], report["baseline"]
    verdict = (
        f"{r['label']} is {sp['median']:.2f}× faster than {b['label']}"
        if sp["median"] >= 1
        else f"{r['label']} is slower than {b['label']} here, {sp['median']:.2f}× its speed"
    )
    return (
        f"{verdict} (median iteration {_seconds(r['latency_s']['median'])} vs {_seconds(b['latency_s']['median'])}, "
        f"steps {r['compared_steps'][0]}–{r['compared_steps'][1]}); the plan predicted "
        + (f"{sp['predicted']:.2f}×" if sp["predicted"] else "–")
        + (f", the simulator {sp['simulated']:.2f}×" if sp["simulated"] else "")
        + "."
    )


def tile_speed_line(report: dict) -> str | None:
    """Why measured and predicted differ, when the simulator ran: did the tiles take their profiled time?"""
    r, b = report["run"], report["baseline"]
    if not (r["simulated"] and b["simulated"]):
        return None
    text = (
        f"Tile compute took {r['simulated']['busy_ratio']:.2f}× the profile's prediction with {r['label']} and "
        f"{b['simulated']['busy_ratio']:.2f}× with {b['label']} (measured busy time per stage / simulated)."
    )
    if r["simulated"]["busy_ratio"] > 1.2 * b["simulated"]["busy_ratio"]:
        text += (
            f" {r['label']}'s stages compute at the same time, so anything they share — cores, memory "
            "bandwidth, other processes on the machine — slows its tiles more than GPipe's, which mostly take "
            "turns."
        )
    return text


def loss_line(report: dict) -> str:
    loss = report["loss"]
    verdict = "match" if loss["match"] else "DO NOT match"
    return (
        f"Losses {verdict} at every one of the {loss['steps']} steps: max |Δ| = {loss['max_abs_diff']:.3g}, "
        f"max relative {loss['max_rel_diff']:.3g} (tolerance {loss['rel_tolerance']:g}, fp32) — "
        "both runs are the same synchronous training."
    )


def bubble_line(report: dict) -> str:
    r, b = report["run"], report["baseline"]
    return (
        f"Idle time: the stages wait {r['bubble_fraction']:.0%} of the pipelined span with {r['label']} "
        f"({_tiles(r['tiles'])}) vs {b['bubble_fraction']:.0%} with {b['label']} ({_tiles(b['tiles'])}); "
        f"the formula (K−1)/(M+K−1) for equal tiles says {r['bubble_formula']:.0%} vs {b['bubble_formula']:.0%}."
    )


def _tiles(n: int) -> str:
    return f"{n} tile" + ("" if n == 1 else "s")


def to_markdown(report: dict) -> str:
    r, b = report["run"], report["baseline"]
    cm = report.get("cost_model") or {}

    def table(header: list[str], rows: list[list[str]]) -> str:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        return "\n".join(lines)

    files = report["files"]
    parts = [
        f"# terapipe report: {report['model']}, K={r['stages']}, B={r['batch_size']}, L={r['seq_len']}"
        + (f", D={r['data_parallel']}" if r["data_parallel"] > 1 else ""),
        "",
        headline(report),
        "",
        f"- {r['label']} run: `{r['path']}` — `{r['short_form']}`",
        f"- {b['label']} baseline: `{b['path']}` — `{b['short_form']}`",
        f"- device: {r['device']}; {report['warmup_steps']} warm-up step(s) left out of the timings; "
        f"{r['tokens_per_step']} tokens per step",
        "",
        "## Iteration latency",
        "",
        table(latency_header(report), latency_rows(report)),
        "",
        "Predictions are the plan's objective (docs/design.md §4) and the schedule simulator, both from the cost model"
        + (
            f" of `{cm.get('profile')}` ({cm.get('source')})"
            if cm.get("used")
            else f" (simulator not run: {cm.get('why', 'no cost model')})"
        )
        + "; errors are (predicted − measured median) / measured median. Peak memory is the largest rank's "
        "(on CPU: the process's peak resident memory).",
        "",
        "## Where the time goes",
        "",
        bubble_line(report),
        "",
        *([tile_speed_line(report), ""] if tile_speed_line(report) else []),
        table(STAGE_HEADER, stage_rows(report)),
        "",
        f"![timeline]({Path(files['timeline.png']).name})",
        "",
        "## Loss",
        "",
        loss_line(report),
        "",
        table(
            ["step", r["label"], b["label"], "|Δ|"],
            [
                [str(n), f"{x:.6f}", f"{y:.6f}", f"{abs(x - y):.2g}"]
                for n, (x, y) in enumerate(zip(r["losses"], b["losses"], strict=False), 1)
            ],
        ),
        "",
        f"![loss]({Path(files['loss.png']).name})",
        "",
        f"Chrome trace (one process per rank, both runs): `{Path(files['trace.json']).name}` — open it in "
        "https://ui.perfetto.dev.",
        "",
    ]
    return "\n".join(parts)
