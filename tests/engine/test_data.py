"""Token data, step batches, the embedded data set, and checkpoint completeness (no workers needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from terapipe_cli.engine.data import check_data, default_data_path, generate_default_text, load_data, step_batch
from terapipe_cli.errors import UserError
from terapipe_cli.train import checkpoint


def test_embedded_data_is_the_generators_output():
    assert default_data_path().read_text() == generate_default_text()


def test_text_bin_and_npy_files(tmp_path):
    text = tmp_path / "a.txt"
    raw = ("tiny stories, naïve café ✓\n" * 8).encode()
    text.write_bytes(raw)
    d = load_data(text)
    assert d.kind == "text" and len(d) == len(raw) and d.max_token == max(raw)
    ids = np.array([5, 300, 7, 9], dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids)
    for name in ("t.bin", "t.npy"):
        d = load_data(tmp_path / name, "uint16" if name.endswith(".bin") else None)  # a headerless .bin: its type
        assert d.kind == "tokens" and list(d.tokens) == [5, 300, 7, 9]
    with pytest.raises(UserError, match="token id 300 at position 1, the first outside a vocabulary of 256 ids"):
        check_data(d, vocab=256, seq_len=2)
    with pytest.raises(UserError, match="fewer than the sequence length"):
        check_data(d, vocab=1000, seq_len=4)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(UserError, match="not a whole number of uint16 ids"):
        load_data(tmp_path / "odd.bin", "uint16")
    # Not text: an image's bytes, or NUL bytes, are refused (a text file is read as bytes, so anything would train).
    (tmp_path / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (tmp_path / "nul.txt").write_bytes(b"text\x00more text")
    for name in ("picture.png", "nul.txt"):
        with pytest.raises(UserError, match="does not look like text"):
            load_data(tmp_path / name)
    cut = b"a" + "é".encode() * 40000  # 80,001 bytes: the 64 KiB sample ends inside a character, which is fine
    (tmp_path / "long.txt").write_bytes(cut)
    assert load_data(tmp_path / "long.txt").kind == "text"
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(UserError, match="empty"):
        load_data(tmp_path / "empty.txt")


def test_step_batches_depend_on_seed_and_step_only():
    d = load_data(None)
    a = step_batch(d, seed=1, step=3, sequences=4, seq_len=16)
    assert a.shape == (4, 17) and a.dtype == torch.int64
    assert torch.equal(a, step_batch(d, seed=1, step=3, sequences=4, seq_len=16))
    assert not torch.equal(a, step_batch(d, seed=1, step=4, sequences=4, seq_len=16))
    assert not torch.equal(a, step_batch(d, seed=2, step=3, sequences=4, seq_len=16))
    # Each window is a contiguous run of the data.
    text = d.tokens
    row = a[0].numpy()
    starts = [s for s in range(len(text) - 16) if text[s] == row[0] and np.array_equal(text[s : s + 17], row)]
    assert starts


def test_only_marked_checkpoints_count(tmp_path):
    state = {"w": torch.ones(2)}
    for step in (2, 4, 6):
        for stage in range(2):
            checkpoint.save_stage(tmp_path, step, stage, 2, state, {})
        if step != 6:  # step 6: every file written, but the run died before the marker
            checkpoint.mark_complete(tmp_path, step, 2)
    assert checkpoint.complete_steps(tmp_path) == [2, 4]
    assert checkpoint.latest_complete(tmp_path) == 4
    checkpoint.mark_complete(tmp_path, 6, 2)
    assert checkpoint.complete_steps(tmp_path) == [4, 6]  # the two newest are kept
    assert torch.equal(checkpoint.load_stage(tmp_path, 6, 1)["model"]["w"], state["w"])
    checkpoint.stage_file(tmp_path, 6, 1).unlink()
    assert checkpoint.latest_complete(tmp_path) == 4


def test_durations_read_in_whole_units():
    from terapipe_cli.units import format_duration

    assert [format_duration(s) for s in (0.4, 42, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
