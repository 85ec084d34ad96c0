#!/usr/bin/env python3
"""Plan every published TeraPipe setting from analytic profiles and print one table.

For each experiment file (default: configs/experiments/paper-*.toml, the ten settings of docs/design.md §7 and the
long-sequence runs) this builds an analytic profile of the experiment's model on its hardware, plans one
pipeline replica (B / data-parallel sequences) with the exact planner, and compares it with the best GPipe
microbatching and the best uniform token slicing, all priced by the same cost model (data-parallel
all-reduce and optimizer step included):

    python scripts/paper_table.py                                   # V100 (p3.16xlarge), as published
    python scripts/paper_table.py --hardware configs/hardware/h100.toml   # the same settings on p5 nodes
    python scripts/paper_table.py --markdown                        # a Markdown table for docs/results.md
    python scripts/paper_table.py --memory-limit 12                 # every setting within 12 GiB per device

Every setting is planned within a memory limit per device, as `terapipe plan` plans: by default the device memory
of the experiment's hardware file (16 GiB on the V100), or --memory-limit GIB for all. The planner returns the
fastest scheme that fits, choosing the token slicing, the batch grouping, the schedule order (GPipe or 1F1B) and
which stages recompute; the GPipe baseline runs in the same order and recomputation. A setting that no scheme fits
(with a --memory-limit below what a setting needs) is planned without the limit, so its times still compare TeraPipe
with GPipe, and its peak is flagged "(!)" with the smallest peak any scheme could reach ("min").

Columns: GPipe scheme and predicted latency per step, TeraPipe scheme (the DP's exact optimum of the objective) and
predicted latency, the predicted speed-up, the DP's gain over the best uniform slicing (uniform / DP latency), and
the planner's wall seconds (the search within the memory limit, the schedule-aware choice and the baselines
included).
Schemes are in the short form of docs/design.md §2, runs of equal slices folded (``[72]*12``); long ones are
shortened in the middle (--full shows them whole). Then the latencies the schedule simulator predicts for the
GPipe and TeraPipe schemes (transfers overlapping compute, as the runtime's asynchronous sends do); the simulated
latency of the plan's schedule-aware choice (`terapipe plan --rank simulated`, the default: the fastest in the
simulator among the optimum and the schemes the search ranks next to it) and its gain, or "same"; the plan's
schedule order and recomputing stages ("—" none, "all", or a list such as "0–3, 7"), and its estimated peak
memory of its fullest stage in GiB.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from terapipe_cli.config.experiment import Experiment, load_experiment
from terapipe_cli.config.hardware import load_hardware  # noqa: E402
from terapipe_cli.errors import UserError  # noqa: E402
from terapipe_cli.plan.choice import plan_for_profile, smallest_peak
from terapipe_cli.plan.costmodel import profile_from_dict  # noqa: E402
from terapipe_cli.plan.file import short_form  # noqa: E402
from terapipe_cli.plan.request import plan_request  # noqa: E402
from terapipe_cli.profile.analytic import experiment_profile  # noqa: E402

# The limit a setting that no scheme fits is planned under instead: none that any model here comes near.
NO_LIMIT_GIB = 1e6


@dataclass
class Row:
    experiment: Experiment
    gpipe_scheme: str
    gpipe_s: float
    terapipe_scheme: str
    terapipe_s: float
    uniform_scheme: str
    uniform_s: float
    step_s: float
    planner_s: float  # wall seconds of planning: the slicing DP, the search within the memory limit, the baselines
    gpipe_sim_s: float
    terapipe_sim_s: float  # the objective's optimum (the TeraPipe scheme above), simulated
    chosen_sim_s: float  # the plan's schedule-aware choice (`terapipe plan --rank simulated`), simulated
    order: str  # the plan's schedule order: "gpipe" or "1f1b"
    recompute: tuple[bool, ...]  # per stage
    peak_memory_bytes: float
    # No scheme fits the limit: the row is planned without it, and this is the smallest peak any scheme could reach
    # (bytes); None when the plan fits.
    smallest_peak_bytes: float | None = None
    calibrated: Row | None = None  # the same setting planned on the calibrated hardware file (--calibrated)

    @property
    def fits(self) -> bool:
        return self.smallest_peak_bytes is None

    @property
    def speedup(self) -> float:
        return self.gpipe_s / self.terapipe_s

    @property
    def simulated_speedup(self) -> float:
        """GPipe's simulated latency over the plan's (its schedule-aware choice's)."""
        return self.gpipe_sim_s / self.chosen_sim_s

    @property
    def dp_gain(self) -> float:
        return self.uniform_s / self.terapipe_s


def plan_experiment(exp: Experiment, memory_limit_gib: float | None = None) -> Row:
    """Analytic profile -> the library's plan and its two baselines, for one pipeline replica, within
    ``memory_limit_gib`` per device (None: the device memory of the experiment's hardware). A setting that no
    scheme fits is planned without the limit and records the smallest peak any scheme could reach."""
    B, g = exp.batch_per_replica, exp.token_step
    obj = experiment_profile(exp, batch_size=B, tensor_parallel=exp.tensor_parallel, token_step=g)
    profile = profile_from_dict(obj, f"analytic profile of {exp.path}")
    request = plan_request(
        profile,
        stages=exp.stages,
        batch_size=B,
        seq_len=exp.seq_len,
        token_step=g,
        data_parallel=exp.data_parallel,
        memory_limit_gib=memory_limit_gib,
    )
    least, start = None, time.perf_counter()
    try:
        planned = plan_for_profile(profile, request)
    except UserError as e:
        if e.where != "--memory-limit":  # raised by plan_for_profile only when no scheme fits the limit
            raise
        limit = memory_limit_gib * 2**30 if memory_limit_gib is not None else float(profile.device["memory_bytes"])
        least, _ = smallest_peak(profile, request, limit)
        planned = plan_for_profile(profile, replace(request, memory_limit_gib=NO_LIMIT_GIB))
    planner_s = time.perf_counter() - start
    gp, un = planned.gpipe, planned.uniform
    res = planned.formula_optimal or planned.terapipe  # the DP's exact optimum of the objective
    optimum_sim = planned.formula_optimal_simulated_s or planned.simulated_s["terapipe"]
    memory = planned.memory
    return Row(
        experiment=exp,
        gpipe_scheme=compact_form(gp.slices),
        gpipe_s=gp.predicted_s,
        terapipe_scheme=compact_form(res.slices),
        terapipe_s=res.predicted_s,
        uniform_scheme=compact_form(un.slices),
        uniform_s=un.predicted_s,
        step_s=planned.cost.step_s,
        planner_s=planner_s,
        gpipe_sim_s=planned.simulated_s["gpipe"],
        terapipe_sim_s=optimum_sim,
        chosen_sim_s=planned.simulated_s["terapipe"],
        order=planned.order,
        recompute=planned.recompute,
        peak_memory_bytes=memory.peak_bytes if memory else float("nan"),
        smallest_peak_bytes=least,
    )


def compact_form(slices) -> str:
    """The short form of docs/design.md §2 with runs of equal token slices folded; still a valid Python expression."""
    return short_form(slices, fold=True)


def stage_ranges(stages: tuple[bool, ...]) -> str:
    """The recomputing stages, compact: ``—`` for none, ``all``, or runs such as ``0–3, 7``."""
    if not any(stages):
        return "—"
    if all(stages):
        return "all"
    on = [k for k, yes in enumerate(stages) if yes]
    runs: list[list[int]] = []
    for k in on:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs)


def _peak_cell(row: Row) -> str:
    gib = f"{row.peak_memory_bytes / 2**30:.1f}"
    return gib if row.fits else f"{gib} (!) min {row.smallest_peak_bytes / 2**30:.1f}"


def _calibrated_cell(row: Row, width: int) -> str:
    c = row.calibrated
    if c is None:
        return "—"
    return f"{_shorten(c.terapipe_scheme, width // 2)}: {c.speedup:.2f}x / {c.simulated_speedup:.2f}x"


def calibrated_sibling(hardware_path: str | Path) -> Path | None:
    """The calibrated counterpart of a hardware file, when one is shipped beside it: ``X-calibrated.toml``, or
    ``X-dispatch.toml`` (a dispatch floor carried over from a calibrated GPU: an estimate)."""
    path = Path(hardware_path)
    for suffix in ("-calibrated", "-dispatch"):
        sibling = path.with_name(f"{path.stem}{suffix}.toml")
        if sibling.is_file():
            return sibling
    return None


def _rerank_cell(row: Row) -> str:
    """The schedule-aware choice's simulated latency and its gain over the optimum's, or "same"."""
    if row.chosen_sim_s >= row.terapipe_sim_s:
        return "same"
    return f"{row.chosen_sim_s:.3f} ({row.chosen_sim_s / row.terapipe_sim_s - 1:+.1%})"


def _shorten(scheme: str, width: int) -> str:
    if width <= 0 or len(scheme) <= width:
        return scheme
    keep = (width - 5) // 2
    return f"{scheme[:keep]} ... {scheme[-keep:]}"


def _cells(row: Row, width: int) -> list[str]:
    e = row.experiment
    return [
        e.setting,
        e.model.name,
        str(e.gpus),
        str(e.batch_size),
        str(e.data_parallel),
        str(e.stages),
        str(e.tensor_parallel),
        _shorten(row.gpipe_scheme, width),
        f"{row.gpipe_s:.3f}",
        _shorten(row.terapipe_scheme, width),
        f"{row.terapipe_s:.3f}",
        f"{row.speedup:.2f}x / {row.simulated_speedup:.2f}x",
        _calibrated_cell(row, width),
        f"{row.dp_gain:.3f}x",
        f"{row.planner_s:.2f}",
        f"{row.gpipe_sim_s:.3f} / {row.terapipe_sim_s:.3f}",
        _rerank_cell(row),
        "1F1B" if row.order == "1f1b" else "GPipe",
        stage_ranges(row.recompute),
        _peak_cell(row),
    ]


HEADERS = [
    "setting",
    "model",
    "GPUs",
    "B",
    "DP",
    "stages",
    "TP",
    "GPipe scheme",
    "GPipe s",
    "TeraPipe scheme",
    "TeraPipe s",
    "speed-up formula / simulated",
    "calibrated: TeraPipe scheme, speed-up formula / simulated",
    "DP vs uniform",
    "planner s",
    "simulated GPipe / TeraPipe s",
    "schedule-aware: simulated s",
    "order",
    "recompute",
    "peak GiB",
]


def footnote(rows: list[Row], limit_text: str) -> str | None:
    """The line under the table explaining "(!)"; None when every setting fits."""
    if all(row.fits for row in rows):
        return None
    return (
        f"(!) no scheme fits {limit_text}: planned without the limit; min = the smallest peak any scheme reaches "
        "(batch slices of one sequence, either order, recomputing where it helps)."
    )


def render_rich(rows: list[Row], console: Console, width: int, title: str, note: str | None) -> None:
    table = Table(title=title, show_lines=False, caption=note, caption_justify="left")
    for h in HEADERS:
        table.add_column(
            h, justify="right" if h not in {"model", "GPipe scheme", "TeraPipe scheme"} else "left", overflow="fold"
        )
    for row in rows:
        table.add_row(*_cells(row, width))
    console.print(table)


def render_markdown(rows: list[Row], width: int, note: str | None) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in rows:
        cells = _cells(row, width)
        cells[7], cells[9] = f"`{cells[7]}`", f"`{cells[9]}`"
        lines.append("| " + " | ".join(cells) + " |")
    if note:
        lines += ["", note]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiments", nargs="*", help="experiment TOML files (default: configs/experiments/paper-*.toml)")
    ap.add_argument("--hardware", help="plan every setting on this hardware file instead of the experiment's own")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for docs/results.md)")
    ap.add_argument("--full", action="store_true", help="show long schemes whole instead of shortened")
    ap.add_argument(
        "--calibrated",
        metavar="HARDWARE.toml",
        help="also plan every setting on this hardware file (default: the calibrated file shipped beside each "
        "setting's own, X-calibrated.toml or X-dispatch.toml, when there is one)",
    )
    ap.add_argument("--no-calibrated", action="store_true", help="do not plan on a calibrated hardware file")
    ap.add_argument(
        "--memory-limit",
        type=float,
        metavar="GIB",
        help="plan every setting within this many GiB per device (default: the device memory of its hardware file)",
    )
    args = ap.parse_args(argv)
    # Piped into a file, rich would wrap rows at 80 columns; a wide canvas keeps one line per setting.
    console = Console(width=None if sys.stdout.isatty() else 240)
    try:
        paths = [Path(p) for p in args.experiments] or sorted((ROOT / "configs" / "experiments").glob("paper-*.toml"))
        if not paths:
            raise UserError("no experiment files found", where=str(ROOT / "configs" / "experiments"))
        experiments = [load_experiment(p) for p in paths]
        if args.hardware:
            hw = load_hardware(args.hardware)
            experiments = [replace(e, hardware=hw, hardware_path=str(args.hardware)) for e in experiments]
        rows: list[Row] = []
        start = time.perf_counter()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as progress:
            task = progress.add_task("planning", total=len(experiments))
            calibrated_files = set()
            for exp in experiments:
                progress.update(task, description=f"planning {exp.name}")
                row = plan_experiment(exp, args.memory_limit)
                after = None if args.no_calibrated else args.calibrated or calibrated_sibling(exp.hardware_path)
                if after:
                    hw = replace(exp, hardware=load_hardware(str(after)), hardware_path=str(after))
                    row.calibrated = plan_experiment(hw, args.memory_limit)
                    calibrated_files.add(Path(after).name)
                rows.append(row)
                progress.advance(task)
        total = time.perf_counter() - start
    except UserError as e:
        sys.stderr.write(f"paper_table: error: {e}\n")
        return 2
    width = 0 if args.full else 60
    hardware = sorted({e.hardware.name for e in experiments})
    limit_text = "the device memory" if args.memory_limit is None else f"{args.memory_limit:g} GiB per device"
    title = (
        f"TeraPipe vs GPipe, predicted from analytic profiles on {', '.join(hardware)} within {limit_text} "
        f"(per step, data-parallel all-reduce and optimizer included); {total:.1f} s in all"
    )
    note = footnote(rows, limit_text)
    if calibrated_files:
        note = ((note + "\n") if note else "") + (
            f"calibrated: planned again on {', '.join(sorted(calibrated_files))} (its dispatch floor and efficiency "
            "fitted to measurements, or carried over from a calibrated GPU as an estimate: see its header)."
        )
    if args.markdown:
        print(f"{title}\n")
        print(render_markdown(rows, width, note))
    else:
        render_rich(rows, console, width, title, note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
