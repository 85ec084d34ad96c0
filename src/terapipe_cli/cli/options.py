"""Options that mean the same in several commands, declared once so that their name and help cannot drift."""

from __future__ import annotations

from typing import Annotated

import typer

# The one device rule behind it: `terapipe_cli.config.device.resolve_device`.
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA when present), cpu or cuda.")]

# The one precision rule behind it: `terapipe_cli.config.device.resolve_precision` (None: not given, the default).
PrecisionOption = Annotated[
    str | None,
    typer.Option(
        "--precision",
        help="fp32, bf16 or fp16: bf16/fp16 compute under autocast with fp32 master weights.",
        show_default="auto: bf16 on CUDA, fp32 on CPU",
    ),
]
