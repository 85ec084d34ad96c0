"""``terapipe data``: ``tokenize`` text into a Megatron corpus (corpus/tokenize.py), ``inspect`` any data file."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.table import Table

from terapipe_cli import units
from terapipe_cli.cli.console import ProgressBar, make_console
from terapipe_cli.corpus import formats
from terapipe_cli.errors import UserError

HELP = "Prepare training data: tokenize text into a corpus, or inspect any data file terapipe train reads."

TOKENIZE_HELP = """Tokenize text, JSON Lines or Parquet with a Hugging Face tokenizer into a Megatron-LM corpus.

The tokenizer is a tokenizer.json, or a transformers model folder holding one (nothing is downloaded). Writes \
CORPUS.bin + CORPUS.idx (Megatron-LM's indexed dataset: uint16 for fewer than 65,500 ids, else int32), \
CORPUS.json (the summary) and CORPUS.tokenizer/ (the tokenizer, copied); `terapipe train --data CORPUS` reads it.

Every document gets the special tokens the tokenizer's own template adds (Llama 3's <|begin_of_text|>) and the EOS \
id after it: the eos_token of the folder's tokenizer_config.json, or --eos. A JSON Lines record (--field) or a \
Parquet row (needs pyarrow) is a document; a text file is one, or one per line or paragraph with --split. Needs \
pip install 'terapipe-cli\\[data]'.

Examples:

    terapipe data tokenize books/*.txt --tokenizer llama3/ --out data/books

    terapipe data tokenize web.jsonl --tokenizer gpt2.json --eos '<|endoftext|>' --out data/web

    terapipe data tokenize wiki.parquet --field text --tokenizer llama3/ --out data/wiki

    terapipe data tokenize notes.txt --split line --tokenizer llama3/ --out data/notes
"""

CONTENTS_HELP = """Print what a data file holds, read as terapipe train reads it: format, tokens, documents, type, \
largest id.

Every format train reads: a Megatron corpus (PREFIX, or its .bin or .idx), an llm.c .bin (256-int32 header), a .npy \
of integers, a headerless .bin with --token-dtype uint16|uint32, or text (read as bytes). For a corpus from \
terapipe data tokenize, also its tokenizer and the start of its first document, decoded.

Examples:

    terapipe data inspect data/books

    terapipe data inspect fineweb_train_000001.bin

    terapipe data inspect train.bin --token-dtype uint16 --vocab 50257
"""

app = typer.Typer(name="data", help=HELP, no_args_is_help=True, rich_markup_mode="rich")


@app.command("tokenize", help=TOKENIZE_HELP)
def tokenize(
    inputs: Annotated[
        list[Path], typer.Argument(help="Text, JSON Lines (.jsonl) or Parquet files.", show_default=False)
    ],
    tokenizer: Annotated[
        Path,
        typer.Option(
            "--tokenizer", help="A tokenizer.json, or a transformers model folder holding one.", show_default=False
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="The corpus: writes OUT.bin, OUT.idx, OUT.json, OUT.tokenizer/.", show_default=False
        ),
    ],
    field: Annotated[
        str, typer.Option("--field", help="The text's field in JSON Lines, its column in Parquet.")
    ] = "text",
    split: Annotated[
        str,
        typer.Option("--split", help="A text file's documents: file (the whole file), line (each line) or paragraph."),
    ] = "file",
    eos: Annotated[
        str | None,
        typer.Option("--eos", help="The token after every document.", show_default="the tokenizer config's eos_token"),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite existing files that are not a terapipe corpus.")
    ] = False,
) -> None:
    from terapipe_cli.corpus import tokenize as tokenizing

    tokenizing.check_inputs(inputs, field=field, split=split)
    prefix = tokenizing.check_corpus_out(out, force=force)
    tok = tokenizing.load_tokenizer(tokenizer, eos)
    console = make_console(highlight=False)
    total = sum(p.stat().st_size for p in inputs)
    console.print(
        f"tokenizing {len(inputs)} file{'s' * (len(inputs) != 1)} ({units.format_bytes(total)}) with {tok.files[0]} "
        f"({tok.vocab:,} ids) -> {prefix}.bin + .idx",
        soft_wrap=True,
    )
    made_folder = not prefix.parent.exists()
    try:
        with ProgressBar(console) as update:
            summary = tokenizing.tokenize_corpus(
                inputs, tok, prefix, field=field, split=split,
                progress=lambda done, all_: update("tokenizing", done, all_),
            )  # fmt: skip
    except BaseException:
        if made_folder:  # nothing left behind, not even the folder made for the corpus (rmdir: only when empty)
            with contextlib.suppress(OSError):
                prefix.parent.rmdir()
        raise
    _print_summary(console, summary, tok, prefix)


def _print_summary(console, summary, tok, prefix: Path) -> None:
    """The corpus written: its documents, tokens, largest id, per-document template, tokenizer copy and speed."""
    table = Table(title=f"corpus {prefix}", show_header=False)
    rate = summary.input_bytes / summary.seconds / 1e6 if summary.seconds > 0 else 0.0
    rows = [
        (
            "documents",
            f"{summary.documents:,}" + (f" ({summary.skipped:,} empty, left out)" if summary.skipped else ""),
        ),
        ("tokens", f"{summary.tokens:,} ({summary.dtype})"),
        ("largest id", f"{summary.max_token:,} of {summary.vocab:,}"),
        ("per document", _template_text(tok)),
        ("tokenizer", f"{prefix.parent / summary.tokenizer}/"),
        ("took", f"{summary.seconds:.1f} s ({rate:.1f} MB/s)"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    console.print(f"wrote [bold]{prefix}.bin[/bold], .idx, .json; train on it with --data {prefix}", soft_wrap=True)


def _template_text(tok) -> str:
    names = [tok.tokenizer.id_to_token(i) for i in tok.prefix]
    after = [tok.tokenizer.id_to_token(i) for i in tok.suffix]
    return " ".join([*names, "TEXT", *after])


@app.command("inspect", help=CONTENTS_HELP)
def inspect_data(
    corpus: Annotated[Path, typer.Argument(help="A data file or Megatron corpus prefix.", show_default=False)],
    token_dtype: Annotated[
        str | None, typer.Option("--token-dtype", help="The ids' type of a headerless .bin: uint16 or uint32.")
    ] = None,
    vocab: Annotated[
        int | None, typer.Option("--vocab", help="Check that every id fits a vocabulary of this many ids.")
    ] = None,
) -> None:
    if vocab is not None and vocab < 1:
        raise UserError(f"must be at least 1, got {vocab}", where="--vocab")
    opened = formats.open_token_file(corpus, token_dtype)
    high = formats.largest_id(opened)
    console = make_console(highlight=False)
    console.print(
        formats.data_line(opened.path, opened.format_name, opened.tokens, opened.documents, high), soft_wrap=True
    )
    if opened.documents is not None and len(opened.documents):
        lengths = opened.documents.lengths()
        console.print(
            f"document lengths: min {int(lengths.min()):,}, median {int(np.median(lengths)):,}, "
            f"max {int(lengths.max()):,} tokens"
        )
    summary = _corpus_summary(opened)
    if summary is not None:
        folder = Path(opened.path).parent / summary["tokenizer"]
        console.print(
            f"tokenizer: {folder}/ ({summary['vocab']:,} ids, EOS {summary['eos']['token']!r}); made from "
            f"{len(summary['inputs'])} input file(s) on {summary['created']}",
            soft_wrap=True,
        )
        beginning = _first_document(folder, opened.tokens)
        if beginning is not None:
            console.print(f"begins: {beginning!r}", soft_wrap=True)
    if vocab is not None:
        problem = formats.vocab_problem(opened.tokens, vocab, high, documents=opened.documents, format=opened.format)
        if problem is not None:
            raise UserError(f"{problem} (--vocab)", where=opened.path)
        console.print(f"every id fits a vocabulary of {vocab:,}")


def _corpus_summary(opened: formats.TokenFile) -> dict | None:
    if opened.format != "megatron":
        return None
    from terapipe_cli.corpus.identity import corpus_prefix, read_summary

    return read_summary(corpus_prefix(Path(opened.path)))


def _first_document(folder: Path, tokens) -> str | None:
    """The start of the corpus decoded with its own tokenizer (None without the `tokenizers` package, or when the
    copied tokenizer cannot be read)."""
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return tokenizer.decode([int(t) for t in tokens[:64]], skip_special_tokens=False)[:160]
    except Exception:  # ImportError, a missing or damaged file: the summary above is still right
        return None


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="data")
