"""``terapipe data tokenize``: text, JSON Lines and Parquet through a Hugging Face tokenizer into a Megatron corpus.

The tokenizer is a `tokenizers` ``tokenizer.json``, or a ``transformers`` model folder holding one (never a download).
Every document becomes the ids its own template wraps it in (`CorpusTokenizer.prefix`: Llama 3's
``<|begin_of_text|>``; GPT-2's: none), its text's ids, and the EOS id after it (the folder's ``tokenizer_config.json``
names it, or ``--eos``). Special tokens written in a document's text are encoded as text, as tiktoken's
``encode_ordinary`` does: a web page that contains ``<|endoftext|>`` does not end its document there.

What a document is: a JSON Lines record's ``--field`` (``.jsonl``, ``.ndjson``, ``.json``), a Parquet row's column
(``.parquet``, with ``pyarrow``), and for a text file (any other name) ``--split``: the whole file, each non-empty
line, or each paragraph (lines up to a blank line).

Speed: documents are encoded in batches of about `BATCH_CHARS` characters by ``Tokenizer.encode_batch_fast``, which
spreads a batch over every core (Rust threads). A document longer than `PIECE_CHARS` is encoded in pieces cut before
a space that follows a non-space and precedes a letter, where the pre-tokenizers of byte-level BPEs (GPT-2's and
Llama 3's patterns) cut anyway, so the ids equal the whole document's (tested); a tokenizer for which that is not
certain (`_cuttable`: a normalizer or pre-tokenizer that prepends, strips or rewrites across spaces) encodes every
document whole.

The output, for ``--out CORPUS``: ``CORPUS.bin`` + ``CORPUS.idx`` (`formats.MegatronWriter`), ``CORPUS.tokenizer/``
(the tokenizer's files, so that a later command decodes the ids with the tokenizer that made them) and
``CORPUS.json``, the summary (`SUMMARY_SCHEMA`; `read_summary`): documents, tokens, largest id, type, tokenizer, EOS,
inputs.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import select
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from terapipe_cli import units
from terapipe_cli.corpus.formats import MegatronWriter, megatron_dtype
from terapipe_cli.corpus.identity import (
    SUMMARY_SCHEMA,
    corpus_files,
    corpus_prefix,
    fingerprint_files,
    read_summary,
    tokenizer_digest,
)
from terapipe_cli.errors import UserError, ending_signals_off_this_thread
from terapipe_cli.extras import require
from terapipe_cli.files import _umask, check_free_space, read_json, write_json_atomic

SPLITS = ("file", "line", "paragraph")  # what one document of a text file is
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # copied beside the corpus

PIECE_CHARS = 1 << 16  # a longer document is encoded in pieces of about this many characters
BATCH_CHARS = 1 << 20  # characters per encode_batch_fast call (smaller batches: fewer cache misses, measured)
READ_BYTES = 1 << 20
WAKE_S = 0.2  # a pipe's reader comes back this often while it waits (`_open_input`)
PARQUET_ROWS = 8192

# Normalizers and pre-tokenizers under which a cut before " letter" gives the ids of the uncut text (`_cuttable`).
_CUTTABLE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Sequence"}
_CUTTABLE_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "Sequence"}

Progress = Callable[[float, float], None]  # (bytes read, bytes in all)


@dataclass(frozen=True)
class CorpusTokenizer:
    """A `tokenizers` tokenizer with what a corpus needs of it."""

    tokenizer: Any  # tokenizers.Tokenizer
    files: tuple[Path, ...]  # what is copied beside the corpus (tokenizer.json first)
    eos: str
    eos_id: int
    prefix: tuple[int, ...]  # the ids its template puts before every document (Llama 3: <|begin_of_text|>)
    suffix: tuple[int, ...]  # the ids after every document: the template's, the EOS last
    vocab: int  # its largest id + 1
    cuttable: bool  # a long document may be encoded in pieces (module docstring)


def load_tokenizer(path: Path, eos: str | None = None) -> CorpusTokenizer:
    """The tokenizer of ``path`` (a ``tokenizer.json``, or a folder holding one with its ``tokenizer_config.json``),
    its EOS token ``eos`` or else the one its config names; one-line `UserError` naming ``--tokenizer`` or ``--eos``."""
    tokenizers = require("tokenizers", where="--tokenizer")
    path = Path(path)
    if not path.exists():
        raise UserError(
            f"{path} not found: give a tokenizer.json, or a transformers model folder holding one (nothing is "
            "downloaded)",
            where="--tokenizer",
        )
    folder = path if path.is_dir() else path.parent
    main = path / "tokenizer.json" if path.is_dir() else path
    if not main.is_file():
        raise UserError(
            f"{path} holds no tokenizer.json (a transformers folder of a fast tokenizer has one)", where="--tokenizer"
        )
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(main))
    except Exception as e:  # tokenizers raises its own Exception for a malformed file
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{main} is not a tokenizers tokenizer.json ({message})", where="--tokenizer") from None
    files = (main, *(folder / name for name in TOKENIZER_FILES[1:] if (folder / name).is_file()))
    if eos is None:
        eos = _configured_eos(folder)
    if eos is None:
        raise UserError(
            f"no EOS token known for {path} (no tokenizer_config.json naming eos_token beside it): name the token "
            "that ends every document, e.g. --eos '<|endoftext|>'",
            where="--eos",
        )
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise UserError(f"{eos!r} is not a token of {main}", where="--eos")
    tokenizer.encode_special_tokens = True  # "<|endoftext|>" written in a text is text (module docstring)
    prefix, suffix = _template(tokenizer, main)
    if not suffix or suffix[-1] != eos_id:
        suffix = (*suffix, eos_id)
    vocab = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return CorpusTokenizer(tokenizer, files, eos, eos_id, prefix, suffix, vocab, _cuttable(tokenizer))


def _configured_eos(folder: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if not (folder / name).is_file():
            continue
        token = read_json(folder / name, what="tokenizer config").get("eos_token")
        if isinstance(token, dict):  # an AddedToken written out: {"content": "</s>", ...}
            token = token.get("content")
        if isinstance(token, str) and token:
            return token
    return None


def _template(tokenizer, where: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the tokenizer's post-processor puts before and after a text (Llama 3: (<|begin_of_text|>,), ())."""
    plain = tokenizer.encode("x", add_special_tokens=False).ids
    wrapped = tokenizer.encode("x", add_special_tokens=True).ids
    for at in range(len(wrapped) - len(plain) + 1):
        if wrapped[at : at + len(plain)] == plain:
            return tuple(wrapped[:at]), tuple(wrapped[at + len(plain) :])
    raise UserError("its post-processor does not put fixed tokens around a text: not supported", where=str(where))


def _cuttable(tokenizer) -> bool:
    """Whether a cut before " letter" (after a non-space) leaves the ids unchanged (module docstring)."""
    spec = json.loads(tokenizer.to_str())

    def types(node) -> Iterator[dict]:
        if isinstance(node, dict):
            yield node
            for key in ("normalizers", "pretokenizers"):
                for child in node.get(key) or ():
                    yield from types(child)

    normalizers = list(types(spec.get("normalizer")))
    pre_tokenizers = list(types(spec.get("pre_tokenizer")))
    if any(n.get("type") not in _CUTTABLE_NORMALIZERS for n in normalizers):
        return False
    if any(p.get("type") not in _CUTTABLE_PRE_TOKENIZERS or p.get("add_prefix_space") for p in pre_tokenizers):
        return False
    # A non-special added token with a space in it is matched across the text before pre-tokenization.
    return not any(not t.get("special") and any(c.isspace() for c in t["content"]) for t in spec["added_tokens"])


@dataclass
class _Counter:
    done: int = 0  # bytes of the inputs read
    skipped: int = 0  # empty documents (no text), not written


def input_kind(path: Path) -> str:
    """ "jsonl", "parquet" or "text", by the file's name."""
    suffix = path.suffix.lower()
    return "jsonl" if suffix in JSONL_SUFFIXES else "parquet" if suffix in PARQUET_SUFFIXES else "text"


def check_inputs(inputs: list[Path], *, field: str, split: str) -> None:
    """Every input a readable file (a Parquet file with its ``field`` column, as text), before any work."""
    if split not in SPLITS:
        raise UserError(f"must be one of {', '.join(SPLITS)}, got {split!r}", where="--split")
    if not inputs:
        raise UserError("give at least one input file", where="terapipe data tokenize")
    for path in inputs:
        if not path.exists():
            raise UserError("input file not found", where=str(path))
        if path.is_dir():
            raise UserError("expected an input file, found a folder", where=str(path))
        if input_kind(path) == "parquet":
            _parquet_column(path, field)


def _parquet_column(path: Path, name: str):
    parquet = require("pyarrow.parquet", where=str(path))
    try:
        table = parquet.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and kin
        raise UserError(f"cannot read as Parquet ({str(e).splitlines()[0]})", where=str(path)) from None
    schema = table.schema_arrow
    if name not in schema.names:
        raise UserError(
            f"has no column {name!r} (columns: {', '.join(schema.names)}); choose one with --field", where=str(path)
        )
    kind = str(schema.field(name).type)
    if kind not in ("string", "large_string", "string_view"):
        raise UserError(f"column {name!r} holds {kind}, not text", where=str(path))
    return table


def _documents(path: Path, *, field: str, split: str, counter: _Counter) -> Iterator[str]:
    """The texts of the documents of one input (a text file in ``--split file`` mode: read whole, one text)."""
    kind = input_kind(path)
    if kind == "parquet":
        yield from _parquet_documents(path, field, counter)
    elif kind == "jsonl":
        yield from _jsonl_documents(path, field, counter)
    else:
        yield from _text_documents(path, split, counter)


class _WakingPipe(io.RawIOBase):
    """A pipe (a named one, /dev/stdin) read by waiting for data at most `WAKE_S` at a time: the main thread comes
    back to Python between the waits, so a stop signal's handler runs even when the kernel handed the signal to another
    thread (one a library started without blocking it), which would leave a read blocked in the kernel waiting on."""

    def __init__(self, raw: io.FileIO) -> None:
        super().__init__()
        self.raw = raw

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.raw.fileno()

    def readinto(self, buffer) -> int | None:
        while not select.select([self.raw], [], [], WAKE_S)[0]:
            pass
        return self.raw.readinto(buffer)

    def close(self) -> None:
        self.raw.close()
        super().close()


def _open_input(path: Path) -> io.BufferedReader:
    """``path`` opened for reading bytes; a pipe through `_WakingPipe`."""
    raw = open(path, "rb", buffering=0)  # noqa: SIM115 - the reader returned closes it
    if stat.S_ISREG(os.fstat(raw.fileno()).st_mode):
        return io.BufferedReader(raw)
    return io.BufferedReader(_WakingPipe(raw))


def _jsonl_documents(path: Path, field: str, counter: _Counter) -> Iterator[str]:
    with _open_input(path) as f:
        for number, raw in enumerate(f, 1):
            counter.done += len(raw)
            if not raw.strip():
                continue
            where = f"{path}: line {number}"
            try:
                record = json.loads(raw)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise UserError(f"not a JSON object ({str(e).splitlines()[0]})", where=where) from None
            if not isinstance(record, dict):
                raise UserError(f"not a JSON object but {type(record).__name__}", where=where)
            if field not in record:
                keys = ", ".join(list(record)[:8])
                raise UserError(f"has no field {field!r} (fields: {keys}); choose one with --field", where=where)
            text = record[field]
            if text is not None and not isinstance(text, str):
                raise UserError(f"field {field!r} is {type(text).__name__}, not text", where=where)
            yield text or ""  # null: an empty document, left out and counted


def _parquet_documents(path: Path, field: str, counter: _Counter) -> Iterator[str]:
    table = _parquet_column(path, field)
    rows, size, done = max(table.metadata.num_rows, 1), path.stat().st_size, 0
    start = counter.done
    for batch in table.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
        texts = batch.column(0).to_pylist()
        done += len(texts)
        counter.done = start + size * done // rows
        for text in texts:
            if text is None:
                counter.skipped += 1
                continue
            yield text
    counter.done = start + size


def _text_documents(path: Path, split: str, counter: _Counter) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    with _open_input(path) as f:
        # Read on, never seek back: the input may be a pipe (a named one, /dev/stdin).
        head = f.read(len(codecs.BOM_UTF8))
        if head == codecs.BOM_UTF8:  # a byte-order mark (Windows editors) is no text
            counter.done += len(head)
            head = b""
        if split == "file":
            chunks = chain([head], iter(lambda: f.read(READ_BYTES), b""))
            text = "".join(_decode(decoder, chunk, counter, path) for chunk in chunks)
            yield text + _decode(decoder, b"", counter, path, final=True)
            return
        paragraph: list[str] = []
        first = io.BytesIO(head + f.readline()) if head else io.BytesIO()  # the head's lines, split as f's are
        for raw in chain(first, f):
            line = _decode(decoder, raw, counter, path)
            if split == "line":
                if line.strip():
                    yield line.rstrip("\r\n")
            elif line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph).rstrip("\r\n")
                paragraph = []
        _decode(decoder, b"", counter, path, final=True)  # a character cut off at the end is an error too
        if paragraph:
            yield "".join(paragraph).rstrip("\r\n")


def _decode(decoder, raw: bytes, counter: _Counter, path: Path, *, final: bool = False) -> str:
    try:
        text = decoder.decode(raw, final=final)
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text at byte {counter.done + e.start:,}", where=str(path)) from None
    counter.done += len(raw)
    return text


def _pieces(text: str, cuttable: bool) -> list[str]:
    """``text`` in pieces of about `PIECE_CHARS`, cut before a space between a non-space and a letter (one piece
    when it is short, has no such place, or the tokenizer is not `_cuttable`)."""
    if not cuttable or len(text) <= 2 * PIECE_CHARS:
        return [text]
    pieces, start = [], 0
    while len(text) - start > 2 * PIECE_CHARS:
        at = text.find(" ", start + PIECE_CHARS)
        while at != -1 and not (at + 1 < len(text) and text[at + 1].isalpha() and not text[at - 1].isspace()):
            at = text.find(" ", at + 1)
        if at == -1:
            break
        pieces.append(text[start:at])
        start = at
    pieces.append(text[start:])
    return pieces


@dataclass
class CorpusSummary:
    """What `tokenize_corpus` wrote (and ``CORPUS.json`` holds)."""

    prefix: Path
    documents: int = 0
    tokens: int = 0
    max_token: int = -1
    dtype: str = ""
    vocab: int = 0
    eos: str = ""
    eos_id: int = -1
    prefix_ids: list[int] = field(default_factory=list)
    tokenizer: str = ""  # the copied tokenizer's folder, beside the corpus
    tokenizer_sha256: str = ""  # "sha256:HEX" of its tokenizer.json (`identity.tokenizer_digest`)
    fingerprint: dict = field(default_factory=dict)  # of the .bin and .idx (`identity.fingerprint_files`)
    inputs: list[str] = field(default_factory=list)
    input_bytes: int = 0
    skipped: int = 0  # empty documents
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "schema": SUMMARY_SCHEMA,
            "format": "megatron",
            "documents": self.documents,
            "tokens": self.tokens,
            "max_token": self.max_token,
            "dtype": self.dtype,
            "vocab": self.vocab,
            "tokenizer": self.tokenizer,
            "tokenizer_sha256": self.tokenizer_sha256,
            "fingerprint": self.fingerprint,
            "eos": {"token": self.eos, "id": self.eos_id},
            "prefix_ids": self.prefix_ids,
            "inputs": self.inputs,
            "input_bytes": self.input_bytes,
            "skipped_documents": self.skipped,
            "seconds": round(self.seconds, 3),
            "created": units.utc_timestamp(),
        }


def check_corpus_out(out: Path, *, force: bool) -> Path:
    """The corpus prefix of ``--out``, checked before any work: its folder exists or is the one to create, it is
    writable, and an existing corpus there is overwritten only when it is one of ours (its summary) or ``force``."""
    prefix = corpus_prefix(out)
    if str(out).endswith(("/", os.sep)) or prefix.is_dir():
        raise UserError(f"{out} names a folder; give the corpus's name, e.g. {Path(out) / 'corpus'}", where="--out")
    parent = prefix.parent
    if not parent.exists() and not parent.parent.exists():
        raise UserError(f"folder {parent.parent} does not exist (only {parent.name}/ would be created)", where="--out")
    files = corpus_files(prefix)
    existing = [p for p in files.values() if p.exists()]
    if existing and not force and read_summary(prefix) is None:
        raise UserError(
            f"{existing[0]} exists and is not a terapipe corpus; pass --force to overwrite it", where="--out"
        )
    nearest = parent if parent.exists() else parent.parent
    if not os.access(nearest, os.W_OK):
        raise UserError(f"cannot write {prefix}.bin (folder {nearest} is not writable)", where="--out")
    return prefix


# More input bytes per token than BPE tokenizers average on English text (GPT-2's about 4.3, Llama 3's about 4.6):
# the corpus's size estimated from it is low, so a disk refused by it is too small for any likely corpus.
INPUT_BYTES_PER_TOKEN = 6


def check_corpus_room(prefix: Path, input_bytes: int, dtype: np.dtype) -> None:
    """Free disk for the corpus of ``input_bytes`` of input before any is written: "disk full" in one line naming
    the .bin when its folder has less room than the ids at `INPUT_BYTES_PER_TOKEN` (a disk that fills anyway is said
    as full when it does, `MegatronWriter`, and nothing is left)."""
    needed = input_bytes // INPUT_BYTES_PER_TOKEN * dtype.itemsize
    estimate = f"{units.format_bytes(input_bytes)} of input at {INPUT_BYTES_PER_TOKEN} bytes a token, {dtype.name} ids"
    check_free_space(corpus_files(prefix)["bin"], needed, estimate=estimate)


def tokenize_corpus(
    inputs: list[Path],
    tok: CorpusTokenizer,
    prefix: Path,
    *,
    field: str = "text",
    split: str = "file",
    progress: Progress | None = None,
) -> CorpusSummary:
    """Tokenize ``inputs`` (checked by `check_inputs`) with ``tok`` into the corpus ``prefix`` (checked by
    `check_corpus_out`); nothing is left behind when it fails or is interrupted."""
    started = time.perf_counter()
    total = sum(p.stat().st_size for p in inputs)
    counter = _Counter()
    dtype = megatron_dtype(tok.vocab)
    check_corpus_room(prefix, total, dtype)
    summary = CorpusSummary(prefix, dtype=dtype.name, vocab=tok.vocab, eos=tok.eos, eos_id=tok.eos_id)
    summary.prefix_ids = list(tok.prefix)
    summary.inputs = [str(p) for p in inputs]
    prefix.parent.mkdir(exist_ok=True)
    assembler = _Assembler(tok, dtype)
    # One batch is encoded (by tokenizers' threads, without the GIL) while this thread reads the next one and writes
    # the one before: the reading and the writing take no time of their own.
    with (
        MegatronWriter(prefix, dtype) as writer,
        ThreadPoolExecutor(max_workers=1, initializer=ending_signals_off_this_thread) as encoder,
    ):
        waiting: tuple[_Batch, Future] | None = None

        def send(batch: _Batch) -> None:
            nonlocal waiting
            future = encoder.submit(tok.tokenizer.encode_batch_fast, batch.texts, add_special_tokens=False)
            if waiting is not None:
                assembler.write(waiting[0], waiting[1].result(), writer, summary)
            waiting = (batch, future)
            if progress is not None:
                progress(counter.done, total)

        batch = _Batch()
        for path in inputs:
            for text in _documents(path, field=field, split=split, counter=counter):
                if not text:
                    counter.skipped += 1
                    continue
                pieces = _pieces(text, tok.cuttable)
                for n, piece in enumerate(pieces):
                    if batch.add(piece, first=n == 0, last=n == len(pieces) - 1) >= BATCH_CHARS:
                        send(batch)
                        batch = _Batch()
        if batch.texts:
            send(batch)
        if waiting is not None:
            assembler.write(waiting[0], waiting[1].result(), writer, summary)
        if progress is not None:
            progress(total, total)
        if writer.tokens == 0:
            empty = f"only empty documents ({counter.skipped:,}, left out)" if counter.skipped else "no document"
            where = str(inputs[0]) if len(inputs) == 1 else f"{inputs[0]} and the {len(inputs) - 1} other inputs"
            raise UserError(f"no text to tokenize: {empty}; nothing written", where=where)
        summary.tokens, summary.input_bytes, summary.skipped = writer.tokens, counter.done, counter.skipped
        files = corpus_files(prefix)
        summary.tokenizer = files["tokenizer"].name
        summary.tokenizer_sha256 = tokenizer_digest(tok.files[0]) or ""
        _copy_tokenizer(tok.files, files["tokenizer"])
        summary.seconds = time.perf_counter() - started

        def write_summary(bin_path: Path, idx_path: Path) -> None:  # the corpus's files written, not yet in place
            summary.fingerprint = fingerprint_files("megatron", {"index": idx_path, "tokens": bin_path})
            write_json_atomic(files["summary"], summary.to_dict())

        writer.commit(write_summary)
    return summary


@dataclass
class _Batch:
    """Pieces of documents for one ``encode_batch_fast``: each piece's text, and whether it begins or ends its
    document (a long one is several pieces, maybe over several batches)."""

    texts: list[str] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)
    last: list[bool] = field(default_factory=list)
    chars: int = 0

    def add(self, text: str, *, first: bool, last: bool) -> int:
        self.texts.append(text)
        self.first.append(first)
        self.last.append(last)
        self.chars += len(text)
        return self.chars


class _Assembler:
    """Writes encoded batches in order, each document's ids inside its template (prefix, then its ids, then the
    suffix ending with the EOS), and the lengths of the documents that end in each."""

    def __init__(self, tok: CorpusTokenizer, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.prefix, self.suffix = np.array(tok.prefix, np.int64), np.array(tok.suffix, np.int64)
        self.open = 0  # the ids already written of the document that the next piece continues

    def write(self, batch: _Batch, encodings: list, writer: MegatronWriter, summary: CorpusSummary) -> None:
        lengths = np.fromiter((len(e) for e in encodings), np.int64, count=len(encodings))
        ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), np.int64, count=int(lengths.sum()))
        first, last = np.array(batch.first), np.array(batch.last)
        prefix, suffix = self.prefix, self.suffix
        # Each piece's place in the output: the prefix before a document's first piece, the suffix after its last.
        sizes = lengths + prefix.size * first + suffix.size * last
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        body = starts + prefix.size * first
        out = np.empty(int(sizes.sum()), np.int64)
        out[np.repeat(body - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths) + np.arange(ids.size)] = ids
        for k, token in enumerate(prefix):
            out[starts[first] + k] = token
        for k, token in enumerate(suffix):
            out[(body + lengths)[last] + k] = token
        ends = np.cumsum(sizes)[last]
        documents = np.diff(np.concatenate(([0], ends)))
        if documents.size:
            documents[0] += self.open
            self.open = int(sizes.sum() - ends[-1])
        else:
            self.open += int(sizes.sum())
        writer.write(out.astype(self.dtype), documents)
        summary.documents += int(documents.size)
        if out.size:
            summary.max_token = max(summary.max_token, int(out.max()))


def _copy_tokenizer(files: tuple[Path, ...], folder: Path) -> None:
    """The tokenizer's files into ``folder`` (a new folder renamed into place; an old one replaced)."""
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        for n, path in enumerate(files):
            shutil.copyfile(path, staging / (TOKENIZER_FILES[0] if n == 0 else path.name))
        os.chmod(staging, 0o777 & ~_umask())
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
