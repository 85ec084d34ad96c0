"""How times, sizes and moments are written for people: one formatter each, used by every command and report."""

from __future__ import annotations

import datetime as dt


def format_seconds(s: float | None, *, digits: int = 2) -> str:
    """Milliseconds below one second, seconds above; ``–`` for an unknown value."""
    if s is None:
        return "–"
    return f"{s * 1e3:.{digits}f} ms" if abs(s) < 1 else f"{s:.{max(digits, 3)}f} s"


def format_link(latency_s: float, bytes_per_s: float) -> str:
    """A link ``latency + bytes / bandwidth`` as the profile fits it: ``30.5 µs + bytes / 3.48 GB/s``."""
    return f"{latency_s * 1e6:.1f} µs + bytes / {bytes_per_s / 1e9:.2f} GB/s"


def format_duration(s: float) -> str:
    """A wait in whole units for a progress line: ``42s``, ``3m05s``, ``2h07m``."""
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_bytes(n: float | None, unit: str | None = None) -> str:
    """Bytes in MiB or GiB with one decimal (by default GiB from 1 GiB up, else MiB); ``–`` for an unknown value."""
    if n is None:
        return "–"
    unit = unit or ("GiB" if n >= 2**30 else "MiB")
    scale = {"MiB": 2**20, "GiB": 2**30}[unit]
    return f"{n / scale:.1f} {unit}"


def format_stages(flags) -> str:
    """The stages whose flag is on, runs of three or more as ranges: ``stage 0``, ``stages 0, 1``,
    ``stages 0–33, 39``; empty when none is."""
    on = [k for k, flag in enumerate(flags) if flag]
    runs: list[list[int]] = []
    for k in on:
        if runs and runs[-1][-1] == k - 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    parts = []
    for run in runs:
        parts += [f"{run[0]}–{run[-1]}"] if len(run) > 2 else [str(k) for k in run]
    return f"stage{'s' if len(on) > 1 else ''} {', '.join(parts)}" if on else ""


def utc_timestamp() -> str:
    """The moment a file is written, as stored in its ``"created"`` field (ISO 8601, UTC, whole seconds)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def folder_stamp() -> str:
    """A local date-time for default run-folder names (``runs/20261123-052301``): sorts by time, no spaces."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")
