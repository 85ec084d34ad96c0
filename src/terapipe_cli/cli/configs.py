"""``terapipe configs``: what ships with the package, by the names the other commands accept."""

from __future__ import annotations

import typer
from rich.table import Table

from terapipe_cli.cli.console import make_console
from terapipe_cli.config.bundled import BUNDLED_KINDS, bundled_config_summaries

HELP = """List the bundled models, hardware files and experiments: the names `--model`, `--hardware` and the \
experiment loaders accept from any folder (a TOML path works everywhere too).

Example:  terapipe configs
"""


def configs() -> None:
    table = Table(title="bundled configs", title_justify="left")
    table.add_column("kind")
    table.add_column("name", no_wrap=True)
    table.add_column("what")
    for kind in BUNDLED_KINDS:
        for name, summary in bundled_config_summaries(kind):
            table.add_row(kind, name, summary)
    make_console(highlight=False).print(table)


def register(app: typer.Typer) -> None:
    app.command("configs", help=HELP)(configs)
