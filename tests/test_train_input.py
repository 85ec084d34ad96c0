"""Bad input to `terapipe train`: one line, exit 2, before any worker starts (in-process: no workers)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, terapipe, write_plan_file

from terapipe_cli.cli import main


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
    assert code == 2 and "token id 999, outside the model's vocabulary of 256" in err


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
    from terapipe_cli.config.run import RunConfig
    from terapipe_cli.train.prepare import prepare_run

    settings = RunConfig(plan=str(plan), steps=3, out=str(tmp_path / "r"), checkpoint_every=1, device="cpu")
    prepare_run(settings)
    code, err = run(capsys, "--resume", "--out", str(tmp_path / "r"))
    assert code == 2 and "no complete checkpoint to resume from" in err
    code, err = run(capsys, "--plan", str(plan), "--out", str(tmp_path / "r"))
    assert code == 2 and "already holds a run" in err


def test_verify_cannot_follow_resume(tmp_path, capsys):
    code, err = run(capsys, "--resume", "--verify", "--out", str(tmp_path / "r"))
    assert code == 2 and "--verify" in err


def test_a_live_run_folder_is_refused(tmp_path):
    """While `terapipe train` runs in a folder it holds its lock: a second train, --resume or report says so in one
    line. The live run hangs at step 3 (a test fault) until its 20-s wait limit ends it (long enough for the three
    commands on a loaded machine); then --resume works."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": "", "TERAPIPE_TEST_FAULT": "hang:1:3"}
    args = ["train", "--plan", str(plan), "--steps", "4", "--checkpoint-every", "1", "--timeout-s", "20"]
    args += ["--out", str(run), "--device", "cpu"]
    live = subprocess.Popen([sys.executable, "-m", "terapipe_cli", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(read_metrics_safe(run)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(read_metrics_safe(run)) >= 2, "the run did not start"
        for cmd, what in [
            (("train", "--plan", str(plan), "--out", str(run), "--device", "cpu"), "use another --out"),
            (("train", "--resume", "--out", str(run), "--dry-run", "--device", "cpu"), "resume it once"),
            (("report", str(run)), "report on it once"),
        ]:
            p = terapipe(*cmd)
            assert_one_line_error(p, f"a `terapipe train` is running in this folder (pid {live.pid}): {what}")
    finally:
        assert live.wait(timeout=120) != 0  # ended by its wait limit
    p = terapipe("train", "--resume", "--out", str(run), "--device", "cpu")
    assert p.returncode == 0, p.stderr


def read_metrics_safe(run) -> list[str]:
    path = run / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []
