"""The report's words and tables, from the report object alone (as in report.json): the same rows and sentences
for the terminal (`terapipe_cli.cli.report`) and for report.md (`to_markdown`).

Every function takes a report with or without a baseline (``terapipe report --no-baseline``: ``baseline``,
``speedup`` and ``loss`` are null); the tables then have one column of numbers, and the text says that no
baseline was run.
"""

from __future__ import annotations

from pathlib import Path

from terapipe_cli.schedule.orders import DEFAULT_ORDER, order_of
from terapipe_cli.units import format_bytes, format_seconds, format_stages

NO_BASELINE = "No baseline was run (--no-baseline): no speed-up, and no loss comparison."


def summaries(report: dict) -> list[dict]:
    """The runs the report describes, the run first: its own summary, then its baseline's if there is one."""
    return [report["run"]] + ([report["baseline"]] if report.get("baseline") else [])


def shape(report: dict) -> str:
    """The run's parallel layout and batch: ``D=1, K=2, T=1, B=1, L=32`` (replicas, stages, tensor ranks), and its
    schedule order and recomputation when not the defaults (``, 1F1B order, recomputed on stages 0, 1``)."""
    r = report["run"]
    text = f"D={r['data_parallel']}, K={r['stages']}, T={r['tensor_parallel']}, B={r['batch_size']}, L={r['seq_len']}"
    order = order_of(r.get("order") or DEFAULT_ORDER.name)
    if order is not DEFAULT_ORDER:
        text += f", {order.title}"
    if any(r.get("recompute") or []):
        text += f", recomputed on {format_stages(r['recompute'])}"
    return text


def title(report: dict) -> str:
    """The header of the terminal's table and of report.md."""
    r = report["run"]
    first, last = r["compared_steps"]
    return f"{report['model']}: {shape(report)} — steps {first}–{last} (after {report['warmup_steps']} warm-up)"


def _seconds(s: float | None) -> str:
    """The report's times: tenths of a millisecond."""
    return format_seconds(s, digits=1)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1%}"


def latency_header(report: dict) -> list[str]:
    return ["", *(s["label"] for s in summaries(report))]


def latency_rows(report: dict) -> list[list[str]]:
    """The main table, one row per quantity and one column per run."""
    runs = summaries(report)

    def row(name: str, f) -> list[str]:
        return [name, *(f(s) for s in runs)]

    def sim(s: dict, key: str):
        return s["simulated"][key] if s["simulated"] else None

    lat = "latency_s"
    return [
        row("tiles per step (M)", lambda s: str(s["tiles"])),
        row("iteration, median", lambda s: _seconds(s[lat]["median"])),
        row("iteration, mean ± std", lambda s: f"{_seconds(s[lat]['mean'])} ± {_seconds(s[lat]['std'])}"),
        row("iteration, min – max", lambda s: f"{_seconds(s[lat]['min'])} – {_seconds(s[lat]['max'])}"),
        row("tokens/s", lambda s: f"{s['tokens_per_s']:,.0f}"),
        row("model TFLOP/s per device", lambda s: f"{s['model_tflops']:.3g}" if "model_tflops" in s else "–"),
        row("MFU", lambda s: "n/a" if s.get("mfu") is None else f"{s['mfu']:.1%}"),
        row(
            "predicted by the plan (error)", lambda s: f"{_seconds(s['predicted_s'])} ({_pct(s['predicted_rel_err'])})"
        ),
        row(
            "predicted by the simulator (error)",
            lambda s: f"{_seconds(sim(s, 'latency_s'))} ({_pct(sim(s, 'rel_err'))})" if s["simulated"] else "–",
        ),
        row("bubble, measured", lambda s: f"{s['bubble_fraction']:.1%}"),
        row("bubble, simulated", lambda s: f"{sim(s, 'bubble_fraction'):.1%}" if s["simulated"] else "–"),
        row("bubble, (K−1)/(v·M+K−1)", lambda s: f"{s['bubble_formula']:.1%}"),
        row("peak memory (largest rank)", lambda s: format_bytes(s["peak_memory_bytes"], "MiB")),
    ]


STAGE_HEADER = ["schedule", "stage", "busy per step", "idle per step", "busy share"]


def stage_rows(report: dict) -> list[list[str]]:
    return [
        [s["label"], str(st["stage"]), _seconds(st["busy_s"]), _seconds(st["idle_s"]), f"{st['busy_fraction']:.0%}"]
        for s in summaries(report)
        for st in s["stage_times"]
    ]


MEMORY_TITLE = "memory per stage (its largest rank over the compared steps)"


def _stages(report: dict) -> list[tuple[str, dict]]:
    """(run label, ``memory_per_stage`` entry) for every stage of every run in the report."""
    return [(s["label"], st) for s in summaries(report) for st in s.get("memory_per_stage") or []]


def memory_table(report: dict) -> tuple[list[str], list[list[str]]] | None:
    """The plan's memory estimate per stage next to the measured (``memory_per_stage``), for each run; a column no
    run has (no estimate in the plan, no saved-tensor count in an older run) is left out. None when nothing is
    known."""
    stages = _stages(report)
    sizes = [v for _, st in stages for k, v in st.items() if k.endswith("_bytes") and v is not None]
    unit = "GiB" if max(sizes, default=0) >= 2**30 else "MiB"
    peak = "process RSS" if str(report["run"]["device"]).startswith("cpu") else "CUDA max allocated"
    columns = {  # header -> cell of one stage
        "estimated kept for backward": lambda st: format_bytes(st["estimated_activation_bytes"], unit),
        "measured kept (saved tensors)": lambda st: format_bytes(st["measured_saved_bytes"], unit),
        "error": lambda st: _pct(st["rel_err"]),
        "estimated live (less state)": lambda st: format_bytes(st.get("estimated_live_bytes"), unit),
        "measured live (tracked step)": lambda st: format_bytes(st.get("measured_live_bytes"), unit),
        "live error": lambda st: _pct(st.get("live_rel_err")),
        "estimated total (with state)": lambda st: format_bytes(st["estimated_total_bytes"], unit),
        f"measured peak ({peak})": lambda st: format_bytes(st["measured_peak_bytes"], unit),
    }
    cells = {name: [cell(st) for _, st in stages] for name, cell in columns.items()}
    shown = [name for name, column in cells.items() if any(c != "–" for c in column)]
    if not shown:
        return None
    rows = [[label, str(st["stage"]), *(cells[name][n] for name in shown)] for n, (label, st) in enumerate(stages)]
    return ["schedule", "stage", *shown], rows


MEMORY_TOLERANCE = 0.10  # an estimate further than this from what the run kept is worth a line


# The estimates the report checks against what the run measured: (error, estimate, measured, what each holds).
_CHECKED = (
    ("rel_err", "estimated_activation_bytes", "measured_saved_bytes", ("kept for the backward", "the run kept")),
    ("live_rel_err", "estimated_live_bytes", "measured_live_bytes", ("live beyond the state", "the tracked step held")),
)


def memory_mismatch_lines(report: dict) -> list[str]:
    """One line per stage and estimate (what it keeps for the backward; with a tracked step, what is live beyond the
    state) more than `MEMORY_TOLERANCE` from what the run measured (``memory_per_stage``)."""
    lines = []
    for s in summaries(report):
        for st in s.get("memory_per_stage") or []:
            for err_key, est_key, got_key, (estimated, measured) in _CHECKED:
                err = st.get(err_key)
                if err is not None and abs(err) > MEMORY_TOLERANCE:
                    lines.append(
                        f"{s['label']} stage {st['stage']}: the plan estimated {format_bytes(st[est_key], 'MiB')} "
                        f"{estimated}, {measured} {format_bytes(st[got_key], 'MiB')} ({_pct(err)}, more than "
                        f"{MEMORY_TOLERANCE:.0%} off)"
                    )
    return lines


def headline(report: dict) -> str:
    """The report's verdict in one sentence: the speed-up, or without a baseline the run's own time."""
    r, b, sp = report["run"], report["baseline"], report["speedup"]
    steps = f"steps {r['compared_steps'][0]}–{r['compared_steps'][1]}"
    if b is None:
        sim = r["simulated"]
        return (
            f"{r['label']} {r['short_form']}: median iteration {_seconds(r['latency_s']['median'])} ({steps}); "
            f"the plan predicted {_seconds(r['predicted_s'])} ({_pct(r['predicted_rel_err'])})"
            + (f", the simulator {_seconds(sim['latency_s'])} ({_pct(sim['rel_err'])})" if sim else "")
            + "."
        )
    verdict = (
        f"{r['label']} is {sp['median']:.2f}× faster than {b['label']}"
        if sp["median"] >= 1
        else f"{r['label']} is slower than {b['label']} here, {sp['median']:.2f}× its speed"
    )
    return (
        f"{verdict} (median iteration {_seconds(r['latency_s']['median'])} vs {_seconds(b['latency_s']['median'])}, "
        f"{steps}); the plan predicted "
        + (f"{sp['predicted']:.2f}×" if sp["predicted"] else "–")
        + (f", the simulator {sp['simulated']:.2f}×" if sp["simulated"] else "")
        + "."
    )


def tile_speed_line(report: dict) -> str | None:
    """Why measured and predicted differ, when the simulator ran: did the tiles take their profiled time?"""
    runs = summaries(report)
    if not all(s["simulated"] for s in runs):
        return None
    ratio = [f"{s['simulated']['busy_ratio']:.2f}×" for s in runs]
    text = f"Tile compute took {ratio[0]} the profile's prediction with {runs[0]['label']}" + "".join(
        f" and {x} with {s['label']}" for x, s in zip(ratio[1:], runs[1:], strict=True)
    )
    text += " (measured busy time per stage / simulated)."
    if len(runs) == 2 and runs[0]["simulated"]["busy_ratio"] > 1.2 * runs[1]["simulated"]["busy_ratio"]:
        r = runs[0]
        text += (
            f" {r['label']}'s stages compute at the same time, so anything they share — cores, memory "
            "bandwidth, other processes on the machine — slows its tiles more than GPipe's, which mostly take "
            "turns."
        )
    return text


def loss_line(report: dict) -> str:
    loss = report["loss"]
    if loss is None:
        losses = report["run"]["losses"]
        return f"Loss {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {len(losses)}. {NO_BASELINE}"
    verdict = "match" if loss["match"] else "DO NOT match"
    return (
        f"Losses {verdict} at every one of the {loss['steps']} steps: max |Δ| = {loss['max_abs_diff']:.3g}, "
        f"max relative {loss['max_rel_diff']:.3g} (tolerance {loss['rel_tolerance']:g}, fp32) — "
        "both runs are the same synchronous training."
    )


def bubble_line(report: dict) -> str:
    r, *others = summaries(report)
    waits = f"{r['bubble_fraction']:.0%} of the pipelined span with {r['label']} ({_tiles(r['tiles'])})"
    waits += "".join(f" vs {s['bubble_fraction']:.0%} with {s['label']} ({_tiles(s['tiles'])})" for s in others)
    formula = " vs ".join(f"{s['bubble_formula']:.0%}" for s in (r, *others))
    return f"Idle time: the stages wait {waits}; the formula (K−1)/(v·M+K−1) for equal tiles says {formula}."


def segments_line(report: dict) -> str | None:
    """For a run resumed under another plan, D or T: each plan's steps, layout and median step, and that the
    report's timings are of its last plan's steps; None for a run trained under one plan."""
    segs = report["run"].get("segments") or []
    if len(segs) < 2:
        return None

    def one(seg: dict) -> str:
        steps = f"steps {seg['steps'][0]}–{seg['steps'][1]}"
        if seg["short_form"] is None:
            return f"{steps} under a plan this run folder did not record"
        layout = f"D × K × T {seg['data_parallel']} × {seg['stages']} × {seg['tensor_parallel']}"
        return (
            f"{steps} under {layout} `{seg['short_form']}` (median {_seconds(seg['latency_median_s'])}, "
            f"bubble {seg['bubble_fraction']:.0%})"
        )

    return (
        f"Resumed under another plan: {'; '.join(one(seg) for seg in segs)}. The timings above are of the last "
        "plan's steps."
    )


def _tiles(n: int) -> str:
    return f"{n} tile" + ("" if n == 1 else "s")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_markdown(report: dict) -> str:
    """report.md: the header, the latency table, where the time goes, the loss, the pictures and the trace."""
    files = {name: Path(path).name for name, path in report["files"].items()}
    parts = [
        f"# terapipe report — {title(report)}",
        "",
        headline(report),
        "",
        *([segments_line(report), ""] if segments_line(report) else []),
        *_runs_list(report),
        "",
        "## Iteration latency",
        "",
        _table(latency_header(report), latency_rows(report)),
        "",
        _predictions_note(report),
        "",
        "## Where the time goes",
        "",
        bubble_line(report),
        "",
        *([tile_speed_line(report), ""] if tile_speed_line(report) else []),
        _table(STAGE_HEADER, stage_rows(report)),
        "",
        f"![timeline]({files['timeline.png']})",
        "",
        *_memory_section(report),
        "## Loss",
        "",
        loss_line(report),
        "",
        _table(*_loss_table(report)),
        "",
        f"![loss]({files['loss.png']})",
        "",
        f"Chrome trace (one process per rank{', both runs' if report['baseline'] else ''}): `{files['trace.json']}`"
        " — open it in https://ui.perfetto.dev.",
        "",
    ]
    return "\n".join(parts)


def _memory_section(report: dict) -> list[str]:
    table = memory_table(report)
    if table is None:
        return []
    note = (
        "Each stage's largest rank over the compared steps. Kept for backward: the tensors a stage holds for its "
        "backward, estimated by the plan and measured by the runtime's saved-tensor hooks; error = (estimated − "
        "measured) / measured."
    )
    if any(st.get("measured_live_bytes") is not None for _, st in _stages(report)):
        note += (
            " Live: the most bytes live at once beyond the state (weights, gradients, optimizer) — kept for backward, "
            "the transients on top, the K/V caches, the messages — estimated by the plan and measured by a tracker of "
            "every tensor made during the first step a CPU run's launch takes (the warm-up's, whatever it is)."
        )
    mismatches = [f"- {line}" for line in memory_mismatch_lines(report)]
    return ["## Memory per stage", "", note, "", _table(*table), "", *mismatches, *([""] if mismatches else [])]


def _runs_list(report: dict) -> list[str]:
    r, b = report["run"], report["baseline"]
    lines = [f"- {r['label']} run: `{r['path']}` — `{r['short_form']}`"]
    lines.append(f"- {b['label']} baseline: `{b['path']}` — `{b['short_form']}`" if b else f"- {NO_BASELINE}")
    lines.append(
        f"- device: {r['device']}; {report['warmup_steps']} warm-up step(s) left out of the timings; "
        f"{r['tokens_per_step']} tokens per step"
    )
    return lines


def _predictions_note(report: dict) -> str:
    cm = report.get("cost_model") or {}
    source = (
        f" of `{cm.get('profile')}` ({cm.get('source')})"
        if cm.get("used")
        else f" (simulator not run: {cm.get('why', 'no cost model')})"
    )
    return (
        f"Predictions are the plan's objective (docs/design.md §4) and the schedule simulator, both from the cost "
        f"model{source}; errors are (predicted − measured median) / measured median. Peak memory is the largest "
        "rank's (on CPU: the process's peak resident memory)."
    )


def _loss_table(report: dict) -> tuple[list[str], list[list[str]]]:
    r, b = report["run"], report["baseline"]
    if b is None:
        return ["step", r["label"]], [[str(n), f"{x:.6f}"] for n, x in enumerate(r["losses"], 1)]
    rows = [
        [str(n), f"{x:.6f}", f"{y:.6f}", f"{abs(x - y):.2g}"]
        for n, (x, y) in enumerate(zip(r["losses"], b["losses"], strict=False), 1)
    ]
    return ["step", r["label"], b["label"], "|Δ|"], rows
