"""The token files `terapipe train --data` reads, told apart by their own headers, memory-mapped, never loaded whole.

    format     files                      told apart by                                        ids
    megatron   PREFIX.bin + PREFIX.idx    an .idx beside the .bin (magic MMIDIDX); named by    its dtype code
                                          PREFIX, as Megatron-LM names it, or by either file
    llm.c      NAME.bin                   a header of 256 int32: magic 20240520 (GPT-2) or     uint16 / uint32
                                          20240801 (Llama 3), version, token count
    npy        NAME.npy                   NumPy's own header                                   any integer type
    bin        NAME.bin                   none of the above: ``--token-dtype`` says its type   uint16 or uint32
    text       any other name             UTF-8 text, read as bytes                            bytes (0..255)

A headerless ``.bin`` is never guessed: without ``token_dtype`` it is refused in one line naming ``--token-dtype``
(a uint32 file read as uint16 would pass every vocabulary check and train on noise). Read as uint16, a file whose
every second id at its start is below 16 (the high halves of little-endian uint32 ids) is refused too.

Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py): ``.bin`` is the tokens of every sequence,
one after another; ``.idx`` is the 9-byte magic ``MMIDIDX\\0\\0``, a little-endian uint64 version (1), a uint8 dtype
code (`MEGATRON_DTYPES`), uint64 sequence count S, uint64 count of document indices (documents + 1), then int32
sequence lengths [S], int64 byte offsets of the sequences in the ``.bin`` [S], and int64 document indices [documents
+ 1]: document d is sequences ``document_indices[d]`` up to ``document_indices[d + 1]``, starting from 0.
`MegatronWriter` writes one sequence per document, as Megatron-LM's ``preprocess_data.py`` does without sentence
splitting, in uint16 when every id is below 65,500 and in int32 otherwise (Megatron's ``optimal_dtype``).
"""

from __future__ import annotations

import codecs
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from terapipe_cli.errors import UserError, signals_held
from terapipe_cli.files import DISK_FULL, _umask, why_not_written

TOKEN_DTYPES = ("uint16", "uint32")  # what --token-dtype names: the ids of a headerless .bin

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
# Megatron-LM's DType enum: code -> numpy type (little-endian).
MEGATRON_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
MEGATRON_UINT16_BELOW = 65500  # Megatron's optimal_dtype: uint16 for a vocabulary below this, else int32
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices

LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
# llm.c's dev/data/data_common.py: magic -> (version, token type).
LLMC_FORMATS = {20240520: (1, "<u2"), 20240801: (7, "<u4")}

FORMAT_NAMES = {
    "megatron": "Megatron indexed (.bin + .idx)",
    "llm.c": "llm.c (.bin with header)",
    "npy": ".npy",
    "bin": "headerless .bin",
    "text": "text, read as bytes",
}

TEXT_SAMPLE_BYTES = 1 << 16
UINT32_SAMPLE_IDS = 1 << 15  # the uint16 ids at a headerless file's start checked for uint32 halves
UINT32_HIGH_BELOW = 16  # ... every second one below this: uint32 ids below 2^20 (`_uint32_hint`)
_SCAN = 1 << 24  # ids per chunk when a whole file is scanned (bounded memory, any file size)


@dataclass(frozen=True)
class Documents:
    """Where each document of a Megatron corpus starts, from its index (memory-mapped; the starts are computed
    when first asked for: a corpus may hold 10^8 documents)."""

    sequence_lengths: np.ndarray  # int32 [S]
    document_indices: np.ndarray  # int64 [documents + 1]

    def __len__(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @cached_property
    def starts(self) -> np.ndarray:
        """The position (in tokens) of every document's first token, int64 [documents]."""
        first = np.zeros(self.sequence_lengths.shape[0] + 1, np.int64)
        np.cumsum(self.sequence_lengths, out=first[1:])
        return first[self.document_indices[:-1]]

    def lengths(self) -> np.ndarray:
        """Every document's length in tokens, int64 [documents]."""
        return np.diff(self.starts, append=int(np.sum(self.sequence_lengths, dtype=np.int64)))

    def of(self, position: int) -> int:
        """The document holding token ``position``."""
        return int(np.searchsorted(self.starts, position, side="right")) - 1


@dataclass(frozen=True)
class TokenFile:
    """A data file opened: its ids (1-D, memory-mapped) and what its format records."""

    path: str  # as named (a Megatron corpus: its prefix)
    format: str  # a key of FORMAT_NAMES
    tokens: np.ndarray
    documents: Documents | None = None  # Megatron's document index; None where the format records none
    token_dtype: str | None = None  # the --token-dtype it was read with (a headerless .bin)

    @property
    def format_name(self) -> str:
        if self.format == "bin":
            return f"headerless .bin, --token-dtype {self.token_dtype}"
        return FORMAT_NAMES[self.format]


def open_token_file(path: str | Path, token_dtype: str | None = None) -> TokenFile:
    """Open a data file of any format (module docstring); one-line `UserError` naming the file when it cannot be
    used. ``token_dtype`` (uint16, uint32) is the type of a headerless ``.bin``'s ids; a file whose own header says
    another type is refused with it."""
    p = Path(path)
    where = str(p)
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise UserError(f"must be one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}", where="--token-dtype")
    try:
        kind, bin_path, idx_path = _locate(p)
        if kind == "bin":
            return _open_headerless(p, token_dtype)
        if kind == "megatron":
            data = _open_megatron(where, bin_path, idx_path)
        else:
            data = {"npy": _open_npy, "llm.c": _open_llmc, "text": _open_text}[kind](p)
    except UserError:
        raise
    except (OSError, ValueError) as e:  # numpy's own complaints about a damaged file
        raise UserError(f"cannot read data file ({e})", where=where) from None
    _check_own_type(data, token_dtype)
    return data


def _locate(p: Path) -> tuple[str, Path, Path | None]:
    """(format, the file holding the ids, the Megatron index or None)."""
    if p.suffix == ".idx":
        bin_path = p.with_suffix(".bin")
        if not p.exists():
            raise UserError("data file not found", where=str(p))
        if not bin_path.exists():
            raise UserError(f"a Megatron index without its data: {bin_path.name} is missing beside it", where=str(p))
        return "megatron", bin_path, p
    if not p.exists():
        bin_path, idx_path = Path(f"{p}.bin"), Path(f"{p}.idx")
        if bin_path.exists() and idx_path.exists():
            return "megatron", bin_path, idx_path
        if bin_path.exists() or idx_path.exists():
            missing = idx_path if bin_path.exists() else bin_path
            raise UserError(
                f"a Megatron corpus needs {bin_path.name} and {idx_path.name}: {missing} is missing", where=str(p)
            )
        raise UserError("data file not found", where=str(p))
    if p.is_dir():
        raise UserError("expected a data file, found a folder", where=str(p))
    if p.suffix == ".npy":
        return "npy", p, None
    if p.suffix != ".bin":
        return "text", p, None
    idx_path = p.with_suffix(".idx")
    if idx_path.exists():
        return "megatron", p, idx_path
    with open(p, "rb") as f:
        head = f.read(4)
    if len(head) == 4 and struct.unpack("<i", head)[0] in LLMC_FORMATS:
        return "llm.c", p, None
    return "bin", p, None


def files_of(path: str | Path) -> tuple[str, dict[str, Path]]:
    """(the format of the data file ``path``, the files holding it: its ids as "tokens", and a Megatron corpus's
    index as "index")."""
    kind, bin_path, idx_path = _locate(Path(path))
    return kind, {"tokens": bin_path} if idx_path is None else {"index": idx_path, "tokens": bin_path}


def names_token_ids(path: str | Path) -> bool:
    """Whether ``path`` names token ids rather than text, by its name alone (the file may be gone since): a .bin,
    .npy or .idx, or the prefix of a Megatron corpus."""
    return Path(path).suffix in (".bin", ".npy", ".idx") or Path(f"{path}.idx").exists()


def _check_own_type(data: TokenFile, token_dtype: str | None) -> None:
    """``--token-dtype`` is the type of a headerless .bin's ids; a file that records its own type must agree."""
    if token_dtype is None:
        return
    if data.format == "text":
        raise UserError(
            "--token-dtype is for a headerless .bin of token ids, and this file is read as text (bytes): leave it out",
            where=data.path,
        )
    own = data.tokens.dtype.name
    if own != token_dtype:
        raise UserError(
            f"its {FORMAT_NAMES[data.format]} header says {own} ids, not --token-dtype {token_dtype} (which is for a "
            "headerless .bin): leave --token-dtype out",
            where=data.path,
        )


def _open_megatron(where: str, bin_path: Path, idx_path: Path) -> TokenFile:
    index = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_path.stat().st_size else np.zeros(0, np.uint8)
    idx_where = str(idx_path)
    if index.shape[0] < _MEGATRON_HEADER.size or bytes(index[:9]) != MEGATRON_MAGIC:
        raise UserError(f"not a Megatron index (it does not start with {MEGATRON_MAGIC!r})", where=idx_where)
    _, version, code, sequences, indices = _MEGATRON_HEADER.unpack(bytes(index[: _MEGATRON_HEADER.size]))
    if version != MEGATRON_VERSION:
        raise UserError(f"Megatron index version {version}; only version {MEGATRON_VERSION} is known", where=idx_where)
    if code not in MEGATRON_DTYPES:
        raise UserError(f"dtype code {code} is none of Megatron's DType codes (1 to 8)", where=idx_where)
    dtype = np.dtype(MEGATRON_DTYPES[code])
    if np.issubdtype(dtype, np.floating):
        raise UserError(f"dtype code {code} ({dtype.name}) holds no token ids", where=idx_where)
    expected = _MEGATRON_HEADER.size + 4 * sequences + 8 * sequences + 8 * indices
    if index.shape[0] != expected:
        raise UserError(
            f"holds {index.shape[0]:,} bytes, but its header ({sequences:,} sequences, {indices:,} document indices) "
            f"makes {expected:,}",
            where=idx_where,
        )
    at = _MEGATRON_HEADER.size
    lengths = np.frombuffer(index, dtype="<i4", count=sequences, offset=at)
    pointers = np.frombuffer(index, dtype="<i8", count=sequences, offset=at + 4 * sequences)
    document_indices = np.frombuffer(index, dtype="<i8", count=indices, offset=at + 12 * sequences)
    total = _check_megatron_layout(lengths, pointers, document_indices, dtype.itemsize, idx_where)
    size = bin_path.stat().st_size
    if size != total * dtype.itemsize:
        raise UserError(
            f"holds {size:,} bytes, but its index ({idx_path.name}) describes {total:,} {dtype.name} ids "
            f"({total * dtype.itemsize:,} bytes)",
            where=str(bin_path),
        )
    tokens = np.memmap(bin_path, dtype=dtype, mode="r") if total else np.zeros(0, dtype)
    return TokenFile(where, "megatron", tokens, Documents(lengths, document_indices))


def _check_megatron_layout(
    lengths: np.ndarray, pointers: np.ndarray, document_indices: np.ndarray, itemsize: int, where: str
) -> int:
    """The sequences lie one after another from the .bin's start (as Megatron's builder writes them), and the
    document indices run from 0 to the last sequence without going back; the total of ids. Checked in chunks."""
    sequences = lengths.shape[0]
    total = 0
    for lo, hi in _chunks(sequences):
        size = np.asarray(lengths[lo:hi], dtype=np.int64)
        if size.size and size.min() < 0:
            bad = lo + int(np.argmax(size < 0))
            raise UserError(f"sequence {bad} has a negative length ({lengths[bad]})", where=where)
        expected = total * itemsize + np.concatenate(([0], np.cumsum(size[:-1]))) * itemsize
        found = np.asarray(pointers[lo:hi])
        if not np.array_equal(found, expected):
            bad = lo + int(np.argmax(found != expected))
            raise UserError(
                f"sequence {bad} starts at byte {pointers[bad]:,} of the .bin, not right after the one before it "
                f"(byte {expected[bad - lo]:,}): only sequences stored one after another are read",
                where=where,
            )
        total += int(size.sum())
    if document_indices.shape[0] == 0 or document_indices[0] != 0 or document_indices[-1] != sequences:
        ends = (int(document_indices[0]), int(document_indices[-1])) if document_indices.shape[0] else None
        raise UserError(
            f"its document indices must run from 0 to the sequence count {sequences:,}, found {ends}", where=where
        )
    for lo, hi in _chunks(document_indices.shape[0]):
        step = np.diff(np.asarray(document_indices[max(lo - 1, 0) : hi]))
        if step.size and step.min() < 0:
            raise UserError("its document indices go back (they must not decrease)", where=where)
    return total


def _open_llmc(p: Path) -> TokenFile:
    header = np.fromfile(p, dtype="<i4", count=LLMC_HEADER_INTS)
    if header.shape[0] < LLMC_HEADER_INTS:
        raise UserError(
            f"starts with llm.c's magic but is shorter than its {LLMC_HEADER_BYTES}-byte header", where=str(p)
        )
    magic, version, count = (int(v) for v in header[:3])
    known, token_type = LLMC_FORMATS[magic]
    if version != known:
        raise UserError(f"llm.c magic {magic} with version {version}; only version {known} is known", where=str(p))
    dtype = np.dtype(token_type)
    size = p.stat().st_size
    expected = LLMC_HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected:
        raise UserError(
            f"its llm.c header says {count:,} {dtype.name} ids ({expected:,} bytes with the header), but the file "
            f"holds {size:,} bytes",
            where=str(p),
        )
    tokens = (
        np.memmap(p, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,)) if count else np.zeros(0, dtype)
    )
    return TokenFile(str(p), "llm.c", tokens)


def _open_npy(p: Path) -> TokenFile:
    arr = np.load(p, mmap_mode="r", allow_pickle=False)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"a .npy token file must hold a 1-D integer array, got {arr.dtype} {arr.shape}", where=str(p))
    return TokenFile(str(p), "npy", arr)


def _open_headerless(p: Path, token_dtype: str | None) -> TokenFile:
    where, size = str(p), p.stat().st_size
    if token_dtype is None:
        raise UserError(
            "a .bin without a header (llm.c's) or a Megatron .idx beside it: say the type of its ids with "
            f"--token-dtype uint16 (nanoGPT's files) or --token-dtype uint32{_uint32_hint(p, size)}",
            where=where,
        )
    dtype = np.dtype(token_dtype).newbyteorder("<")
    if size % dtype.itemsize:
        raise UserError(
            f"holds {size:,} bytes, not a whole number of {token_dtype} ids ({dtype.itemsize} bytes each)", where=where
        )
    if token_dtype == "uint16" and _uint32_hint(p, size):
        raise UserError(
            "read as uint16 ids, every second one at its start is below 16: it holds uint32 ids; pass "
            "--token-dtype uint32",
            where=where,
        )
    tokens = np.memmap(p, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    return TokenFile(where, "bin", tokens, token_dtype=token_dtype)


def _uint32_hint(p: Path, size: int) -> str:
    """``"; it looks like uint32 ..."`` when the file's start, read as uint16, has a small id (below 16) at every
    second place, as little-endian uint32 ids below 2^20 have their high halves; else "". A uint16 stream of real
    text has such ids (bytes, control tokens) far too rarely for 16,384 of them in a row."""
    if size % 4 or size < 8:
        return ""
    sample = np.fromfile(p, dtype="<u2", count=min(size // 2, UINT32_SAMPLE_IDS))
    high, low = sample[1::2], sample[0::2]
    if high.max() >= UINT32_HIGH_BELOW or low.max() < UINT32_HIGH_BELOW:
        return ""
    return "; it looks like uint32: every second uint16 of its start is below 16"


def _open_text(p: Path) -> TokenFile:
    arr = np.memmap(p, dtype=np.uint8, mode="r") if p.stat().st_size else np.zeros(0, np.uint8)
    sample = bytes(arr[:TEXT_SAMPLE_BYTES])
    try:
        # Incremental, so that a character cut at the sample's end is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
        binary = b"\x00" in sample
    except UnicodeDecodeError:
        binary = True
    if binary:
        # Anything decodes as bytes: without this an image or an archive would train without a word.
        raise UserError(
            "does not look like text (not UTF-8, or NUL bytes): give a text file, or token ids (.bin, .npy, a "
            "Megatron corpus)",
            where=str(p),
        )
    return TokenFile(str(p), "text", arr)


def _chunks(n: int, size: int = _SCAN) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, size):
        yield lo, min(n, lo + size)


def id_range(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) id, scanned in chunks; (0, -1) for no ids."""
    low, high = None, None
    for lo, hi in _chunks(tokens.shape[0]):
        part = tokens[lo:hi]
        a, b = int(part.min()), int(part.max())
        low, high = a if low is None else min(low, a), b if high is None else max(high, b)
    return (0, -1) if low is None else (low, high)


def largest_id(data: TokenFile) -> int:
    """The file's largest id, every id scanned: one-line `UserError` for a file without ids or with a negative one."""
    if data.tokens.shape[0] == 0:
        raise UserError("data file is empty", where=data.path)
    try:
        low, high = id_range(data.tokens)
    except OSError as e:
        raise UserError(f"cannot read data file ({e})", where=data.path) from None
    if low < 0:
        raise UserError(f"token ids must not be negative, found {low}", where=data.path)
    return high


def first_at_least(tokens: np.ndarray, bound: int) -> int | None:
    """The position of the first id >= ``bound``, or None."""
    for lo, hi in _chunks(tokens.shape[0]):
        over = np.asarray(tokens[lo:hi]) >= bound
        if over.any():
            return lo + int(np.argmax(over))
    return None


def data_line(path: str, format_name: str, tokens: np.ndarray, documents: Documents | None, largest: int) -> str:
    """The one line a run prints about its data at start (and `terapipe data inspect` too): file, format, tokens,
    documents, type, largest id."""
    counted = "no document index" if documents is None else _count(len(documents), "document")
    return f"data: {path}: {format_name}, {_count(tokens.shape[0], 'token')}, {counted}, {tokens.dtype.name}, " + (
        f"largest id {largest:,}"
    )


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def vocab_problem(
    tokens: np.ndarray,
    vocab: int,
    largest: int,
    *,
    documents: Documents | None = None,
    format: str = "",
    start: int = 0,
) -> str | None:
    """What is wrong when ids reach ``vocab`` (``largest`` is the file's largest id): the first such id, its position
    in the file (``start``: the position of ``tokens[0]``) and document; None when all fit."""
    if largest < vocab:
        return None
    at = first_at_least(tokens, vocab) or 0
    found, at = int(tokens[at]), start + at
    document = f" (document {documents.of(at):,})" if documents is not None else ""
    hint = ""
    if format == "bin" and tokens.dtype.name == "uint32" and largest >= 1 << 16:
        hint = "; read as uint32: if the file holds uint16 ids, pass --token-dtype uint16"
    return (
        f"holds token id {found} at position {at:,}{document}, the first outside a vocabulary of {vocab} ids; its "
        f"largest id is {largest}{hint}"
    )


def megatron_dtype(vocab: int) -> np.dtype:
    """The type Megatron-LM stores the ids of a ``vocab``-id tokenizer in."""
    return np.dtype("<u2") if vocab < MEGATRON_UINT16_BELOW else np.dtype("<i4")


class MegatronWriter:
    """Writes a Megatron corpus ``PREFIX.bin`` + ``PREFIX.idx``, one sequence per document, through temporary files
    renamed into place by `commit` (the .idx last: a corpus whose .idx is there is whole); `discard` removes them.

    ``with MegatronWriter(prefix, dtype) as w: w.write(ids, lengths); ...; w.commit()``
    """

    def __init__(self, prefix: Path, dtype: np.dtype) -> None:
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        if self.dtype.name not in ("uint16", "int32"):
            raise ValueError(f"a Megatron corpus is written in uint16 or int32, not {self.dtype.name}")
        self.bin_path, self.idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
        self.lengths: list[np.ndarray] = []
        self.tokens = 0
        fd, self._bin_tmp = tempfile.mkstemp(dir=self.bin_path.parent, prefix=f".{self.bin_path.name}.", suffix=".tmp")
        self._bin = os.fdopen(fd, "wb")
        self._idx_tmp: str | None = None

    def write(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append ids, and the lengths of the documents that end among them (a document may run over several
        writes: its length counts all its ids)."""
        self._bin.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.lengths.append(np.asarray(lengths, dtype=np.int64))
        self.tokens += int(ids.shape[0])

    def commit(self, written: Callable[[Path, Path], None] | None = None) -> None:
        """Write the index and rename both files into place; ``written(bin, idx)`` is called with the complete
        temporary files before that (what describes the corpus, such as its fingerprint, is written there first)."""
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        if int(lengths.sum()) != self.tokens:
            raise ValueError(
                f"the documents' lengths add up to {int(lengths.sum())}, not the {self.tokens} ids written"
            )
        if lengths.size and lengths.max() >= 2**31:
            raise ValueError("a document of 2^31 tokens or more does not fit Megatron's int32 lengths")
        code = next(c for c, t in MEGATRON_DTYPES.items() if np.dtype(t) == self.dtype)
        pointers = np.zeros(lengths.shape[0], np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(lengths.shape[0] + 1, dtype=np.int64)  # document d is sequence d
        self._finish(self._bin)
        fd, self._idx_tmp = tempfile.mkstemp(dir=self.idx_path.parent, prefix=f".{self.idx_path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(_MEGATRON_HEADER.pack(MEGATRON_MAGIC, MEGATRON_VERSION, code, lengths.shape[0], documents.shape[0]))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
            self._finish(f)
        if written is not None:
            written(Path(self._bin_tmp), Path(self._idx_tmp))
        mode = 0o666 & ~_umask()
        for tmp in (self._bin_tmp, self._idx_tmp):
            os.chmod(tmp, mode)
        self.idx_path.unlink(missing_ok=True)  # never an old index beside the new data, even for a moment
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        self._bin_tmp = self._idx_tmp = None

    def discard(self) -> None:
        with signals_held():  # a signal now (the one that stopped the writing, again) waits for the files to go
            if not self._bin.closed:
                self._bin.close()
            for tmp in (self._bin_tmp, self._idx_tmp):
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)

    @staticmethod
    def _finish(f) -> None:
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def __enter__(self) -> MegatronWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.discard()  # after commit: nothing left to remove
        if isinstance(error, OSError) and error.errno in DISK_FULL:  # the files are gone: one line, not a traceback
            raise UserError(f"{why_not_written(error)} while the corpus was written; nothing was written",
                            where=str(self.bin_path)) from None  # fmt: skip
