"""Versioned JSON files: atomic writes and validated reads.

Every file terapipe writes carries a ``"schema"`` field (``"terapipe.plan/1"``); every reader checks it.
Writes go to a temporary file in the same folder and are renamed into place, so an interrupted or failed
command never leaves a half-written output.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from terapipe_cli.errors import UserError
from terapipe_cli.units import format_bytes


def check_output_file(
    path: Path, *, kind: str, schema: str | tuple[str, ...] | None, force: bool, example: str, flag: str = "--out"
) -> None:
    """Check an output file before any work starts (one-line `UserError` naming ``flag``):

    - it names a file, not a folder (``example`` is the file name suggested instead);
    - at most its own folder is created: a folder further up that does not exist is an error, not made silently;
    - an existing file is overwritten only when it is of the kind being written (a JSON object whose "schema" is
      ``schema``, or one of them), or with ``force``;
    - the nearest existing folder is writable.
    """
    text = str(path)
    if path.is_dir() or text.endswith(("/", os.sep)):
        raise UserError(
            f"{text!r} names a folder; give the {kind} file to write, e.g. {Path(text) / example}", where=flag
        )
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists() and not parent.parent.exists():
        raise UserError(f"folder {parent.parent} does not exist (only {parent.name}/ would be created)", where=flag)
    if path.exists() and not force:
        if schema is None:
            raise UserError(f"{text} exists; pass --force to overwrite it", where=flag)
        if _schema_of(path) not in ((schema,) if isinstance(schema, str) else schema):
            raise UserError(f"{text} exists and is not a {kind}; pass --force to overwrite it", where=flag)
    nearest = parent if parent.exists() else parent.parent
    if not os.access(nearest, os.W_OK):
        raise UserError(f"cannot write {text} (folder {nearest} is not writable)", where=flag)


def _schema_of(path: Path) -> str | None:
    """The "schema" of a JSON object file; None for anything else."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return obj.get("schema") if isinstance(obj, dict) else None


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, or none left to this user (a quota)


def why_not_written(e: OSError) -> str:
    """A failed write's cause in words: "disk full (No space left on device)" for a full disk or quota, else the
    system's own."""
    reason = e.strerror or str(e)
    return f"disk full ({reason})" if e.errno in DISK_FULL else reason


def check_free_space(path: str | os.PathLike, needed: int, *, estimate: str = "") -> None:
    """A one-line `UserError` naming ``path`` and saying "disk full" when its file system (asked at its nearest
    existing folder) has fewer than ``needed`` bytes free; ``estimate``: how ``needed`` was estimated, said too."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # nothing to ask (a folder gone meanwhile): the write itself will say what is wrong
    if free < needed:
        how = f" ({estimate})" if estimate else ""
        raise UserError(
            f"disk full: needs about {_size(needed)}{how}, {folder} has {_size(free)} free", where=str(path)
        )


def _size(n: int) -> str:
    return format_bytes(n) if n >= 2**20 else f"{n:,} bytes"


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file and a rename."""
    return write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    if path.is_dir():
        raise UserError("is a folder; give a file path to write", where=str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create folder ({e.strerror})", where=str(path.parent)) from None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise UserError(f"cannot write here ({e.strerror})", where=str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; outputs get the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise UserError(f"cannot write: {why_not_written(e)}", where=str(path)) from None
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def read_user_text(path: Path, *, name: str, expected: str) -> str:
    """The text of a file the user named; a missing file, a folder or bytes that are not text are one error.

    ``name`` says what the file is ("profile", "model config file"), ``expected`` what a folder should have
    been ("a profile (JSON file)").
    """
    if not path.exists():
        raise UserError(f"{name} not found", where=str(path))
    if path.is_dir():
        raise UserError(f"expected {expected}, found a folder", where=str(path))
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"not a {name}: not text", where=str(path)) from None
    except OSError as e:
        raise UserError(f"cannot read ({e.strerror})", where=str(path)) from None


def read_json(path: str | os.PathLike, *, schema: str | None = None, what: str = "file") -> dict:
    """Read a JSON object; with ``schema``, require its ``"schema"`` field to equal it."""
    path = Path(path)
    text = read_user_text(path, name=what, expected=f"a {what} (JSON file)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", where=str(path)) from None
    if not isinstance(obj, dict):
        raise UserError(f"not a {what}: expected a JSON object", where=str(path))
    if schema is not None:
        found = obj.get("schema")
        if found != schema:
            raise UserError(f"field 'schema' is {found!r}, expected {schema!r} (not a {what}?)", where=str(path))
    return obj


def read_json_with_schema(path: str | os.PathLike, schema: str, what: str) -> dict:
    """Read a JSON object that must carry a ``"schema"`` field; its value is checked by the caller's validator
    (which names the field), a missing one here, with a hint that the file may be something else."""
    obj = read_json(path, what=what)
    if "schema" not in obj:
        raise UserError(f"field 'schema' is missing (expected {schema!r}; not a {what}?)", where=str(path))
    return obj


class Fields:
    """Typed, validated access to the fields of a JSON object, with errors naming file and field."""

    def __init__(self, obj: dict, where: str, prefix: str = "") -> None:
        self.obj, self.where, self.prefix = obj, where, prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, message: str) -> UserError:
        return UserError(f"field '{self._name(key)}' {message}", where=self.where)

    def get(self, key: str, default: Any = ...) -> Any:
        if key not in self.obj:
            if default is ...:
                raise self.fail(key, "is missing")
            return default
        return self.obj[key]

    def int(self, key: str, *, minimum: int | None = None, default: Any = ...) -> int:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, f"must be an integer, got {v!r}")
        if minimum is not None and v < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {v}")
        return v

    def number(self, key: str, *, minimum: float | None = None, positive: bool = False, default: Any = ...) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise self.fail(key, f"must be a number, got {v!r}")
        if positive and not v > 0:
            raise self.fail(key, f"must be positive, got {v}")
        if minimum is not None and v < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {v}")
        return float(v)

    def str(self, key: str, default: Any = ...) -> str:
        v = self.get(key, default)
        if not isinstance(v, str):
            raise self.fail(key, f"must be a string, got {v!r}")
        return v

    def list(self, key: str, default: Any = ...) -> list:
        v = self.get(key, default)
        if not isinstance(v, list):
            raise self.fail(key, f"must be a list, got {type(v).__name__}")
        return v

    def sub(self, key: str) -> Fields:
        v = self.get(key)
        if not isinstance(v, dict):
            raise self.fail(key, "must be an object")
        return Fields(v, self.where, f"{self._name(key)}.")
