"""terapipe: plan and launch token-level pipeline-parallel training (TeraPipe).

The documented library modules: `terapipe_cli.planner` and `terapipe_cli.costmodel` (the planner, no torch) and
`terapipe_cli.exported` (an exported model loaded back, with torch)."""

from __future__ import annotations

__version__ = "0.1.0"
