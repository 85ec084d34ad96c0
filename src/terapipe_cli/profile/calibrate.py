"""Calibration: fit a hardware file's free constants to measured tile times of the same device and precision.

The analytic model (`profile.analytic`) prices a layer from datasheet figures and a few modelling constants that
no datasheet gives: the fraction of peak a large matrix product reaches (``matmul_efficiency``), how fast that
fraction falls for small matrices (``matmul_half_dim``), the host's dispatch time per kernel (``dispatch_s``)
and, where it shows, the GPU's shortest kernel (``kernel_launch_s``). `calibrate` fits them to measured tile
times with ``scipy.optimize.least_squares`` on log errors, log(predicted / measured) — relative errors, so a
2 ms tile counts as much as a 100 ms one — and returns the calibrated hardware with its error on every tile.

Measured tile times come from a measured ``terapipe.profile/2`` or ``/1`` (its no-context grid and its context tiles,
forward and backward each; `from_profile`) or from a tile table (`read_tile_table`: CSV rows
``model,hidden,heads,b,i,j,eager_ms[,graphed_ms]``, totals of forward + backward, eager as the runtime runs
and optionally CUDA-graphed, which no host dispatches). Graphed tiles are priced with ``dispatch_s = 0``: fitted
together with eager ones, the eager times pin the dispatch floor and the graphed ones the GPU's own constants,
``kernel_launch_s`` among them (without graphed tiles it hides under the dispatch floor and is not fitted).

Pure numpy and scipy, no torch, no I/O beyond the readers; the CLI (`terapipe profile --calibrate`) renders.
"""

from __future__ import annotations

import csv
import io
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from terapipe_cli.config.device import same_device_name
from terapipe_cli.config.hardware import Hardware
from terapipe_cli.errors import UserError
from terapipe_cli.files import read_user_text
from terapipe_cli.models import GptConfig, ModelConfig
from terapipe_cli.plan.costmodel import Profile
from terapipe_cli.profile.analytic import layer_seconds

# What a calibration may fit, with the range it searches (a value at an edge says the data does not pin it).
BOUNDS = {
    "dispatch_s": (1e-7, 1e-3),
    "matmul_efficiency": (0.02, 1.0),
    "matmul_half_dim": (1.0, 4096.0),
    "kernel_launch_s": (1e-7, 1e-4),
}
# Tile sizes (b·i tokens) the error table groups by: upper bounds of each row.
SIZE_EDGES = (64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class TileTimes:
    """Measured seconds of one decoder layer on tiles (b, i, j) of one model shape, one way of running it."""

    model: ModelConfig
    kind: str  # what the error table calls these tiles: "grid", "context", "gpt3-1b eager", "gpt3-1b graphed"
    b: np.ndarray
    i: np.ndarray
    j: np.ndarray
    total_s: np.ndarray  # forward + backward
    forward_s: np.ndarray | None = None  # None where only the total was measured
    backward_s: np.ndarray | None = None
    graphed: bool = False  # CUDA-graphed: no host dispatch, priced with dispatch_s = 0
    # Whether each tile's backward added its weight gradients into standing ones (`Training.
    # grad_accumulate_bytes_per_param`): the runtime's profile does; a tile table's stand-alone timing loop does
    # not say so, and its tiles fit best without the pass (8.8% mean, against 8.9% at 6 and 16.7% at 12 bytes per
    # parameter), so they are priced without it.
    accumulates: bool = True


@dataclass(frozen=True)
class Measurement:
    """Everything measured on one device in one precision that a calibration fits."""

    source: str  # the file it came from
    device_name: str | None  # None: the file does not say (a tile table); the hardware file is trusted
    precision: str
    tiles: tuple[TileTimes, ...]

    @property
    def count(self) -> int:
        return sum(t.b.size for t in self.tiles)


@dataclass(frozen=True)
class SizeRow:
    """Errors of the tiles of one kind whose b·i falls in (low, high]."""

    kind: str
    low: int
    high: int
    tiles: int
    measured_s: float  # mean tile time (forward + backward) measured
    calibrated_s: float
    uncalibrated_s: float
    rel_err_mean: float  # calibrated against measured, |p − m| / m
    rel_err_max: float
    uncalibrated_rel_err_mean: float


@dataclass(frozen=True)
class Calibration:
    """The result of `calibrate`: the calibrated hardware, what was fitted, and how well it fits."""

    hardware: Hardware
    uncalibrated: Hardware
    fitted: dict[str, float]
    rel_err_mean: float  # over every tile's forward + backward total
    rel_err_max: float
    uncalibrated_rel_err_mean: float
    by_kind: dict[str, float]  # mean error per kind of tile (`TileTimes.kind`)
    rows: list[SizeRow] = field(default_factory=list)
    tiles: int = 0
    cost: float = 0.0  # the least-squares objective: ½ Σ log-error²
    graphed: bool = False  # CUDA-graphed tiles were among them (priced with dispatch_s = 0)

    @property
    def at_bounds(self) -> list[str]:
        """Fitted constants at an edge of their search range (`BOUNDS`): the data did not pin them down."""
        return [k for k, v in self.fitted.items() if not BOUNDS[k][0] * 1.01 < v < BOUNDS[k][1] * 0.99]


def check_matches(measurement: Measurement, hardware: Hardware) -> None:
    """A calibration fits one device in one precision: the measurement's must be the hardware file's."""
    where = measurement.source
    if measurement.precision != hardware.training.dtype:
        raise UserError(
            f"was measured in {measurement.precision}, but {hardware.path} prices {hardware.training.dtype} "
            "([training] dtype); calibrate a hardware file of the measured precision",
            where=where,
        )
    if measurement.device_name is not None and not same_device_name(hardware.device.name, measurement.device_name):
        raise UserError(
            f"was measured on {measurement.device_name!r}, but {hardware.path} describes {hardware.device.name!r}; "
            "calibrate a hardware file of the measured device",
            where=where,
        )


def from_profile(prof: Profile) -> Measurement:
    """The tiles of a measured profile: its no-context grid and its context tiles, forward and backward each."""
    where = prof.path or "profile"
    if prof.source != "measured":
        raise UserError(f"is an {prof.source!r} profile; calibrate on a measured one", where=where)
    if prof.tensor_parallel > 1:
        raise UserError(
            f"was measured at tensor parallelism {prof.tensor_parallel}; calibrate on a T = 1 profile", where=where
        )
    bb, ii = np.meshgrid(np.array(prof.batch_sizes, float), np.array(prof.token_lengths, float), indexing="ij")
    fwd, bwd = prof.forward_s.ravel(), prof.backward_s.ravel()
    tiles = [
        TileTimes(prof.model, "grid", bb.ravel(), ii.ravel(), np.zeros(bb.size), fwd + bwd, fwd, bwd),
    ]
    points = prof.raw.get("context_points") or []
    try:
        ctx = np.array([[p["b"], p["i"], p["j"], p["forward_s"], p["backward_s"]] for p in points], dtype=float)
    except (KeyError, TypeError, ValueError):
        raise UserError(
            "field 'context_points' must be a list of objects with numbers b, i, j, forward_s, backward_s", where=where
        ) from None
    if ctx.size:
        if not np.all(np.isfinite(ctx)) or np.any(ctx[:, :2] < 1) or np.any(ctx[:, 2:] < 0):
            raise UserError("field 'context_points' holds a tile that is not a measurement", where=where)
        b, i, j, f, w = ctx.T
        tiles.append(TileTimes(prof.model, "context", b, i, j, f + w, f, w))
    _check_positive(tiles, where)
    return Measurement(where, str(prof.device.get("name")), prof.precision, tuple(tiles))


TILE_TABLE_COLUMNS = ("model", "hidden", "heads", "b", "i", "j", "eager_ms")


def read_tile_table(path: str | Path, precision: str) -> Measurement:
    """A CSV of tile totals: ``model,hidden,heads,b,i,j,eager_ms`` and optionally ``graphed_ms`` (other columns
    are ignored; lines starting with '#' are comments); one row per tile, forward + backward of one layer in
    milliseconds. It records neither the device nor the precision: ``precision`` is the caller's word for it, and
    the device is not checked."""
    where = str(path)
    text = read_user_text(Path(path), name="tile table", expected="a CSV of tile times")
    # Lines starting with '#' are comments (where the times come from); keep the file's line numbers for errors.
    numbered = [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(ln for _, ln in numbered)))
    rows = list(reader)
    header = set(reader.fieldnames or ())
    missing = [c for c in TILE_TABLE_COLUMNS if c not in header]
    if missing:
        raise UserError(
            f"is not a tile table: no column {missing[0]!r} (needs {', '.join(TILE_TABLE_COLUMNS)}"
            ", optionally graphed_ms)",
            where=where,
        )
    graphed = "graphed_ms" in header
    shapes: dict[tuple[str, int, int], list[list[float]]] = {}
    for (n, _), row in zip(numbered[1:], rows, strict=False):
        try:
            key = (row["model"], int(row["hidden"]), int(row["heads"]))
            values = [float(row[c]) for c in ("b", "i", "j", "eager_ms")]
            values.append(float(row["graphed_ms"]) if graphed and row["graphed_ms"] not in ("", None) else np.nan)
        except (TypeError, ValueError):
            raise UserError(f"line {n}: b, i, j, hidden, heads and the times must be numbers", where=where) from None
        b, i, j = values[:3]
        if b < 1 or i < 1 or j < 0 or b != int(b) or i != int(i) or j != int(j):
            raise UserError(f"line {n}: b and i must be positive integers and j a non-negative one", where=where)
        if key[1] < 1 or key[2] < 1 or key[1] % key[2]:
            raise UserError(f"line {n}: heads must divide hidden ({key[1]}), got {key[2]}", where=where)
        shapes.setdefault(key, []).append(values)
    if not shapes:
        raise UserError("has no tiles", where=where)
    tiles = []
    for (name, hidden, heads), values in shapes.items():
        b, i, j, eager, graphed_ms = np.array(values, dtype=float).T
        model = GptConfig(
            name=name, layers=1, hidden=hidden, heads=heads, vocab=2, seq_len=int(max(i + j)), mlp_ratio=4
        )
        tiles.append(TileTimes(model, f"{name} eager", b, i, j, eager / 1e3, accumulates=False))
        have = np.isfinite(graphed_ms)
        if have.any():
            tiles.append(
                TileTimes(
                    model, f"{name} graphed", b[have], i[have], j[have], graphed_ms[have] / 1e3, graphed=True,
                    accumulates=False,
                )
            )  # fmt: skip
    _check_positive(tiles, where)
    return Measurement(where, None, precision, tuple(tiles))


def combine(measurements: Sequence[Measurement]) -> tuple[Measurement, int]:
    """One measurement of several files of one device and precision, and how many tiles were left out.

    A measured profile times the layer through the runtime's own code path, host dispatch included; a tile table's
    eager rows time a stand-alone block, whose host pays less per kernel. Where a profile is among the files, the
    tables' eager rows are left out (the profile prices the host), and their CUDA-graphed rows, which no host
    dispatches, still pin the GPU's own constants.
    """
    if len(measurements) == 1:
        return measurements[0], 0
    precisions = {m.precision for m in measurements}
    if len(precisions) > 1:
        first, other = measurements[0], next(m for m in measurements if m.precision != measurements[0].precision)
        raise UserError(
            f"was measured in {other.precision}, but {first.source} in {first.precision}", where=other.source
        )
    names = {m.device_name for m in measurements if m.device_name is not None}
    named = [m for m in measurements if m.device_name is not None]
    for m in named[1:]:
        if not same_device_name(named[0].device_name, m.device_name):
            raise UserError(
                f"was measured on {m.device_name!r}, but {named[0].source} on {named[0].device_name!r}", where=m.source
            )
    profiled = bool(named)
    tiles: list[TileTimes] = []
    left_out = 0
    for m in measurements:
        for t in m.tiles:
            if profiled and m.device_name is None and not t.graphed:
                left_out += t.b.size
                continue
            tiles.append(t)
    return (
        Measurement(" and ".join(m.source for m in measurements), min(names) if names else None, precisions.pop(),
                    tuple(tiles)),
        left_out,
    )  # fmt: skip


def _check_positive(tiles: Sequence[TileTimes], where: str) -> None:
    for t in tiles:
        for arr in (t.total_s, t.forward_s, t.backward_s):
            if arr is not None and not np.all(np.isfinite(arr) & (arr > 0)):
                raise UserError(f"has a {t.kind} tile whose time is not a positive number of seconds", where=where)


def predict(hardware: Hardware, tiles: TileTimes) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds the analytic model gives ``tiles`` on ``hardware`` (graphed: no dispatch)."""
    if tiles.graphed:
        hardware = replace(hardware, device=replace(hardware.device, dispatch_s=0.0))
    if not tiles.accumulates:
        hardware = replace(hardware, training=replace(hardware.training, grad_accumulate_bytes_per_param=0.0))
    return layer_seconds(tiles.model, hardware, tiles.b, tiles.i, tiles.j)


def log_errors(hardware: Hardware, measurement: Measurement) -> np.ndarray:
    """log(predicted / measured) of every measured time: forward and backward where both were measured, else the
    total. The calibration's residuals."""
    out = []
    for t in measurement.tiles:
        fwd, bwd = predict(hardware, t)
        if t.forward_s is not None and t.backward_s is not None:
            out += [np.log(fwd / t.forward_s), np.log(bwd / t.backward_s)]
        else:
            out.append(np.log((fwd + bwd) / t.total_s))
    return np.concatenate(out)


def tile_errors(hardware: Hardware, measurement: Measurement) -> list[tuple[TileTimes, np.ndarray, np.ndarray]]:
    """(tiles, predicted totals, relative errors |p − m| / m of the totals) for each group of tiles."""
    out = []
    for t in measurement.tiles:
        fwd, bwd = predict(hardware, t)
        total = fwd + bwd
        out.append((t, total, np.abs(total - t.total_s) / t.total_s))
    return out


def with_constants(hardware: Hardware, values: dict[str, float]) -> Hardware:
    return replace(hardware, device=replace(hardware.device, **values))


def calibrate(measurement: Measurement, hardware: Hardware, *, params: Sequence[str] | None = None) -> Calibration:
    """Fit ``params`` of ``hardware.device`` (default: ``dispatch_s``, ``matmul_efficiency``,
    ``matmul_half_dim``, and ``kernel_launch_s`` when graphed tiles are measured) to ``measurement``.

    Least squares on the log errors of every measured time, from a few starting points (the floor makes the
    objective piecewise smooth); the best fit wins. Raises `UserError` when the device or precision differ.
    """
    from scipy.optimize import least_squares

    check_matches(measurement, hardware)
    graphed = any(t.graphed for t in measurement.tiles)
    if params is None:
        params = ("dispatch_s", "matmul_efficiency", "matmul_half_dim") + (("kernel_launch_s",) if graphed else ())
    unknown = [p for p in params if p not in BOUNDS]
    if unknown or not params:
        raise ValueError(f"can fit {', '.join(BOUNDS)}; got {list(params)}")
    lo = np.log([BOUNDS[p][0] for p in params])
    hi = np.log([BOUNDS[p][1] for p in params])

    def residuals(x: np.ndarray) -> np.ndarray:
        return log_errors(with_constants(hardware, dict(zip(params, np.exp(x), strict=True))), measurement)

    best = None
    for start in _starts(hardware, params, lo, hi):
        fit = least_squares(residuals, start, bounds=(lo, hi), x_scale=1.0, diff_step=1e-4)
        if best is None or fit.cost < best.cost:
            best = fit
    # Rounded as the calibrated file writes them, so the errors reported are those of the file.
    fitted = {p: float(f"{v:.4g}") for p, v in zip(params, np.exp(best.x), strict=True)}
    calibrated = with_constants(hardware, fitted)
    return _summary(measurement, calibrated, hardware, fitted, float(best.cost))


def _starts(hardware: Hardware, params: Sequence[str], lo: np.ndarray, hi: np.ndarray) -> list[np.ndarray]:
    """The hardware file's own values (a zero, such as an absent dispatch_s, as 20 µs), and two spread over each
    range."""
    own = np.log([getattr(hardware.device, p) or 20e-6 for p in params])
    own = np.clip(own, lo, hi)
    return [own, lo + 0.3 * (hi - lo), lo + 0.7 * (hi - lo)]


def _summary(
    measurement: Measurement, calibrated: Hardware, uncalibrated: Hardware, fitted: dict[str, float], cost: float
) -> Calibration:
    after = tile_errors(calibrated, measurement)
    before = tile_errors(uncalibrated, measurement)
    err = np.concatenate([e for _, _, e in after])
    err_before = np.concatenate([e for _, _, e in before])
    by_kind: dict[str, list[np.ndarray]] = {}
    for t, _, e in after:
        by_kind.setdefault(t.kind, []).append(e)
    rows = []
    for (t, pred, e), (_, pred0, e0) in zip(after, before, strict=True):
        tokens = t.b * t.i
        low = 0
        for high in SIZE_EDGES + (int(tokens.max()),):
            sel = (tokens > low) & (tokens <= high)
            if sel.any():
                rows.append(
                    SizeRow(
                        kind=t.kind,
                        low=low,
                        high=high,
                        tiles=int(sel.sum()),
                        measured_s=float(t.total_s[sel].mean()),
                        calibrated_s=float(pred[sel].mean()),
                        uncalibrated_s=float(pred0[sel].mean()),
                        rel_err_mean=float(e[sel].mean()),
                        rel_err_max=float(e[sel].max()),
                        uncalibrated_rel_err_mean=float(e0[sel].mean()),
                    )
                )
            low = max(low, high)
    return Calibration(
        hardware=calibrated,
        uncalibrated=uncalibrated,
        fitted=fitted,
        rel_err_mean=float(err.mean()),
        rel_err_max=float(err.max()),
        uncalibrated_rel_err_mean=float(err_before.mean()),
        by_kind={k: float(np.concatenate(v).mean()) for k, v in by_kind.items()},
        rows=rows,
        tiles=int(err.size),
        cost=cost,
        graphed=any(t.graphed for t in measurement.tiles),
    )


def calibrated_toml(text: str, calibration: Calibration, source: str) -> str:
    """The hardware TOML ``text`` with the fitted constants in place and a header saying where they come from.

    Every other line (and its source comment) is kept. A fitted key's line and its comment's continuation lines
    become one line that says it was fitted and what it was; a key the file lacked (``dispatch_s``) joins the
    ``[device]`` table.
    """
    c = calibration
    kinds = ", ".join(f"{k} {v:.1%}" for k, v in c.by_kind.items())
    header = textwrap.wrap(
        f"CALIBRATED on {source} (`terapipe profile --calibrate`): fitted {', '.join(c.fitted)}. Relative error of "
        f"its {c.tiles} tiles (forward + backward of one layer): mean {c.rel_err_mean:.1%}, max {c.rel_err_max:.1%} "
        f"({kinds}); before the fit: mean {c.uncalibrated_rel_err_mean:.1%}."
        + (" CUDA-graphed tiles are priced with dispatch_s = 0, as no host dispatches them." if c.graphed else "")
        + " The file it was fitted from follows:",
        width=116,
        initial_indent="# ",
        subsequent_indent="# ",
    )
    before = c.uncalibrated.device
    lines = text.splitlines()
    out: list[str] = []
    section = None
    pending = dict(c.fitted)
    constants = [CALIBRATED_LINE]  # [hardware] says the constants are calibrated (`config.hardware.CONSTANTS`)
    skipping = False
    for line in lines:
        stripped = line.strip()
        if skipping and line[:1].isspace() and stripped.startswith("#"):
            continue  # the continuation of a replaced line's comment
        skipping = False
        if stripped.startswith("["):
            if section == "device":
                _insert_missing(out, pending, before, source)
            if section == "hardware":
                _insert_lines(out, constants)
            section = stripped.strip("[]").split("]")[0].strip()
        key = stripped.split("=", 1)[0].strip() if "=" in stripped and not stripped.startswith("#") else None
        if section == "hardware" and key == "constants":
            _insert_lines(out, constants, at_end=True)
            skipping = True
            continue
        if section == "device" and key in pending:
            out.append(_fitted_line(key, pending.pop(key), getattr(before, key), source))
            skipping = True
            continue
        out.append(line)
    if section == "device":
        _insert_missing(out, pending, before, source)
    return "\n".join(header + out) + "\n"


def _fitted_line(key: str, value: float, was: float | None, source: str) -> str:
    previously = "absent before" if was is None else f"was {was:.4g}"
    return f"{f'{key} = {value:.4g}':<33}# FITTED to {source} ({previously})"


CALIBRATED_LINE = (
    'constants = "calibrated"         # fitted to measured tiles: see the header and the FITTED lines below'
)


def _insert_lines(out: list[str], pending: list[str], *, at_end: bool = False) -> None:
    """Move the ``pending`` lines into ``out``: at its end, or before the blank lines that close its last table."""
    at = len(out)
    while not at_end and at and not out[at - 1].strip():
        at -= 1
    out[at:at] = pending
    pending.clear()


def _insert_missing(out: list[str], pending: dict[str, float], before, source: str) -> None:
    """Add the fitted keys the ``[device]`` table lacked at its end (before the blank lines that close it)."""
    at = len(out)
    while at and not out[at - 1].strip():
        at -= 1
    for key in list(pending):
        out.insert(at, _fitted_line(key, pending.pop(key), None, source))
        at += 1
