"""How far to trust a profile's fitted parts: one warning line per fit that is off, for `terapipe profile` to print
after it writes a profile and for `terapipe plan` to print about the profile it plans from. Pure Python, no torch.

Two fits of a ``terapipe.profile/2`` or ``/1`` (`costmodel`) are checked:

* **The context term** t_ctx(b, i, j) of either pass: its mean relative error on the held-out tiles
  (``context.forward|backward.heldout_rel_err_mean``, the error of the whole tile time the planner adds up) above
  `CONTEXT_ERR_LIMIT`. Checked for every profile that records it, measured or analytic.
* **The stage-to-stage link** ``latency_s + bytes / bytes_per_s`` of a measured profile, as `profile.comm` fits it
  (`profile.fit.fit_link`: least squares in relative terms, both terms bounded at zero, the slope at no less than
  1e-15 s/B). The fit is *degenerate* when any of these holds:

  - the bandwidth is at least `LINK_BYTES_PER_S_LIMIT` (100 TB/s): no link between two devices moves that, so the
    fitter found message times that do not grow with size and clipped the slope at its bound (then 1 PB/s);
  - the latency is below `LINK_LATENCY_FLOOR_S` (1 ns): clipped at its bound of zero, so times did not level off
    for small messages either;
  - the fit's mean relative error over the message sizes (``comm.fit_rel_err_mean``) is above `LINK_ERR_LIMIT`.

  A link the profile did not measure is not checked: an analytic or example profile's comes from a hardware file
  or a note, and ``--no-comm`` records a free link (no ``comm.sizes_bytes``: nothing was fitted).
"""

from __future__ import annotations

import math

from terapipe_cli.plan.costmodel import Profile
from terapipe_cli.units import format_link

CONTEXT_ERR_LIMIT = 0.10
LINK_ERR_LIMIT = 0.25
LINK_BYTES_PER_S_LIMIT = 1e14
LINK_LATENCY_FLOOR_S = 1e-9


def fit_warnings(profile: Profile) -> list[str]:
    """One line per fit of ``profile`` that is off (module docstring), saying which, by how much and what to do;
    empty when every fit it records is good."""
    lines = [_context_warning(profile), _link_warning(profile)]
    return [line for line in lines if line]


def _context_warning(profile: Profile) -> str | None:
    high = []
    for which, fit in (("forward", profile.context_forward), ("backward", profile.context_backward)):
        err = _number(fit.heldout_rel_err_mean)
        if err is not None and err > CONTEXT_ERR_LIMIT:
            high.append(f"{which} {err:.1%}")
    if not high:
        return None
    return (
        f"the context fit's held-out tile error is {' and '.join(high)} on average (above {CONTEXT_ERR_LIMIT:.0%}), "
        f"so tiles with context may be priced that far off; {_context_advice(profile)}"
    )


def _context_advice(profile: Profile) -> str:
    if profile.source != "measured":
        return (
            "the context term's form does not follow this estimate closely: measure a profile on the device "
            "(`terapipe profile --model ...`) to plan long contexts"
        )
    steps = []
    if _quick(profile):
        steps.append("without --quick (more rounds and context tiles)")
    steps.append("on an idle machine (other busy processes make single timings jump)")
    clock = str(profile.device.get("clock", ""))
    if profile.device.get("kind") == "cpu" and clock.startswith("wall") and profile.tensor_parallel == 1:
        steps.append("with --clock cpu (counts this process's own CPU time, not the time others take from its core)")
    elif profile.tensor_parallel > 1:
        steps[-1] = f"on an idle machine with a free core or GPU for each of the {profile.tensor_parallel} processes"
    return "measure again " + _and(steps)


def _link_warning(profile: Profile) -> str | None:
    comm = profile.raw.get("comm") or {}
    if profile.source != "measured" or "sizes_bytes" not in comm:
        return None
    why = []
    if profile.bytes_per_s >= LINK_BYTES_PER_S_LIMIT:
        why.append(
            f"the bandwidth is beyond any link ({LINK_BYTES_PER_S_LIMIT / 1e12:.0f} TB/s or more, at or near the "
            "fit's bound of 1 PB/s): message times did not grow with size"
        )
    if profile.latency_s < LINK_LATENCY_FLOOR_S:
        why.append("the latency is clipped at zero")
    err = _number(comm.get("fit_rel_err_mean"))
    if err is not None and err > LINK_ERR_LIMIT:
        sizes = len(comm["sizes_bytes"]) if isinstance(comm["sizes_bytes"], list) else "its"
        why.append(f"its mean error over the {sizes} message sizes is {err:.0%} (above {LINK_ERR_LIMIT:.0%})")
    if not why:
        return None
    more = ["without --quick (more message sizes and rounds)"] if _quick(profile) else []
    again = _and([*more, "on an idle machine"])
    return (
        f"the stage-to-stage link fit {format_link(profile.latency_s, profile.bytes_per_s)} is degenerate: "
        f"{'; '.join(why)}; plans price sending activations with it, so measure again {again}"
    )


def _quick(profile: Profile) -> bool:
    """Measured with ``--quick`` (its ``grid.kind``): fewer rounds, context tiles and message sizes."""
    grid = profile.raw.get("grid")
    return isinstance(grid, dict) and grid.get("kind") == "quick"


def _number(value) -> float | None:
    """A finite number recorded in the profile, else None (an old or hand-made profile may hold none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
