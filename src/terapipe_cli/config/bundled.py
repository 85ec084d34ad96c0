"""Configs shipped with the package (``configs/models``, ``configs/hardware``, ``configs/experiments``) and the one
TOML reader: a config the user names is a file path or the name of a bundled one (`find_config`)."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

from terapipe_cli.errors import UserError
from terapipe_cli.files import read_user_text

BUNDLED_KINDS = ("models", "hardware", "experiments")


def bundled_names(kind: str) -> list[str]:
    """The names of the configs of ``kind`` shipped with the package (``--model tiny``, ``--hardware h100``)."""
    folder = resources.files("terapipe_cli") / "configs" / kind
    return sorted(e.name.removesuffix(".toml") for e in folder.iterdir() if e.name.endswith(".toml"))


def bundled_config_summaries(kind: str) -> list[tuple[str, str]]:
    """(name, the file's first comment line) of each bundled config of ``kind``."""
    folder = resources.files("terapipe_cli") / "configs" / kind
    rows = []
    for name in bundled_names(kind):
        first = (folder / f"{name}.toml").read_text().splitlines()[:1]
        rows.append((name, first[0].lstrip("# ").strip() if first and first[0].startswith("#") else ""))
    return rows


def find_config(name_or_path: str | Path, kind: str, flag: str, *, prefix: bool = False) -> Path:
    """A config the user named: a file path as given, or the name of a bundled one (from any folder).

    A path that exists wins; a bare name (no folder, no suffix) is looked up among the package's configs of
    ``kind``; with ``prefix``, a bare name may also be the start of exactly one bundled name (``paper-04`` for
    ``paper-04-gpt3-13b``). Anything else is a one-line error that lists the bundled names (or the matches).
    """
    path = Path(name_or_path)
    if path.exists() or path.suffix or len(path.parts) != 1:
        return path  # the reader reports a missing or unreadable file in one line
    folder = resources.files("terapipe_cli") / "configs" / kind
    bundled = folder / f"{path.name}.toml"
    if bundled.is_file():
        return Path(str(bundled))
    names = bundled_names(kind)
    matches = [n for n in names if n.startswith(path.name)] if prefix else []
    if len(matches) == 1:
        return Path(str(folder / f"{matches[0]}.toml"))
    if matches:
        message = f"{str(path)!r} is the start of {len(matches)} bundled {kind} configs: {', '.join(matches)}"
    else:
        message = f"no file {str(path)!r} here and no bundled {kind} config of that name (bundled: {', '.join(names)})"
    raise UserError(message, where=flag)


def load_toml(path: str | Path, what: str = "config") -> dict:
    """Parse a TOML file the user named (one-line `UserError` naming it when it is missing or malformed)."""
    path = Path(path)
    text = read_user_text(path, name=f"{what} file", expected=f"a {what} TOML file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"malformed TOML: {e}", where=str(path)) from None
