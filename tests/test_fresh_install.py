"""A fresh install, used from an empty folder outside the repository, by bundled names only.

The package is built and installed (no dependencies: they are this environment's) into a folder of its own,
and every command runs from another, empty folder with only that install on the path: whatever the commands
need (bundled models, the default data) must come with the installed package, not from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from terapipe_cli.train.rundir import read_metrics


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return target


def _run(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed), "COLUMNS": "200", "NO_COLOR": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "terapipe_cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_profile_plan_train_report_export_from_an_empty_folder(installed, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run(
        [sys.executable, "-c", "import terapipe_cli; print(terapipe_cli.__file__)"],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
    )
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout + where.stderr

    steps = [
        ("configs",),
        ("profile", "--model", "tiny", "--quick", "--no-comm", "--no-allreduce", "--batch-sizes", "1"),
        ("plan", "--profile", "profile.json", "--stages", "2", "--batch", "1"),
        ("train", "--plan", "plan.json", "--steps", "3", "--out", "run", "--eval-every", "1"),
        ("report", "run", "--no-baseline", "--warmup", "1"),
        ("export", "run", "--out", "model.pt"),
    ]
    for args in steps:
        p = _run(installed, work, *args)
        assert p.returncode == 0, f"terapipe {' '.join(args)}:\n{p.stdout}\n{p.stderr}"
    assert sorted(f.name for f in work.iterdir()) == ["model.pt", "plan.json", "profile.json", "run"]
    assert all("val_loss" in r for r in read_metrics(work / "run"))
    assert (work / "run" / "report" / "loss.png").is_file()
    exported = torch.load(work / "model.pt", weights_only=True)
    assert exported["model_config"]["name"] == "tiny"
