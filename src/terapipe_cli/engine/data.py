"""Token data and the batches of each training step.

A data file is either text, read as bytes (vocabulary 256), or a token file of uint16 ids: raw
little-endian ``.bin`` or a one-dimensional integer ``.npy``. Files are memory-mapped, never loaded whole.

The batch of step s is drawn from the seed and s alone (``numpy`` generator seeded with ``[seed, s]``):
``B·D`` windows of ``L + 1`` tokens at random offsets; window r feeds sequence r of the global batch, the
first L tokens as inputs and the last L as targets. So any worker, the single-process reference of
``--verify``, and a resumed run all see exactly the same batches without exchanging anything.

Held-out data: `split_data` keeps the file's last ``val_fraction`` for validation. Training windows are drawn
from the part before it only, and the validation batch (`validation_batch`) is one fixed set of windows from
the held-out part, the same at every evaluation, so the validation curve compares like with like.

The embedded default data set (``terapipe_cli/data/tiny-stories.txt``) is ~300 KB of English-like text
made by `generate_default_text` from a small fixed grammar (subjects, verbs, objects, adjectives, counting
and simple sums): regular enough that a tiny model's byte-level loss falls visibly within tens of steps,
and varied enough not to be memorised at once. No downloads; the file is reproducible from the function.
"""

from __future__ import annotations

import codecs
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from terapipe_cli.errors import UserError

DEFAULT_DATA_NAME = "tiny-stories.txt"
DEFAULT_DATA_BYTES = 300_000


def default_data_path() -> Path:
    return Path(str(resources.files("terapipe_cli") / "data" / DEFAULT_DATA_NAME))


@dataclass(frozen=True)
class TokenData:
    path: str
    kind: str  # "text" (bytes) or "tokens" (uint16)
    tokens: np.ndarray  # 1-D, memory-mapped
    max_token: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def load_data(path: str | Path | None) -> TokenData:
    """Open a data file (None: the embedded default); one-line UserError if it cannot be used."""
    p = Path(path) if path is not None else default_data_path()
    where = str(p)
    if not p.exists():
        raise UserError("data file not found", where=where)
    if p.is_dir():
        raise UserError("expected a data file, found a folder", where=where)
    try:
        if p.suffix == ".npy":
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise UserError(
                    f"a .npy token file must hold a 1-D integer array, got {arr.dtype} {arr.shape}", where=where
                )
            kind = "tokens"
        elif p.suffix == ".bin":
            if p.stat().st_size % 2:
                raise UserError("a .bin token file holds uint16 ids, but its size is odd", where=where)
            arr = np.memmap(p, dtype="<u2", mode="r") if p.stat().st_size else np.zeros(0, np.uint16)
            kind = "tokens"
        else:
            arr = np.memmap(p, dtype=np.uint8, mode="r") if p.stat().st_size else np.zeros(0, np.uint8)
            kind = "text"
            _check_text(arr, where)
    except UserError:
        raise
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read data file ({e})", where=where) from None
    if arr.shape[0] == 0:
        raise UserError("data file is empty", where=where)
    low, high = int(arr.min()), int(arr.max())
    if low < 0:
        raise UserError(f"token ids must not be negative, found {low}", where=where)
    return TokenData(where, kind, arr, high)


TEXT_SAMPLE_BYTES = 1 << 16


def _check_text(arr: np.ndarray, where: str) -> None:
    """A text file (read as bytes) must look like text: UTF-8 without NUL bytes in its first 64 KiB.

    Anything decodes as bytes, so without this an image or an archive would train without a word."""
    sample = bytes(arr[:TEXT_SAMPLE_BYTES])
    try:
        # Incremental, so that a character cut at the sample's end is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
        binary = b"\x00" in sample
    except UnicodeDecodeError:
        binary = True
    if binary:
        raise UserError(
            "does not look like text (not UTF-8, or NUL bytes): give a text file, or token ids as .bin (uint16) "
            "or .npy",
            where=where,
        )


def check_data(data: TokenData, *, vocab: int, seq_len: int) -> None:
    """The data must hold a window of L + 1 tokens, and its ids must fit the model's vocabulary."""
    if len(data) < seq_len + 1:
        raise UserError(
            f"holds {len(data)} tokens, fewer than the sequence length + 1 ({seq_len + 1}) a training window needs",
            where=data.path,
        )
    if data.max_token >= vocab:
        raise UserError(
            f"holds token id {data.max_token}, outside the model's vocabulary of {vocab} (plan field 'model.vocab')",
            where=data.path,
        )


def split_data(data: TokenData, val_fraction: float, seq_len: int) -> tuple[TokenData, TokenData | None]:
    """(training part, held-out part): the file's last ``val_fraction`` held out (None when 0). Both must hold
    a window of L + 1 tokens."""
    if not 0 <= val_fraction < 1:
        raise UserError(f"must be in [0, 1), got {val_fraction}", where="--val-fraction")
    if val_fraction == 0:
        return data, None
    cut = len(data) - int(len(data) * val_fraction)
    parts = (data.tokens[:cut], data.tokens[cut:])
    for name, tokens in zip(("training", "held-out"), parts, strict=True):
        if len(tokens) < seq_len + 1:
            raise UserError(
                f"its {name} part ({len(tokens)} of {len(data)} tokens at --val-fraction {val_fraction:g}) is "
                f"shorter than one window of L + 1 = {seq_len + 1} tokens: give more data or another --val-fraction",
                where=data.path,
            )
    train, held_out = (TokenData(data.path, data.kind, tokens, data.max_token) for tokens in parts)
    return train, held_out


def validation_batch(held_out: TokenData, *, seed: int, sequences: int, seq_len: int) -> torch.Tensor:
    """The fixed (sequences, L + 1) windows of every evaluation, from the held-out part."""
    return step_batch(held_out, seed=seed, step=0, sequences=sequences, seq_len=seq_len)


def step_batch(data: TokenData, *, seed: int, step: int, sequences: int, seq_len: int) -> torch.Tensor:
    """The (sequences, L + 1) int64 windows of step ``step`` (same on every process)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq_len, size=sequences)
    rows = np.stack([np.asarray(data.tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    return torch.from_numpy(rows)


def generate_default_text(n_bytes: int = DEFAULT_DATA_BYTES, seed: int = 1234) -> str:
    """The embedded default data set: sentences from a small fixed grammar, deterministic in ``seed``."""
    rng = random.Random(seed)
    names = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kai", "Lena"]
    animals = ["cat", "dog", "fox", "owl", "bear", "duck", "frog", "goat", "hen", "mole", "seal", "wolf"]
    adjectives = ["small", "big", "red", "green", "quiet", "happy", "sleepy", "brave", "old", "young", "shy"]
    places = ["the park", "the river", "the hill", "the garden", "the market", "the forest", "the barn", "school"]
    things = ["a ball", "a book", "an apple", "a kite", "a hat", "a cake", "a boat", "a lamp", "a drum", "a map"]
    verbs = [("sees", "saw"), ("likes", "liked"), ("finds", "found"), ("helps", "helped"), ("calls", "called")]
    moves = [("walks to", "walked to"), ("runs to", "ran to"), ("goes to", "went to"), ("looks at", "looked at")]
    feelings = ["happy", "sad", "tired", "hungry", "glad", "cold", "warm", "sleepy"]

    def subject() -> str:
        if rng.random() < 0.5:
            return rng.choice(names)
        return f"the {rng.choice(adjectives)} {rng.choice(animals)}"

    def sentence(past: bool) -> str:
        t = 1 if past else 0
        kind = rng.randrange(7)
        if kind == 0:
            return f"{subject()} {rng.choice(verbs)[t]} {subject()}."
        if kind == 1:
            return f"{subject()} {rng.choice(moves)[t]} {rng.choice(places)}."
        if kind == 2:
            return f"{subject()} {'had' if past else 'has'} {rng.choice(things)}."
        if kind == 3:
            return f"{subject()} {'was' if past else 'is'} {rng.choice(feelings)}."
        if kind == 4:
            a, b = rng.randrange(10), rng.randrange(10)
            return f"{a} and {b} make {a + b}."
        if kind == 5:
            n = rng.randrange(1, 6)
            count = ["one", "two", "three", "four", "five"][n - 1]
            return f"{count} {rng.choice(animals)}{'s' if n > 1 else ''} sat in {rng.choice(places)}."
        return f"then {subject()} {rng.choice(verbs)[t]} {rng.choice(things)} in {rng.choice(places)}."

    out: list[str] = []
    size = 0
    while size < n_bytes:
        past = rng.random() < 0.5
        story = " ".join(sentence(past) for _ in range(rng.randrange(3, 8)))
        story = story[0].upper() + story[1:] + "\n"
        out.append(story)
        size += len(story)
    return "".join(out)[:n_bytes]
