"""Settings as dataclass fields with one-line docs, and the one reader of their TOML tables and JSON objects.

A settings dataclass declares each field with `setting`: its doc (one line), and optionally its command-line flag,
bounds and how it is shown. Everything else derives from the fields — the known keys of a file, the validation of
every value by its annotated type (``int``, ``float``, ``bool``, ``str``, ``list[str]``, ``X | None``), the typer
options of a command (cli/options.py) — so no list of field names is written twice (torchtitan's job config does the
same).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from terapipe_cli.config.bundled import load_toml
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields


@dataclass(frozen=True)
class Doc:
    """What a `setting` field carries besides its default (``dataclasses.field(metadata=...)``)."""

    help: str
    flag: str | None = None  # the command-line flag (default: ``--`` and the name with dashes)
    short: str | None = None  # a one-letter alias, e.g. ``-d``
    minimum: float | None = None
    positive: bool = False
    below: float | None = None  # an exclusive upper bound (a beta: below 1)
    choices: tuple[str, ...] | None = None
    fallback: Any = None  # the value of a setting left out (None: not given), where it is fixed
    shown: str | None = None  # the default as help shows it (default: the fallback), e.g. a computed one in words
    path: bool = False  # a file path: relative to the file that names it
    panel: str | None = None  # the group the option is listed under in ``--help``
    resume: str | None = None  # for a resumed run (config/run.py): "keep", "change", "layout" or "announce"
    metavar: str | None = None  # how ``--help`` names the option's value (default: from its type)

    @property
    def shown_default(self) -> str | None:
        """The default as help shows it: ``shown``, else the fallback (``on``/``off`` for a switch)."""
        if self.shown is not None or self.fallback is None:
            return self.shown
        if isinstance(self.fallback, bool):
            return "on" if self.fallback else "off"
        return f"{self.fallback:g}" if isinstance(self.fallback, float) else str(self.fallback)


def setting(help: str, default: Any = None, **doc: Any) -> Any:
    """A dataclass field with its one-line doc and the `Doc` options (``flag``, ``minimum``, ``shown``, ...)."""
    return field(default=default, metadata={"doc": Doc(help, **doc)})


def doc_of(f: dataclasses.Field) -> Doc:
    return f.metadata.get("doc") or Doc("")


def out_of_bounds(value: Any, doc: Doc) -> str | None:
    """What is wrong with a number or name for a field of ``doc`` (its minimum, sign, exclusive bound, choices),
    in words (``must be at least 1, got 0``); None when it is within them. NaN is within no bounds."""
    if doc.choices is not None and value not in doc.choices:
        return f"must be one of {', '.join(doc.choices)}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if doc.below is not None and not (value < doc.below and (doc.minimum is None or value >= doc.minimum)):
        if doc.minimum is None:
            return f"must be below {doc.below:g}, got {value}"
        return f"must be in [{doc.minimum:g}, {doc.below:g}), got {value}"
    if doc.minimum is not None and not value >= doc.minimum:
        return f"must be at least {doc.minimum:g}, got {value}"
    if doc.positive and not value > 0:
        return f"must be positive, got {value}"
    return None


def include_settings(component, *, optional: bool = False):
    """A class decorator, under ``@dataclass``: the settings of a component's own config dataclass (its `setting`
    fields, e.g. `config.optimizer.OptimizerConfig`) become fields of this one too, each declared once, with the
    component. ``optional``: each defaults to None (not given; a command's options, a TOML file's keys) with the
    component's default as its `Doc.fallback`; else the component's type and default (what a run keeps)."""

    def include(cls):
        annotations = dict(inspect.get_annotations(cls))
        hints = typing.get_type_hints(component)
        for f in fields(component):
            doc = doc_of(f)
            if optional:
                annotations[f.name] = hints[f.name] | None
                doc = dataclasses.replace(doc, fallback=f.default)
                setattr(cls, f.name, field(default=None, metadata={"doc": doc}))
            else:
                annotations[f.name] = hints[f.name]
                setattr(cls, f.name, field(default=f.default, metadata=f.metadata))
        cls.__annotations__ = annotations
        return cls

    return include


def component_of(component, settings: Any):
    """``component``'s config from the same-named fields of ``settings`` (a `RunArguments`; or a `RunConfig`, whose
    fields left out take the component's defaults)."""
    values = {f.name: getattr(settings, f.name) for f in fields(component)}
    return component(**{name: value for name, value in values.items() if value is not None})


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
        if doc.path and base is not None:  # a list of files, each relative to the file that names it
            return [str(Path(v).expanduser() if Path(v).expanduser().is_absolute() else base / v) for v in value]
        return list(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise f.fail(name, f"must be true or false, got {value!r}")
        return value
    if kind is int:
        return f.int(name, minimum=None if doc.minimum is None else int(doc.minimum))
    if kind is float:
        number = f.number(name, minimum=doc.minimum, positive=doc.positive)
        if doc.below is not None and (problem := out_of_bounds(number, doc)) is not None:
            raise f.fail(name, problem)
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


def toml_table(path: Path, table: str, what: str) -> dict:
    """The ``[table]`` table of the TOML file ``path`` (a ``what``, for the error of a file that cannot be read); a
    file with another table, or without this one, is one line."""
    data = load_toml(path, what)
    values = data.get(table)
    if not isinstance(values, dict):
        raise UserError(f"missing the [{table}] table", where=str(path))
    extra = sorted(set(data) - {table})
    if extra:
        raise UserError(f"unknown table [{extra[0]}] (only [{table}] is read)", where=str(path))
    return values


def read_table(cls, path: Path, table: str, *, what: str = "setting") -> dict[str, Any]:
    """The checked values of the ``[table]`` table of the TOML file ``path`` for ``cls``'s fields (`read_fields`;
    paths relative to the file): the ``--config FILE`` of a command whose settings are ``cls``."""
    values = toml_table(path, table, f"{table} config")
    return read_fields(cls, values, str(path), prefix=f"{table}.", what=what, base=path.parent)


class Fallbacks:
    """For a settings dataclass whose fields default to None (not given): `value` is a field's value, or its
    `Doc.fallback` when left out (None for a field whose default depends on something else)."""

    def value(self, name: str):
        v = getattr(self, name)
        return doc_of(self.__dataclass_fields__[name]).fallback if v is None else v


def to_toml(table: str, values: dict[str, Any], comments: dict[str, str] | None = None) -> str:
    """One TOML table of plain values (numbers, strings, booleans). None is left out, with ``comments[key]`` (what
    leaving it out means) as a comment line if there is one; a value given has no such comment."""
    comments = comments or {}
    lines = [f"[{table}]"]
    for key, value in values.items():
        if value is None:
            if key in comments:
                lines.append(f"# {key} is not set: {comments[key]}")
            continue
        lines.append(f"{key} = {_toml_value(value)}")
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
