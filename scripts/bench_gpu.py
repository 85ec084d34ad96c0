#!/usr/bin/env python3
"""Training-step time of one GPT3-1B stage on one CUDA GPU: the whole sequence vs token slices vs the plan.

    python scripts/bench_gpu.py                       # quick profiles, plans, then the timings (~10 min, H100)
    python scripts/bench_gpu.py --markdown            # the same as Markdown tables, for docs/results.md
    python scripts/bench_gpu.py --profile P.json      # plan from this profile (its precision) instead of measuring
    python scripts/bench_gpu.py --model CUT.toml --batch 2 --precision bf16   # another model (a llama3-8b cut)

One process, no torchrun: K = 1 stage holding the whole model (configs/models/gpt3-1b.toml, L = 2048, or
--model's; a --profile must be of that model at that L), run by
the runtime's own code — `StageRunner` tiles walked by `worker.run_schedule` (which synchronises the GPU after
every tile, as the workers do), then `optim.take_step` (global-norm clip 1.0, AdamW from `make_optimizer`).
For each precision (fp32, bf16) and batch B (1, 8) the schemes run interleaved on the same weights — whole
sequence, 4 and 8 uniform token slices, the planner's plan — A B C D A B C D ..., so a drift of the GPU's speed
hits them alike; each cell is the median (min–max) over the rounds after the warm-up ones.

The planner's plan comes from a profile measured at the start with terapipe's profile library in quick mode
(one layer through StageRunner at the same precision, batch sizes 1 and B, no link: K = 1 sends nothing), or
from ``--profile`` files. The committed ``gpt3-1b-h100-fp32-measured.json`` of the GPU measurements is not used
by default: it predates the K/V cache and the precision field, so its tile times are not this runtime's.

Columns: ms per step; model TFLOP/s = (6·N·B·L + 12·layers·B·L²·H) / step time (`plan.mfu.step_flops`, the count
of `terapipe plan` and `terapipe report`), where N counts the weights of the linear layers (attention, MLP, LM head;
embeddings are lookups) and the second term is attention over the whole L × L rectangle as PaLM counts it (QKᵀ and
AV, forward + backward = 3 × forward; a causal kernel does about half) — the same for every slicing; MFU against the
device's bf16 dense peak (configs/hardware/h100.toml for an H100 or H200, else --peak-tflops), also for fp32
rows; peak memory (torch.cuda.max_memory_allocated over the step, weights and AdamW state included); the
cost model's prediction. Below the table, one layer's per-tile floor: b = 1, i = 8, forward and backward
through StageRunner (the profile library's TileTimer, CUDA events). CUDA graphs: the runtime has no switch
for them, so that row says "not implemented".

    python scripts/bench_gpu.py --device cpu           # a dry run of the same code on the CPU (seconds)

Without a CUDA GPU it prints one line and exits 2 (nothing was measured: not a success). ``--device cpu`` runs the
same code path on the CPU, by default on the tiny model at L = 128, B = 1, fp32, one round: a check that the
script works (scripts/gpu_bringup.sh's dry run), not a measurement. Its table says "no CUDA" where GPU figures
would be (MFU, peak memory: the CUDA allocator's peak has no CPU counterpart that counts the same bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

NO_GPU = "bench_gpu.py needs a CUDA GPU; none here"
NO_CUDA = "no CUDA"  # what the table says where a GPU figure would be, on a --device cpu dry run
PEAK_HARDWARE = ROOT / "configs" / "hardware" / "h100.toml"  # bf16 dense peak of an H100 SXM (H200: the same)
PRECISIONS = ("fp32", "bf16")
TOKEN_STEP = 8
# The options' defaults on the GPU, and on a --device cpu dry run: the smallest run of every code path (a tiny
# model at L = 128 takes seconds on one core; GPT3-1B at L = 2048 would take an hour there).
DEFAULTS = {
    "cuda": dict(model=str(ROOT / "configs/models/gpt3-1b.toml"), batch="1,8", precision="fp32,bf16", rounds=5,
                 warmup=2, floor_repeats=30),
    "cpu": dict(model=str(ROOT / "configs/models/tiny.toml"), batch="1", precision="fp32", rounds=1, warmup=0,
                floor_repeats=3),
}  # fmt: skip
CPU_SEQ_LEN = 128  # the default model's L on the CPU (a model given with --model keeps its own)


@dataclass
class Cell:
    """One scheme at one (precision, B): its step times (s), peak memory, and why it stopped if it did."""

    precision: str
    batch: int
    name: str
    slices: list
    predicted_s: float
    times: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    failed: str | None = None
    loss_chunk_tokens: int | None = None  # the head's chunk (engine/loss.py); None: the runner's default


def model_flops(model, batch: int) -> float:
    """Model FLOPs of one training step (forward + backward) of B sequences of the model's L tokens, by the one count
    of `terapipe plan` and `terapipe report` (`plan.mfu.step_flops`): 6·N·B·L for the products with the weights
    (the layers' matrices and the LM head; embeddings are lookups), plus 12·layers·B·L²·H for attention over the
    whole L × L rectangle, as PaLM counts it (see the module docstring)."""
    from terapipe_cli.plan.mfu import step_flops

    return step_flops(model, model.seq_len, batch)


def candidates(planned: list, batch: int, seq_len: int) -> list[tuple[str, list]]:
    """The schemes timed: whole sequence, 4 and 8 equal token slices, the planner's (and `plan_cells` adds the whole
    sequence with the head unchunked)."""
    return [
        ("whole sequence", [(batch, [seq_len])]),
        ("uniform/4", [(batch, [seq_len // 4] * 4)]),
        ("uniform/8", [(batch, [seq_len // 8] * 8)]),
        ("planner", [(b, list(s)) for b, s in planned]),
    ]


def peak_flops(device_name: str, given_tflops: float | None) -> tuple[float | None, str]:
    """The bf16 dense peak for MFU, and where it came from."""
    if given_tflops is not None:
        return given_tflops * 1e12, "--peak-tflops"
    if "H100" in device_name or "H200" in device_name:
        from terapipe_cli.config.hardware import load_hardware

        return load_hardware(PEAK_HARDWARE).device.peak_flops, f"{PEAK_HARDWARE.relative_to(ROOT)} (H100 SXM)"
    return None, "unknown for this device: pass --peak-tflops"


# ----------------------------------------------------------------------------------------------- measuring


def measure_profile_for(model, precision: str, batches: list[int], device, out_dir: Path) -> Path:
    """A quick profile of one layer at ``precision`` (terapipe's profile library, no link), written to a file."""
    from terapipe_cli.files import write_json_atomic
    from terapipe_cli.profile.measure import measure_profile
    from terapipe_cli.profile.tiles import Settings

    sizes = sorted({1, *batches})
    settings = Settings.make(model, sizes, TOKEN_STEP, quick=True, check=False, precision=precision)
    started = time.perf_counter()
    profile = measure_profile(model, settings, device, measure_comm=False, measure_allreduce=False)
    path = write_json_atomic(out_dir / f"profile-{model.name}-{precision}.json", profile)
    print(f"measured {path} in {time.perf_counter() - started:.0f} s (reuse it with --profile)", flush=True)
    return path


def plan_cells(model, precision: str, profile_path: Path, batches: list[int]) -> list[Cell]:
    """Every scheme at every B for one precision, with the planner's plan and the cost model's predictions."""
    from terapipe_cli.plan.costmodel import CostModel
    from terapipe_cli.plan.search import evaluate, solve

    cost = CostModel.from_profile(profile_path, stages=1)
    cells = []
    for batch in batches:
        planned = solve(cost, seq_len=model.seq_len, batch_size=batch, stages=1, token_step=cost.profile.token_step)
        for name, slices in candidates(planned.slices, batch, model.seq_len):
            cells.append(Cell(precision, batch, name, slices, evaluate(cost, slices, 1)))
        # The chunked head's price: the whole sequence again with the head's logits made at once (chunk 0).
        whole = cells[-4]
        cells.append(dataclasses.replace(whole, name="whole, head unchunked", times=[], loss_chunk_tokens=0))
    return cells


def time_group(model, cells: list[Cell], device, *, rounds: int, warmup: int) -> int:
    """Time one (precision, B) group's schemes interleaved on one stage; returns N (linear weights)."""
    import torch

    from terapipe_cli.engine.data import load_data, step_batch
    from terapipe_cli.engine.executor import StageExecutor
    from terapipe_cli.engine.optim import make_optimizer
    from terapipe_cli.engine.p2p import Links
    from terapipe_cli.engine.stage import StageRunner
    from terapipe_cli.schedule.schedule import Schedule

    batch, precision = cells[0].batch, cells[0].precision
    runner = StageRunner(model, 0, 1, seed=0, device=device, precision=precision)
    runner.set_loss_scale(1.0 / (batch * model.seq_len))
    optimizer = make_optimizer(runner.module, 1e-5)
    links = Links(prev_rank=None, next_rank=None, hidden=model.hidden, dtype=torch.float32, device=device, timeout_s=60)
    tokens = step_batch(load_data(None), seed=0, step=1, sequences=batch, seq_len=model.seq_len).to(device)
    executors = {c.name: StageExecutor(runner, Schedule.build(c.slices, 1), 0, links) for c in cells}
    chunk = runner.loss_chunk_tokens
    linear = sum(m.weight.numel() for m in runner.module.modules() if isinstance(m, torch.nn.Linear))
    for round_ in range(warmup + rounds):
        for cell in cells:
            if cell.failed is None:
                runner.loss_chunk_tokens = chunk if cell.loss_chunk_tokens is None else cell.loss_chunk_tokens
                _time_step(cell, runner, optimizer, executors[cell.name], tokens, device, keep=round_ >= warmup)
    del runner, optimizer, links
    _free_cached(device)
    return linear


def _time_step(cell: Cell, runner, optimizer, executor, tokens, device, *, keep: bool) -> None:
    """One training step of ``cell``'s scheme: its time and peak memory, or why it failed (out of memory)."""
    import torch

    from terapipe_cli.engine.optim import take_step

    cuda = device.type == "cuda"
    params = list(runner.module.parameters())
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        optimizer.zero_grad(set_to_none=True)
        executor.step(tokens, step_start=start)
        take_step(optimizer, params, max_norm=1.0)
        _sync(device)
    except torch.cuda.OutOfMemoryError:
        cell.failed = "out of memory"
        runner.reset()
        optimizer.zero_grad(set_to_none=True)
        _free_cached(device)
        return
    if keep:
        cell.times.append(time.perf_counter() - start)
        if cuda:
            cell.peak_bytes = max(cell.peak_bytes, torch.cuda.max_memory_allocated(device))


def _sync(device) -> None:
    """Wait for the GPU's queued work (the CPU computes synchronously: nothing to wait for)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_cached(device) -> None:
    """Give the CUDA allocator's cached blocks back, so the next group's peak starts from its own weights."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def tile_floor(model, precision: str, device, repeats: int) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of one layer's smallest tile (b = 1, i = 8, no context), ``repeats`` times."""
    from terapipe_cli.profile.timer import TileTimer

    timer = TileTimer(model, device, precision=precision)
    with timer.runner.step():  # as in a training step: one low-precision copy of the weights for all tiles
        for _ in range(3):
            timer.time_tile(1, TOKEN_STEP, 0)
        times = [timer.time_tile(1, TOKEN_STEP, 0) for _ in range(repeats)]
    del timer
    _free_cached(device)
    return [f for f, _ in times], [b for _, b in times]


# ----------------------------------------------------------------------------------------------- output


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}–{max(values) * 1e3:.1f})"


def table_rows(cells: list[Cell], flops_of, peak: float | None, *, cuda: bool = True) -> list[list[str]]:
    """One row per cell, and a "CUDA graphs on" row per precision (not implemented in the runtime). Without
    ``cuda`` (a --device cpu dry run) MFU and peak memory say "no CUDA"."""
    from terapipe_cli.plan.file import short_form

    rows = []
    for c in cells:
        head = [c.precision, str(c.batch), c.name, short_form(c.slices, fold=True)]
        if c.failed or not c.times:
            rows.append(head + [c.failed or "no rounds", "", "", "", f"{c.predicted_s * 1e3:.1f}"])
            continue
        seconds = statistics.median(c.times)
        tflops = flops_of(c.batch) / seconds / 1e12
        mfu = f"{tflops * 1e12 / peak:.1%}" if peak and cuda else ("n/a" if cuda else NO_CUDA)
        gib = f"{c.peak_bytes / 2**30:.1f}" if cuda else NO_CUDA
        rows.append(head + [_ms(c.times), f"{tflops:.1f}", mfu, gib, f"{c.predicted_s * 1e3:.1f}"])
    for precision in dict.fromkeys(c.precision for c in cells):
        rows.append([precision, "", "CUDA graphs on", "", "not implemented (the runtime has no graphs switch)"])
        rows[-1] += [""] * 4
    return rows


HEADERS = ["precision", "B", "scheme", "slices", "ms/step median (min–max)", "TFLOP/s", "MFU", "peak GiB", "pred. ms"]


def render(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(headers, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def floor_lines(floors: dict[str, tuple[list[float], list[float]]], markdown: bool) -> list[str]:
    lines = []
    for precision, (fwd, bwd) in floors.items():
        total = [f + b for f, b in zip(fwd, bwd, strict=True)]
        lines.append(
            f"{'- ' if markdown else '  '}{precision}: forward {_ms(fwd)} ms + backward {_ms(bwd)} ms, "
            f"together {_ms(total)} ms (median of {len(total)})"
        )
    return lines


# ----------------------------------------------------------------------------------------------- main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run (default cuda)")
    parser.add_argument("--model", help="model TOML or bundled name (default gpt3-1b; on the CPU tiny)")
    parser.add_argument("--seq-len", type=int, help="sequence length L (default the model's; on the CPU, tiny's: 128)")
    parser.add_argument("--batch", help="batch sizes B, comma-separated (default 1,8; on the CPU 1)")
    parser.add_argument("--precision", help="fp32 and/or bf16, comma-separated (default both; on the CPU fp32)")
    parser.add_argument("--profile", action="append", default=[], help="a profile to plan with (one per precision)")
    parser.add_argument("--rounds", type=int, help="timed rounds of every scheme (default 5; on the CPU 1)")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (default 2; on the CPU 0)")
    parser.add_argument("--floor-repeats", type=int, help="timings of the per-tile floor (default 30; on the CPU 3)")
    parser.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak, TFLOP/s, for MFU")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables (for docs/results.md)")
    a = parser.parse_args(argv)
    if a.device == "cpu" and a.model is None and a.seq_len is None:
        a.seq_len = CPU_SEQ_LEN
    for key, value in DEFAULTS[a.device].items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    a.batches = [int(x) for x in a.batch.split(",")]
    a.precisions = a.precision.split(",")
    if not set(a.precisions) <= set(PRECISIONS) or min(a.batches) < 1 or a.rounds < 1 or a.warmup < 0:
        parser.error(f"--precision must be among {','.join(PRECISIONS)}, --batch and --rounds positive")
    if a.seq_len is not None and (a.seq_len < TOKEN_STEP or a.seq_len % TOKEN_STEP):
        parser.error(f"--seq-len must be a positive multiple of {TOKEN_STEP}")
    return a


def load_model(path: str, seq_len: int | None):
    """The model to time: ``path``'s, at ``seq_len`` when given (a shorter L for a dry run)."""
    from terapipe_cli.config.model import load_model_config

    model = load_model_config(path)
    return model if seq_len is None else dataclasses.replace(model, seq_len=seq_len)


def profile_mismatch(profile, model, path: str) -> str | None:
    """Why ``profile`` cannot plan ``model``, or None. A profile prices its own model's layers at its own L:
    planning another shape with it would print the predictions of another model."""
    keys = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len")
    differ = [k for k in keys if getattr(profile.model, k) != getattr(model, k)]
    if not differ:
        return None
    given = ", ".join(f"{k} {getattr(profile.model, k)} (the model's {getattr(model, k)})" for k in differ)
    return f"bench_gpu.py: {path} profiles another model: {given}"


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(argv)
    import torch

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    from terapipe_cli.plan.costmodel import read_profile

    model = load_model(a.model, a.seq_len)
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        peak, peak_source = peak_flops(name, a.peak_tflops)
    else:
        device, name = torch.device("cpu"), f"cpu ({NO_CUDA}: a dry run of the code path, its times mean nothing)"
        peak, peak_source = None, f"{NO_CUDA}"
        torch.set_num_threads(1)  # one core, as a runtime stage and its profile have: two threads spin on two cores
    given = {}
    for p in a.profile:
        profile = read_profile(p)
        why = profile_mismatch(profile, model, p)
        if why:
            print(why, file=sys.stderr)
            return 2
        given[profile.precision] = Path(p)
    out_dir = Path(tempfile.mkdtemp(prefix="bench_gpu."))
    print(f"{name}, torch {torch.__version__}: {model.name}, K=1, L={model.seq_len}, B in {a.batches}", flush=True)
    cells, floors, linear = [], {}, 0
    for precision in a.precisions:
        path = given.get(precision) or measure_profile_for(model, precision, a.batches, device, out_dir)
        group = plan_cells(model, precision, path, a.batches)
        for batch in a.batches:
            mine = [c for c in group if c.batch == batch]
            print(f"timing {precision}, B={batch}: {len(mine)} schemes x {a.rounds} rounds (+{a.warmup})", flush=True)
            linear = time_group(model, mine, device, rounds=a.rounds, warmup=a.warmup)
        cells += group
        floors[precision] = tile_floor(model, precision, device, a.floor_repeats)

    def flops_of(batch: int) -> float:
        return model_flops(model, batch)

    print()
    print(render(HEADERS, table_rows(cells, flops_of, peak, cuda=cuda), a.markdown))
    print(
        f"\nTFLOP/s: model FLOPs 6·N·B·L + 12·layers·B·L²·H (plan.mfu, as terapipe plan and report count them; "
        f"the runtime's {linear:,} linear weights); "
        f"MFU against {peak / 1e12:.0f} TFLOP/s bf16 dense ({peak_source})"
        if peak
        else f"\nMFU: {peak_source}"
    )
    print("\none layer's per-tile floor, b=1, i=8, no context (StageRunner via the profile library's TileTimer):")
    print("\n".join(floor_lines(floors, a.markdown)))
    return 0


if __name__ == "__main__":
    from terapipe_cli.ending import entry_point

    entry_point(main)
