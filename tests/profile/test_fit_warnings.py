"""A profile's fits checked (`plan.fit_quality`): a context fit off by more than 10% on its held-out tiles, or a
degenerate stage-to-stage link fit of a measured profile, is one warning line each, which `terapipe profile` prints
on stderr after writing the profile; the shipped profiles give none."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.plan.costmodel import profile_from_dict, read_profile
from terapipe_cli.plan.fit_quality import fit_warnings
from terapipe_cli.profile.analytic import experiment_profile
from terapipe_cli.profile.fit import fit_link

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted((ROOT / "configs" / "profiles").glob("*.json"))
# Measured on an H100 through the eager runtime, whose small tiles are host-bound: their times jump by ~20% from
# visit to visit (docs/results.md, "GPU bring-up"), more than the context term the fit looks for. It warns, truly.
NOISY = ROOT / "configs" / "profiles" / "gpt3-1b-h100-bf16-measured.json"
# Measured at schema /3 on the shared CPU machine with nothing else running: its context fit (10-12% held out, this
# machine's timing noise) is off, and it says so (docs/results.md).
CPU_MEASURED = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
# The tiny model's earlier measurement (schema /1, a quieter machine), whose fits are good: the base made bad below.
MEASURED = json.loads((ROOT / "tests" / "data" / "tiny-cpu-measured-schema1.json").read_text())
SIZES = [8192, 19972, 48692, 118716, 289432]  # a quick profile's five message sizes for the tiny model


def warnings_of(obj: dict) -> list[str]:
    return fit_warnings(profile_from_dict(obj, "test profile"))


def measured(**changes) -> dict:
    """tiny-cpu-measured.json with ``changes``: ``forward``/``backward`` (held-out mean error), ``comm`` (replaces
    it), ``quick``, ``device`` (merged into it)."""
    obj = copy.deepcopy(MEASURED)
    for which in ("forward", "backward"):
        if which in changes:
            obj["context"][which]["heldout_rel_err_mean"] = changes[which]
    if "comm" in changes:
        obj["comm"] = changes["comm"]
    if changes.get("quick"):
        obj["grid"]["kind"] = "quick"
    obj["device"].update(changes.get("device", {}))
    return obj


def fitted_link(seconds: list[float]) -> dict:
    """The ``comm`` object of a link fitted to one-way ``seconds`` at `SIZES`, as `profile.comm` records it."""
    fit = fit_link(np.array(SIZES), np.array(seconds))
    return {
        "latency_s": fit.latency_s, "bytes_per_s": fit.bytes_per_s, "method": "torchrun ping-pong (test)",
        "sizes_bytes": SIZES, "one_way_s_median": seconds, "fit_rel_err_mean": fit.fit_err.mean,
        "fit_rel_err_max": fit.fit_err.max,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ the shipped ones


QUIET = [p for p in PROFILES if p not in (NOISY, CPU_MEASURED)]


@pytest.mark.parametrize("path", QUIET, ids=[p.name for p in QUIET])
def test_no_shipped_profile_warns(path: Path):
    # gpt3-1b-h100-fp32-measured: context 7.7% / 6.1% held out, link 9.6 µs + bytes / 1975 GB/s with 8.6% error;
    # example-tiny-cpu records no held-out error and its link is not a measured one.
    assert fit_warnings(read_profile(path)) == []


def test_the_noisy_gpu_profile_says_so():
    (warning,) = fit_warnings(read_profile(NOISY))
    assert "forward 13.1% and backward 14.2%" in warning


def test_the_cpu_profile_says_its_context_fit_is_this_machines_noise():
    # Measured again with nothing else running (load average 1.1): the held-out context tiles of this 2-core machine
    # still jump by 10-12%; the link fit holds.
    (context,) = fit_warnings(read_profile(CPU_MEASURED))
    assert "forward 12.0% and backward 10.6%" in context and "idle machine" in context
    assert fit_warnings(profile_from_dict(MEASURED, "the earlier measurement")) == []


@pytest.mark.parametrize("name", ["paper-01-gpt3-1b", "paper-05-gpt3-13b-L8192", "paper-10-gpt3-175b"])
def test_the_analytic_profiles_of_the_papers_settings_do_not_warn(name):
    exp = load_experiment(name)
    obj = experiment_profile(exp, batch_size=exp.batch_per_replica, tensor_parallel=8, token_step=exp.token_step)
    assert warnings_of(obj) == []


# ------------------------------------------------------------------------------------------------ the context fit


def test_a_context_fit_off_by_more_than_ten_percent_is_one_line_naming_the_passes():
    (line,) = warnings_of(measured(forward=0.213, backward=0.34, quick=True))
    assert line.startswith("the context fit's held-out tile error is forward 21.3% and backward 34.0% on average")
    assert "above 10%" in line and "without --quick" in line and "idle machine" in line
    assert "--clock" not in line  # measured with the CPU clock already
    (line,) = warnings_of(measured(backward=0.105))
    assert "is backward 10.5% on average" in line and "forward" not in line and "--quick" not in line
    assert warnings_of(measured(forward=0.1, backward=0.0999)) == []


def test_the_advice_follows_how_the_profile_was_measured():
    wall = measured(forward=0.3, device={"clock": "wall time (time.perf_counter)"})
    assert "with --clock cpu" in warnings_of(wall)[0]
    cuda = measured(forward=0.3, device={"kind": "cuda", "clock": "CUDA events after torch.cuda.synchronize"})
    assert "--clock" not in warnings_of(cuda)[0]
    tensor = measured(forward=0.3, device={"clock": "wall time (time.perf_counter)", "tensor_parallel": 2})
    (line,) = warnings_of(tensor)
    assert "--clock" not in line and "each of the 2 processes" in line  # --clock cpu is refused with T > 1


def test_an_analytic_profile_is_checked_for_its_context_fit_only():
    exp = load_experiment("paper-01-gpt3-1b")
    obj = experiment_profile(exp, batch_size=exp.batch_per_replica, tensor_parallel=8, token_step=exp.token_step)
    obj["context"]["forward"]["heldout_rel_err_mean"] = 0.2
    obj["comm"] = {"latency_s": 0.0, "bytes_per_s": 1e15}  # a hardware file's link is not a fit
    (line,) = warnings_of(obj)
    assert "forward 20.0%" in line and "measure a profile on the device" in line


def test_a_context_fit_without_a_recorded_error_is_not_judged():
    obj = measured()
    for which in ("forward", "backward"):
        del obj["context"][which]["heldout_rel_err_mean"]
    obj["context"]["backward"]["heldout_rel_err_mean"] = "n/a"
    assert warnings_of(obj) == []


# ------------------------------------------------------------------------------------------------ the link fit


def test_a_link_whose_times_do_not_grow_with_size_is_degenerate():
    comm = fitted_link([600e-6, 450e-6, 300e-6, 200e-6, 150e-6])
    assert comm["bytes_per_s"] == pytest.approx(1e15)  # fit_link's bound: the slope clipped at 1e-15 s/B
    (line,) = warnings_of(measured(comm=comm, quick=True))
    assert line.startswith("the stage-to-stage link fit 214.0 µs + bytes / 1000000.00 GB/s is degenerate: ")
    assert "the bandwidth is beyond any link (100 TB/s or more, at or near the fit's bound of 1 PB/s)" in line
    assert "its mean error over the 5 message sizes is 39% (above 25%)" in line
    assert "without --quick" in line and "idle machine" in line


def test_a_latency_clipped_at_zero_or_a_large_error_is_degenerate():
    proportional = fitted_link([1e-6 * s / 8192 for s in SIZES])  # no latency at all: clipped at zero
    assert proportional["latency_s"] == 0.0
    (line,) = warnings_of(measured(comm=proportional))
    assert "the latency is clipped at zero" in line and "bound" not in line and "mean error" not in line
    noisy = fitted_link([400e-6, 180e-6, 520e-6, 150e-6, 300e-6])
    assert 0 < noisy["latency_s"] and noisy["bytes_per_s"] < 1e14
    (line,) = warnings_of(measured(comm=noisy))
    assert "its mean error over the 5 message sizes is 38%" in line and "clipped" not in line
    assert warnings_of(measured(comm={**noisy, "fit_rel_err_mean": 0.25})) == []


def test_a_link_not_measured_or_recorded_without_its_error():
    free = {"latency_s": 0.0, "bytes_per_s": 1e12, "method": "not measured (--no-comm): a free link"}
    assert warnings_of(measured(comm=free)) == []  # --no-comm: nothing was fitted
    old = {k: v for k, v in fitted_link([600e-6, 450e-6, 300e-6, 200e-6, 150e-6]).items() if "err" not in k}
    (line,) = warnings_of(measured(comm=old))  # a profile from before the fit's error was recorded still loads
    assert "fit's bound" in line and "mean error" not in line
    example = json.loads((ROOT / "configs" / "profiles" / "example-tiny-cpu.json").read_text())
    assert warnings_of({**example, "comm": old}) == []  # only a measured profile's link is a fit


def test_both_problems_are_two_lines():
    obj = measured(forward=0.5, comm=fitted_link([600e-6, 450e-6, 300e-6, 200e-6, 150e-6]))
    context, link = warnings_of(obj)
    assert context.startswith("the context fit's") and link.startswith("the stage-to-stage link fit")


# ------------------------------------------------------------------------------------------------ the command


def test_terapipe_profile_prints_the_warnings_on_stderr_after_writing(tmp_path: Path, capsys, monkeypatch):
    import terapipe_cli.profile.measure as measure

    # What `measure_profile` returns, without the half minute of timing: the earlier tiny profile with its fits made
    # bad.
    good = {**MEASURED, "precision": "fp32"}  # (recorded since that file was measured)
    bad = {**measured(forward=0.213, backward=0.34, quick=True), "precision": "fp32"}
    bad["comm"] = fitted_link([600e-6, 450e-6, 300e-6, 200e-6, 150e-6])
    monkeypatch.setattr(measure, "measure_profile", lambda *args, **kwargs: copy.deepcopy(bad))
    out = tmp_path / "profile.json"
    p = run_cli(capsys, "profile", "--model", "tiny", "--quick", "--device", "cpu", "--out", out)
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text()) == {**bad, "model_source": "tiny"}  # the --model it was made from
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2, p.stderr
    assert lines[0].startswith("warning: the context fit's held-out tile error is forward 21.3% and backward 34.0%")
    assert lines[1].startswith("warning: the stage-to-stage link fit 214.0 µs + bytes / 1000000.00 GB/s is degenerate")
    assert f"wrote {out}" in p.stdout and "Traceback" not in p.stderr
    monkeypatch.setattr(measure, "measure_profile", lambda *args, **kwargs: copy.deepcopy(good))
    p = run_cli(capsys, "profile", "--model", "tiny", "--quick", "--device", "cpu", "--out", out)
    assert p.returncode == 0 and p.stderr == ""
