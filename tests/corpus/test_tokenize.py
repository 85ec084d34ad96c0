"""`terapipe data tokenize` and `terapipe data inspect`, with tokenizers built here by `tokenizers` (no download)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import assert_one_line_error, local_setup, run_cli, tiny_model, train_locally

from terapipe_cli.corpus import tokenize as tz
from terapipe_cli.corpus.identity import fingerprint, tokenizer_digest
from terapipe_cli.engine.data import generate_default_text, load_data

tokenizers = pytest.importorskip("tokenizers")

TEXT = generate_default_text(60_000, seed=5)
EOT, BOS = "<|endoftext|>", "<|begin_of_text|>"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A GPT-2-style byte-level BPE (1,000 ids) trained on the default text: a bare tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=[EOT, BOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def llama_folder(bpe, tmp_path_factory):
    """A transformers-style folder: the BPE with a template adding <|begin_of_text|> (as Llama 3's), and the
    tokenizer_config.json that names its EOS."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(bpe))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    folder = tmp_path_factory.mktemp("llama")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOT}, "bos_token": BOS}))
    return folder


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tokenizer of 70,258 ids whose every text id is above 65,535: a corpus of it must be int32."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {f"<unused_{i}>": i for i in range(70_000)}
    vocab.update({ch: 70_000 + n for n, ch in enumerate(sorted(alphabet))})
    vocab[EOT] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    path = tmp_path_factory.mktemp("wide") / "tokenizer.json"
    tok.save(str(path))
    return path


def ids_of(path, texts, *, bos=False):
    """The ids a corpus must hold: each text's ids (its template: BOS), then the EOS."""
    tok = tokenizers.Tokenizer.from_file(str(path))
    out = []
    for text in texts:
        out += ([tok.token_to_id(BOS)] if bos else []) + tok.encode(text, add_special_tokens=False).ids
        out.append(tok.token_to_id(EOT))
    return out


def test_text_by_line_jsonl_and_parquet_into_one_corpus(tmp_path, capsys, llama_folder):
    lines = TEXT.splitlines()[:40]
    (tmp_path / "a.txt").write_text("\n".join(lines[:20]) + "\n\n")
    with open(tmp_path / "b.jsonl", "w") as f:
        for n, line in enumerate(lines[20:30]):
            f.write(json.dumps({"id": n, "text": line}) + "\n")
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"text": lines[30:40]}), tmp_path / "c.parquet")
    inputs = [tmp_path / n for n in ("a.txt", "b.jsonl", "c.parquet")]
    p = run_cli(
        capsys,
        "data",
        "tokenize",
        *inputs,
        "--split",
        "line",
        "--tokenizer",
        llama_folder,
        "--out",
        tmp_path / "out" / "corpus",
    )
    assert p.returncode == 0, p.stderr
    assert "documents    │ 40" in p.stdout and f"{BOS} TEXT {EOT}" in p.stdout
    data = load_data(tmp_path / "out" / "corpus")
    expected = ids_of(llama_folder / "tokenizer.json", lines, bos=True)
    assert data.format == "megatron" and data.tokens.dtype == np.uint16 and list(data.tokens) == expected
    assert len(data.documents) == 40 and data.tokens[data.documents.starts[7]] == 1  # <|begin_of_text|> is id 1
    summary = json.loads((tmp_path / "out" / "corpus.json").read_text())
    assert summary["schema"] == "terapipe.corpus/1" and summary["tokens"] == len(expected)
    assert summary["max_token"] == max(expected) and summary["eos"] == {"token": EOT, "id": 0}
    assert summary["fingerprint"] == fingerprint(tmp_path / "out" / "corpus")  # what a run keeps and checks
    assert summary["tokenizer_sha256"] == tokenizer_digest(llama_folder / "tokenizer.json")
    copied = sorted(q.name for q in (tmp_path / "out" / "corpus.tokenizer").iterdir())
    assert copied == ["tokenizer.json", "tokenizer_config.json"]
    # inspect prints the same summary, and the start of the first document decoded with the copied tokenizer.
    p = run_cli(capsys, "data", "inspect", tmp_path / "out" / "corpus")
    assert p.returncode == 0, p.stderr
    assert f"{len(expected):,} tokens, 40 documents, uint16" in p.stdout
    assert f"begins: '{BOS}{lines[0][:20]}" in p.stdout


def test_a_text_file_as_one_document_and_paragraphs(tmp_path, bpe):
    """A long document is encoded in pieces over the tokenizer's threads: the ids equal the whole text's."""
    long_text = generate_default_text(400_000, seed=9)  # over 2 x PIECE_CHARS: cut into pieces
    (tmp_path / "story.txt").write_text(long_text)
    tok = tz.load_tokenizer(bpe, EOT)
    assert tok.cuttable and len(tz._pieces(long_text, True)) > 2
    tz.tokenize_corpus([tmp_path / "story.txt"], tok, tmp_path / "whole")
    assert list(load_data(tmp_path / "whole").tokens) == ids_of(bpe, [long_text])
    (tmp_path / "paras.txt").write_text("One here.\nStill one.\n\n\nTwo.\n  \nThree\n")
    tz.tokenize_corpus([tmp_path / "paras.txt"], tok, tmp_path / "paras", split="paragraph")
    data = load_data(tmp_path / "paras")
    assert list(data.tokens) == ids_of(bpe, ["One here.\nStill one.", "Two.", "Three"])


def test_a_named_pipe_is_read_to_its_end_without_seeking(tmp_path, bpe):
    """An input that cannot seek (a named pipe, as /dev/stdin is) tokenizes like the same text in a file, a
    byte-order mark and lines shorter than it included."""
    import threading

    tok = tz.load_tokenizer(bpe, EOT)
    for split, text in (("line", "\ufeffA\nBe.\nSee the cat.\n"), ("file", "\ufeffOne story.\n")):
        fifo = tmp_path / f"{split}.txt"
        os.mkfifo(fifo)
        feeder = threading.Thread(target=lambda f=fifo, t=text: f.write_bytes(t.encode()))
        feeder.start()
        tz.tokenize_corpus([fifo], tok, tmp_path / split, split=split)
        feeder.join()
        (tmp_path / f"{split}.plain").write_text(text)
        tz.tokenize_corpus([tmp_path / f"{split}.plain"], tok, tmp_path / f"{split}-plain", split=split)
        assert list(load_data(tmp_path / split).tokens) == list(load_data(tmp_path / f"{split}-plain").tokens)
    assert list(load_data(tmp_path / "line").tokens) == ids_of(bpe, ["A", "Be.", "See the cat."])


def test_a_signal_during_the_cleanup_waits_for_it():
    """Within `signals_held` a SIGTERM (handled by `signals_raise`) is kept until the block ends, then raised."""
    from terapipe_cli.errors import StopSignal, signals_held, signals_raise

    done = []
    with pytest.raises(StopSignal) as stopped, signals_raise():
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            done.append("cleaned up")
    assert done == ["cleaned up"] and stopped.value.exit_code == 143


def test_more_than_65536_ids_make_an_int32_corpus(tmp_path, wide):
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in ("Ada sees", "a cat", "")))
    tok = tz.load_tokenizer(wide, EOT)
    summary = tz.tokenize_corpus([tmp_path / "t.jsonl"], tok, tmp_path / "c", field="body")
    data = load_data(tmp_path / "c.idx")
    assert summary.dtype == "int32" and data.tokens.dtype == np.int32 and summary.skipped == 1
    assert list(data.tokens) == ids_of(wide, ["Ada sees", "a cat"]) and min(data.tokens) > 65_535


def test_special_tokens_in_a_text_are_text(tmp_path, bpe):
    (tmp_path / "t.txt").write_text(f"one{EOT}two")
    tz.tokenize_corpus([tmp_path / "t.txt"], tz.load_tokenizer(bpe, EOT), tmp_path / "c")
    ids = list(load_data(tmp_path / "c").tokens)
    assert ids.count(0) == 1 and ids[-1] == 0  # the EOS only where the document ends


@pytest.mark.parametrize(
    "make, args, words",
    [
        (None, ["--eos", EOT, "--out", "c"], ["input file not found"]),
        ("t.txt", ["--out", "c"], ["--eos", "no EOS token known"]),
        ("t.txt", ["--eos", "<|nope|>", "--out", "c"], ["--eos", "'<|nope|>' is not a token"]),
        ("t.txt", ["--eos", EOT, "--out", "c", "--split", "words"], ["--split", "file, line, paragraph"]),
        ("bad.jsonl", ["--eos", EOT, "--out", "c"], ["bad.jsonl: line 2", "not a JSON object"]),
        ("nofield.jsonl", ["--eos", EOT, "--out", "c"], ["line 1", "no field 'text'", "--field"]),
        ("t.txt", ["--eos", EOT, "--out", "taken"], ["taken.bin exists", "--force"]),
        ("latin1.txt", ["--eos", EOT, "--out", "c"], ["latin1.txt", "not UTF-8 text at byte 3"]),
        ("empty.jsonl", ["--eos", EOT, "--out", "new/c"], ["empty.jsonl", "no text to tokenize: no document"]),
        ("nulls.jsonl", ["--eos", EOT, "--out", "c"], ["nulls.jsonl", "only empty documents (2, left out)"]),
        ("/dev/null", ["--eos", EOT, "--out", "c"], ["/dev/null", "no text", "nothing written"]),
    ],
)
def test_tokenize_mistakes_are_one_line_and_write_nothing(tmp_path, capsys, bpe, make, args, words):
    (tmp_path / "t.txt").write_text("Ada sees the cat.\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (tmp_path / "nofield.jsonl").write_text('{"body": "ok"}\n')
    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (tmp_path / "taken.bin").write_bytes(b"something else")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nulls.jsonl").write_text('{"text": null}\n{"text": ""}\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    p = run_cli(capsys, "data", "tokenize", tmp_path / (make or "missing.txt"), "--tokenizer", bpe, *args, cwd=tmp_path)
    assert_one_line_error(p, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no corpus, no temporary file


def test_inspect_checks_a_vocabulary_and_reads_every_format(tmp_path, capsys):
    np.array([3, 70_000, 5, 6], dtype="<u4").tofile(tmp_path / "t.bin")
    assert_one_line_error(run_cli(capsys, "data", "inspect", tmp_path / "t.bin"), "t.bin", "--token-dtype uint16")
    p = run_cli(capsys, "data", "inspect", tmp_path / "t.bin", "--token-dtype", "uint32", "--vocab", "50257")
    assert_one_line_error(p, "t.bin", "token id 70000 at position 1", "vocabulary of 50257", "(--vocab)")
    p = run_cli(capsys, "data", "inspect", tmp_path / "t.bin", "--token-dtype", "uint32", "--vocab", "70001")
    assert p.returncode == 0 and "headerless .bin, --token-dtype uint32, 4 tokens, no document index" in p.stdout


def test_sample_decodes_a_corpus_run_with_the_corpus_tokenizer(tmp_path, llama_folder):
    from terapipe_cli.train.sample import run_tokenizer

    (tmp_path / "t.txt").write_text("Ada sees the cat.")
    tz.tokenize_corpus([tmp_path / "t.txt"], tz.load_tokenizer(llama_folder), tmp_path / "c")
    for data in ("c", "c.bin", "c.idx"):
        tok = run_tokenizer(str(tmp_path / data), model_vocab=1024)
        assert tok.name.startswith("c.tokenizer/ (") and tok.default_prompt == [1]  # <|begin_of_text|>
        ids = tok.encode("Ada sees")
        assert ids[0] == 1 and tok.decode(ids) == f"{BOS}Ada sees"


def test_a_corpus_trains_through_the_workers_own_code(tmp_path, bpe):
    """Every rank of a 2-stage run (threads of this process) reads the corpus as a worker does and trains on it."""
    (tmp_path / "t.txt").write_text(TEXT)
    tz.tokenize_corpus([tmp_path / "t.txt"], tz.load_tokenizer(bpe, EOT), tmp_path / "c", split="line")
    model = tiny_model(layers=2, seq_len=32, vocab=1024)
    setup = local_setup([(1, [16, 16])], stages=2, model=model, steps=2, data=str(tmp_path / "c"), eval_every=2)
    assert setup.data.format == "megatron" and setup.held_out.start == len(setup.data)
    run = train_locally(setup)
    assert len(run.losses) == 2 and all(np.isfinite(run.losses)) and np.isfinite(run.val_losses[-1])


def test_the_optional_packages_are_named_when_missing(tmp_path, capsys, monkeypatch, bpe):
    import sys

    (tmp_path / "t.txt").write_bytes(b"\xef\xbb\xbfAda sees the cat.")
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"text": ["Ada"]}), tmp_path / "t.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as in a Python without it
    p = run_cli(capsys, "data", "tokenize", tmp_path / "t.parquet", "--tokenizer", bpe, "--out", tmp_path / "c")
    assert_one_line_error(p, "t.parquet", "pip install pyarrow")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    p = run_cli(capsys, "data", "tokenize", tmp_path / "t.txt", "--tokenizer", bpe, "--out", tmp_path / "c")
    assert_one_line_error(p, "--tokenizer", "pip install 'terapipe-cli[data]'")
    monkeypatch.undo()
    tz.tokenize_corpus([tmp_path / "t.txt"], tz.load_tokenizer(bpe, EOT), tmp_path / "c")  # the BOM is no text
    assert list(load_data(tmp_path / "c").tokens) == ids_of(bpe, ["Ada sees the cat."])


def full_disk_before(monkeypatch):
    from terapipe_cli import files

    real = files.shutil.disk_usage
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: real(path)._replace(free=19_999))


def full_disk_during(monkeypatch):
    """The corpus's .bin opened on a disk that fills at its first write."""
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        (full_disk_before, ["c.bin: disk full: needs about 20,000 bytes", "6 bytes a token, uint16 ids", "19,999"]),
        (full_disk_during, ["c.bin: disk full (No space left on device)", "nothing was written"]),
    ],
    ids=["free-space-checked-first", "filled-while-writing"],
)
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, bpe, fault, words):
    """`terapipe data tokenize` onto a full disk: the free space checked before the corpus (60,000 bytes of text at
    6 bytes a token, 2 bytes an id), and a disk that fills while it is written, each one line saying "disk full"."""
    (tmp_path / "t.txt").write_text(TEXT)
    fault(monkeypatch)
    p = run_cli(
        capsys, "data", "tokenize", tmp_path / "t.txt", "--tokenizer", bpe, "--eos", EOT, "--out", tmp_path / "c"
    )
    assert_one_line_error(p, *words)
    assert [q.name for q in tmp_path.iterdir()] == ["t.txt"]  # no corpus, no temporary file


def test_ctrl_c_during_tokenize_leaves_no_temporary_file(tmp_path, capsys, monkeypatch, bpe):
    """Ctrl-C while the first batch is written (in this process, where the CLI runs): exit 130, one line. The handler
    the command set for SIGINT is called as the signal calls it: a raised signal's delivery is the kernel's and the
    interpreter's (real signals reach a real process in the test below and in tests/cli)."""
    (tmp_path / "t.txt").write_text(TEXT)
    write = tz._Assembler.write

    def interrupted(self, *args):
        write(self, *args)
        assert list(tmp_path.glob(".c.bin.*.tmp"))  # the corpus is being written
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler) and handler is not signal.default_int_handler, handler  # the command's own
        handler(signal.SIGINT, None)

    monkeypatch.setattr(tz._Assembler, "write", interrupted)
    p = run_cli(
        capsys, "data", "tokenize", tmp_path / "t.txt", "--tokenizer", bpe, "--eos", EOT, "--out", tmp_path / "c"
    )
    assert p.returncode == 130 and p.stderr.strip() == "terapipe: interrupted", (p.stdout, p.stderr)
    assert [q.name for q in tmp_path.iterdir()] == ["t.txt"]


def test_a_stop_signal_another_thread_takes_ends_a_read_waiting_on_a_pipe(tmp_path):
    """The kernel hands a process's signal to any thread that does not block it; one that a thread takes only marks
    Python's handler to run in the main thread, which cannot while it waits in a read in the kernel. The corpus's
    reader of a pipe waits in short steps (`tokenize._open_input`), so the handler runs and the read ends: here the
    signal is sent to a helper thread itself, while the main thread waits on a pipe nobody writes to. (The same with a
    plain ``open`` waits until the helper's safety valve writes, after 30 s: the test then fails.)"""
    from terapipe_cli.errors import StopSignal, signals_raise

    fifo = tmp_path / "in.txt"
    os.mkfifo(fifo)
    stopped, valve = threading.Event(), []

    def helper():
        writer = os.open(fifo, os.O_WRONLY)  # once the main thread has opened it for reading
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # taken by this thread, not the main one
        if not stopped.wait(30):
            valve.append(1)
            os.write(writer, b"x")
        os.close(writer)

    thread = threading.Thread(target=helper)
    with signals_raise():
        thread.start()
        with pytest.raises(StopSignal), tz._open_input(fifo) as f:
            f.read(1)
        stopped.set()
    thread.join()
    assert not valve  # the read ended by the signal, not by data


AS_FROM_A_SHELL = """
import runpy, signal, sys
signal.pthread_sigmask(signal.SIG_SETMASK, [])
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv[0] = "terapipe"
runpy.run_module("terapipe_cli", run_name="__main__", alter_sys=True)
"""


def test_sigterm_during_tokenize_leaves_no_temporary_file(tmp_path, bpe):
    """A real `terapipe data tokenize` process reading a pipe that is kept open: SIGTERM while it waits there for
    more text (its .bin's temporary file written) ends it with exit 143, one line, and no file left."""
    from conftest import ROOT

    fifo = tmp_path / "in.txt"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    argv = ["data", "tokenize", fifo, "--tokenizer", bpe, "--eos", EOT, "--out", tmp_path / "c"]
    # `python -m terapipe_cli`, with the signal state a shell gives a command: an ignored or blocked SIGTERM is
    # inherited through exec, and this test is about the command, not about what this process was left with.
    parent = (signal.getsignal(signal.SIGTERM), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    command = [sys.executable, "-c", AS_FROM_A_SHELL, *map(str, argv)]
    p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The command opens the pipe once its .bin's temporary file exists (one that never does fails the test).
        writer, deadline = None, time.monotonic() + 120
        while writer is None and p.poll() is None and time.monotonic() < deadline:
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.05)
        assert writer is not None, p.communicate() if p.poll() is not None else "it never opened its input"
        os.write(writer, b"Ada sees the cat.\n")
        assert [q.name for q in tmp_path.glob(".c.bin.*.tmp")]
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        os.close(writer)
    finally:
        p.kill()
    assert p.returncode == 143 and err.strip() == "terapipe: stopped by SIGTERM", (err, "this process:", parent)
    assert [q.name for q in tmp_path.iterdir()] == ["in.txt"]
