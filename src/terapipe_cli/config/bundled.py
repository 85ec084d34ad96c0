"""Configs shipped with the package (``configs/models``, ``configs/hardware``, ``configs/experiments``) and the one
TOML reader: a config the user names is a file path or the name of a bundled one (`find_config`)."""

from __future__ import annotations

import re
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
    ``kind``; with ``prefix``, a bare name may also be the start of exactly one bundled name up to a word boundary
    (``paper-04`` for ``paper-04-gpt3-13b``, not ``paper-1`` for ``paper-10-gpt3-175b``: `prefix_matches`).
    Anything else is a one-line error that lists what the user may have meant (`near_names`), or else the bundled
    names.
    """
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".toml", ".json") or len(path.parts) != 1:
        return path  # the reader reports a missing or unreadable file in one line (a bare name may hold a dot: 3.1)
    folder = resources.files("terapipe_cli") / "configs" / kind
    bundled = folder / f"{path.name}.toml"
    if bundled.is_file():
        return Path(str(bundled))
    names = bundled_names(kind)
    if not prefix:
        raise UserError(_no_such_config(str(path), kind, names), where=flag)
    matches = prefix_matches(path.name, names)
    if len(matches) == 1:
        return Path(str(folder / f"{matches[0]}.toml"))
    starts = [n for n in names if n.startswith(path.name)]
    by_number = [n for n in near_names(path.name, names) if n not in starts]
    if matches:  # two or more
        message = f"{str(path)!r} is the start of {len(starts)} bundled {kind} configs: {', '.join(starts)}"
        if by_number:
            message += f"; read by number it also begins {', '.join(by_number)}"
    elif starts or by_number:
        meant = [n for n in names if n in starts or n in by_number]
        message = (
            f"no bundled {kind} config is named {str(path)!r} or begins with it up to a '-', '_' or '.'; "
            f"did you mean {_one_of(meant)}?"
        )
    else:
        message = _no_such_config(str(path), kind, names)
    raise UserError(message, where=flag)


# A bare name is the start of a bundled name only up to one of these (or the name's end): `paper-1` must not
# silently stand for `paper-10-gpt3-175b` when the user meant setting 1, `paper-01-gpt3-1b`.
WORD_BOUNDARIES = "-_."


def prefix_matches(prefix: str, names: list[str]) -> list[str]:
    """The ``names`` that begin with ``prefix`` followed by a word boundary (`WORD_BOUNDARIES`) or nothing; a
    ``prefix`` that itself ends with a boundary (``paper-04-``) cuts no word either."""
    if not prefix:
        return []
    ends_word = prefix[-1] in WORD_BOUNDARIES
    return [
        n
        for n in names
        if n.startswith(prefix) and (ends_word or n[len(prefix) : len(prefix) + 1] in ("", *WORD_BOUNDARIES))
    ]


def near_names(prefix: str, names: list[str]) -> list[str]:
    """The ``names`` that begin with ``prefix`` when runs of digits are compared as numbers (``paper-1`` begins
    ``paper-01-gpt3-1b``, ``gpt3-013b`` begins ``gpt3-13b``): what a user who wrote a number without its leading
    zeros, or with extra ones, may have meant. A trailing number must be the whole number there (``paper-1`` does
    not begin ``paper-10-gpt3-175b`` by number)."""
    want = _number_runs(prefix)
    if not want:
        return []
    out = []
    for name in names:
        have = _number_runs(name)
        if len(have) < len(want):
            continue
        head, last = have[: len(want) - 1], have[len(want) - 1]
        if head != want[:-1]:
            continue
        if last == want[-1] or (isinstance(last, str) and isinstance(want[-1], str) and last.startswith(want[-1])):
            out.append(name)
    return out


def _number_runs(text: str) -> list[str | int]:
    """``text`` cut into runs of digits (as ints) and runs of anything else: ``paper-01-gpt3`` ->
    ``['paper-', 1, '-gpt', 3]``."""
    return [int(run) if run[0] in "0123456789" else run for run in re.findall(r"[0-9]+|[^0-9]+", text)]


def _one_of(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _no_such_config(name: str, kind: str, names: list[str]) -> str:
    return f"no file {name!r} here and no bundled {kind} config of that name (bundled: {', '.join(names)})"


def load_toml(path: str | Path, what: str = "config") -> dict:
    """Parse a TOML file the user named (one-line `UserError` naming it when it is missing or malformed)."""
    path = Path(path)
    text = read_user_text(path, name=f"{what} file", expected=f"a {what} TOML file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"malformed TOML: {e}", where=str(path)) from None
