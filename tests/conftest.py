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
