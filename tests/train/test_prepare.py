"""Bad input to `terapipe train`: one line, exit 2, before any worker starts (in-process: no workers)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest
from conftest import assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.cli import main
from terapipe_cli.config.run import RunConfig
from terapipe_cli.train.prepare import prepare_run
from terapipe_cli.train.rundir import append_metrics, run_lock


def run(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["train", *args])
    err = capsys.readouterr().err
    return e.value.code, err


@pytest.fixture
def plan(tmp_path):
    return write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)


def test_missing_data_file(tmp_path, capsys, plan):
    code, err = run(capsys, "--plan", str(plan), "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "r"))
    assert code == 2 and "nope.txt: data file not found" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_sequence_longer_than_the_data(tmp_path, capsys, plan):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    code, err = run(capsys, "--plan", str(plan), "--data", str(short), "--out", str(tmp_path / "r"))
    assert code == 2 and "fewer than the sequence length + 1 (33)" in err


def test_token_ids_outside_the_vocabulary(tmp_path, capsys, plan):
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.arange(1000, dtype=np.uint16))
    code, err = run(capsys, "--plan", str(plan), "--data", str(tokens), "--out", str(tmp_path / "r"))
    assert code == 2 and "token id 256 at position 256, the first outside a vocabulary of 256 ids" in err
    assert "its largest id is 999 (the model's: plan field 'model.vocab')" in err and err.count("\n") == 1


def test_a_headerless_bin_needs_token_dtype_which_the_run_keeps(tmp_path, capsys, plan):
    """uint32 ids in a .bin without a header: refused without --token-dtype (read as uint16 they would train on
    noise), read right with it; the run prints what it read and keeps the type, which --resume may not change."""
    tokens = tmp_path / "t.bin"
    (np.arange(1000) % 200).astype("<u4").tofile(tokens)
    base = ["train", "--plan", plan, "--data", tokens, "--device", "cpu", "--out", tmp_path / "r"]
    assert_one_line_error(run_cli(capsys, *base, "--dry-run"), "t.bin", "--token-dtype uint32", "looks like uint32")
    assert_one_line_error(run_cli(capsys, *base, "--token-dtype", "uint8", "--dry-run"), "--token-dtype", "uint16")
    p = run_cli(capsys, *base, "--token-dtype", "uint32", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert f"data: {tokens}: headerless .bin, --token-dtype uint32, 1,000 tokens, no document index, uint32, " in (
        p.stdout.replace("\n", "")
    )
    config = RunConfig(plan=str(plan), data=str(tokens), token_dtype="uint32", out=str(tmp_path / "r"), device="cpu")
    prepared = prepare_run(config)
    assert prepared.data_line.endswith("largest id 199")
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["arguments"]
    assert saved["token_dtype"] == "uint32" and 'token_dtype = "uint32"' in (tmp_path / "r" / "run.toml").read_text()
    # run.toml says what a setting left out means, never beside one given: --data is this file, not the embedded text.
    assert f'data = ["{tokens}"]\n' in (tmp_path / "r" / "run.toml").read_text()
    p = run_cli(capsys, "train", "--resume", "--out", tmp_path / "r", "--token-dtype", "uint16", "--dry-run")
    assert_one_line_error(p, "--token-dtype", "trained with --token-dtype uint32")


def test_too_many_workers(tmp_path, capsys, plan):
    code, err = run(capsys, "--plan", str(plan), "--data-parallel", "1000", "--out", str(tmp_path / "r"))
    assert code == 2 and "D × K × T = 1000 × 2 × 1 = 2000 workers" in err and "more than allowed" in err


def test_plan_that_does_not_fit_the_model(tmp_path, capsys):
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2, layers=6)
    import json

    obj = json.loads(plan.read_text())
    obj["stages"] = 4  # 6 layers do not split into 4 stages
    plan.write_text(json.dumps(obj))
    code, err = run(capsys, "--plan", str(plan), "--out", str(tmp_path / "r"))
    assert code == 2 and "4 stages do not divide the 6 layers" in err


def test_resume_without_a_run(tmp_path, capsys):
    code, err = run(capsys, "--resume", "--out", str(tmp_path / "none"))
    assert code == 2 and "no run to resume here" in err


def test_resume_without_a_complete_checkpoint(tmp_path, capsys, plan):
    code, _ = run(capsys, "--plan", str(plan), "--out", str(tmp_path / "r"), "--dry-run")
    assert code == 0
    settings = RunConfig(plan=str(plan), steps=3, out=str(tmp_path / "r"), checkpoint_every=10, device="cpu")
    prepare_run(settings)
    append_metrics(tmp_path / "r", {"step": 1, "loss": 5.0})  # a step done, killed before its first checkpoint
    code, err = run(capsys, "--resume", "--out", str(tmp_path / "r"))
    assert code == 2 and "no complete checkpoint to resume from" in err
    code, err = run(capsys, "--plan", str(plan), "--out", str(tmp_path / "r"))
    assert code == 2 and "already holds a run" in err


def test_verify_cannot_follow_resume(tmp_path, capsys):
    code, err = run(capsys, "--resume", "--verify", "--out", str(tmp_path / "r"))
    assert code == 2 and "--verify" in err


def test_a_live_run_folder_is_refused(tmp_path, capsys):
    """While `terapipe train` runs in a folder it holds the folder's lock (an advisory flock, dropped when the holder
    ends however it ends): a second train, --resume or report says so in one line, naming the holder. Here this
    process holds it, as a live run's launcher does."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    run = tmp_path / "run"
    prepare_run(RunConfig(plan=str(plan), out=str(run), steps=2, device="cpu"))  # a run folder, not trained
    with run_lock(run):
        for cmd, what in [
            (("train", "--plan", plan, "--out", run, "--device", "cpu"), "use another --out"),
            (("train", "--resume", "--out", run, "--dry-run", "--device", "cpu"), "resume it once"),
            (("report", run), "report on it once"),
        ]:
            p = run_cli(capsys, *cmd)
            assert_one_line_error(p, f"a `terapipe train` is running in this folder (pid {os.getpid()}): {what}")
    p = run_cli(capsys, "report", run)  # the lock is gone with its holder: the report finds an unfinished run
    assert_one_line_error(p, "the run did not finish")


def test_resume_if_present_starts_a_fresh_folder_and_continues_a_run(tmp_path, capsys):
    """For a job script that may run again: a new folder starts; a folder holding a run continues it from its last
    complete checkpoint (--init-from, which only starts a run, left aside); a run already at --steps has nothing to
    train (exit 0); a plan of another model is one line."""
    from fake_runs import SEQ, checkpointed_run

    from terapipe_cli.train.prepare import start_or_continue

    plan = write_plan_file(tmp_path / "plan.json", [(1, [8, 8, 8, 8])], stages=2, seq_len=SEQ, layers=4)
    fresh = RunConfig(plan=str(plan), out=str(tmp_path / "new"), resume_if_present=True, init_from="model.pt")
    assert start_or_continue(fresh, resume=False) == (fresh, False)
    run = checkpointed_run(tmp_path / "run", step=3)
    given = RunConfig(plan=str(plan), out=str(run), steps=5, device="cpu", init_from="model.pt")
    config, resume = start_or_continue(replace(given, resume_if_present=True), resume=False)
    assert resume and config.init_from is None
    assert start_or_continue(given, resume=False) == (given, False)  # without the flag: as before

    p = run_cli(capsys, "train", "--plan", plan, "--out", run, "--steps", 5, "--resume-if-present", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "--resume-step 3" in p.stdout
    p = run_cli(capsys, "train", "--plan", plan, "--out", run, "--resume-if-present", "--device", "cpu")
    assert p.returncode == 0 and p.stderr == ""
    assert f"{run}: the run already reached step 3 (--steps 3): nothing to train" in p.stdout
    other = write_plan_file(tmp_path / "other.json", [(1, [8, 8, 8, 8])], stages=2, seq_len=SEQ, layers=6)
    p = run_cli(capsys, "train", "--plan", other, "--out", run, "--steps", 5, "--resume-if-present", "--dry-run")
    assert_one_line_error(p, str(other), "its model differs from the run's", "its own model")
    p = run_cli(capsys, "train", "--plan", plan, "--resume-if-present", "--dry-run")
    assert_one_line_error(p, "--resume-if-present", "needs --out")
