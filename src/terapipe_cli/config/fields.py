"""Settings as dataclass fields with one-line docs, and the one reader of their TOML tables and JSON objects.

A settings dataclass declares each field with `setting`: its doc (one line), and optionally its command-line flag,
bounds and how it is shown. Everything else derives from the fields — the known keys of a file, the validation of
every value by its annotated type (``int``, ``float``, ``bool``, ``str``, ``list[str]``, ``X | None``), the typer
options of a command (cli/options.py) — so no list of field names is written twice (torchtitan's job config does the
same).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from terapipe_cli.files import Fields


@dataclass(frozen=True)
class Doc:
    """What a `setting` field carries besides its default (``dataclasses.field(metadata=...)``)."""

    help: str
    flag: str | None = None  # the command-line flag (default: ``--`` and the name with dashes)
    short: str | None = None  # a one-letter alias, e.g. ``-d``
    minimum: float | None = None
    positive: bool = False
    choices: tuple[str, ...] | None = None
    shown: str | None = None  # the default as help shows it, when None stands for a computed one
    path: bool = False  # a file path: relative to the file that names it
    panel: str | None = None  # the group the option is listed under in ``--help``
    resume: str | None = None  # for a resumed run (config/run.py): "keep", "change" or "agree"


def setting(help: str, default: Any = None, **doc: Any) -> Any:
    """A dataclass field with its one-line doc and the `Doc` options (``flag``, ``minimum``, ``shown``, ...)."""
    return field(default=default, metadata={"doc": Doc(help, **doc)})


def doc_of(f: dataclasses.Field) -> Doc:
    return f.metadata.get("doc") or Doc("")


def flag_of(f: dataclasses.Field) -> str:
    return doc_of(f).flag or "--" + f.name.replace("_", "-")


def known_keys(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def field_types(cls) -> dict[str, type]:
    """Each field's type with ``| None`` taken off (``int | None`` -> ``int``)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        out[name] = args[0] if optional and len(args) == 1 else hint
    return out


def optional_fields(cls) -> set[str]:
    """The fields whose type admits None."""
    return {
        name
        for name, hint in typing.get_type_hints(cls).items()
        if type(None) in typing.get_args(hint) or hint is type(None)
    }


def read_fields(
    cls,
    obj: dict,
    where: str,
    *,
    prefix: str = "",
    what: str = "setting",
    base: Path | None = None,
    partial: bool = False,
) -> dict[str, Any]:
    """The values of ``obj`` (a TOML table or JSON object) for ``cls``'s fields, each checked against its type and
    bounds; a key that is no field, or a bad value, is one `UserError` naming ``where`` and ``prefix + key``. Keys
    left out are left out (the dataclass's defaults fill them); a required field left out is an error unless
    ``partial`` (overrides of some fields). Path fields are resolved against ``base``."""
    f = Fields(obj, where, prefix)
    names = known_keys(cls)
    unknown = sorted(set(obj) - set(names))
    if unknown:
        raise f.fail(unknown[0], f"is not a {what} (known: {', '.join(names)})")
    kinds, nullable = field_types(cls), optional_fields(cls)
    out: dict[str, Any] = {}
    for fd in fields(cls):
        name = fd.name
        if name not in obj:
            if not partial and fd.default is MISSING and fd.default_factory is MISSING:
                raise f.fail(name, "is missing")
            continue
        value = obj[name]
        if value is None and name in nullable:
            out[name] = None
            continue
        out[name] = check_value(f, name, value, kinds[name], doc_of(fd), base)
    return out


def check_value(f: Fields, name: str, value: Any, kind: type, doc: Doc, base: Path | None = None) -> Any:
    """One value checked against its field's type and `Doc` bounds (a one-line error naming the field)."""
    if typing.get_origin(kind) is list:  # a list of strings (a repeatable option)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise f.fail(name, f"must be a list of strings, got {value!r}")
        return list(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise f.fail(name, f"must be true or false, got {value!r}")
        return value
    if kind is int:
        return f.int(name, minimum=None if doc.minimum is None else int(doc.minimum))
    if kind is float:
        number = f.number(name, minimum=doc.minimum, positive=doc.positive)
        return number
    if kind is str:
        text = f.str(name)
        if doc.choices is not None and text not in doc.choices:
            raise f.fail(name, f"must be one of {', '.join(doc.choices)}, got {text!r}")
        if doc.path and base is not None:
            path = Path(text).expanduser()
            text = str(path if path.is_absolute() else base / path)
        return text
    return value


def to_toml(table: str, values: dict[str, Any], comments: dict[str, str] | None = None) -> str:
    """One TOML table of plain values (numbers, strings, booleans; None is left out, with its comment if any)."""
    comments = comments or {}
    lines = [f"[{table}]"]
    for key, value in values.items():
        note = f"  # {comments[key]}" if key in comments else ""
        if value is None:
            if note:
                lines.append(f"# {key} is not set:{note[3:]}")
            continue
        lines.append(f"{key} = {_toml_value(value)}{note}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
