"""Token data and the batches of each training step.

A data file is either text, read as bytes (vocabulary 256), or token ids: a Megatron-LM corpus (``.bin`` +
``.idx``), an llm.c ``.bin``, a one-dimensional integer ``.npy``, or a headerless ``.bin`` whose type ``--token-dtype``
says (`corpus.formats`, which tells them apart). Files are memory-mapped, never loaded whole. A run prints one line
about its data at start (`TokenData.start_line`): file, format, tokens, documents, type, largest id.

The batch of step s is drawn from the seed and s alone: ``B·D`` windows of ``L + 1`` tokens; window r feeds
sequence r of the global batch, the first L tokens as inputs and the last L as targets. So any worker, the
single-process reference of ``--verify``, and a resumed run all see exactly the same batches without exchanging
anything. Two samplings (``--sampling``, `window_offsets`): ``random`` windows at random offsets (``numpy`` generator
seeded with ``[seed, s]``; the default for text and for runs begun before), and ``epoch``, as Megatron-LM's dataset
builds them: the data cut into non-overlapping windows of L tokens (each with the next window's first token as its
last target), shuffled once per epoch (seeded with ``[seed, EPOCH_SEED, epoch]``) and taken in that order, sample
g = (s − 1)·B·D + r being window g mod W of epoch g div W (W windows); every window once per epoch.

Packed documents (`step_documents`, docs/design.md §6): with a document mask each window also carries, per input
token, where its document begins in the window (0 for one that began before it): from the corpus's own document
index (a Megatron corpus), or after every EOS id of the run's tokenizer (any other file). The attention then masks
across documents and positions restart at each (`attention.DocumentMask`).

Held-out data: `run_data` reads the run's data and its held-out part: ``--val-data FILE`` (a file of its own, any
format), or `split_data`, which keeps the file's last ``val_fraction`` for validation. Training windows are drawn
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
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from terapipe_cli.config.run import SAMPLINGS
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


GPT2_EOS = 50256  # <|endoftext|> of GPT-2's BPE: the EOS of a token file that names no tokenizer (as `train.sample`)
TEXT_EOS = ord("\n")  # text read as bytes: a line is a document (the embedded stories are one a line)


def resolve_document_mask(
    data: TokenData | list[TokenData], asked: bool | None, eos_id: int | None, *, vocab: int | None = None
) -> tuple[bool, int | None]:
    """(whether the run masks across documents, the EOS id that ends them where a file records none) for its data (a
    mixture: every source): on by default when every file records its documents, off otherwise unless asked, where
    the documents of a file that records none end at ``eos_id`` or the run tokenizer's EOS (`TEXT_EOS` in text,
    `GPT2_EOS` in other token files).

    An EOS id that would change nothing is one line (``where="eos_id"``), never ignored: one given while the mask is
    off, or given for files that all record their documents (a Megatron corpus: from its index); and one outside the
    model's ``vocab``, given or the default (no id of the data could end a document: the mask would mask nothing)."""
    files = data if isinstance(data, list) else [data]
    recorded = all(d.documents is not None for d in files)
    if asked is False or (asked is None and not recorded):
        if eos_id is not None:
            off = (
                "--no-document-mask turns the mask off"
                if asked is False
                else f"the mask is off: {files[0].path} records no documents (add --document-mask to end them at it)"
            )
            raise UserError(f"ends each document for the document mask, but {off}", where="eos_id")
        return False, None
    if recorded:
        if eos_id is not None:
            whose = f"{files[0].path} records" if len(files) == 1 else "every source records"
            raise UserError(
                f"{whose} its documents in its index (a Megatron corpus), so no id ends them: leave --eos-id out "
                "(it is for files that record none)",
                where="eos_id",
            )
        return True, None
    given = eos_id is not None
    if not given:
        eos_id = TEXT_EOS if files[0].kind == "text" else GPT2_EOS
    if vocab is not None and eos_id >= vocab:
        if given:
            raise UserError(
                f"must be an id of the model's vocabulary of {vocab:,} ids (plan field 'model.vocab'), got {eos_id}",
                where="eos_id",
            )
        raise UserError(
            f"the document mask ends each document at GPT-2's <|endoftext|> (id {eos_id}) by default, outside the "
            f"model's vocabulary of {vocab:,} ids: give the id that ends the data's documents with --eos-id, or "
            "leave the mask off (--no-document-mask)",
            where="eos_id",
        )
    return True, eos_id


def document_mask_note(document_mask: bool, eos_id: int | None) -> str:
    """What the run's data line adds about its document mask (nothing without one)."""
    if not document_mask:
        return ""
    where = "the corpus's own" if eos_id is None else f"ending at id {eos_id}"
    return f"; documents masked (block-causal attention, positions per document): {where}"


def run_data(args, *, seq_len: int, vocab: int) -> tuple[TokenData | Mixture, TokenData | Mixture | None, str]:
    """(training data, held-out data or None, the line a run prints about its data) of a run's resolved ``args``
    (`config.run.RunArguments`): the data file — or, with ``data_mix``, every source by its weight (`Mixture`) —
    checked, and its held-out part: ``val_data``'s own file, or the last ``val_fraction`` of each source."""
    if args.data_mix is None:
        sources, weights = [args.data], [1.0]
    else:
        weights, sources = zip(
            *((float(w), p) for w, p in (entry.split(":", 1) for entry in args.data_mix)), strict=True
        )
    parts, held, lines = [], [], []
    for path in sources:
        data = load_data(path, args.token_dtype)
        check_data(data, vocab=vocab, seq_len=seq_len)
        lines.append(data.start_line())
        train, held_out = split_data(data, args.val_fraction if args.val_data is None else 0.0, seq_len)
        parts.append(train)
        held.append(held_out)
    if args.data_mix is None:
        train, held_out = parts[0], held[0]
    else:
        train = Mixture(tuple(parts), tuple(weights))
        held_out = None if held[0] is None else Mixture(tuple(held), tuple(weights))
        lines = [f"{w:g} × {line}" for w, line in zip(weights, lines, strict=True)]
    line = "\n".join(lines)
    if args.val_data is not None:
        held_out = load_data(args.val_data, args.token_dtype)
        check_data(held_out, vocab=vocab, seq_len=seq_len)
        line += f"; held out: {held_out.path} ({len(held_out):,} tokens)"
    return train, held_out, line


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


def validation_documents(
    held_out: TokenData, *, seed: int, sequences: int, seq_len: int, eos: int | None = None
) -> torch.Tensor:
    """The document starts (sequences, L) of `validation_batch`'s windows (`step_documents`)."""
    return step_documents(held_out, seed=seed, step=0, sequences=sequences, seq_len=seq_len, eos=eos)


EPOCH_SEED = 0x45504F43  # mixed into an epoch's shuffle, so that it never meets a step's random windows


def epoch_windows(data: TokenData, seq_len: int) -> int:
    """W: the non-overlapping windows of L tokens (and one more as the last target) that ``data`` holds."""
    return (len(data) - 1) // seq_len


def window_offsets(
    data: TokenData,
    *,
    seed: int,
    step: int,
    sequences: int,
    seq_len: int,
    sampling: str = "random",
    first: int | None = None,
    stream: tuple[int, ...] = (),
) -> np.ndarray:
    """Where the windows of step ``step`` (1, 2, ...) begin in ``data`` (same on every process; the module
    docstring). ``first``: with epoch sampling, the sample number of the first of them (default: (step − 1)·sequences,
    every window of the step from ``data``); ``stream``: what tells a mixture's sources' draws apart."""
    if sampling == "random":
        rng = np.random.default_rng([seed, step, *stream])
        return rng.integers(0, len(data) - seq_len, size=sequences)
    if sampling != "epoch":
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    windows = epoch_windows(data, seq_len)
    samples = ((step - 1) * sequences if first is None else first) + np.arange(sequences)
    epochs, places = np.divmod(samples, windows)
    order = {
        int(e): np.random.default_rng([seed, EPOCH_SEED, int(e), *stream]).permutation(windows)
        for e in np.unique(epochs)
    }
    return np.array([order[int(e)][p] for e, p in zip(epochs, places, strict=True)], dtype=np.int64) * seq_len


@dataclass(frozen=True)
class Mixture:
    """Several sources drawn by weight (``--data 0.7:web --data 0.3:code``): each window of a step comes from one
    source, chosen from the seed and the step (`step_windows`), then placed in it as that source's own windows are
    (its own stream of random offsets, or its own epochs)."""

    sources: tuple[TokenData, ...]
    weights: tuple[float, ...]  # normalised: they add up to 1
    _drawn: dict = field(default_factory=dict, repr=False, compare=False)  # step -> windows of each source before it

    @property
    def path(self) -> str:
        return ", ".join(f"{w:g}:{d.path}" for w, d in zip(self.weights, self.sources, strict=True))

    @property
    def kind(self) -> str:
        return self.sources[0].kind

    def __len__(self) -> int:
        return sum(len(d) for d in self.sources)

    def choices(self, seed: int, step: int, sequences: int) -> np.ndarray:
        """The source of each window of step ``step``."""
        rng = np.random.default_rng([seed, MIX_SEED, step])
        return rng.choice(len(self.sources), size=sequences, p=np.asarray(self.weights))

    def drawn_before(self, seed: int, step: int, sequences: int) -> np.ndarray:
        """Windows each source gave to steps 1 … step − 1 (epoch sampling places a window by this count): replayed
        from the seed once, then kept."""
        known = [s for s in self._drawn if s <= step]
        at = max(known, default=1)
        counts = self._drawn.get(at, np.zeros(len(self.sources), np.int64)).copy()
        for s in range(at, step):
            counts += np.bincount(self.choices(seed, s, sequences), minlength=len(self.sources))
        self._drawn[step] = counts
        return counts


MIX_SEED = 0x4D4958  # mixed into a mixture's choice of sources


def step_windows(
    data: TokenData | Mixture, *, seed: int, step: int, sequences: int, seq_len: int, sampling: str = "random"
) -> list[tuple[TokenData, int]]:
    """The windows of step ``step``, each as (its data, its offset there)."""
    if isinstance(data, TokenData):
        offsets = window_offsets(data, seed=seed, step=step, sequences=sequences, seq_len=seq_len, sampling=sampling)
        return [(data, int(o)) for o in offsets]
    choice = data.choices(seed, step, sequences)
    before = data.drawn_before(seed, step, sequences) if sampling == "epoch" else None
    out: list[tuple[TokenData, int] | None] = [None] * sequences
    for j, source in enumerate(data.sources):
        rows = np.flatnonzero(choice == j)
        if rows.size == 0:
            continue
        first = None if before is None else int(before[j])
        offsets = window_offsets(
            source, seed=seed, step=step, sequences=rows.size, seq_len=seq_len, sampling=sampling, first=first,
            stream=(j,),
        )  # fmt: skip
        for r, o in zip(rows, offsets, strict=True):
            out[r] = (source, int(o))
    return out


def epochs_done(data: TokenData | Mixture, *, step: int, sequences: int, seq_len: int) -> float:
    """Epochs of the training data the first ``step`` steps drew: windows drawn over W (random windows: the same count,
    as an expectation; a mixture: over all its sources' windows)."""
    sources = data.sources if isinstance(data, Mixture) else (data,)
    return step * sequences / sum(epoch_windows(d, seq_len) for d in sources)


def step_batch(
    data: TokenData | Mixture, *, seed: int, step: int, sequences: int, seq_len: int, sampling: str = "random"
) -> torch.Tensor:
    """The (sequences, L + 1) int64 windows of step ``step`` (same on every process)."""
    windows = step_windows(data, seed=seed, step=step, sequences=sequences, seq_len=seq_len, sampling=sampling)
    rows = np.stack([np.asarray(d.tokens[s : s + seq_len + 1], dtype=np.int64) for d, s in windows])
    return torch.from_numpy(rows)


def step_documents(
    data: TokenData | Mixture,
    *,
    seed: int,
    step: int,
    sequences: int,
    seq_len: int,
    eos: int | None = None,
    sampling: str = "random",
) -> torch.Tensor:
    """For the windows of `step_batch`: where each input token's document begins in its window, (sequences, L) int64
    (0 for a document that began before the window). The documents are the corpus's own (a Megatron index) or, in a
    file that records none, the runs of tokens ending at each ``eos`` id; `UserError` with neither."""
    windows = step_windows(data, seed=seed, step=step, sequences=sequences, seq_len=seq_len, sampling=sampling)
    return torch.stack([_window_documents(d, offset, seq_len, eos) for d, offset in windows])


def _window_documents(data: TokenData, offset: int, seq_len: int, eos: int | None) -> torch.Tensor:
    """Where each of the L input tokens of the window at ``offset`` begins its document, in the window (L,)."""
    if data.documents is not None:
        at = data.start + offset  # the window's place in the file
        starts = data.documents.starts
        first = starts[np.searchsorted(starts, at + np.arange(seq_len), side="right") - 1] - at
        return torch.from_numpy(np.maximum(first, 0).astype(np.int64))
    if eos is None:
        raise UserError("records no documents: a document mask needs the EOS id that ends each", where=data.path)
    row = torch.from_numpy(np.asarray(data.tokens[offset : offset + seq_len], dtype=np.int64))
    return eos_document_starts(row[None], eos)[0]


def eos_document_starts(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Where each token's document begins in its row of ``tokens`` (n, L): just after the latest ``eos`` before it
    (an EOS token ends its own document), else 0."""
    places = torch.arange(tokens.shape[1]).expand_as(tokens)
    begins = torch.zeros_like(tokens, dtype=torch.int64)
    begins[:, 1:] = torch.where(tokens[:, :-1] == eos, places[:, 1:], 0)
    return torch.cummax(begins, dim=1).values


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
