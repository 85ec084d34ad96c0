"""`terapipe train` on a Megatron corpus of short documents: the document mask is on by default (the corpus records
its documents), the run keeps it, and ``--verify`` through real torchrun workers (K = 2, token slices crossing the
documents) equals the single-device model with the same mask. The scheme families, precisions and the negative
control run in one process (tests/engine/test_documents.py)."""

from __future__ import annotations

import json

import numpy as np
from conftest import run_cli, write_plan_file

from terapipe_cli.corpus.formats import MegatronWriter
from terapipe_cli.train.rundir import read_summary


def short_documents_corpus(prefix, *, documents: int = 400, seed: int = 0) -> None:
    """Byte-sized ids (vocab 256) in documents of 4-20 tokens, each ending with id 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 21, size=documents)
    ids = np.concatenate([np.append(rng.integers(1, 256, size=n - 1), 0) for n in lengths]).astype(np.uint16)
    with MegatronWriter(prefix, np.dtype(np.uint16)) as writer:
        writer.write(ids, lengths)
        writer.commit()


def test_a_megatron_corpus_trains_with_its_documents_masked_and_verifies(tmp_path, capfd):
    short_documents_corpus(tmp_path / "docs")
    plan = write_plan_file(tmp_path / "plan.json", [(1, [10, 22]), (1, [20, 12])], stages=2, layers=4)
    out = tmp_path / "run"
    p = run_cli(
        capfd,
        "train", "--plan", plan, "--data", tmp_path / "docs", "--steps", "2", "--out", out, "--verify",
        "--device", "cpu",
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert read_summary(out)["verify"]["ok"] is True
    arguments = json.loads((out / "config.json").read_text())["arguments"]
    assert arguments["document_mask"] is True and arguments["eos_id"] is None
