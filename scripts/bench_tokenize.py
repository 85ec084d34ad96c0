#!/usr/bin/env python3
"""`terapipe data tokenize`'s speed: MB of text per second into a Megatron corpus, with a 32,000-id byte-level BPE.

    python scripts/bench_tokenize.py                  # 20 MB, 32,000 ids, 5 rounds of each split
    python scripts/bench_tokenize.py --mb 5 --rounds 1

The text: the project's own English-like generator (`engine.data.generate_default_text`, one story per line), with
three words in ten replaced by made-up words drawn from a Zipf law (exponent 1.1) over 200,000 of them, so that the
vocabulary is rich enough for a BPE to fill 32,000 ids and for its word cache to miss as with real text (the
generator alone has a few hundred words). The BPE (GPT-2's byte-level pre-tokenizer, `<|endoftext|>` as EOS) is
trained here by `tokenizers`' own trainer. Then `corpus.tokenize.tokenize_corpus` (what the command calls, progress
bar aside) runs on the text as one file of many documents (``--split line``, one per story) and as one 20 MB
document (``--split file``: encoded in pieces), rounds taken in turn. Prints MB/s per round and the median, the CPU time
(all threads: the cores kept busy, and MB per CPU-second, the rate per free core), and the machine's load
(/proc/loadavg) before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from terapipe_cli.corpus import tokenize as tz  # noqa: E402
from terapipe_cli.engine.data import generate_default_text  # noqa: E402

SYLLABLES = "ka lo mi ten ra vel sto qui an der pho ne tri zu gan el or is bar mon ter ly ing ed pre con ex un ble tion"


def english_like(n_bytes: int, seed: int = 7) -> str:
    """The generator's stories with 30% of their words swapped for Zipf-drawn made-up words (module docstring)."""
    rng = random.Random(seed)
    syllables = SYLLABLES.split()
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(200_000)]
    import numpy as np

    draws = np.random.default_rng(seed)
    words = generate_default_text(n_bytes, seed=seed).split(" ")
    ranks = draws.zipf(1.1, size=len(words))
    swap = draws.random(len(words)) < 0.3
    out = [lexicon[r] if s and r < len(lexicon) else w for w, r, s in zip(words, ranks, swap, strict=True)]
    return " ".join(out)[:n_bytes]


def train_bpe(text: str, vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.save(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="MB of text (default 20)")
    parser.add_argument("--vocab", type=int, default=32_000, help="the BPE's ids (default 32,000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each split (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        text = english_like(int(args.mb * 1e6))
        (folder / "text.txt").write_text(text)
        size = (folder / "text.txt").stat().st_size
        print(f"text: {size / 1e6:.1f} MB, {len(text.splitlines()):,} lines ({time.perf_counter() - started:.1f} s)")
        started = time.perf_counter()
        train_bpe(text, args.vocab, folder / "tokenizer.json")
        tok = tz.load_tokenizer(folder / "tokenizer.json", "<|endoftext|>")
        print(f"BPE: {tok.vocab:,} ids, trained in {time.perf_counter() - started:.1f} s")
        del text
        print(
            f"load before: {_loadavg()}; cores: {os.cpu_count()}, "
            f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS')}"
        )
        rates: dict[str, list[float]] = {"line": [], "file": []}
        for round_ in range(1, args.rounds + 1):
            for split in rates:
                started, cpu = time.perf_counter(), time.process_time()
                summary = tz.tokenize_corpus([folder / "text.txt"], tok, folder / f"corpus-{split}", split=split)
                seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
                rates[split].append(size / 1e6 / seconds)
                print(
                    f"round {round_} --split {split}: {summary.documents:,} document(s), {summary.tokens:,} tokens "
                    f"({summary.dtype}) in {seconds:.2f} s: {rates[split][-1]:.1f} MB/s; CPU {cpu:.2f} s "
                    f"({cpu / seconds:.2f} cores busy, {size / 1e6 / cpu:.1f} MB per CPU-second)"
                )
        print(f"load after: {_loadavg()}")
        for split, values in rates.items():
            print(
                f"--split {split}: median {statistics.median(values):.1f} MB/s "
                f"(min {min(values):.1f}, max {max(values):.1f}: the machine's other work takes its share)"
            )


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
