"""Least-squares fits of the cost model's parametric parts (docs/design.md §3). Pure numpy/scipy, no torch, no I/O.

Both fits minimise *relative* error (each residual divided by the measured time), because the planner
cares about every tile in proportion to its cost: an unweighted fit is dominated by the largest tiles and
is off by tens of percent on the small slices that fine slicing produces.

* `fit_context`: t_ctx(b, i, j) = a0 + a1·b·i + a2·b·j + a3·b·i·j, fitted so that t_nc(b, i) + t_ctx(b, i, j)
  matches the measured time of a tile with j context tokens.
* `fit_link`: t(bytes) = latency_s + bytes / bytes_per_s for point-to-point messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from terapipe_cli.plan.costmodel import context_seconds, context_terms

# The smallest seconds-per-byte a link fit may report: keeps bytes_per_s finite (JSON has no infinity)
# when the measured slope is zero within noise; 1e-15 s/B is 1 PB/s, far above any real link.
_MIN_S_PER_BYTE = 1e-15


@dataclass(frozen=True)
class RelErr:
    """Relative errors |predicted − measured| / measured over a set of points."""

    mean: float
    max: float
    count: int

    @staticmethod
    def of(predicted: np.ndarray, measured: np.ndarray) -> RelErr:
        predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
        if predicted.size == 0:
            return RelErr(float("nan"), float("nan"), 0)
        err = np.abs(predicted - measured) / measured
        return RelErr(float(err.mean()), float(err.max()), int(err.size))


@dataclass(frozen=True)
class ContextFitResult:
    """Coefficients [a0, a1, a2, a3] (seconds, per layer) and the in-sample relative error of the tile time."""

    coef: tuple[float, float, float, float]
    fit_err: RelErr

    def t_ctx(self, b, i, j) -> np.ndarray:
        """The fitted context term, exactly as the cost model evaluates it."""
        return context_seconds(self.coef, b, i, j)

    def errors(self, b, i, j, t_nc, t_measured) -> RelErr:
        """Relative error of the predicted tile time t_nc + t_ctx against measured tile times."""
        return RelErr.of(np.asarray(t_nc, float) + self.t_ctx(b, i, j), t_measured)

    def context_errors(self, b, i, j, t_nc, t_measured) -> RelErr:
        """Relative error of the context term alone against the measured extra time (t_measured − t_nc).

        Harsher than `errors`: the measured extra time is a difference of two noisy timings.
        """
        extra = np.asarray(t_measured, float) - np.asarray(t_nc, float)
        keep = extra > 0
        return RelErr.of(self.t_ctx(b, i, j)[keep], extra[keep])


def _check_points(name: str, *arrays: np.ndarray) -> None:
    n = {a.shape for a in arrays}
    if len(n) != 1 or arrays[0].ndim != 1:
        raise ValueError(f"{name}: all inputs must be 1-D arrays of the same length, got shapes {sorted(n)}")


def fit_context(b, i, j, t_nc, t_measured) -> ContextFitResult:
    """Fit t_ctx by least squares in relative terms.

    ``b, i, j``: batch slice size, new tokens and context tokens of each measured tile (j > 0);
    ``t_nc``: the no-context time of the same (b, i); ``t_measured``: the measured time with context.
    Minimises Σ ((t_nc + t_ctx − t_measured) / t_measured)². a2 and a3 are bounded at ≥ 0 (reading more
    context never makes a tile cheaper), which keeps extrapolation to long contexts sane under noise.
    """
    b, i, j, t_nc, t = (np.asarray(x, dtype=float) for x in (b, i, j, t_nc, t_measured))
    _check_points("fit_context", b, i, j, t_nc, t)
    if b.size < 4:
        raise ValueError(f"fit_context: need at least 4 points for 4 coefficients, got {b.size}")
    if np.any(j <= 0) or np.any(t <= 0):
        raise ValueError("fit_context: every point needs j > 0 and a positive measured time")
    X = np.stack(context_terms(b, i, j), axis=1)
    w = 1.0 / t
    A, y = X * w[:, None], (t - t_nc) * w
    # Columns span ~6 orders of magnitude (1 … b·i·j); scale them to unit norm so the solver is well
    # conditioned, then undo the scaling on the coefficients.
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    lower = np.array([-np.inf, -np.inf, 0.0, 0.0])
    sol = _lsq_linear()(A / scale, y, bounds=(lower, np.full(4, np.inf)), method="bvls")
    coef = sol.x / scale
    res = ContextFitResult(tuple(float(c) for c in coef), RelErr(0.0, 0.0, 0))
    return ContextFitResult(res.coef, res.errors(b, i, j, t_nc, t))


@dataclass(frozen=True)
class LinkFit:
    """t(bytes) = latency_s + bytes / bytes_per_s, with the in-sample relative error."""

    latency_s: float
    bytes_per_s: float
    fit_err: RelErr

    def __call__(self, nbytes) -> np.ndarray:
        return self.latency_s + np.asarray(nbytes, dtype=float) / self.bytes_per_s


def fit_link(nbytes, seconds) -> LinkFit:
    """Fit latency + bytes/bandwidth to one-way message times, in relative terms, both terms ≥ 0."""
    x, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    _check_points("fit_link", x, t)
    if x.size < 2 or np.unique(x).size < 2:
        raise ValueError("fit_link: need at least two different message sizes")
    if np.any(t <= 0) or np.any(x < 0):
        raise ValueError("fit_link: message sizes must be non-negative and times positive")
    w = 1.0 / t
    A = np.stack([w, x * w], axis=1)
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    sol = _lsq_linear()(A / scale, np.ones_like(t), bounds=(0.0, np.inf), method="bvls")
    latency, s_per_byte = sol.x / scale
    s_per_byte = max(float(s_per_byte), _MIN_S_PER_BYTE)
    fit = LinkFit(float(latency), 1.0 / s_per_byte, RelErr(0.0, 0.0, 0))
    return LinkFit(fit.latency_s, fit.bytes_per_s, RelErr.of(fit(x), t))


def _lsq_linear():
    """scipy's bounded least squares; imported when a fit runs (scipy.optimize takes a third of a second to load,
    and every command's start-up would pay it)."""
    from scipy.optimize import lsq_linear

    return lsq_linear
