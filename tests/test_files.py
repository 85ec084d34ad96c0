"""Atomic writes (no half-written output, no stray temporary file) and the validated JSON reader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from terapipe_cli import files
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_json, write_bytes_atomic, write_json_atomic, write_text_atomic


def test_write_json_creates_folders_and_ends_with_newline(tmp_path: Path) -> None:
    path = write_json_atomic(tmp_path / "a" / "b" / "x.json", {"schema": "s/1", "v": [1, 2]})
    assert path == tmp_path / "a" / "b" / "x.json"
    assert path.read_text().endswith("\n")
    assert json.loads(path.read_text()) == {"schema": "s/1", "v": [1, 2]}
    assert os.listdir(path.parent) == ["x.json"]


def test_overwrite_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    write_text_atomic(path, "a much longer first version\n")
    write_text_atomic(path, "short\n")
    assert path.read_text() == "short\n"


def test_failed_rename_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    write_json_atomic(path, {"schema": "s/1", "old": True})

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises((OSError, UserError)):  # a UserError naming the file would be better (see test_cli_plan)
        write_json_atomic(path, {"schema": "s/1", "old": False})
    assert json.loads(path.read_text()) == {"schema": "s/1", "old": True}
    assert os.listdir(tmp_path) == ["plan.json"]


def test_failed_write_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files.os, "fsync", broken_fsync)
    with pytest.raises((OSError, UserError)):
        write_bytes_atomic(tmp_path / "out.bin", b"data")
    assert os.listdir(tmp_path) == []


def test_interrupt_during_write_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C (a BaseException, not an Exception) must clean up too.
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(tmp_path / "out.txt", "x")
    assert os.listdir(tmp_path) == []


def test_written_files_follow_the_umask(tmp_path: Path) -> None:
    # A plan or profile written by one user must be readable by workers that the umask lets read it.
    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "x.json", {})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_unserialisable_object_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "x.json", {"v": object()})
    assert os.listdir(tmp_path) == []


def test_unwritable_folder_is_a_user_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError) as err:
        write_json_atomic(blocker / "x.json", {})
    assert str(blocker) in str(err.value)


# --- reading ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, word",
    [
        (b"{", "malformed JSON at line 1"),
        (b"\xff\xfe\x00garbage", "not text"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"schema": "other/1"}', "'schema' is 'other/1', expected 'want/1'"),
        (b"{}", "'schema' is None"),
    ],
)
def test_read_json_errors_name_the_file(tmp_path: Path, content: bytes, word: str) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        read_json(path, schema="want/1", what="thing")
    message = str(err.value)
    assert message.startswith(f"{path}: ") and word in message, message


def test_read_json_missing_and_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="thing not found"):
        read_json(tmp_path / "none.json", what="thing")
    with pytest.raises(UserError, match="folder"):
        read_json(tmp_path, what="thing")


def test_read_json_ok(tmp_path: Path) -> None:
    path = write_json_atomic(tmp_path / "f.json", {"schema": "want/1", "x": 1})
    assert read_json(path, schema="want/1") == {"schema": "want/1", "x": 1}


def test_fields_errors_name_file_and_dotted_field() -> None:
    f = Fields({"n": 3, "flag": True, "x": "s", "sub": {"k": -1}}, "f.json")
    assert f.int("n", minimum=1) == 3
    assert f.int("missing", default=7) == 7
    with pytest.raises(UserError, match=r"f.json: field 'flag' must be an integer"):
        f.int("flag")  # a bool is not an integer here
    with pytest.raises(UserError, match="field 'gone' is missing"):
        f.get("gone")
    with pytest.raises(UserError, match=r"field 'sub.k' must be at least 0"):
        f.sub("sub").number("k", minimum=0)
    with pytest.raises(UserError, match="field 'x' must be an object"):
        f.sub("x")
    with pytest.raises(UserError, match="must be positive"):
        Fields({"v": 0}, "w").number("v", positive=True)
    with pytest.raises(UserError, match="must be a number"):
        Fields({"v": float("nan")}, "w").number("v")


def test_user_error_is_one_line() -> None:
    err = UserError("first line\nsecond   line", where="file.json")
    assert str(err) == "file.json: first line second line"
    assert err.exit_code == 2
