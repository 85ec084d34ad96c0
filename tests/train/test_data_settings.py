"""The data settings of a run (issue 36 items 3 and 4) as `prepare_run` resolves and keeps them: the document mask on by
default for a Megatron corpus only, the sampling (epoch for token ids, random for text and for runs begun before),
``--val-data`` instead of ``--val-fraction`` (both: one line), and a resumed run keeping each. In process."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_one_line_error, run_cli, write_plan_file

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
