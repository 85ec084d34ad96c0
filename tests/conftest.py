"""Shared fixtures: tiny models that train in milliseconds on one CPU thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from terapipe_cli.config import ModelConfig


def tiny_model(layers: int = 4, hidden: int = 32, heads: int = 2, vocab: int = 256, seq_len: int = 64) -> ModelConfig:
    return ModelConfig(name="test-tiny", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len)


@pytest.fixture
def tiny() -> ModelConfig:
    """4 layers, H = 32, 2 heads, byte vocabulary, L up to 64."""
    return tiny_model()


def write_plan_file(path, slices, *, stages: int, layers: int = 6, seq_len: int = 32, data_parallel: int = 1):
    """A hand-made plan for a tiny model (H = 32, 2 heads) over ``slices``; returns the path."""
    from terapipe_cli.files import write_json_atomic
    from terapipe_cli.plan import make_plan_dict

    model = tiny_model(layers=layers, seq_len=seq_len)
    plan = make_plan_dict(
        model=model,
        stages=stages,
        batch_size=sum(b for b, _ in slices),
        seq_len=seq_len,
        token_step=1,
        slices=slices,
        data_parallel=data_parallel,
    )
    write_json_atomic(path, plan)
    return path


ROOT = Path(__file__).resolve().parents[1]


def terapipe(
    *args, cwd: str | Path | None = None, env: dict | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Run ``python -m terapipe_cli ARGS`` as a user would: a real process, its exit code, stdout and stderr.

    The package is found through PYTHONPATH (so a checkout without an install works), and the terminal is a
    wide dumb one (no colour, no wrapping at 80 columns) so that assertions on output are stable.
    """
    base = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "terapipe_cli", *map(str, args)],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(p: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 2, exactly one ``terapipe: error:`` line on stderr naming every word, no traceback."""
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("terapipe: error: "), p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in lines[0], lines[0]
