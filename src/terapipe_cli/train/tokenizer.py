"""A run's own tokenizer: recorded in its folder at the start, read by ``terapipe sample`` and written into the
``transformers`` folder of ``terapipe export --format hf``.

A run on a corpus made by ``terapipe data tokenize`` copies the corpus's tokenizer (``CORPUS.tokenizer/``: its
``tokenizer.json`` and the config files beside it) and the corpus summary (``CORPUS.json``: the EOS id, the template's
prefix ids) into ``RUN/tokenizer/`` when the run folder is written, so the run decodes with the tokenizer that made its
ids even once the corpus has moved. A run on text (bytes) or on a token file that names no tokenizer records none and
keeps working as before (`train.sample`'s byte tokenizer; GPT-2's BPE through tiktoken).

Special ids: EOS is the corpus's (the id that ends every document); BOS is the first id of its template's prefix when
the tokenizer has one (Llama 3's ``<|begin_of_text|>``), else the EOS id (GPT-2's ``<|endoftext|>`` is both).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

RUN_TOKENIZER = "tokenizer"  # RUN/tokenizer/: the run's own tokenizer files
CORPUS_SUMMARY = "corpus.json"  # RUN/tokenizer/corpus.json: the corpus summary it came with


@dataclass(frozen=True)
class RunTokenizer:
    """Where a run's tokenizer files are, and its special ids."""

    folder: Path  # holds tokenizer.json
    eos_id: int | None
    bos_id: int | None
    eos: str | None  # the EOS token's text

    @property
    def file(self) -> Path:
        return self.folder / "tokenizer.json"


def corpus_tokenizer_folder(data: str | None) -> Path | None:
    """The tokenizer folder ``terapipe data tokenize`` copied beside the corpus ``data``, if there is one."""
    if data is None:
        return None
    from terapipe_cli.corpus.identity import corpus_files, corpus_prefix

    folder = corpus_files(corpus_prefix(Path(data)))["tokenizer"]
    return folder if (folder / "tokenizer.json").is_file() else None


def record_tokenizer(run_dir: Path, data: str | None) -> None:
    """Copy the corpus's tokenizer and its summary into ``RUN/tokenizer/`` (nothing for a corpus without one)."""
    folder = corpus_tokenizer_folder(data)
    if folder is None:
        return
    from terapipe_cli.corpus.identity import corpus_prefix, read_summary

    target = run_dir / RUN_TOKENIZER
    target.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file():
            shutil.copyfile(f, target / f.name)
    summary = read_summary(corpus_prefix(Path(data)))
    if summary is not None:
        (target / CORPUS_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")


def run_tokenizer_files(run_dir: Path | None, data: str | None) -> RunTokenizer | None:
    """The run's tokenizer: its own copy in ``RUN/tokenizer/``, else the one beside its corpus (a run from before
    runs recorded theirs); None for a run whose data names no tokenizer."""
    folder, summary = None, None
    if run_dir is not None and (run_dir / RUN_TOKENIZER / "tokenizer.json").is_file():
        folder = run_dir / RUN_TOKENIZER
        path = folder / CORPUS_SUMMARY
        summary = json.loads(path.read_text()) if path.is_file() else None
    else:
        folder = corpus_tokenizer_folder(data)
        if folder is None:
            return None
        from terapipe_cli.corpus.identity import corpus_prefix, read_summary

        summary = read_summary(corpus_prefix(Path(data)))
    eos = (summary or {}).get("eos") or {}
    eos_id = eos.get("id")
    prefix = (summary or {}).get("prefix_ids") or []
    return RunTokenizer(folder, eos_id, prefix[0] if prefix else eos_id, eos.get("token"))


def write_hf_tokenizer(out: Path, tok: RunTokenizer, *, seq_len: int) -> None:
    """The tokenizer files of a ``transformers`` folder, so that ``AutoTokenizer.from_pretrained(out)`` loads the
    run's tokenizer: its ``tokenizer.json``, and a ``tokenizer_config.json`` (the original's settings, if it came
    with one, with the fast tokenizer's class and the run's special tokens)."""
    shutil.copyfile(tok.file, out / "tokenizer.json")
    source = tok.folder / "tokenizer_config.json"
    config = json.loads(source.read_text()) if source.is_file() else {}
    config.pop("auto_map", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # reads tokenizer.json alone, whatever made it
    config["model_max_length"] = seq_len
    names = _token_names(tok)
    for key, name in names.items():
        if name is not None:
            config[key] = name
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _token_names(tok: RunTokenizer) -> dict[str, str | None]:
    """The texts of the BOS and EOS tokens, from the tokenizer's own vocabulary."""
    from terapipe_cli.extras import require

    tokenizers = require("tokenizers", where=f"the run's tokenizer ({tok.folder})")
    t = tokenizers.Tokenizer.from_file(str(tok.file))
    return {
        "eos_token": t.id_to_token(tok.eos_id) if tok.eos_id is not None else None,
        "bos_token": t.id_to_token(tok.bos_id) if tok.bos_id is not None else None,
    }
