"""Every token format `terapipe train --data` reads, read back to the ids written, and each mistake one line."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from conftest import run_arguments

from terapipe_cli.config.run import RunArguments
from terapipe_cli.corpus.formats import MegatronWriter, open_token_file
from terapipe_cli.engine.data import check_data, load_data, split_data
from terapipe_cli.errors import UserError

IDS = np.array([5, 300, 7, 70_000, 9, 12, 65_535, 65_536, 1, 2], dtype=np.int64)  # beyond uint16 on purpose


def megatron_by_hand(prefix, ids, sequences, documents, code=4, dtype="<i4"):
    """A Megatron-LM corpus written from the layout of megatron/core/datasets/indexed_dataset.py, independently of
    `MegatronWriter`: ``sequences`` are lengths, ``documents`` the document indices (0 first, S last)."""
    data = np.asarray(ids, dtype=dtype)
    data.tofile(f"{prefix}.bin")
    lengths = np.asarray(sequences, dtype="<i4")
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype("<i8") * data.itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents)))
        f.write(lengths.tobytes() + pointers.tobytes() + np.asarray(documents, dtype="<i8").tobytes())


def llmc(path, ids, magic, version, dtype, count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=dtype).tobytes())


def test_megatron_corpus_named_by_prefix_or_either_file(tmp_path):
    # Three documents; the second is two sequences (Megatron's sentence split): document starts 0, 3, 8.
    megatron_by_hand(tmp_path / "c", IDS, sequences=[3, 2, 3, 2], documents=[0, 1, 3, 4])
    for name in ("c", "c.bin", "c.idx"):
        data = load_data(tmp_path / name)
        assert data.format == "megatron" and data.tokens.dtype == np.int32
        assert np.array_equal(data.tokens, IDS)
        assert len(data.documents) == 3 and list(data.documents.starts) == [0, 3, 8]
        assert list(data.documents.lengths()) == [3, 5, 2]
        assert data.max_token == 70_000
    line = load_data(tmp_path / "c").start_line()
    assert (
        line
        == f"data: {tmp_path / 'c'}: Megatron indexed (.bin + .idx), 10 tokens, 3 documents, int32, largest id 70,000"
    )
    # The held-out part keeps where it lies in the file (for a later document mask).
    train, held_out = split_data(load_data(tmp_path / "c"), 0.4, 3)
    assert len(train) == 6 and held_out.start == 6 and np.array_equal(held_out.tokens, IDS[6:])


def test_megatron_writer_is_read_back_and_picks_megatrons_type(tmp_path):
    for ids, dtype in ((IDS % 65_500, np.uint16), (IDS, np.int32)):
        with MegatronWriter(tmp_path / "w", dtype) as writer:
            writer.write(ids[:4], [2])  # documents 2, 4 and 4 long, the second over two writes
            writer.write(ids[4:], [4, 4])
            writer.commit()
        data = load_data(tmp_path / "w")
        assert data.tokens.dtype == dtype and np.array_equal(data.tokens, ids)
        assert list(data.documents.starts) == [0, 2, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin", "w.idx"]  # no temporary file left


def test_llmc_files_of_both_versions(tmp_path):
    llmc(tmp_path / "gpt2.bin", IDS % 50_257, 20240520, 1, "<u2")
    llmc(tmp_path / "llama3.bin", IDS, 20240801, 7, "<u4")
    gpt2, llama3 = load_data(tmp_path / "gpt2.bin"), load_data(tmp_path / "llama3.bin")
    assert gpt2.format == llama3.format == "llm.c" and gpt2.documents is None
    assert gpt2.tokens.dtype == np.uint16 and np.array_equal(gpt2.tokens, IDS % 50_257)
    assert llama3.tokens.dtype == np.uint32 and np.array_equal(llama3.tokens, IDS)
    assert load_data(tmp_path / "llama3.bin", "uint32").format == "llm.c"  # agreeing with the header is fine


def test_npy_of_any_integer_type(tmp_path):
    for dtype in (np.uint16, np.int32, np.uint32, np.int64):
        np.save(tmp_path / "t.npy", (IDS % 65_000).astype(dtype))
        data = load_data(tmp_path / "t.npy")
        assert data.format == "npy" and data.tokens.dtype == dtype and np.array_equal(data.tokens, IDS % 65_000)


def test_a_headerless_bin_needs_its_type(tmp_path):
    IDS.astype("<u4").tofile(tmp_path / "u32.bin")
    (IDS % 65_536).astype("<u2").tofile(tmp_path / "u16.bin")
    with pytest.raises(UserError, match="--token-dtype uint16 .* or --token-dtype uint32") as e:
        load_data(tmp_path / "u16.bin")
    assert "looks like uint32" not in str(e.value)
    # Without the type, a uint32 file is refused, and the error says what it looks like; read as uint16 it would
    # have passed every vocabulary check as halves below 65,536.
    with pytest.raises(UserError, match="--token-dtype.*it looks like uint32"):
        load_data(tmp_path / "u32.bin")
    with pytest.raises(UserError, match="it holds uint32 ids; pass --token-dtype uint32"):
        load_data(tmp_path / "u32.bin", "uint16")
    data = load_data(tmp_path / "u32.bin", "uint32")
    assert data.format == "bin" and data.tokens.dtype == np.uint32 and np.array_equal(data.tokens, IDS)
    assert "headerless .bin, --token-dtype uint32" in data.start_line()
    assert np.array_equal(load_data(tmp_path / "u16.bin", "uint16").tokens, IDS % 65_536)
    (tmp_path / "odd.bin").write_bytes(b"abcdef")
    with pytest.raises(UserError, match="not a whole number of uint32 ids"):
        load_data(tmp_path / "odd.bin", "uint32")


def test_uint16_ids_read_as_uint32_are_named_by_the_vocabulary_check(tmp_path):
    np.array([5, 300, 7, 9, 1, 2], dtype="<u2").tofile(tmp_path / "u16.bin")
    data = load_data(tmp_path / "u16.bin", "uint32")
    with pytest.raises(UserError, match=r"token id 19660805 at position 0, .*pass --token-dtype uint16"):
        check_data(data, vocab=50_257, seq_len=1)


def test_an_id_beyond_the_vocabulary_is_named_with_its_position_and_document(tmp_path):
    megatron_by_hand(tmp_path / "c", IDS, sequences=[3, 2, 3, 2], documents=[0, 1, 3, 4])
    with pytest.raises(UserError) as e:
        check_data(load_data(tmp_path / "c"), vocab=50_257, seq_len=4)
    assert str(e.value) == (
        f"{tmp_path / 'c'}: holds token id 70000 at position 3 (document 1), the first outside a vocabulary of 50257 "
        "ids; its largest id is 70000 (the model's: plan field 'model.vocab')"
    )
    check_data(load_data(tmp_path / "c"), vocab=70_001, seq_len=4)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: (p / "c.idx").unlink(), ["c.idx is missing"]),
        (lambda p: (p / "c.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40)), ["not a Megatron index"]),
        (lambda p: (p / "c.bin").write_bytes(bytes(8)), ["holds 8 bytes", "describes 10 int32 ids"]),
        (lambda p: megatron_by_hand(p / "c", IDS, [3, 7], [0, 2], code=9), ["dtype code 9"]),
        (lambda p: megatron_by_hand(p / "c", IDS, [3, 7], [0, 1]), ["document indices must run from 0 to", "2"]),
        (lambda p: _truncate(p / "c.idx", 4), ["its header", "makes"]),
        (lambda p: _move_pointer(p / "c.idx"), ["sequence 1 starts at byte 16", "not right after"]),
    ],
)
def test_a_damaged_megatron_corpus_is_one_line(tmp_path, damage, words):
    megatron_by_hand(tmp_path / "c", IDS, sequences=[3, 7], documents=[0, 1, 2])
    damage(tmp_path)
    with pytest.raises(UserError) as e:
        load_data(tmp_path / "c")
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


def _truncate(path, n):
    path.write_bytes(path.read_bytes()[:-n])


def _move_pointer(path):
    raw = bytearray(path.read_bytes())
    at = 34 + 4 * 2 + 8  # the second sequence's pointer
    raw[at : at + 8] = struct.pack("<q", 16)
    path.write_bytes(bytes(raw))


def test_llmc_and_token_dtype_mistakes_are_one_line(tmp_path):
    llmc(tmp_path / "short.bin", IDS, 20240801, 7, "<u4", count=11)
    llmc(tmp_path / "v2.bin", IDS, 20240520, 2, "<u2")
    llmc(tmp_path / "ok.bin", IDS, 20240801, 7, "<u4")
    (tmp_path / "t.txt").write_text("some text\n")
    cases = [
        ("short.bin", None, "header says 11 uint32 ids"),
        ("v2.bin", None, "version 2; only version 1 is known"),
        ("ok.bin", "uint16", "header says uint32 ids, not --token-dtype uint16"),
        ("t.txt", "uint16", "is read as text"),
        ("missing", None, "data file not found"),
    ]
    for name, token_dtype, words in cases:
        with pytest.raises(UserError, match=words) as e:
            open_token_file(tmp_path / name, token_dtype)
        assert str(e.value).startswith(str(tmp_path / name))


def test_a_run_from_before_token_dtype_reads_its_bin_as_uint16(tmp_path):
    """Its config.json has no token_dtype: a .bin then means uint16 ids, as it always did; other data, nothing."""
    saved = dataclasses.asdict(run_arguments(data=str(tmp_path / "train.bin")))
    del saved["token_dtype"]
    assert RunArguments.from_dict(saved, "config.json").token_dtype == "uint16"
    saved["data"] = None
    assert RunArguments.from_dict(saved, "config.json").token_dtype is None
    new = dataclasses.asdict(run_arguments(data=str(tmp_path / "train.bin"), token_dtype="uint32"))
    assert RunArguments.from_dict(new, "config.json").token_dtype == "uint32"
