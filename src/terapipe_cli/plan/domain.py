"""Where a profile's times hold, and where they come from (docs/design.md §3a). Imports no torch.

Domain. A profile times tiles on a grid of batch sizes × token lengths (every token grid reaches the model's
seq_len, which a plan's L never exceeds) and fits the context term on tiles with i + j ≤ L. Between grid points the
cost model interpolates; beyond the grid it would have to extrapolate, and a line through the two largest batch
sizes is no model of a device: where a dispatch floor makes t(8) ≈ t(4), the line through them prices 32 sequences
as nearly free. So the planner prices no tile outside the grid: a batch slice of fewer sequences than the grid's
smallest or more than its largest costs +inf (`CostModel(within_profile=True)`), and neither the search nor a
baseline uses it; every scheme of a plan's table is priced by the same numbers. An analytic profile is a model that
holds at any b: `terapipe plan` prices it again at the sizes its batch needs (`profile.analytic.extended_for_batch`),
and the plan says so (`Domain.line`).

Provenance. Every plan names its profile's source (`provenance`): measured (the device, the date), analytic (the
hardware file, and whether its constants are calibrated on measurements or estimated from datasheets) or an
example (made up to show the format).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.plan.costmodel import Profile


@dataclass(frozen=True)
class Domain:
    """The batch-slice sizes a profile prices: ``smallest`` to ``largest`` sequences (interpolated between the grid's
    sizes); ``added``: sizes an analytic profile was priced at beyond its file's grid (``grid``)."""

    smallest: int
    largest: int
    grid: tuple[int, ...]
    added: tuple[int, ...] = ()

    def line(self, batch_size: int) -> str | None:
        """One line when the domain shaped the plan of ``batch_size`` sequences per replica; None otherwise."""
        if self.added:
            return (
                f"batch slices priced by the analytic model at {_sizes(self.added)} sequences beyond the profile's "
                f"grid of {_sizes(self.grid)} (interpolated between those sizes)"
            )
        if batch_size > self.largest:
            sizes = ",".join(str(b) for b in _doubling(self.grid, batch_size))
            return (
                f"batch slices of at most {self.largest} sequences, the largest the profile timed (not extrapolated "
                f"beyond it); `terapipe profile --batch-sizes {sizes}` times larger ones"
            )
        return None

    def to_dict(self) -> dict:
        return {"batch_slices": [self.smallest, self.largest], "grid": list(self.grid), "added": list(self.added)}


def domain_of(profile: Profile) -> Domain:
    extended = profile.raw.get("extended")
    added = tuple(extended.get("added", ())) if isinstance(extended, dict) else ()
    grid = tuple(b for b in profile.batch_sizes if b not in added)
    return Domain(min(profile.batch_sizes), max(profile.batch_sizes), grid, added)


def _sizes(sizes) -> str:
    return ", ".join(str(b) for b in sizes)


def _doubling(grid, batch_size: int) -> list[int]:
    """The grid doubled from its largest size until it reaches ``batch_size`` (the last one capped at it)."""
    sizes = list(grid)
    while sizes[-1] < batch_size:
        sizes.append(min(2 * sizes[-1], batch_size))
    return sizes


def provenance(profile: Profile) -> str:
    """Where the profile's numbers come from, in words: ``measured on cpu (AMD EPYC), 2026-11-21``, ``analytic:
    hardware a100.toml, constants estimated from datasheets, none measured``, ``example: made-up numbers``."""
    device = profile.device
    created = str(profile.raw.get("created", ""))[:10] or "date not recorded"
    if profile.source == "measured":
        name = device.get("name") or "?"
        return f"measured on {device.get('kind', '?')} ({name}), {created}"
    if profile.source == "analytic":
        hardware = device.get("hardware_file")
        named = Path(hardware).name if isinstance(hardware, str) else device.get("hardware", "?")
        return f"analytic: hardware {named}, {_constants(profile)}"
    if profile.source == "operators":
        table = profile.raw.get("operator_table", {}).get("path", "?")
        return f"operators: each kernel priced from the table {Path(table).name} ({device.get('name', '?')}), {created}"
    return "example: made-up numbers that show the format, not a measurement"


def _constants(profile: Profile) -> str:
    constants = profile.device.get("constants")
    if constants == "calibrated":
        return "constants calibrated on measured tiles"
    if constants == "estimated":
        return "constants estimated from datasheets, none measured"
    return "its constants' source not recorded (a profile from before it was)"


def provenance_record(profile: Profile) -> dict:
    """The plan's ``profile`` fields that say where its numbers come from (docs/design.md §8)."""
    device = profile.device
    out = {"provenance": provenance(profile), "created": profile.raw.get("created")}
    if profile.source == "analytic":
        out.update(hardware_file=device.get("hardware_file"), constants=device.get("constants"))
    out["domain"] = domain_of(profile).to_dict()
    return out
