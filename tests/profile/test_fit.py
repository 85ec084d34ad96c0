"""The profile's fits recover known coefficients from synthetic timings, with and without noise."""

from __future__ import annotations

import numpy as np
import pytest

from terapipe_cli.profile.fit import RelErr, fit_context, fit_link

# A plausible one-layer CPU cost: fixed context-path overhead, K/V concatenation ~ b·j, attention ~ b·i·j.
TRUE = (4e-5, 2e-8, 6e-8, 4e-9)


def t_nc(b, i):
    return 3e-4 + 1.5e-6 * b * i  # per-slice overhead + per-token work


def t_ctx(b, i, j, coef=TRUE):
    a0, a1, a2, a3 = coef
    return a0 + a1 * b * i + a2 * b * j + a3 * b * i * j


def points(rng, n, seq_len=1024):
    b = rng.choice([1, 2, 4], n).astype(float)
    i = rng.choice(np.arange(8, 513, 8), n).astype(float)
    j = np.array([rng.choice(np.arange(8, seq_len - ii + 1, 8)) for ii in i], dtype=float)
    return b, i, j


def test_exact_timings_give_exact_coefficients():
    rng = np.random.default_rng(0)
    b, i, j = points(rng, 40)
    fit = fit_context(b, i, j, t_nc(b, i), t_nc(b, i) + t_ctx(b, i, j))
    np.testing.assert_allclose(fit.coef, TRUE, rtol=1e-6, atol=1e-12)
    assert fit.fit_err.max < 1e-9


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_timings_recover_coefficients_and_predict_heldout(seed):
    rng = np.random.default_rng(seed)
    b, i, j = points(rng, 120)
    noise = 0.03  # 3% multiplicative timing noise, about a quiet CPU
    measured = (t_nc(b, i) + t_ctx(b, i, j)) * rng.lognormal(0.0, noise, b.size)
    fit = fit_context(b, i, j, t_nc(b, i), measured)
    _, _, a2, a3 = fit.coef
    # The dominant terms come back within a few percent; the small ones within their noise floor.
    assert a3 == pytest.approx(TRUE[3], rel=0.05)
    assert a2 == pytest.approx(TRUE[2], rel=0.25)
    hb, hi, hj = points(rng, 40)
    truth = t_nc(hb, hi) + t_ctx(hb, hi, hj)
    err = RelErr.of(t_nc(hb, hi) + fit.t_ctx(hb, hi, hj), truth)
    assert err.mean < 0.01 and err.max < 0.03
    # Against noisy held-out measurements the error is about the noise, no more.
    noisy = truth * rng.lognormal(0.0, noise, hb.size)
    assert fit.errors(hb, hi, hj, t_nc(hb, hi), noisy).mean < 2 * noise


def test_relative_weighting_beats_unweighted_when_the_model_is_not_exact():
    # Real timings are not exactly linear in (b·i, b·j, b·i·j) (caches, kernel choices). An unweighted fit
    # then trades the small tiles' relative error for the large tiles' seconds; the relative fit does not.
    rng = np.random.default_rng(3)
    b, i, j = points(rng, 150)

    def truth(b, i, j):
        return t_nc(b, i) + t_ctx(b, i, j) + 2e-12 * b * i * j * j

    fit = fit_context(b, i, j, t_nc(b, i), truth(b, i, j))
    X = np.stack([np.ones_like(b), b * i, b * j, b * i * j], axis=1)
    ols = np.linalg.lstsq(X, truth(b, i, j) - t_nc(b, i), rcond=None)[0]
    rel_wls = (t_nc(b, i) + fit.t_ctx(b, i, j)) / truth(b, i, j) - 1
    rel_ols = (t_nc(b, i) + t_ctx(b, i, j, ols)) / truth(b, i, j) - 1
    assert np.sqrt(np.mean(rel_wls**2)) < np.sqrt(np.mean(rel_ols**2))
    sb, si, sj = np.ones(20), np.full(20, 8.0), np.arange(8, 168, 8, dtype=float)
    small_wls = RelErr.of(t_nc(sb, si) + fit.t_ctx(sb, si, sj), truth(sb, si, sj))
    small_ols = RelErr.of(t_nc(sb, si) + t_ctx(sb, si, sj, ols), truth(sb, si, sj))
    assert small_wls.mean < small_ols.mean / 2


def test_context_term_is_zero_without_context_and_never_negative():
    rng = np.random.default_rng(0)
    b, i, j = points(rng, 20)
    fit = fit_context(b, i, j, t_nc(b, i), t_nc(b, i) + t_ctx(b, i, j))
    assert fit.t_ctx(1, 64, 0) == 0.0
    assert np.all(fit.t_ctx(b, i, j) >= 0)


def test_fit_context_rejects_bad_points():
    with pytest.raises(ValueError, match="at least 4"):
        fit_context([1, 1], [8, 16], [8, 8], [1e-3, 1e-3], [2e-3, 2e-3])
    with pytest.raises(ValueError, match="j > 0"):
        fit_context([1] * 4, [8] * 4, [0, 8, 16, 24], [1e-3] * 4, [2e-3] * 4)
    with pytest.raises(ValueError, match="same length"):
        fit_context([1] * 4, [8] * 5, [8] * 4, [1e-3] * 4, [2e-3] * 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_link_fit_recovers_latency_and_bandwidth(seed):
    rng = np.random.default_rng(seed)
    nbytes = np.repeat(2.0 ** np.arange(10, 25), 3)
    latency, bandwidth = 40e-6, 3e9
    exact = latency + nbytes / bandwidth
    fit = fit_link(nbytes, exact)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    noisy = exact * rng.lognormal(0.0, 0.05, nbytes.size)
    fit = fit_link(nbytes, noisy)
    assert fit.latency_s == pytest.approx(latency, rel=0.1)
    assert fit.bytes_per_s == pytest.approx(bandwidth, rel=0.1)
    assert fit.fit_err.mean < 0.1


def test_link_fit_with_flat_times_keeps_bandwidth_finite():
    fit = fit_link([1024, 4096, 16384], [1e-5, 1e-5, 1e-5])
    assert np.isfinite(fit.bytes_per_s) and fit.bytes_per_s > 0
    assert fit.latency_s == pytest.approx(1e-5, rel=1e-3)
    with pytest.raises(ValueError, match="two different"):
        fit_link([1024, 1024], [1e-5, 2e-5])
