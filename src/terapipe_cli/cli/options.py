"""Options that mean the same in several commands, declared once so that their name and help cannot drift."""

from __future__ import annotations

from typing import Annotated

import typer

# The one device rule behind it: `terapipe_cli.device.resolve_device`.
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA when present), cpu or cuda.")]
