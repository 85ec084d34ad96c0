"""`terapipe plan` while it searches: a line that moves — what is searched, how much is left, the best so far — told
by `plan_configured(progress=…)` and drawn on stderr by rich on a terminal; where stderr is a pipe or a file, a plain
line every few seconds once the search has run a few; nothing with --quiet. Options that contradict each other are
refused in one line."""

from __future__ import annotations

import functools
import io

import pytest
from conftest import ROOT, assert_one_line_error, run_cli

from terapipe_cli.cli import plan as plan_command
from terapipe_cli.cli.console import PlainProgress
from terapipe_cli.plan.configs import plan_configured
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.request import plan_request

TINY = ROOT / "tests" / "data" / "tiny-cpu-measured-schema1.json"


def test_the_search_tells_what_it_searches_what_is_left_and_the_best_so_far():
    prof = read_profile(TINY)
    heard: list[str] = []
    request = plan_request(prof, stages=2, batch_size=4, virtual=None, partition="auto")
    configured = plan_configured(prof, request, heard.append)
    assert heard and all(isinstance(line, str) and "\n" not in line for line in heard)
    assert any("v = 1" in line and "partitions" in line and "left after bounds" in line for line in heard)
    assert any("best" in line and "by the objective" in line for line in heard)
    assert any("fastest so far" in line for line in heard)  # v = 2 is searched knowing v = 1's plan
    # Telling changes nothing.
    again = plan_configured(prof, request)
    assert again.planned.terapipe.slices == configured.planned.terapipe.slices
    assert again.planned.partition == configured.planned.partition


def test_a_plain_line_every_few_seconds_once_the_search_has_run_a_few():
    """Not on a terminal: nothing in the first seconds, then the latest news every ``every_s``, on a clock of the
    test's own (no waiting)."""
    now = [100.0]
    out = io.StringIO()
    progress = PlainProgress("Planning tiny", out, after_s=5.0, every_s=10.0, clock=lambda: now[0])
    progress.update("v = 1: 3 partitions")
    now[0] += 4.0
    progress.tick()
    assert out.getvalue() == ""  # a plan that takes a few seconds says nothing
    now[0] += 2.0
    progress.update("v = 1: best 12 ms")
    now[0] += 9.0
    progress.tick()  # 9 s after the last line: not yet
    now[0] += 1.0
    progress.tick()  # a long stretch without news still gets its line
    assert out.getvalue().splitlines() == [
        "Planning tiny — v = 1: best 12 ms (6s so far)",
        "Planning tiny — v = 1: best 12 ms (16s so far)",
    ]


def test_under_a_pipe_the_plan_prints_plain_progress_lines(tmp_path, capsys, monkeypatch):
    """`terapipe plan ... 2>&1 | cat`: stderr is no terminal (here: captured), and the lines come plain, one each."""
    monkeypatch.setattr(plan_command, "PlainProgress", functools.partial(PlainProgress, after_s=0.0, every_s=0.0))
    p = run_cli(capsys, "plan", "--profile", TINY, "-k", "2", "-b", "4", "--out", tmp_path / "p.json")
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("Planning tiny: L=")]  # not the fit's warnings
    assert lines and all(line.endswith("so far)") for line in lines), p.stderr
    assert any("best" in line for line in lines) and "\x1b" not in p.stderr and "\r" not in p.stderr


def test_quiet_prints_nothing_on_stderr(tmp_path, capsys):
    p = run_cli(capsys, "plan", "--profile", TINY, "-k", "2", "-b", "4", "--quiet", "--out", tmp_path / "p.json")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (("--recompute", "--no-recompute"), ("--recompute", "--no-recompute", "contradict")),
        (("--layers-per-stage", "2,2", "--partition", "balanced"), ("--layers-per-stage", "--partition balanced")),
        (("--layers-per-stage", "2,2", "--partition", "auto"), ("--layers-per-stage", "--partition auto")),
    ],
)
def test_contradictory_options_are_refused_in_one_line(extra, words, tmp_path, capsys):
    p = run_cli(capsys, "plan", "--profile", TINY, "-k", "2", "-b", "4", *extra, "--out", tmp_path / "p.json")
    assert_one_line_error(p, *words)
