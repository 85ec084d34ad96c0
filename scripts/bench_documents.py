#!/usr/bin/env python3
"""What the document mask costs: one training step's forward and backward of the tiny model on one CPU thread, in token
slices through the runtime's `StageRunner`, full causal attention against block-causal attention over packed documents.

    python scripts/bench_documents.py --rounds 15

The tiny model (configs/models/tiny.toml: H = 256, 4 layers, L = 1024), B = 1, the whole model as one stage, 8 equal
token slices. The candidates run interleaved in rounds (causal, one document, short documents, ...), so drift in the
machine's speed hits them alike: "causal" is today's path (the CPU's reversed additive mask over the whole prefix),
"one document" the document mask with no boundary in the window (the explicit boolean mask over the whole prefix: the
mask's own cost), "documents of ~N" windows of documents whose lengths are drawn uniformly from [1, 2N] (each tile
reads the cache from its earliest document start only). Prints the median step (min–max) and the ratio to causal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from terapipe_cli.config.model import load_model_config  # noqa: E402
from terapipe_cli.engine.stage import StageRunner  # noqa: E402


def documents(L: int, mean: int | None, seed: int = 0) -> torch.Tensor | None:
    """Where each token's document begins, (1, L): documents of lengths uniform in [1, 2·mean]; None: causal."""
    if mean is None:
        return None
    rng = np.random.default_rng(seed)
    starts, row, at = [], np.zeros(L, np.int64), 0
    while at < L:
        starts.append(at)
        at += int(rng.integers(1, 2 * mean + 1))
    for s in starts:
        row[s:] = s
    return torch.from_numpy(row)[None]


def step(runner: StageRunner, tokens: torch.Tensor, docs: torch.Tensor | None, cuts: list[int]) -> float:
    begin = time.perf_counter()
    runner.set_loss_scale(1.0 / tokens.shape[1])
    with runner.step():
        start = 0
        for n, i in enumerate(cuts):
            d = None if docs is None else docs[:, start : start + i]
            x, y = tokens[:, start : start + i], tokens[:, start + 1 : start + i + 1]
            runner.forward_tile(0, n, x, y, doc_starts=d)
            start += i
        for n in reversed(range(len(cuts))):
            runner.backward_tile(0, n, None)
    runner.module.zero_grad(set_to_none=True)
    return time.perf_counter() - begin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--slices", type=int, default=8)
    ap.add_argument("--model", default=str(ROOT / "configs/models/tiny.toml"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_model_config(args.model)
    L = cfg.seq_len
    cuts = [L // args.slices] * args.slices
    runner = StageRunner(cfg, 0, 1, seed=0)
    tokens = torch.randint(0, cfg.vocab, (1, L + 1), generator=torch.Generator().manual_seed(0))
    candidates = {
        "causal": None,
        "one document": 10 * L,
        f"documents of ~{L // 4}": L // 4,
        f"documents of ~{L // 16}": L // 16,
    }
    docs = {name: documents(L, mean) for name, mean in candidates.items()}
    if docs["one document"] is not None:
        docs["one document"].zero_()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for name in candidates:  # warm-up
        step(runner, tokens, docs[name], cuts)
    for _ in range(args.rounds):
        for name in candidates:
            times[name].append(step(runner, tokens, docs[name], cuts))
    base = statistics.median(times["causal"])
    print(f"tiny model, L = {L}, {args.slices} slices, B = 1, one thread, {args.rounds} rounds")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} {1e3 * med:7.1f} ms ({1e3 * min(ts):.1f}-{1e3 * max(ts):.1f})  {med / base:.3f}x causal")


if __name__ == "__main__":
    main()
