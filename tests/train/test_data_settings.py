"""The data settings of a run as `prepare_run` resolves and keeps them: the document mask on by
default for a Megatron corpus only, the sampling (epoch for token ids, random for text and for runs begun before),
``--val-data`` instead of ``--val-fraction`` (both: one line), and a resumed run keeping each. In process."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.config.run import RunArguments, RunConfig, load_run_config
from terapipe_cli.corpus.formats import MegatronWriter
from terapipe_cli.engine.data import generate_default_text
from terapipe_cli.errors import UserError
from terapipe_cli.train.prepare import prepare_run


@pytest.fixture
def plan(tmp_path):
    return write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 40, size=300)
    with MegatronWriter(tmp_path / "docs", np.dtype(np.uint16)) as writer:
        writer.write(rng.integers(0, 256, size=int(lengths.sum())).astype(np.uint16), lengths)
        writer.commit()
    return str(tmp_path / "docs")


def test_defaults_follow_the_data(tmp_path, plan, corpus):
    text = prepare_run(RunConfig(plan=str(plan), out=str(tmp_path / "a"), device="cpu"), write=False).args
    assert (text.document_mask, text.sampling, text.val_data) == (False, "random", None)
    tokens = prepare_run(RunConfig(plan=str(plan), out=str(tmp_path / "b"), device="cpu", data=corpus), write=False)
    assert (tokens.args.document_mask, tokens.args.eos_id, tokens.args.sampling) == (True, None, "epoch")
    assert "documents masked" in tokens.data_line
    off = RunConfig(plan=str(plan), out=str(tmp_path / "c"), device="cpu", data=corpus, document_mask=False)
    assert prepare_run(off, write=False).args.document_mask is False
    eos = RunConfig(plan=str(plan), out=str(tmp_path / "d"), device="cpu", document_mask=True, sampling="epoch")
    assert (prepare_run(eos, write=False).args.eos_id, prepare_run(eos, write=False).args.sampling) == (10, "epoch")
    # A run from before these settings: no mask, random windows, the held-out fraction.
    old = RunArguments.from_dict(
        {"steps": 1, "data": None, "seed": 0, "lr": 1e-3, "data_parallel": 1, "checkpoint_every": 1, "threads": 1,
         "timeout_s": 1.0, "verify": False}, "old",
    )  # fmt: skip
    assert (old.document_mask, old.sampling, old.val_data) == (False, "random", None)


def test_a_validation_file_replaces_the_held_out_fraction(tmp_path, capsys, plan):
    (tmp_path / "val.txt").write_text(generate_default_text(5_000, seed=7))
    out = tmp_path / "run"
    prepared = prepare_run(RunConfig(plan=str(plan), out=str(out), device="cpu", val_data=str(tmp_path / "val.txt")))
    assert prepared.args.val_fraction == 0 and prepared.args.val_data == str(tmp_path / "val.txt")
    assert prepared.args.eval_every > 0 and "held out: " in prepared.data_line
    assert len(prepared.data) == len(generate_default_text())  # all of --data trains
    # A resumed run keeps it: another file is refused in one line.
    (tmp_path / "other.txt").write_text("x" * 100)
    with pytest.raises(UserError, match="keeps it"):
        prepare_run(RunConfig(out=str(out), val_data=str(tmp_path / "other.txt")), resume=True, write=False)
    p = run_cli(
        capsys, "train", "--plan", plan, "--out", tmp_path / "both", "--dry-run", "--val-data", tmp_path / "val.txt",
        "--val-fraction", "0.2",
    )  # fmt: skip
    assert_one_line_error(p, "--val-data", "not both")


def test_a_mixture_is_resolved_once_and_kept(tmp_path, capsys, monkeypatch, plan, corpus):
    (tmp_path / "code.txt").write_text(generate_default_text(40_000, seed=3))
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # the sources relative to where the command runs
    prepared = prepare_run(RunConfig(plan=str(plan), out=str(out), device="cpu", data=["3:docs", "1:code.txt"]))
    args = prepared.args
    assert args.data == corpus and args.data_mix == [f"{0.75!r}:{corpus}", f"{0.25!r}:{tmp_path / 'code.txt'}"]
    assert prepared.data.weights == (0.75, 0.25) and "0.25 × " in prepared.data_line
    # run.toml trains it again: the same sources and weights.
    again = load_run_config(out / "run.toml")
    assert again.data == args.data_mix
    # A resumed run keeps them; another mixture is one line.
    with pytest.raises(UserError, match="keeps it"):
        prepare_run(RunConfig(out=str(out), data=[f"0.5:{corpus}", f"0.5:{tmp_path / 'code.txt'}"]), resume=True)
    p = run_cli(
        capsys, "train", "--plan", plan, "--out", tmp_path / "x", "--dry-run", "--data", corpus, "--data",
        f"0.3:{tmp_path / 'code.txt'}",
    )  # fmt: skip
    assert_one_line_error(p, "--data", "positive weight")


def word_tokenizer(path, words) -> None:
    """A word-level tokenizer.json (instant to make; ``words`` in their order: another order, another tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<eos>", "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder holding a plan (256 ids), corpora a and a2 of one word-level tokenizer, b of another, an empty
    corpus, and a .npy of ids below 200 (no documents)."""
    pytest.importorskip("tokenizers")
    from terapipe_cli.corpus import tokenize as tz

    folder = tmp_path_factory.mktemp("data")
    write_plan_file(folder / "plan.json", [(1, [16, 16])], stages=2)
    text = generate_default_text(4_000, seed=2)
    (folder / "t.txt").write_text(text)
    words = sorted(set(text.replace(".", " ").split()))
    word_tokenizer(folder / "tok-a.json", words)
    word_tokenizer(folder / "tok-b.json", words[::-1])
    for name, tok in (("a", "tok-a.json"), ("a2", "tok-a.json"), ("b", "tok-b.json")):
        tz.tokenize_corpus([folder / "t.txt"], tz.load_tokenizer(folder / tok, "<eos>"), folder / name, split="line")
    with MegatronWriter(folder / "empty", np.dtype(np.uint16)) as writer:  # as Megatron-LM's tools may leave one
        writer.commit()
    np.save(folder / "ids.npy", (np.arange(4_000) % 200).astype(np.int32))
    return folder


TRAIN = ("train", "--plan", "plan.json", "--out", "run", "--dry-run")
PLAN = ("plan", "--profile", ROOT / "configs" / "profiles" / "example-tiny-cpu.json", "-k", "2", "-b", "1", "-q")


@pytest.mark.parametrize(
    "args, words",
    [
        ((*TRAIN, "--data", "-0.5:a"), ["--data", "the weight of '-0.5:a' must be a positive number, got -0.5"]),
        ((*TRAIN, "--data", "0:a"), ["--data", "'0:a' must be a positive number, got 0"]),
        ((*TRAIN, "--data", "nan:a"), ["--data", "'nan:a' must be a positive number, got nan"]),
        ((*TRAIN, "--data", "1e309:a"), ["--data", "'1e309:a' must be a positive number, got 1e309"]),
        ((*TRAIN, "--data", "abc:x"), ["--data", "the weight 'abc' of 'abc:x' is not a number"]),
        ((*TRAIN, "--data", "0.5:a", "--data", "0.5:b"), ["--data", "/a and ", "/b were made by different tokenizers"]),
        ((*TRAIN, "--data", "a", "--val-data", "b"), ["--data", "different tokenizers", "a.tokenizer/tokenizer.json"]),
        ((*TRAIN, "--data", "0.5:a", "--data", "0.5:ids.npy"), ["--data", "ids.npy holds id 199, outside the"]),
        ((*TRAIN, "--document-mask", "--no-document-mask"), ["--document-mask and --no-document-mask", "give one"]),
        ((*TRAIN, "--data", "ids.npy", "--document-mask"), ["--eos-id", "(id 50256) by default", "of 256 ids"]),
        ((*TRAIN, "--data", "ids.npy", "--document-mask", "--eos-id", "256"), ["--eos-id", "256 ids", "got 256"]),
        ((*TRAIN, "--data", "ids.npy", "--eos-id", "3"), ["--eos-id", "the mask is off", "add --document-mask"]),
        ((*TRAIN, "--no-document-mask", "--eos-id", "3"), ["--eos-id", "--no-document-mask turns the mask off"]),
        ((*TRAIN, "--data", "a", "--eos-id", "0"), ["--eos-id", "/a records its documents", "leave --eos-id out"]),
        ((*PLAN, "--data", "empty"), ["--data", "empty holds no tokens (0 documents)"]),
        ((*PLAN, "--data", "a", "--data", "a2"), ["--data", "several sources each need a weight"]),
        ((*PLAN, "--data", "0.5:a", "--data", "0.5:b"), ["--data", "a and b were made by different tokenizers"]),
        ((*PLAN, "--data", "abc:x"), ["--data", "the weight 'abc' of 'abc:x' is not a number"]),
        ((*PLAN, "--data", "-1:a"), ["--data", "'-1:a' must be a positive number"]),
    ],
)
def test_the_users_bad_data_commands_are_one_line(world, capsys, args, words):
    """Weights that would be dropped, sources of two tokenizers, an EOS id that would mask nothing or be ignored, both
    switches of the mask, an empty corpus to plan on: each one line naming the option, nothing written."""
    before = sorted(p.name for p in world.iterdir())
    assert_one_line_error(run_cli(capsys, *args, cwd=world), *words)
    assert sorted(p.name for p in world.iterdir()) == before


def test_plan_data_takes_a_weighted_mixture_as_train_does(world):
    from terapipe_cli.cli.plan import documents_priced
    from terapipe_cli.plan.costmodel import read_profile

    profile = read_profile(ROOT / "configs" / "profiles" / "example-tiny-cpu.json")
    one, two = (documents_priced(profile, [str(world / name)], 64).attended for name in ("a", "a2"))
    mixed = documents_priced(profile, [f"1:{world / 'a'}", f"3:{world / 'a2'}"], 64).attended
    assert np.allclose(mixed.at_least, 0.25 * one.at_least + 0.75 * two.at_least)
    assert mixed.record()["corpus"] == f"1:{world / 'a'}, 3:{world / 'a2'}"
    weighted = documents_priced(profile, [f"2:{world / 'a'}"], 64).attended  # one source: its weight changes nothing
    assert np.array_equal(weighted.at_least, one.at_least)


def test_a_corpus_replaced_under_a_run_is_refused_at_resume(tmp_path, capsys, plan, corpus):
    out = tmp_path / "run"
    prepare_run(RunConfig(plan=str(plan), out=str(out), device="cpu", data=[corpus]))
    kept = json.loads((out / "config.json").read_text())["arguments"]["data_fingerprints"]
    assert list(kept) == [corpus] and set(kept[corpus]) == {"format", "index", "tokens"}
    with MegatronWriter(tmp_path / "docs", np.dtype(np.uint16)) as writer:  # another corpus under its name
        writer.write(np.arange(5_000, dtype=np.uint16) % 256, np.full(100, 50))
        writer.commit()
    p = run_cli(capsys, "train", "--resume", "--out", out)
    assert_one_line_error(p, corpus, "is not the data the run trained on: its tokens (.bin) holds 10,000 bytes")
    # A run from before runs kept fingerprints: a warning line, and the resume goes on (here to its next check).
    config = json.loads((out / "config.json").read_text())
    del config["arguments"]["data_fingerprints"]
    (out / "config.json").write_text(json.dumps(config))
    p = run_cli(capsys, "train", "--resume", "--out", out)
    warning, error = p.stderr.strip().splitlines()
    assert warning.startswith("terapipe: the run keeps no fingerprint of its data (it began before runs kept one)")
    assert warning.endswith(f": {corpus} not checked to be the data it trained on (kept from now on)")
    assert error.startswith("terapipe: error: ") and "never completed a step" in error
