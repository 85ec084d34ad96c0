#!/usr/bin/env python3
"""Planner benchmark: the exact default method against the published ε-enumeration, side by side.

The costs are the project's own: an analytic profile (docs/design.md §12) of each GPT-3 model on the V100 nodes of
configs/hardware/v100.toml with 8-way tensor parallelism, read by the cost model of docs/design.md §3 for a stage
of the row's layers. The shapes are the reference ones of the planner's search (docs/design.md §5): B = 2, 8, 32,
72, a long sequence (L = 8192) and a token step of one. The two methods run interleaved (A B A B …) on the same
cost; each row prints the median seconds (min–max), the speed-up, and both objectives.

A second table times whole plans (`plan.choice.plan_for_profile`: search, baselines, simulation, memory) at long context
(L = 32768 and 131072, GPT3-13B on the H100 nodes of configs/hardware/h100.toml, T = 8), without a memory limit and
with one that binds: between the smallest peak any scheme reaches and the peak of the fastest scheme (halfway for
B = 1, a tenth of the way for B > 1), so the fastest does not fit and the memory-aware search (over every batch
grouping, both orders and recomputation) must choose. Both run interleaved; the table shows what was chosen.

    python scripts/bench_planner.py                 # all rows, 3 repeats
    python scripts/bench_planner.py --repeats 1 --rows 1,2
    python scripts/bench_planner.py --memory-only   # only the long-context table with a memory limit
    python scripts/bench_planner.py --commands      # every target case's whole `terapipe plan`, CPU seconds
    python scripts/bench_planner.py --commands --cases paper,llama --record plans.json

A third table (``--commands``) times whole `terapipe plan` commands with every choice left to the planner
— the 13 published settings, Llama 3 70B (analytic H100, T = 8, B = 16) at K = 8 and 16, Megatron-LM's ten settings
(b) and (b′) and the six Table 2 rows — in CPU seconds of the command's process (user + system: the machine is
shared), and can record each plan (scheme, order, v, partition, simulated step).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from terapipe_cli.config.hardware import load_hardware  # noqa: E402
from terapipe_cli.config.model import load_model_config  # noqa: E402
from terapipe_cli.files import write_json_atomic  # noqa: E402
from terapipe_cli.plan.choice import plan_for_profile, smallest_peak
from terapipe_cli.plan.costmodel import CostModel, profile_from_dict  # noqa: E402
from terapipe_cli.plan.request import plan_request  # noqa: E402
from terapipe_cli.plan.search import solve  # noqa: E402
from terapipe_cli.profile.analytic import analytic_profile  # noqa: E402
from terapipe_cli.units import format_bytes  # noqa: E402

HARDWARE = ROOT / "configs" / "hardware" / "v100.toml"
LONG_HARDWARE = ROOT / "configs" / "hardware" / "h100.toml"
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


# (label, model file, token_step, batch, stages, where) of the long-context rows: the limit lies ``where`` of the
# way from the smallest peak any scheme reaches to the fastest scheme's peak. With B > 1 the fastest scheme fits
# in 1F1B order down to about a quarter of the way, so those rows take a tenth: the search over every batch
# grouping, with recomputation, must choose.
MEMORY_ROWS = [
    ("GPT3-13B L=131072 g=512 B=1 K=40", "gpt3-13b-L128k", 512, 1, 40, 0.5),
    ("GPT3-13B L=131072 g=64  B=1 K=40", "gpt3-13b-L128k", 64, 1, 40, 0.5),
    ("GPT3-13B L=32768  g=512 B=8 K=40", "gpt3-13b-L32k", 512, 8, 40, 0.1),
    ("GPT3-13B L=131072 g=512 B=4 K=40", "gpt3-13b-L128k", 512, 4, 40, 0.1),
]


def analytic(model_name: str, token_step: int, batch: int, hardware=HARDWARE):
    """An analytic profile whose grid holds every batch-slice size up to B."""
    model = load_model_config(ROOT / "configs" / "models" / f"{model_name}.toml")
    obj = analytic_profile(
        model,
        load_hardware(hardware),
        tensor_parallel=TENSOR_PARALLEL,
        batch_sizes=range(1, batch + 1),
        token_step=token_step,
    )
    return profile_from_dict(obj, f"analytic profile of {model_name}")


def analytic_cost(model_name: str, token_step: int, batch: int, stages: int) -> CostModel:
    """The cost of one stage from an analytic profile whose grid holds every batch-slice size up to B."""
    return CostModel(analytic(model_name, token_step, batch), stages)


def _fmt(ts: list[float]) -> str:
    return f"{statistics.median(ts):.3f} ({min(ts):.3f}–{max(ts):.3f})" if ts else "—"


def memory_table(repeats: int, console: Console, markdown: bool) -> None:
    """Whole plans at L = 131072 without and with a binding memory limit, interleaved (module docstring)."""
    columns = ("shape", "limit", "no limit s", "with limit s", "fastest: peak", "within the limit: chosen",
               "peak", "T / fastest T")  # fmt: skip
    table = Table(title=f"Planning at long context with a binding memory limit, {repeats} interleaved repeats")
    for col in columns:
        table.add_column(col, justify="left" if col in ("shape", "within the limit: chosen") else "right")
    rows_out = []
    for label, model_name, g, B, K, where in MEMORY_ROWS:
        profile = analytic(model_name, g, B, LONG_HARDWARE)
        free = plan_request(profile, stages=K, batch_size=B, token_step=g, memory_limit_gib=1e6)
        fastest = plan_for_profile(profile, free)
        least, _ = smallest_peak(profile, free, 0.0)
        limit = least + where * (fastest.memory.peak_bytes - least)
        bound = plan_request(profile, stages=K, batch_size=B, token_step=g, memory_limit_gib=limit / 2**30)
        t_free, t_bound, chosen = [], [], None
        for _ in range(repeats):
            started = time.perf_counter()
            plan_for_profile(profile, free)
            t_free.append(time.perf_counter() - started)
            started = time.perf_counter()
            chosen = plan_for_profile(profile, bound)
            t_bound.append(time.perf_counter() - started)
        cells = [
            label,
            format_bytes(limit),
            _fmt(t_free),
            _fmt(t_bound),
            format_bytes(fastest.memory.peak_bytes),
            f"{chosen.choice_text()}: batch slices {'+'.join(str(b) for b, _ in chosen.terapipe.slices)}, "
            f"{chosen.terapipe.tiles} tiles, largest {chosen.terapipe.t_max_s * 1e3:.1f} ms"
            + (" (equal batch slices only)" if chosen.equal_slices_only else ""),
            format_bytes(chosen.memory.peak_bytes),
            f"{chosen.terapipe.predicted_s / fastest.terapipe.predicted_s:.3f}",
        ]
        table.add_row(*cells)
        rows_out.append(cells)
        console.print(f"done: {label}", style="dim")
    console.print(table)
    if markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for cells in rows_out:
            print("| " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------------------------------------------
# Whole `terapipe plan` commands: every choice left to the planner, CPU seconds of the command's process.

DGX_A100 = ROOT / "configs" / "hardware" / "dgx-a100.toml"


def _megatron():
    sys.path.insert(0, str(ROOT / "scripts"))
    import megatron_table

    return megatron_table


def command_cases() -> list[tuple[str, list[str], object]]:
    """(label, `terapipe plan` arguments, how to write its profile or None) of every target case: the 13 published
    settings, Llama 3 70B at K = 8 and 16, Megatron-LM's ten settings (b) and (b′) and the six Table 2 rows."""
    cases: list[tuple[str, list[str], object]] = []
    for path in sorted((ROOT / "configs" / "experiments").glob("paper-*.toml")):
        cases.append((path.stem, ["--experiment", path.stem], None))
    llama = (load_model_config("llama3-70b"), LONG_HARDWARE, 8, 8, (1, 2, 4, 8))  # model, hardware, T, g, batch sizes
    for K in (8, 16):
        cases.append((f"llama3-70b K={K} B=16", ["-k", str(K), "-b", "16"], llama))
    mt = _megatron()
    for s in mt.SETTINGS:
        g = mt.TOKEN_STEP.get(s.number, mt.DEFAULT_TOKEN_STEP)
        spec = (s.model(), DGX_A100, s.tensor_parallel, g, mt.BATCH_SIZES)
        args = ["-k", str(s.pipeline), "-b", str(s.batch_per_replica), "-d", str(s.data_parallel), "-g", str(g)]
        cases.append((f"megatron {s.number} ({s.params_b:g}B) (b)", args, spec))
        cases.append((f"megatron {s.number} ({s.params_b:g}B) (b')", [*args, "--recompute"], spec))
    # Narayanan et al. 2021, Table 2: data parallelism grows at a fixed global batch; microbatch 1.
    gpt3 = mt.GptConfig("megatron-174.6b", 96, 12288, 96, mt.VOCAB, mt.SEQ_LEN)
    big = next(s for s in mt.SETTINGS if s.number == 9).model()
    for model, K, batch, gpus in ((gpt3, 12, 1536, (384, 768, 1536)), (big, 35, 2240, (560, 1120, 2240))):
        for n in gpus:
            D = n // (8 * K)
            args = ["-k", str(K), "-b", str(batch // D), "-d", str(D), "-g", "256", "--order", "1f1b", "--recompute",
                    "--memory-limit", "80"]  # fmt: skip
            cases.append((f"table 2: {model.name} on {n} GPUs", args, (model, DGX_A100, 8, 256, (1,))))
    return cases


def _profile_file(spec, folder: Path) -> Path:
    model, hardware, T, g, sizes = spec
    path = folder / f"{model.name}-T{T}-g{g}-{'_'.join(map(str, sizes))}.json"
    if not path.exists():
        obj = analytic_profile(model, load_hardware(hardware), tensor_parallel=T, batch_sizes=sizes, token_step=g)
        write_json_atomic(path, obj)
    return path


def time_command(args: list[str], out: Path, timeout: float | None) -> tuple[float, float, int]:
    """CPU seconds (user + system) and wall seconds of one `terapipe plan` process, and its exit code."""
    code = "import sys; from terapipe_cli.cli import main; sys.argv[0] = 'terapipe'; main()"
    cmd = [sys.executable, "-c", code, "plan", *args, "--out", str(out), "--force"]  # not a terminal: no status line
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc = p.returncode
        if rc:
            print(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {rc}", file=sys.stderr)
    except subprocess.TimeoutExpired:
        rc = -1
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, time.perf_counter() - started, rc


def plan_record(path: Path) -> dict:
    """What fixes a plan: its scheme, order, v, partition, recomputation and both times."""
    plan = json.loads(path.read_text())
    keys = ("short_form", "order", "virtual_stages", "layers_per_stage", "recompute", "simulated_s", "predicted_s")
    return {k: plan.get(k) for k in keys} | {"gpipe_simulated_s": plan["baselines"]["gpipe"]["simulated_s"]}


def commands_table(only: str, record: Path | None, timeout: float | None, console: Console, markdown: bool) -> None:
    """Time each target case's whole `terapipe plan` command (CPU seconds); optionally record its plan."""
    cases = [c for c in command_cases() if not only or any(w in c[0] for w in only.split(","))]
    load = os.getloadavg()
    title = f"terapipe plan, every choice left to the planner: CPU s of the command (load {load[0]:.1f} at start)"
    table = Table(title=title)
    columns = ("case", "CPU s", "wall s", "plan", "order; v; layers", "simulated s")
    for col in columns:
        table.add_column(col, justify="left" if col in ("case", "plan", "order; v; layers") else "right")
    recorded = json.loads(record.read_text()) if record is not None and record.exists() else {}
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label, args, spec in cases:
            full = list(args) if spec is None else ["--profile", str(_profile_file(spec, folder)), *args]
            out = folder / "plan.json"
            cpu, wall, rc = time_command(full, out, timeout)
            if rc == 0:
                rec = plan_record(out)
                recorded[label] = {"args": args, **rec}
                layers = " ".join(map(str, rec["layers_per_stage"] or []))
                how = f"{rec['order']}; v={rec['virtual_stages']}; {layers[:40]}"
                cells = [label, f"{cpu:.1f}", f"{wall:.1f}", rec["short_form"][:60], how, f"{rec['simulated_s']:.4g}"]
            else:
                cells = [label, f"{cpu:.1f}", f"{wall:.1f}", "timed out" if rc == -1 else f"exit {rc}", "", ""]
            table.add_row(*cells)
            rows_out.append(cells)
            console.print(f"done: {label} ({cpu:.1f} s CPU)", style="dim")
            if record is not None:
                write_json_atomic(record, recorded)
    console.print(table)
    if markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for cells in rows_out:
            print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="", help="comma-separated row numbers (1-based); default all")
    ap.add_argument("--epsilon", type=float, default=1e-5, help="ε of the enumeration, seconds (default 1e-5)")
    ap.add_argument("--no-enumerate", action="store_true", help="time only the exact default method")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for docs/results.md)")
    ap.add_argument("--memory-only", action="store_true", help="only the long-context table with a memory limit")
    ap.add_argument("--commands", action="store_true", help="only the whole `terapipe plan` commands of the targets")
    ap.add_argument("--cases", default="", help="with --commands: the cases whose label contains one of these words")
    ap.add_argument("--record", type=Path, help="with --commands: add each plan to this JSON file")
    ap.add_argument("--timeout", type=float, help="with --commands: seconds before a command is given up")
    args = ap.parse_args()
    rows = [ROWS[int(k) - 1] for k in args.rows.split(",")] if args.rows else ROWS
    console = Console(width=max(Console().width, 200))  # a wide table; piped output would wrap it unreadably
    if args.commands:
        commands_table(args.cases, args.record, args.timeout, console, args.markdown)
        return
    if args.memory_only:
        memory_table(args.repeats, console, args.markdown)
        return
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

        speedup = f"{statistics.median(t_enum) / statistics.median(t_exact):.1f}×" if t_enum else "—"
        delta = f"{(res_exact.predicted_s - res_enum.predicted_s) / res_enum.predicted_s:+.4%}" if res_enum else "—"
        cells = [
            label,
            _fmt(t_exact),
            _fmt(t_enum),
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
    memory_table(args.repeats, console, args.markdown)


if __name__ == "__main__":
    main()
