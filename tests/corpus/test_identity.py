"""A data file's fingerprint (a small file hashed whole, a large one by a sample; what differs, in words) and the check
that sources trained together are ids of one tokenizer (`corpus.identity`)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from terapipe_cli.corpus import identity
from terapipe_cli.corpus.formats import MegatronWriter
from terapipe_cli.corpus.identity import (
    Vocabulary,
    check_together,
    check_unchanged,
    fingerprint,
    fingerprint_change,
    vocabulary_of,
)
from terapipe_cli.errors import UserError


def poke(path, at: int) -> None:
    """Change one byte of ``path`` in place (its size unchanged)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


def test_a_fingerprint_hashes_a_small_file_whole_and_samples_a_large_one(tmp_path, monkeypatch):
    ids = np.arange(10_000, dtype="<u2")
    ids.tofile(tmp_path / "t.bin")
    kept = fingerprint(tmp_path / "t.bin")
    assert kept == {"format": "bin", "tokens": {"bytes": 20_000, "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}}
    poke(tmp_path / "t.bin", 10_001)
    change = fingerprint_change(kept, fingerprint(tmp_path / "t.bin"))
    assert change == "its file has the same size but other contents: its checksum differs"
    # Made "large": 64 blocks of 64 bytes, about 316 bytes apart, are hashed; a change between two goes unseen (the
    # price of never reading a multi-GB file whole), one inside a block or of the size does not.
    monkeypatch.setattr(identity, "WHOLE_BELOW", 4096)
    monkeypatch.setattr(identity, "BLOCK_BYTES", 64)
    kept = fingerprint(tmp_path / "t.bin")
    poke(tmp_path / "t.bin", 100)
    assert fingerprint(tmp_path / "t.bin") == kept
    poke(tmp_path / "t.bin", 20_000 - 1)  # the last block
    assert "checksum (of a sample) differs" in fingerprint_change(kept, fingerprint(tmp_path / "t.bin"))
    with open(tmp_path / "t.bin", "ab") as f:
        f.write(b"\0\0")
    assert fingerprint_change(kept, fingerprint(tmp_path / "t.bin")) == "its file holds 20,002 bytes, 20,000 before"


def test_a_megatron_fingerprint_names_its_index_or_its_tokens(tmp_path):
    def corpus(lengths):
        with MegatronWriter(tmp_path / "c", np.dtype(np.uint16)) as w:
            w.write(np.arange(sum(lengths), dtype=np.uint16) % 200, np.array(lengths))
            w.commit()
        return fingerprint(tmp_path / "c")

    kept = corpus([3, 5])
    assert set(kept) == {"format", "index", "tokens"}
    assert fingerprint(tmp_path / "c.idx") == fingerprint(tmp_path / "c.bin") == kept
    assert fingerprint_change(kept, corpus([5, 3])).startswith("its index (.idx) has the same size but other")
    assert fingerprint_change(kept, corpus([3, 6])) == "its tokens (.bin) holds 18 bytes, 16 before"
    np.arange(8, dtype="<u2").tofile(tmp_path / "c.bin")
    (tmp_path / "c.idx").unlink()  # now a headerless .bin
    assert fingerprint_change(kept, fingerprint(tmp_path / "c.bin")).startswith("it reads as headerless .bin now")


def vocab(path, tokenizer=None, size=None, largest=None):
    return Vocabulary(path, tokenizer, f"{path}'s tokenizer", size, largest)


@pytest.mark.parametrize(
    "sources, words",
    [
        ([vocab("a", "sha256:1", 1000), vocab("b", "sha256:2", 1000)], ["a and b", "different tokenizers"]),
        ([vocab("a", "llm.c:GPT-2", 50257), vocab("b", "llm.c:Llama 3", 128256)], ["different tokenizers"]),
        ([vocab("a", "sha256:1", 1000), vocab("b", "llm.c:GPT-2", 50257)], ["tokenizer of 1,000", "one of 50,257"]),
        ([vocab("a", "sha256:1", 1000), vocab("n.npy", largest=1000)], ["n.npy holds id 1,000", "1,000 ids of a"]),
        ([vocab("t.txt", "bytes", 256, 120), vocab("n.npy", largest=300)], ["n.npy holds id 300", "256 ids"]),
        ([vocab("t.txt", "bytes", 256, 120), vocab("a", "sha256:1", 1000, 900)], ["tokenizer of 256"]),
    ],
)
def test_sources_of_two_tokenizers_are_refused(sources, words):
    with pytest.raises(UserError) as e:
        check_together(sources)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_sources_of_one_tokenizer_or_unknown_ones_that_fit_pass(tmp_path):
    check_together([vocab("a", "sha256:1", 1000, 999), vocab("b", "sha256:1", 1000), vocab("n.npy", largest=999)])
    check_together([vocab("t.txt", "bytes", 256, 120), vocab("n.npy", largest=255)])
    check_together([vocab("a", "sha256:1", 50257), vocab("g.bin", "llm.c:GPT-2", 50257)])  # two kinds of identity
    check_together([vocab("n.npy", largest=10**6), vocab("m.npy", largest=3)])  # nothing known: the model's vocab
    check_together([vocab("g.bin", "llm.c:GPT-2", 50257, 60_000)])  # one source: its header's guess is no check
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240801, 7, 2
    (tmp_path / "l.bin").write_bytes(header.tobytes() + np.array([1, 2], dtype="<u4").tobytes())
    assert vocabulary_of(str(tmp_path / "l.bin"), "llm.c").tokenizer == "llm.c:Llama 3"
    assert vocabulary_of(str(tmp_path / "l.bin"), "llm.c").size == 128256


def test_a_resume_checks_the_fingerprints_kept_or_starts_keeping_them(tmp_path):
    np.arange(100, dtype="<u2").tofile(tmp_path / "t.bin")
    path = str(tmp_path / "t.bin")
    warning, kept = check_unchanged(None, [path])  # a run from before runs kept fingerprints
    assert "keeps no fingerprint" in warning and kept == {path: fingerprint(path)}
    assert check_unchanged(kept, [path]) == (None, kept)
    np.arange(101, dtype="<u2").tofile(tmp_path / "t.bin")
    with pytest.raises(UserError, match="t.bin: is not the data the run trained on: its file holds 202 bytes"):
        check_unchanged(kept, [path])
    assert check_unchanged(None, []) == (None, {})  # the embedded text: nothing to check
