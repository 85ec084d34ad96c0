"""Shared fixtures: tiny models that train in milliseconds on one CPU thread."""

from __future__ import annotations

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
