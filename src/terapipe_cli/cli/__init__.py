"""The ``terapipe`` command. Thin: each command module parses, validates, calls the library, renders.

Every command lives in its own module here and registers itself through ``register(app)``.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import NoReturn

import typer

from terapipe_cli.ending import entry_point
from terapipe_cli.errors import Interrupted, StopSignal, UserError, signals_raise, threads_leave_signals_to_main
from terapipe_cli.version import __version__

# numpy starts its BLAS threads when it is first imported: started here, they leave the ending signals to the main
# thread (errors.threads_leave_signals_to_main), whose handler would never run if one of them took a SIGTERM while
# the main thread waits in a read (`data tokenize` on a pipe).
with threads_leave_signals_to_main():
    import numpy  # noqa: F401

app = typer.Typer(
    name="terapipe",
    help="Plan and launch token-level pipeline-parallel training (TeraPipe): profile -> plan -> train -> report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"terapipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Plan and launch token-level pipeline-parallel training (TeraPipe): profile -> plan -> train -> report."""
    # A callback keeps `terapipe` a command group even while only one command is registered.


# Command modules, in the order a user runs them.
COMMANDS: tuple[str, ...] = (
    "profile",
    "plan",
    "data",
    "train",
    "launch_script",
    "report",
    "export",
    "sample",
    "run",
    "configs",
)


def _register() -> None:
    for name in COMMANDS:
        importlib.import_module(f"terapipe_cli.cli.{name}").register(app)


_register()


def fail(message: str) -> None:
    """One line on stderr, exit code 2."""
    sys.stderr.write(f"terapipe: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)


# Newer typer vendors click (typer.main._click); older typer uses the click package. Use whichever typer uses.
_click = getattr(typer.main, "_click", None) or importlib.import_module("click")
_exceptions = _click.exceptions


@functools.cache
def _command():
    """The click command typer builds from ``app`` (built once: a process that runs many commands in turn, as the
    tests do, would otherwise rebuild the whole tree for each)."""
    return typer.main.get_command(app)


def main(argv: list[str] | None = None) -> None:
    command = _command()
    _refuse_both_switches(command, sys.argv[1:] if argv is None else [str(a) for a in argv])
    try:
        with signals_raise():  # SIGTERM unwinds like Ctrl-C: no temporary file is left behind
            code = command.main(args=argv, prog_name="terapipe", standalone_mode=False)
    except UserError as e:
        fail(str(e))
    except (Interrupted, StopSignal) as e:
        sys.stdout.flush()
        sys.stderr.write(f"terapipe: {e}\n")
        raise SystemExit(e.exit_code) from None
    except getattr(_exceptions, "NoArgsIsHelpError", ()) as e:
        print(e.ctx.get_help())
        raise SystemExit(0) from None
    except _exceptions.UsageError as e:
        where = f"{e.ctx.command_path}: " if e.ctx is not None else ""
        hint = " (see --help)" if e.ctx is not None else ""
        fail(f"{where}{e.format_message()}{hint}")
    except _exceptions.ClickException as e:
        fail(e.format_message())
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("terapipe: interrupted\n")
        raise SystemExit(Interrupted.exit_code) from None
    raise SystemExit(code if isinstance(code, int) else 0)


def entry() -> NoReturn:
    """The ``terapipe`` command (``python -m terapipe_cli``): `main`, then the process ends without the interpreter's
    teardown (`terapipe_cli.ending`). `main` itself raises ``SystemExit``, as a caller in the same process expects."""
    entry_point(main)


def _refuse_both_switches(command, argv: list[str]) -> None:
    """A switch given with its negation (``--document-mask --no-document-mask``) is one line, not the last one
    silently winning: the command's own flag pairs are looked up (click's ``opts`` and ``secondary_opts``)."""
    args = argv[: argv.index("--")] if "--" in argv else argv
    while args and args[0] in getattr(command, "commands", {}):  # a group: down to the command named
        command, args = command.commands[args[0]], args[1:]
    given = set(args)
    for param in getattr(command, "params", ()):
        on = [o for o in getattr(param, "opts", ()) if o in given]
        off = [o for o in getattr(param, "secondary_opts", ()) if o in given]
        if on and off:
            fail(f"{on[0]} and {off[0]} contradict each other: give one of them")
