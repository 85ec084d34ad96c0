"""The report's pictures (matplotlib, Agg: no display needed).

``draw_plan`` is `terapipe plan --show`'s picture: the same timelines, simulated, above each stage's memory.
``timeline.png`` is the picture of the pipeline papers: one row per stage, a box per forward (F) and backward
(B) action of each tile, idle time as the hatched grey between boxes. It is a grid of panels on ONE time axis:
a row per run (TeraPipe above GPipe) and a column per source (measured; predicted by the simulator when a cost
model is at hand), each panel one step of one pipeline — any list of `timeline.Event` of one step, measured or
simulated, draws the same way.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.files import write_bytes_atomic
from terapipe_cli.schedule.timeline import Event, stage_times

FORWARD_COLORS = ("#3b6fb6", "#7fa7dc")  # alternate shades so neighbouring tiles stay distinguishable
BACKWARD_COLORS = ("#d9722b", "#f0ab73")
IDLE_COLOR = "#ececec"
IDLE_HATCH_COLOR = "#c4c4c4"


def _matplotlib():
    """pyplot and its patches, on the Agg backend (no display); loaded when a picture is drawn, since matplotlib
    takes a moment to import and the report's other work does not need it."""
    import matplotlib

    matplotlib.use("Agg")  # set before pyplot is first imported
    from matplotlib import patches, pyplot

    return pyplot, patches


@dataclass
class TimelinePanel:
    """One step of one pipeline to draw: its events (times from the step's start) and what to call it."""

    title: str
    events: list[Event]
    stages: int
    tile_order: dict[tuple[int, int], int]  # (batch_slice, token_slice) -> tile number in pipeline order
    step_end_s: float | None = None  # the whole step's end (after optimizer and sync), marked with a line


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return write_bytes_atomic(path, buf.getvalue())


def draw_timelines(grid: Sequence[Sequence[TimelinePanel | None]], path: str | Path, *, title: str = "") -> Path:
    """Draw panels in a grid (rows × columns; None leaves a cell empty) on one shared time axis; write a PNG."""
    plt, patches = _matplotlib()
    Rectangle = patches.Rectangle

    rows, cols = len(grid), max(len(r) for r in grid)
    panels = [p for r in grid for p in r if p is not None]
    x_max = max(max([e.end_s for e in p.events] + [p.step_end_s or 0.0]) for p in panels) * 1e3 * 1.02
    heights = [max((p.stages for p in r if p is not None), default=1) + 1.2 for r in grid]
    fig_w = 15 if cols == 1 else 18
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(fig_w, 0.5 * sum(heights) + 1.2),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for r, row in enumerate(grid):
        for c in range(cols):
            ax = axes[r][c]
            panel = row[c] if c < len(row) else None
            if panel is None:
                ax.axis("off")
                continue
            # A label needs about a fifth of an inch; narrower boxes stay unlabelled rather than overprinted.
            _draw_panel(ax, panel, x_max, Rectangle, min_label_w=x_max * 0.22 / (fig_w / cols - 1.6))
            if r == rows - 1 or all(grid[rr][c] is None for rr in range(r + 1, rows) if c < len(grid[rr])):
                ax.set_xlabel("time from the step's start (ms)")
                ax.tick_params(axis="x", labelbottom=True)
    return _finish_timelines(fig, path, title)


def draw_plan(
    panels: Sequence[TimelinePanel],
    memory: Sequence[tuple[str, Sequence[float]]],
    path: str | Path,
    *,
    limit_bytes: float | None = None,
    limit_label: str = "",
    title: str = "",
) -> Path:
    """A plan before training: the simulated step of each scheme (a row each, one time axis) above every stage's
    estimated peak memory per scheme (``memory``: (label, bytes per stage)), with the limit as a line; write a PNG."""
    plt, patches = _matplotlib()
    K = max(p.stages for p in panels)
    x_max = max(max([e.end_s for e in p.events] + [p.step_end_s or 0.0]) for p in panels) * 1e3 * 1.02
    heights = [p.stages + 1.2 for p in panels] + ([max(4.5, K * 0.3 + 3)] if memory else [])
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(15, 0.5 * sum(heights) + 1.2), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, panel in zip(axes[:, 0], panels, strict=False):
        _draw_panel(ax, panel, x_max, patches.Rectangle, min_label_w=x_max * 0.22 / 13.4)
        ax.set_xlabel("time from the step's start (ms), simulated")
    if memory:
        ax = axes[-1][0]
        width = 0.8 / len(memory)
        colors = ("#3b6fb6", "#d9722b", "#4a9a4a")
        largest = max([max(per_stage) for _, per_stage in memory] + [limit_bytes or 0.0])
        unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
        for n, (label, per_stage) in enumerate(memory):
            xs = [k + (n - (len(memory) - 1) / 2) * width for k in range(len(per_stage))]
            ax.bar(xs, [b / scale for b in per_stage], width, label=label, color=colors[n % len(colors)])
        if limit_bytes:
            ax.axhline(limit_bytes / scale, color="#b22222", linestyle="--", linewidth=1.2, label=limit_label)
        ax.set_xticks(range(K))
        ax.set_xticklabels([f"stage {k}" for k in range(K)], fontsize=9)
        ax.set_ylabel(f"{unit}")
        ax.set_title("estimated peak memory per stage", loc="left", fontsize=10)
        ax.grid(axis="y", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.legend(frameon=False, fontsize=9)
    return _finish_timelines(fig, path, title)


def _finish_timelines(fig, path: str | Path, title: str) -> Path:
    """The timeline pictures' legend (forward, backward, idle) and title; write the PNG and close the figure."""
    plt, patches = _matplotlib()
    handles = [
        patches.Patch(facecolor=FORWARD_COLORS[0], label="forward (F) of a tile"),
        patches.Patch(facecolor=BACKWARD_COLORS[0], label="backward (B) of a tile"),
        patches.Patch(facecolor=IDLE_COLOR, edgecolor=IDLE_HATCH_COLOR, hatch="///", label="idle (bubble)"),
    ]
    fig.legend(handles=handles, loc="upper right", ncol=3, frameon=False, fontsize=9)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=12, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out = _save(fig, Path(path))
    plt.close(fig)
    return out


def _draw_panel(ax, panel: TimelinePanel, x_max: float, Rectangle, *, min_label_w: float) -> None:
    K = panel.stages
    span = max((e.end_s for e in panel.events), default=0.0) * 1e3
    ax.set_xlim(0, x_max)
    ax.set_ylim(K - 0.5 + 0.1, -0.6)  # stage 0 on top
    ax.set_yticks(range(K))
    ax.set_yticklabels([f"stage {k}" for k in range(K)], fontsize=9)
    ax.set_title(panel.title, loc="left", fontsize=10)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for k in range(K):
        ax.add_patch(
            Rectangle(
                (0, k - 0.38),
                span,
                0.76,
                facecolor=IDLE_COLOR,
                edgecolor=IDLE_HATCH_COLOR,
                hatch="///",
                linewidth=0.0,
                zorder=1,
            )
        )
    for e in panel.events:
        n = panel.tile_order.get((e.batch_slice, e.token_slice), 0)
        colors = FORWARD_COLORS if e.phase == "F" else BACKWARD_COLORS
        x, w = e.start_s * 1e3, (e.end_s - e.start_s) * 1e3
        ax.add_patch(
            Rectangle((x, e.stage - 0.38), w, 0.76, facecolor=colors[n % 2], edgecolor="white", linewidth=0.5, zorder=2)
        )
        if w >= min_label_w:
            ax.text(
                x + w / 2,
                e.stage,
                f"{e.phase}{n}" if e.chunk is None else f"{e.phase}{n}·{e.chunk}",
                ha="center",
                va="center",
                fontsize=6.5,
                zorder=3,
                color="white" if n % 2 == 0 else "#222222",
            )
    if panel.step_end_s is not None:
        ax.axvline(panel.step_end_s * 1e3, color="#555555", linestyle="--", linewidth=0.9, zorder=3)
    for k, frac in enumerate(stage_times([panel.events], K).busy_fractions):
        ax.text(
            1.002, k, f"busy {frac:.0%}", transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="#333333"
        )


def draw_losses(
    series: Sequence[tuple[str, Sequence[float]]],
    path: str | Path,
    *,
    untimed: int = 0,
    title: str = "",
    held_out: Sequence[tuple[str, Sequence[tuple[int, float]]]] = (),
) -> Path:
    """Loss per step of each run (top; with ``held_out``, each run's validation loss at its evaluated steps as a
    second curve) and, with more than one run, the absolute difference of every run from the first (bottom)."""
    plt, _ = _matplotlib()
    if len(series) > 1:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, top = plt.subplots(1, 1, figsize=(10, 4.5))
        bottom = None
    styles = [
        dict(linestyle="-", marker="o", markersize=4, linewidth=1.8),
        dict(linestyle="--", marker="x", markersize=6, linewidth=1.2),
    ]
    colors = ("#3b6fb6", "#d9722b", "#4a9a4a", "#8c5fb8")
    ref = list(series[0][1])
    for n, (label, losses) in enumerate(series):
        steps = range(1, len(losses) + 1)
        top.plot(steps, losses, label=label, color=colors[n % len(colors)], **styles[min(n, 1)])
        if n:
            diff = [abs(a - b) for a, b in zip(losses, ref, strict=False)]
            bottom.plot(
                range(1, len(diff) + 1),
                diff,
                color=colors[n % len(colors)],
                marker="o",
                markersize=3,
                label=f"|{label} − {series[0][0]}|",
            )
    for n, (label, points) in enumerate(held_out):
        if points:
            steps, values = zip(*points, strict=True)
            style = dict(linestyle=":", marker="s", markersize=5, linewidth=1.6, markerfacecolor="none")
            top.plot(steps, values, label=f"{label}, held-out", color=colors[(n + 2) % len(colors)], **style)
    for ax in (top, bottom):
        if ax is None:
            continue
        if untimed:  # the warm-up (and, in a run resumed under another plan, the steps of its earlier plans)
            ax.axvspan(0.5, untimed + 0.5, color="#eeeeee", zorder=0, label="not timed" if ax is top else None)
        ax.grid(color="#dddddd", linewidth=0.6)
    top.set_ylabel("loss" if any(points for _, points in held_out) else "training loss")
    top.legend(frameon=False)
    if bottom is not None:
        bottom.set_ylabel("absolute difference")
        bottom.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        bottom.legend(frameon=False, fontsize=9)
    (bottom or top).set_xlabel("step")
    if title:
        top.set_title(title, loc="left", fontsize=11)
    fig.tight_layout()
    out = _save(fig, Path(path))
    plt.close(fig)
    return out
