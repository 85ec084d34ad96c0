#!/usr/bin/env python3
"""Memory benchmarks of a stage, on the CPU. Each part is a function of the parsed arguments; ``--part`` picks it.

    .venv/bin/python scripts/bench_memory.py --part chunking [--seq-len 32768 --vocab 32768] [--repeats N]

``--part chunking``: the chunked LM head and cross-entropy against the unchunked one: the last stage's peak memory and
step time, side by side, interleaved (`part_chunking`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def chunking_worker(seq_len: int, vocab: int, hidden: int, chunk: int, steps: int, precision: str) -> dict:
    """One process's runs of the last stage (``--part chunking``): the step's peak resident set above the process's
    size before it (VmHWM − VmRSS), the most the stage kept for the backward (`SavedBytes`), the timed steps."""
    import torch

    from terapipe_cli.config.model import ModelConfig
    from terapipe_cli.engine.stage import StageRunner

    torch.set_num_threads(1)
    cfg = ModelConfig(name="bench-head", layers=2, hidden=hidden, heads=2, vocab=vocab, seq_len=seq_len)
    runner = StageRunner(cfg, 1, 2, precision=precision, loss_chunk_tokens=chunk)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq_len, hidden, generator=gen)
    targets = torch.randint(0, vocab, (1, seq_len), generator=gen)
    runner.set_loss_scale(1.0 / seq_len)
    start = _rss_bytes("VmRSS")
    times, kept = [], 0
    for step in range(steps + 1):
        runner.module.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        with runner.step():
            runner.forward_tile(0, 0, x, targets)
            runner.backward_tile(0, 0, None)
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
        kept = max(kept, runner.saved.take_peak())
        runner.reset()
    return {"peak_above_start": _rss_bytes("VmHWM") - start, "kept": kept, "times": times}


def part_chunking(args) -> int:
    """The chunked LM head and cross-entropy (engine/loss.py) against the unchunked one, on the last stage of a
    small-width model with a long sequence and a large vocabulary (default L = 8,192, V = 131,072, H = 64, one layer,
    b = 1, the whole sequence as one tile). Each run is its own process (its peak resident set is its own): one step
    to warm up, then ``--steps`` timed, the variants in the order A B A B … so that a loaded machine slows both
    alike. Per variant: the peak above the process's size before the first step (the logits are the bulk of it),
    what the stage kept for the backward, the step's seconds (median, min–max over every timed step); the ratios."""
    import statistics
    import subprocess

    from terapipe_cli.plan.memory import loss_chunk_tokens

    chunk = args.chunk or loss_chunk_tokens(args.vocab)
    variants = {"unchunked": 0, f"chunks of {chunk}": chunk}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, c in variants.items():  # interleaved: A B A B ...
            cmd = [sys.executable, __file__, "--part", "chunking", "--worker", str(c), "--seq-len", str(args.seq_len),
                   "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--steps", str(args.steps),
                   "--precision", args.precision]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"The last stage's head and loss: L = {args.seq_len}, V = {args.vocab}, H = {args.hidden}, one layer, b = 1, "
        f"the whole sequence as one tile, {args.precision}, one CPU thread; {args.repeats} processes per variant, "
        f"{args.steps} timed steps each, interleaved"
    )
    print(f"{'variant':<18} {'peak above start':>18} {'kept for backward':>18} {'step s, median (min-max)':>28}")
    rows = {}
    for name, runs in results.items():
        peak = statistics.median(r["peak_above_start"] for r in runs)
        kept = statistics.median(r["kept"] for r in runs)
        times = [t for r in runs for t in r["times"]]
        rows[name] = (peak, kept, statistics.median(times))
        span = f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"
        print(f"{name:<18} {peak / 2**20:>14.0f} MiB {kept / 2**20:>14.0f} MiB {span:>28}")
    (p0, k0, t0), (p1, k1, t1) = rows.values()
    print(f"chunked / unchunked: peak {p1 / p0:.2f}x, kept {k1 / k0:.2f}x, step time {t1 / t0:.3f}x")
    return 0


# Each part a function of the parsed arguments.
PARTS = {"chunking": part_chunking}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--seq-len", type=int, default=8192, help="chunking: L")
    p.add_argument("--vocab", type=int, default=131072, help="chunking: V")
    p.add_argument("--hidden", type=int, default=64, help="chunking: H")
    p.add_argument("--chunk", type=int, default=None, help="chunking: tokens per chunk (default: the runtime's)")
    p.add_argument("--repeats", type=int, default=2, help="chunking: processes per variant")
    p.add_argument("--steps", type=int, default=1, help="chunking: timed steps per process, after one to warm up")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # chunking: one process's run
    args = p.parse_args(argv)
    if args.worker is not None:
        w = chunking_worker(args.seq_len, args.vocab, args.hidden, args.worker, args.steps, args.precision)
        print(json.dumps(w))
        return 0
    return PARTS[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
