"""`terapipe plan` while it searches (issue 38): a line that moves — what is searched, how much is left, the best so
far — told by `plan_configured(progress=…)` and drawn on stderr by rich on a terminal only; nothing with --quiet.
Options that contradict each other are refused in one line."""

from __future__ import annotations

import pytest
from conftest import ROOT, assert_one_line_error, run_cli

from terapipe_cli.plan.configs import plan_configured
from terapipe_cli.plan.costmodel import read_profile
from terapipe_cli.plan.request import plan_request

TINY = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"


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
