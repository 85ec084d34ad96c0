"""Shared fixtures: tiny models that train in milliseconds on one CPU thread.

Tests run on the CPU, on a machine with a GPU as on one without: unless a test is marked ``gpu``, it sees no
GPU — in this process (`torch.cuda.is_available` is False, so ``--device auto`` means the CPU) and in every
process a test starts (``CUDA_VISIBLE_DEVICES=""``). GPU tests are decorated with `gpu_test` and run their
commands with ``terapipe(..., gpu=True)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from terapipe_cli.config.model import ModelConfig

# This process's own setting, before `hide_gpus` changes it for the session (None: not set).
CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
_REAL_CUDA: dict = {}  # torch.cuda's own is_available and device_count, while hidden


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: a test that uses the GPU (the others see none)")


def gpu_test(fn):
    """Decorates a GPU test: marked ``gpu`` (it sees the machine's GPUs) and skipped where there is none."""
    import torch

    available = torch.cuda.is_available()  # at collection, before `hide_gpus` hides the GPU
    return pytest.mark.gpu(pytest.mark.skipif(not available, reason="needs a CUDA GPU")(fn))


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Torch in this process on one thread: two pytest workers share two cores (scripts/test.sh), and two threads
    each would make them spin against each other (an in-process step measured 100x slower). Processes that tests
    start set their own threads, as the runtime's stage processes do."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def hide_gpus():
    """The session runs as on a machine without a GPU (module docstring); `show_gpus` undoes it for a GPU test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # for the processes tests start, and for CUDA not yet initialised
        torch = sys.modules.get("torch")
        if torch is not None:  # imported during collection: CUDA may be initialised, so the variable would not do
            _REAL_CUDA.update(is_available=torch.cuda.is_available, device_count=torch.cuda.device_count)
            mp.setattr(torch.cuda, "is_available", lambda: False)
            mp.setattr(torch.cuda, "device_count", lambda: 0)
        yield


@pytest.fixture(autouse=True)
def show_gpus(request, monkeypatch):
    """A test marked ``gpu`` sees the GPUs again, in its own process and in the ones it starts."""
    if request.node.get_closest_marker("gpu") is None:
        return
    if CUDA_VISIBLE_DEVICES is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", CUDA_VISIBLE_DEVICES)
    torch = sys.modules.get("torch")
    for name, real in _REAL_CUDA.items():
        monkeypatch.setattr(torch.cuda, name, real)


def tiny_model(layers: int = 4, hidden: int = 32, heads: int = 2, vocab: int = 256, seq_len: int = 64) -> ModelConfig:
    return ModelConfig(name="test-tiny", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len)


@pytest.fixture
def tiny() -> ModelConfig:
    """4 layers, H = 32, 2 heads, byte vocabulary, L up to 64."""
    return tiny_model()


def write_plan_file(path, slices, *, stages: int, layers: int = 6, seq_len: int = 32, data_parallel: int = 1):
    """A hand-made plan for a tiny model (H = 32, 2 heads) over ``slices``; returns the path."""
    from terapipe_cli.files import write_json_atomic
    from terapipe_cli.plan.file import make_plan_dict

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
    *args, cwd: str | Path | None = None, env: dict | None = None, timeout: float = 240, gpu: bool = False
) -> subprocess.CompletedProcess:
    """Run ``python -m terapipe_cli ARGS`` as a user would: a real process, its exit code, stdout and stderr.

    The package is found through PYTHONPATH (so a checkout without an install works), and the terminal is a
    wide dumb one (no colour, no wrapping at 80 columns) so that assertions on output are stable. The process
    sees no GPU unless ``gpu`` (then it sees what this process was started with).
    """
    base = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    base.pop("CUDA_VISIBLE_DEVICES", None)
    if not gpu:
        base["CUDA_VISIBLE_DEVICES"] = ""
    elif CUDA_VISIBLE_DEVICES is not None:
        base["CUDA_VISIBLE_DEVICES"] = CUDA_VISIBLE_DEVICES
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
