"""What a data file is beyond its ids: its contents (`fingerprint`) and the tokenizer that made them (`Vocabulary`).

A fingerprint is cheap at any size: the format, each file's size, and a SHA-256 of the whole file when it holds at
most `WHOLE_BELOW` bytes, else of `SAMPLE_BLOCKS` blocks of `BLOCK_BYTES` spread evenly over it, the first and the
last among them (a multi-GB file is never read whole). A Megatron corpus has two files, its index (.idx) and its
tokens (.bin); every other format one. `terapipe data tokenize` writes the corpus's fingerprint into its summary; a
run keeps the fingerprint of each of its data files (`RunArguments.data_fingerprints`) and ``--resume`` compares
them with the files found then (`fingerprint_change`). A sample catches a corpus replaced, re-tokenized, grown or cut;
an id edited in place between the sampled blocks of a large file it does not.

A `Vocabulary` says whose ids a file holds, as far as the file tells: text read as bytes (256 ids), a corpus of
`terapipe data tokenize` (its ``tokenizer.json``'s SHA-256 and its vocabulary, from its summary), an llm.c file (its
header's magic names GPT-2's or Llama 3's tokenizer), or nothing beyond its largest id (a .npy, a headerless .bin, a
Megatron corpus made elsewhere). `check_together` refuses sources that cannot feed one model's embedding: two
tokenizers, two vocabulary sizes (text's 256 among them), or an id beyond another source's vocabulary.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from terapipe_cli.corpus.formats import FORMAT_NAMES, files_of
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_json

WHOLE_BELOW = 1 << 24  # a file up to 16 MiB is hashed whole
SAMPLE_BLOCKS = 64  # ... a larger one by 64 blocks of 16 KiB: 1 MiB read, whatever its size
BLOCK_BYTES = 1 << 14
_READ = 1 << 20

# llm.c's header magic -> the tokenizer its ids are (dev/data/data_common.py) and that tokenizer's ids.
LLMC_TOKENIZERS = {20240520: ("GPT-2", 50257), 20240801: ("Llama 3", 128256)}
BYTES = 256  # text is read as bytes
SUMMARY_SCHEMA = "terapipe.corpus/1"  # a corpus's PREFIX.json, `terapipe data tokenize`'s summary


def file_fingerprint(path: Path) -> dict:
    """``{"bytes": size, "sha256": hex}`` of one file: the whole file's hash, or its sample's (module docstring)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_BELOW:
            for chunk in iter(lambda: f.read(_READ), b""):
                digest.update(chunk)
        else:
            for k in range(SAMPLE_BLOCKS):
                f.seek((size - BLOCK_BYTES) * k // (SAMPLE_BLOCKS - 1))
                digest.update(f.read(BLOCK_BYTES))
    return {"bytes": size, "sha256": digest.hexdigest()}


def fingerprint_files(format: str, files: dict[str, Path]) -> dict:
    """The fingerprint of a data file of ``format`` held by ``files`` (role -> file: "index", "tokens")."""
    return {"format": format, **{role: file_fingerprint(Path(p)) for role, p in files.items()}}


def fingerprint(path: str | Path) -> dict:
    """The fingerprint of the data file ``path`` (any format `corpus.formats` reads)."""
    try:
        return fingerprint_files(*files_of(path))
    except OSError as e:
        raise UserError(f"cannot read data file ({e})", where=str(path)) from None


def fingerprint_change(kept: dict, found: dict) -> str | None:
    """What differs between a fingerprint ``kept`` and the one ``found`` now, in words; None when they agree."""
    if kept == found:
        return None
    was, now = kept.get("format"), found.get("format")
    if was != now:
        return f"it reads as {FORMAT_NAMES.get(now, now)} now, as {FORMAT_NAMES.get(was, was)} before"
    differ = [role for role in ("tokens", "index") if kept.get(role) != found.get(role)]
    if not differ:
        return "its fingerprint differs"
    names = {"index": "index (.idx)", "tokens": "tokens (.bin)"} if was == "megatron" else {"tokens": "file"}
    for role in differ:  # a size that changed says more than a checksum
        a, b = kept.get(role), found.get(role)
        if a is None or b is None:
            return f"its {names[role]} is {'new' if a is None else 'gone'}"
        if a.get("bytes") != b.get("bytes"):
            return f"its {names[role]} holds {b['bytes']:,} bytes, {a['bytes']:,} before"
    role = differ[0]
    sampled = " (of a sample)" if found[role]["bytes"] > WHOLE_BELOW else ""
    return f"its {names[role]} has the same size but other contents: its checksum{sampled} differs"


@dataclass(frozen=True)
class Vocabulary:
    """Whose ids a data file holds, as far as it tells (module docstring)."""

    path: str
    tokenizer: str | None  # "sha256:HEX" of a tokenizer.json, or "llm.c:GPT-2": equal strings, the same tokenizer
    named: str  # the tokenizer in words, for a message: its tokenizer.json, "GPT-2's, by its llm.c header"
    size: int | None  # the ids its tokenizer has
    largest: int | None  # the file's largest id (None: not scanned)


def vocabulary_of(path: str, format: str, largest: int | None = None, found: dict | None = None) -> Vocabulary:
    """The `Vocabulary` of the data file ``path`` read as ``format`` (a `formats.FORMAT_NAMES` key); ``found``: its
    fingerprint, when computed already. A corpus summary that describes other files than the corpus's own (another
    fingerprint) is one line: its tokenizer is not these ids'."""
    if format == "text":
        return Vocabulary(path, "bytes", "bytes, as text is read", BYTES, largest)
    if format == "llm.c":
        with open(files_of(path)[1]["tokens"], "rb") as f:
            magic = struct.unpack("<i", f.read(4))[0]
        name, size = LLMC_TOKENIZERS[magic]
        return Vocabulary(path, f"llm.c:{name}", f"{name}'s, by its llm.c header", size, largest)
    if format == "megatron":
        prefix = corpus_prefix(Path(path))
        summary = read_summary(prefix)
        if summary is not None:
            files = corpus_files(prefix)
            recorded = summary.get("fingerprint")
            if recorded is not None:
                change = fingerprint_change(recorded, found if found is not None else fingerprint(path))
                if change is not None:
                    raise UserError(
                        f"{files['summary']} describes other data than this corpus ({change}): its tokenizer is not "
                        f"these ids'; tokenize the corpus again, or remove {files['summary'].name} and "
                        f"{files['tokenizer'].name}/",
                        where=path,
                    )
            digest = summary.get("tokenizer_sha256") or tokenizer_digest(files["tokenizer"] / "tokenizer.json")
            named = f"{files['tokenizer'] / 'tokenizer.json'}"
            return Vocabulary(path, digest, named, int(summary["vocab"]), largest)
    return Vocabulary(path, None, "", None, largest)


def tokenizer_digest(path: Path) -> str | None:
    """``sha256:HEX`` of a tokenizer.json (None when there is none): the file that decides every id."""
    if not path.is_file():
        return None
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def check_together(vocabularies: list[Vocabulary], *, where: str = "data") -> None:
    """Sources that one model trains on together must be ids of one tokenizer: not two tokenizers known to differ
    (the same kind of identity: two tokenizer.json files, two llm.c headers), not two vocabulary sizes (text is 256
    byte ids), and no id beyond a vocabulary another source declares (a file that names no tokenizer mixes with text
    only when its ids are below 256). One line naming both sources."""
    for a, b in combinations(vocabularies, 2):
        if a.tokenizer and b.tokenizer and a.tokenizer.split(":")[0] == b.tokenizer.split(":")[0]:
            if a.tokenizer != b.tokenizer:
                raise UserError(
                    f"{a.path} and {b.path} were made by different tokenizers ({a.named} and {b.named} differ): "
                    "sources trained together must be ids of one tokenizer",
                    where=where,
                )
        if a.size is not None and b.size is not None and a.size != b.size:
            raise UserError(
                f"{a.path} holds ids of a tokenizer of {a.size:,} ({a.named}), {b.path} of one of {b.size:,} "
                f"({b.named}): sources trained together must be ids of one tokenizer",
                where=where,
            )
    declared = [v for v in vocabularies if v.size is not None]
    if not declared:
        return
    least = min(declared, key=lambda v: v.size)
    for v in vocabularies:
        if v is least or (v.tokenizer is not None and v.tokenizer == least.tokenizer):
            continue  # ids beyond a file's own header's tokenizer: only the model's vocabulary judges them
        if v.largest is not None and v.largest >= least.size:
            raise UserError(
                f"{v.path} holds id {v.largest:,}, outside the {least.size:,} ids of {least.path}'s tokenizer "
                f"({least.named}): sources trained together must be ids of one tokenizer",
                where=where,
            )


def identify_sources(files: list) -> dict[str, dict]:
    """The fingerprint of each data file a run trains or validates on (path -> `fingerprint`), once they are checked
    to be ids of one tokenizer (`check_together`). ``files``: each with ``path``, ``format`` and ``max_token`` (an
    `engine.data.TokenData`)."""
    prints = {f.path: fingerprint(f.path) for f in files}
    check_together([vocabulary_of(f.path, f.format, f.max_token, prints[f.path]) for f in files])
    return prints


def check_unchanged(kept: dict[str, dict] | None, paths: list[str]) -> tuple[str | None, dict[str, dict]]:
    """A resumed run's data files (``paths``) against the fingerprints it ``kept``: one line naming the first that
    differs. (a warning to print or None, the fingerprints the run keeps from now on): a run that kept none (it began
    before runs kept them) is warned about and keeps the files' fingerprints as found, for the resumes after."""
    if kept is None:
        if not paths:
            return None, {}
        warning = (
            f"the run keeps no fingerprint of its data (it began before runs kept one): {', '.join(paths)} not "
            "checked to be the data it trained on (kept from now on)"
        )
        return warning, {path: fingerprint(path) for path in paths}
    for path, was in kept.items():
        change = fingerprint_change(was, fingerprint(path))
        if change is not None:
            raise UserError(
                f"is not the data the run trained on: {change}; a resumed run trains on the same data (put it back, "
                "or start a new run with --out)",
                where=path,
            )
    return None, kept


def corpus_prefix(out: Path) -> Path:
    """``--out`` as a corpus prefix (``data/c.bin`` or ``data/c.idx`` name ``data/c``, as Megatron names it)."""
    return out.with_suffix("") if out.suffix in (".bin", ".idx") else out


def corpus_files(prefix: Path) -> dict[str, Path]:
    return {
        "bin": Path(f"{prefix}.bin"),
        "idx": Path(f"{prefix}.idx"),
        "summary": Path(f"{prefix}.json"),
        "tokenizer": Path(f"{prefix}.tokenizer"),
    }


def read_summary(prefix: Path) -> dict | None:
    """A corpus's ``PREFIX.json`` (validated), or None when there is none or it is not a corpus summary."""
    path = corpus_files(prefix)["summary"]
    if not path.is_file():
        return None
    try:
        obj = read_json(path, what="corpus summary")
    except UserError:
        return None
    if obj.get("schema") != SUMMARY_SCHEMA:
        return None
    f = Fields(obj, str(path))
    for key in ("documents", "tokens", "vocab"):
        f.int(key, minimum=0)
    f.int("max_token", minimum=-1)
    f.str("dtype")
    f.str("tokenizer")
    f.sub("eos").str("token")
    return obj
