"""Token data and the batches of each training step.

A data file is either text, read as bytes (vocabulary 256), or token ids: a Megatron-LM corpus (``.bin`` +
``.idx``), an llm.c ``.bin``, a one-dimensional integer ``.npy``, or a headerless ``.bin`` whose type ``--token-dtype``
says (`corpus.formats`, which tells them apart). Files are memory-mapped, never loaded whole. A run prints one line
about its data at start (`TokenData.start_line`): file, format, tokens, documents, type, largest id.

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

import dataclasses
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from terapipe_cli.corpus.formats import Documents, data_line, largest_id, open_token_file, vocab_problem
from terapipe_cli.errors import UserError

DEFAULT_DATA_NAME = "tiny-stories.txt"
DEFAULT_DATA_BYTES = 300_000


def default_data_path() -> Path:
    return Path(str(resources.files("terapipe_cli") / "data" / DEFAULT_DATA_NAME))


@dataclass(frozen=True)
class TokenData:
    path: str
    kind: str  # "text" (bytes) or "tokens"
    tokens: np.ndarray  # 1-D, memory-mapped
    max_token: int  # the file's largest id
    format: str = "text"  # how the file was read: a key of corpus.formats.FORMAT_NAMES
    format_name: str = "text, read as bytes"  # in words
    documents: Documents | None = None  # where the file's documents start, where its format records them
    start: int = 0  # the position of ``tokens[0]`` in the file (a held-out part starts after the training part)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def start_line(self) -> str:
        """The one line a run prints about its data at start: file, format, tokens, documents, type, largest id."""
        return data_line(self.path, self.format_name, self.tokens, self.documents, self.max_token)


def load_data(path: str | Path | None, token_dtype: str | None = None) -> TokenData:
    """Open a data file (None: the embedded default) of any format `corpus.formats` reads; ``token_dtype`` is the
    type of a headerless ``.bin``'s ids. One-line UserError if it cannot be used."""
    p = Path(path) if path is not None else default_data_path()
    opened = open_token_file(p, token_dtype)
    high = largest_id(opened)
    kind = "text" if opened.format == "text" else "tokens"
    return TokenData(opened.path, kind, opened.tokens, high, opened.format, opened.format_name, opened.documents)


def check_data(data: TokenData, *, vocab: int, seq_len: int) -> None:
    """The data (the whole file) must hold a window of L + 1 tokens, and its ids must fit the model's vocabulary: the
    first id outside it is named with its position (and document)."""
    if len(data) < seq_len + 1:
        raise UserError(
            f"holds {len(data)} tokens, fewer than the sequence length + 1 ({seq_len + 1}) a training window needs",
            where=data.path,
        )
    problem = vocab_problem(data.tokens, vocab, data.max_token, documents=data.documents, format=data.format)
    if problem is not None:
        raise UserError(f"{problem} (the model's: plan field 'model.vocab')", where=data.path)


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
    train = dataclasses.replace(data, tokens=parts[0])
    held_out = dataclasses.replace(data, tokens=parts[1], start=data.start + cut)
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
