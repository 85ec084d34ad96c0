#!/usr/bin/env python3
"""The Python side of scripts/gpu_bringup.sh: the model cuts it trains and times, one line of result per step read
from the files the step wrote, and the summary table.

    python scripts/gpu_bringup.py cut configs/models/llama3-8b.toml /tmp/cut.toml --layers 2 --seq-len 2048
    python scripts/gpu_bringup.py cut configs/models/tiny.toml /tmp/cut.toml --seq-len 64 --hidden 128  # narrower
    python scripts/gpu_bringup.py verify RUN_DIR          # one line: --verify's checks, the backend, the device
    python scripts/gpu_bringup.py profile PROFILE.json     # the context fit's held-out error
    python scripts/gpu_bringup.py bench BENCH_OUTPUT.md    # whole sequence / uniform / planner, the per-tile floor
    python scripts/gpu_bringup.py memory REPORT.json       # the plan's memory estimate against the measured peaks
    python scripts/gpu_bringup.py pytest PYTEST_OUTPUT     # passed / failed / skipped
    python scripts/gpu_bringup.py operators CHECKS.txt     # each operator-table profile's --check-profile error
    python scripts/gpu_bringup.py summary ROWS.tsv SUMMARY.md --title ... --note ...

It runs between the steps, so it imports no torch (a fraction of a second each) and reads every file through
terapipe's own readers where the format has one (run summaries, profiles).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

# The targets for the bf16 profile and the GPT3-1B bench, checked where the line is written.
HELD_OUT_TARGET = 0.03  # mean relative error of the context fit on held-out tiles
COLUMNS = ("#", "step", "device", "status", "seconds", "result")


# ----------------------------------------------------------------------------------------------- the model cut


def cut_model(source: str, out: Path, layers: int | None, seq_len: int | None, hidden: int | None = None) -> Path:
    """``source``'s model with ``layers`` decoder layers at sequence length ``seq_len`` (the same widths, heads,
    K/V heads and vocabulary), written as a model TOML that every command reads like a bundled one. ``hidden``: a
    narrower width instead, the MLP's inner width scaled with it: the dry run's models (bf16 on a CPU without bf16
    instructions takes about ten times fp32's time; the tiny model's layer at H = 128 takes a quarter of H = 256's)."""
    from terapipe_cli.config.demo import model_toml
    from terapipe_cli.config.model import load_model_config

    model = load_model_config(source)
    model = replace(model, layers=layers or model.layers, seq_len=seq_len or model.seq_len)
    width = ""
    if hidden and hidden != model.hidden:
        # A family that names its MLP width scales it with H; a GPT's (mlp_ratio · H) follows by itself.
        named = "ffn_hidden" in {f.name for f in fields(model)}
        scaled = {"ffn_hidden": model.ffn_hidden * hidden // model.hidden} if named else {}
        model = replace(model, hidden=hidden, **scaled)
        width = f"-h{hidden}"
    model = replace(model, name=f"{model.name}-{model.layers}l{width}-L{model.seq_len}")
    at = f"L = {model.seq_len}" + (f", H = {model.hidden}" if width else "")
    out.write_text(model_toml(model, f"{source} cut to {model.layers} layers at {at} (gpu_bringup)"))
    return out


# ----------------------------------------------------------------------------------------------- one line per step


def verify_line(run_dir: Path) -> str:
    """--verify's three checks (relative difference against its tolerance), the slicing, backend and device."""
    from terapipe_cli.train.rundir import read_config, read_summary

    summary = read_summary(run_dir)
    config, _ = read_config(run_dir)
    verify = summary.get("verify")
    if not verify:
        return f"no --verify result in {run_dir}/summary.json"
    checks = ", ".join(
        f"{c['what'].split(',')[0].split(' ')[0]} {c['max_rel']:.1e}/{c['tolerance']:.0e}"
        + ("" if c["ok"] else " MISMATCH")
        for c in verify["checks"]
    )
    shape = f"K={summary['stages']} T={summary['tensor_parallel']} {summary['slices']}"
    where = f"{config.get('backend')} on {summary['device']}, {summary['precision']}"
    return f"{'verified' if verify['ok'] else 'MISMATCH'} ({checks}: rel/tol); {shape}; {where}"


def profile_line(path: Path) -> str:
    """The context fit's held-out error, forward and backward, against the target, and the smallest tile."""
    from terapipe_cli.plan.costmodel import read_profile

    raw = read_profile(path).raw
    errors = {which: raw["context"][which]["heldout_rel_err_mean"] for which in ("forward", "backward")}
    met = all(e < HELD_OUT_TARGET for e in errors.values())
    fwd, bwd = raw["forward_s"][0][0], raw["backward_s"][0][0]
    return (
        f"{raw['model']['name']} {raw['precision']} on {raw['device']['name']}: held-out context-fit error "
        f"forward {errors['forward']:.2%}, backward {errors['backward']:.2%} mean "
        f"(target < {HELD_OUT_TARGET:.0%}: {'met' if met else 'NOT met'}); "
        f"tile b={raw['batch_sizes'][0]} i={raw['token_lengths'][0]}: {(fwd + bwd) * 1e3:.2f} ms"
    )


def bench_line(path: Path, target_mfu: float | None = None) -> str:
    """The Markdown table scripts/bench_gpu.py printed: each scheme's time, MFU and peak memory, and the floor."""
    text = path.read_text()
    head = next((line for line in text.splitlines() if ", K=1, L=" in line), "")
    where = re.search(r": (\S+), K=1, (L=\d+)", head)
    cells = []
    for line in text.splitlines():
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(row) != 9 or not row[1].isdigit():
            continue
        _, batch, scheme, slices, ms, tflops, mfu, gib, _ = row
        if not tflops:  # failed (out of memory) or not run: the reason is in the time column
            cells.append(f"{scheme} {ms}")
            continue
        ms = ms.split(" ")[0]
        what = f"{scheme} {slices}" if scheme == "planner" else scheme
        extra = f"{mfu} MFU, {gib} GiB" if mfu != "no CUDA" else "no CUDA"
        cells.append(f"{what} {ms} ms, {tflops} TFLOP/s, {extra}")
        if target_mfu is not None and scheme == "whole sequence" and mfu.endswith("%"):
            met = float(mfu.rstrip("%")) >= target_mfu
            cells[-1] += f" (target ≥ {target_mfu:g}%: {'met' if met else 'NOT met'})"
    floor = re.search(r"together (\S+) .*ms \(median", text)
    if not cells:
        return "no table (see steps.log)"
    return (
        (f"{where.group(1)} {where.group(2)} B={batch}: " if where else "")
        + "; ".join(cells)
        + (f"; floor b=1 i=8: {floor.group(1)} ms" if floor else "")
    )


def memory_line(path: Path) -> str:
    """The plan's memory estimate per stage next to what the run measured (report.json's ``memory_per_stage``)."""
    from terapipe_cli.units import format_bytes

    report = json.loads(path.read_text())
    run = report["run"]
    peak = "process RSS" if str(run["device"]).startswith("cpu") else "CUDA max allocated"
    parts = []
    for st in run.get("memory_per_stage") or []:
        err = f" ({st['rel_err']:+.1%})" if st.get("rel_err") is not None else ""
        parts.append(
            f"stage {st['stage']}: kept for backward est. {format_bytes(st['estimated_activation_bytes'])} / "
            f"measured {format_bytes(st['measured_saved_bytes'])}{err}, total est. "
            f"{format_bytes(st['estimated_total_bytes'])} / peak {format_bytes(st['measured_peak_bytes'])} ({peak})"
        )
    return f"{run['short_form']} B={run['batch_size']} L={run['seq_len']}: " + ("; ".join(parts) or "no estimate")


def memory_trace_line(path: Path) -> str:
    """scripts/bench_memory.py --part device's table in one line: the estimate's errors, and the cases that ran."""
    rows = [r.strip("|").split("|") for r in path.read_text().splitlines()[2:] if r.startswith("|")]
    errors = [float(r[3].strip().rstrip("%")) for r in rows if r[3].strip() not in ("-", "")]
    ran = sum(r[4].strip() == "ran" for r in rows)
    broken = sum(r[5].strip() == "yes" and r[4].strip() != "ran" for r in rows)
    spread = f"estimate {min(errors):+.1f}% to {max(errors):+.1f}% of measured" if errors else "nothing measured"
    return f"{len(rows)} cases: {spread}; {ran} ran, {broken} estimated to fit but did not"


def reference_line(path: Path) -> str:
    """scripts/bench_reference.py's table in one line: each mode's median step, MFU and peak."""
    rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in path.read_text().splitlines()]
    cells = [f"{r[0]} {r[1].split(' ')[0]} ms, {r[3]} MFU, {r[4]} GiB" for r in rows if len(r) == 6 and r[0] in
             ("eager", "compiled")]  # fmt: skip
    return "plain PyTorch: " + "; ".join(cells) if cells else "no table (see steps.log)"


def operators_line(path: Path) -> str:
    """The operator table's step in one line: per model, the ``--check-profile`` error of its profile priced from the
    table (``NAME: check: relative error mean X%, max Y%`` lines, as the step writes them)."""
    found = re.findall(r"^(\S+): check: relative error mean ([\d.]+)%, max ([\d.]+)%", path.read_text(), re.M)
    if not found:
        return "no check finished (see steps.log)"
    cells = [f"{name} {mean}% mean, {top}% max" for name, mean, top in found]
    return f"tiles off the table's grid, predicted vs timed: {'; '.join(cells)}"


def pytest_line(path: Path, device: str) -> str:
    """pytest's closing counts, or, when it was stopped before them, the tests' own result lines so far."""
    text = path.read_text(errors="replace")
    counts = re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", text.splitlines()[-1] if text else "")
    if not counts:  # stopped early (timeout): count the -v result lines that did come
        found = re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR)", text)
        counts = [(str(found.count(k)), k.lower()) for k in ("PASSED", "FAILED", "SKIPPED", "ERROR") if k in found]
        counts.append(("stopped", "before the end"))
    line = ", ".join(f"{n} {what}" for n, what in counts)
    return line.replace("skipped", "skipped (no CUDA)") if device == "cpu" else line


# ----------------------------------------------------------------------------------------------- the summary


def clean(cell: str) -> str:
    """A table cell: one line, no column separator."""
    return " ".join(cell.replace("|", "/").split())


def write_summary(rows_path: Path, out: Path, title: str, notes: list[str]) -> None:
    """summary.md: the title, notes, and one row per step from ``rows_path`` (tab-separated, as written)."""
    rows = [line.split("\t") for line in rows_path.read_text().splitlines() if line] if rows_path.exists() else []
    lines = [f"# {title}", "", *(f"- {n}" for n in notes), ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(clean(c) for c in row) + " |" for row in rows]
    out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cut = sub.add_parser("cut")
    cut.add_argument("source")
    cut.add_argument("out", type=Path)
    cut.add_argument("--layers", type=int)
    cut.add_argument("--seq-len", type=int)
    cut.add_argument("--hidden", type=int, help="a narrower width (heads and K/V heads kept)")
    for name in ("verify", "profile", "memory", "memory-trace", "reference", "operators"):
        sub.add_parser(name).add_argument("path", type=Path)
    bench = sub.add_parser("bench")
    bench.add_argument("path", type=Path)
    bench.add_argument("--target-mfu", type=float, help="the whole sequence's MFU target, percent")
    tests = sub.add_parser("pytest")
    tests.add_argument("path", type=Path)
    tests.add_argument("--device", default="cuda")
    summary = sub.add_parser("summary")
    summary.add_argument("rows", type=Path)
    summary.add_argument("out", type=Path)
    summary.add_argument("--title", required=True)
    summary.add_argument("--note", action="append", default=[])
    a = parser.parse_args(argv)
    path = getattr(a, "path", None)
    if a.what not in ("cut", "summary") and path is not None and not path.exists():
        print(f"no result: {path.name} was not written (steps.log says why)")  # a step cut short by its time-out
        return 0
    if a.what == "cut":
        cut_model(a.source, a.out, a.layers, a.seq_len, a.hidden)
    elif a.what == "summary":
        write_summary(a.rows, a.out, a.title, a.note)
    elif a.what == "bench":
        print(bench_line(a.path, a.target_mfu))
    elif a.what == "pytest":
        print(pytest_line(a.path, a.device))
    else:
        lines = {
            "verify": verify_line,
            "profile": profile_line,
            "memory": memory_line,
            "memory-trace": memory_trace_line,
            "reference": reference_line,
            "operators": operators_line,
        }
        print(lines[a.what](a.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
