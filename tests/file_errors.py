"""The one check every reader of a user's file shares: a bad file is one `UserError`, one line, naming it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from terapipe_cli.errors import UserError


def assert_file_error(read: Callable[[Path], object], path: Path, *words: str) -> None:
    """``read(path)`` raises a one-line `UserError` that names the file and every word."""
    with pytest.raises(UserError) as err:
        read(path)
    message = str(err.value)
    assert "\n" not in message, message
    for word in (str(path), *words):
        assert word in message, message
