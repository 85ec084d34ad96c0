#!/usr/bin/env python3
"""Planner benchmark: the exact default method against the published ε-enumeration, side by side.

Synthetic costs of the reference shapes (SPEC §5, issue 2): a roofline-style GPU layer — FLOPs of one decoder layer
(24·b·i·H² + 4·b·i·(i+j)·H forward, ×3 with backward) split over 8-way tensor parallelism, at a peak throughput
scaled by an efficiency that falls for small tiles, plus a kernel-launch floor and the stage-to-stage transfer of
the activation and its gradient. The two methods run interleaved (A B A B …) on the same cost; each row prints the
median seconds (min–max), the speed-up, and both objectives.

    python scripts/bench_planner.py                 # all rows, 3 repeats
    python scripts/bench_planner.py --repeats 1 --rows 1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from terapipe_cli.planner import solve  # noqa: E402


class SyntheticGpuCost:
    """t(b, i, j) for one stage of `layers` decoder layers of hidden size H on a V100-like device (fp16)."""

    def __init__(
        self,
        hidden: int,
        layers: int,
        tensor_parallel: int = 8,
        peak_flops: float = 100e12,
        half_efficiency_tokens: float = 96.0,
        launch_s: float = 150e-6,
        latency_s: float = 20e-6,
        bytes_per_s: float = 25e9 / 8,
    ) -> None:
        self.H, self.layers, self.tp = hidden, layers, tensor_parallel
        self.peak, self.x0, self.launch = peak_flops, half_efficiency_tokens, launch_s
        self.latency, self.bw = latency_s, bytes_per_s

    def __call__(self, b, i, j):
        b, i, j = (np.asarray(x, dtype=float) for x in (b, i, j))
        tokens = b * i
        flops = 3.0 * (24.0 * tokens * self.H**2 + 4.0 * tokens * (i + j) * self.H) / self.tp
        efficiency = tokens / (tokens + self.x0)
        layer = self.launch + flops / (self.peak * efficiency)
        comm = 2.0 * (self.latency + tokens * self.H * 2.0 / self.bw)
        return self.layers * layer + comm


# (label, seq_len, token_step, batch, stages, hidden, layers per stage)
ROWS = [
    ("GPT3-44B  L=2048 g=8 B=2  K=48", 2048, 8, 2, 48, 6144, 2),
    ("GPT3-44B  L=2048 g=8 B=8  K=48", 2048, 8, 8, 48, 6144, 2),
    ("GPT3-13B  L=2048 g=8 B=32 K=20", 2048, 8, 32, 20, 5120, 2),
    ("GPT3-1B   L=2048 g=8 B=72 K=12", 2048, 8, 72, 12, 2048, 2),
    ("GPT3-13B  L=8192 g=8 B=2  K=40", 8192, 8, 2, 40, 5120, 1),
    ("GPT3-1B   L=2048 g=1 B=1  K=8", 2048, 1, 1, 8, 2048, 3),
]


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
    for label, L, g, B, K, H, layers in rows:
        cost = SyntheticGpuCost(H, layers)
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
