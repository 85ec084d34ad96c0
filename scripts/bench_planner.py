#!/usr/bin/env python3
"""Planner benchmark: the exact default method against the published ε-enumeration, side by side.

The costs are the project's own: an analytic profile (docs/design.md §12) of each GPT-3 model on the V100 nodes of
configs/hardware/v100.toml with 8-way tensor parallelism, read by the cost model of docs/design.md §3 for a stage
of the row's layers. The shapes are the reference ones of the planner's search (docs/design.md §5): B = 2, 8, 32,
72, a long sequence (L = 8192) and a token step of one. The two methods run interleaved (A B A B …) on the same
cost; each row prints the median seconds (min–max), the speed-up, and both objectives.

    python scripts/bench_planner.py                 # all rows, 3 repeats
    python scripts/bench_planner.py --repeats 1 --rows 1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from terapipe_cli.config import load_model_config  # noqa: E402
from terapipe_cli.costmodel import CostModel, profile_from_dict  # noqa: E402
from terapipe_cli.hardware import load_hardware  # noqa: E402
from terapipe_cli.planner import solve  # noqa: E402
from terapipe_cli.profile.analytic import analytic_profile  # noqa: E402

HARDWARE = ROOT / "configs" / "hardware" / "v100.toml"
TENSOR_PARALLEL = 8

# (label, model file under configs/models, token_step, batch, stages); L is the model's sequence length.
ROWS = [
    ("GPT3-44B  L=2048 g=8 B=2  K=48", "gpt3-44b", 8, 2, 48),
    ("GPT3-44B  L=2048 g=8 B=8  K=48", "gpt3-44b", 8, 8, 48),
    ("GPT3-13B  L=2048 g=8 B=32 K=20", "gpt3-13b", 8, 32, 20),
    ("GPT3-1B   L=2048 g=8 B=72 K=12", "gpt3-1b", 8, 72, 12),
    ("GPT3-13B  L=8192 g=8 B=2  K=40", "gpt3-13b-L8192", 8, 2, 40),
    ("GPT3-1B   L=2048 g=1 B=1  K=8", "gpt3-1b", 1, 1, 8),
]


def analytic_cost(model_name: str, token_step: int, batch: int, stages: int) -> CostModel:
    """The cost of one stage from an analytic profile whose grid holds every batch-slice size up to B."""
    model = load_model_config(ROOT / "configs" / "models" / f"{model_name}.toml")
    obj = analytic_profile(
        model,
        load_hardware(HARDWARE),
        tensor_parallel=TENSOR_PARALLEL,
        batch_sizes=range(1, batch + 1),
        token_step=token_step,
    )
    return CostModel(profile_from_dict(obj, f"analytic profile of {model_name}"), stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="", help="comma-separated row numbers (1-based); default all")
    ap.add_argument("--epsilon", type=float, default=1e-5, help="ε of the enumeration, seconds (default 1e-5)")
    ap.add_argument("--no-enumerate", action="store_true", help="time only the exact default method")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for the README)")
    args = ap.parse_args()
    rows = [ROWS[int(k) - 1] for k in args.rows.split(",")] if args.rows else ROWS
    console = Console(width=max(Console().width, 200))  # a wide table; piped output would wrap it unreadably
    title = f"Planner: exact default vs ε-enumeration (ε = {args.epsilon:g} s), {args.repeats} interleaved repeats"
    table = Table(title=title)
    columns = ("shape", "exact s", "enumerate s", "speed-up", "exact T (s)", "enumerate T (s)", "Δ objective",
               "probes exact / enum", "exact scheme")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("shape", "exact scheme") else "right")
    rows_out: list[list[str]] = []
    for label, model_name, g, B, K in rows:
        cost = analytic_cost(model_name, g, B, K)
        L = cost.profile.model.seq_len
        t_exact, t_enum, res_exact, res_enum = [], [], None, None
        for _ in range(args.repeats):
            started = time.perf_counter()
            res_exact = solve(cost, seq_len=L, batch_size=B, stages=K, token_step=g)
            t_exact.append(time.perf_counter() - started)
            if not args.no_enumerate:
                started = time.perf_counter()
                res_enum = solve(
                    cost, seq_len=L, batch_size=B, stages=K, token_step=g, epsilon=args.epsilon, method="enumerate"
                )
                t_enum.append(time.perf_counter() - started)

        def fmt(ts: list[float]) -> str:
            return f"{statistics.median(ts):.3f} ({min(ts):.3f}–{max(ts):.3f})" if ts else "—"

        speedup = f"{statistics.median(t_enum) / statistics.median(t_exact):.1f}×" if t_enum else "—"
        delta = f"{(res_exact.predicted_s - res_enum.predicted_s) / res_enum.predicted_s:+.4%}" if res_enum else "—"
        cells = [
            label,
            fmt(t_exact),
            fmt(t_enum),
            speedup,
            f"{res_exact.predicted_s:.6f}",
            f"{res_enum.predicted_s:.6f}" if res_enum else "—",
            delta,
            f"{res_exact.candidates} / {res_enum.candidates if res_enum else '—'}",
            res_exact.short_form(fold=True),
        ]
        table.add_row(*cells)
        rows_out.append(cells)
        console.print(f"done: {label}", style="dim")
    console.print(table)
    if args.markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for cells in rows_out:
            print("| " + " | ".join(cells[:-1]) + f" | `{cells[-1]}` |")


if __name__ == "__main__":
    main()
