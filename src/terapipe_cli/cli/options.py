"""Options that mean the same in several commands, declared once so that their name and help cannot drift; and the
typer options of a settings dataclass, derived from its fields (`settings_options`)."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer

from terapipe_cli.config.fields import doc_of, field_types, flag_of


def config_option(table: str, note: str = "keys: the options' names with underscores") -> object:
    """``--config FILE`` of a command whose settings are declared once (`settings_options`): a TOML file with a
    ``[table]`` table of them, keys as the options' names with underscores; flags given override it."""
    return Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help=f"A TOML file with a \\[{table}] table of these settings ({note}); flags given override it.",
            show_default=False,
        ),
    ]


def settings_options(cls) -> list[inspect.Parameter]:
    """One typer option per field of a settings dataclass (`config.fields.setting`): its flag (``--warmup-steps``
    for ``warmup_steps``, or the field's own), its one-line doc as help, its shown default and help panel. Every
    option defaults to None (not given), so a value from a ``--config`` file is overridden only by a flag given;
    booleans come as ``--verify/--no-verify`` for the same reason."""
    kinds = field_types(cls)
    params = []
    for f in fields(cls):
        doc, kind = doc_of(f), kinds[f.name]
        names = [f"{flag_of(f)}/--no-{flag_of(f)[2:]}"] if kind is bool else [flag_of(f)]
        names += [doc.short] if doc.short else []
        metavar = doc.metavar or ("NAME" if typing.get_origin(kind) is list else None)  # a list: one name each time
        option = typer.Option(
            *names, help=doc.help, show_default=doc.shown_default or False, rich_help_panel=doc.panel, metavar=metavar
        )
        listed = typing.get_origin(kind) is list
        typed = (list[Path] if listed else Path) if doc.path else kind
        annotation = Annotated[typed | None, option]
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation))
    return params


def given(options: dict) -> dict:
    """The options given on the command line (None: not given, left out), files as the strings a settings
    dataclass keeps (`Doc.path`)."""

    def plain(v):
        return [plain(x) for x in v] if isinstance(v, list) else str(v) if isinstance(v, Path) else v

    return {name: plain(v) for name, v in options.items() if v is not None}


def with_settings(command: Callable, cls, *leading: inspect.Parameter) -> Callable:
    """``command`` as typer sees it: the ``leading`` parameters, then one option per field of ``cls``
    (`settings_options`); it is called with all of them as keyword arguments."""

    def wrapped(**kwargs):
        return command(**kwargs)

    params = [*leading, *settings_options(cls)]
    wrapped.__signature__ = inspect.Signature(params)
    wrapped.__annotations__ = {p.name: p.annotation for p in params}
    wrapped.__name__, wrapped.__doc__ = command.__name__, command.__doc__
    return wrapped


def option(name: str, annotation, default) -> inspect.Parameter:
    """A keyword parameter for `with_settings`' leading ones: ``annotation`` is ``Annotated[type, typer.Option]``."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
