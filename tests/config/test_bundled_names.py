"""A bundled experiment named by the start of its name: only at a word boundary and only when one name starts so;
anything else is refused in one line naming what the user may have meant (runs of digits read as numbers too)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from terapipe_cli.config.bundled import bundled_names, find_config, near_names, prefix_matches
from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.errors import UserError

NAMES = bundled_names("experiments")
PAPER_05 = ["paper-05-gpt3-13b", "paper-05-gpt3-13b-L4096", "paper-05-gpt3-13b-L6144", "paper-05-gpt3-13b-L8192"]


def find(name: str) -> str:
    return find_config(name, "experiments", "--experiment", prefix=True).name.removesuffix(".toml")


def refusal(name: str) -> str:
    with pytest.raises(UserError) as err:
        find(name)
    assert err.value.where == "--experiment" and "\n" not in str(err.value)
    return err.value.message


def test_the_bundled_experiments_are_the_ones_these_tests_name():
    assert {"paper-01-gpt3-1b", "paper-04-gpt3-13b", "paper-10-gpt3-175b", *PAPER_05} <= set(NAMES)
    assert [n for n in NAMES if n.startswith("paper-1")] == ["paper-10-gpt3-175b"]


@pytest.mark.parametrize(
    ("given", "found"),
    [
        ("paper-04", "paper-04-gpt3-13b"),
        ("paper-04-", "paper-04-gpt3-13b"),  # a prefix ending at a boundary cuts no word
        ("paper-04-gpt3", "paper-04-gpt3-13b"),
        ("paper-10", "paper-10-gpt3-175b"),
        ("paper-05-gpt3-13b", "paper-05-gpt3-13b"),  # the exact name, though it begins three others
        ("paper-05-gpt3-13b-L4096", "paper-05-gpt3-13b-L4096"),
        ("demo", "demo"),
    ],
)
def test_a_start_up_to_a_word_boundary_of_one_name_finds_it(given, found):
    assert find(given) == found


def test_paper_1_is_refused_naming_setting_1_and_setting_10():
    message = refusal("paper-1")
    assert "paper-01-gpt3-1b or paper-10-gpt3-175b" in message, message
    assert message.startswith("no bundled experiments config is named 'paper-1' or begins with it up to a '-'")
    assert "paper-02" not in message


def test_a_start_of_several_names_lists_them():
    message = refusal("paper-05")
    assert message == f"'paper-05' is the start of 4 bundled experiments configs: {', '.join(PAPER_05)}"
    assert refusal("paper-05-gpt3-13b-L") == (
        "no bundled experiments config is named 'paper-05-gpt3-13b-L' or begins with it up to a '-', '_' or '.'; "
        "did you mean paper-05-gpt3-13b-L4096, paper-05-gpt3-13b-L6144 or paper-05-gpt3-13b-L8192?"
    )
    assert "paper-01-gpt3-1b, paper-02-gpt3-1b" in refusal("paper-0")  # cuts the number: every setting is meant


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("paper-4", "did you mean paper-04-gpt3-13b?"),  # the number without its leading zero
        ("paper-004", "did you mean paper-04-gpt3-13b?"),
        ("paper-4-gpt3-13", "did you mean paper-04-gpt3-13b?"),
        ("paper-10-gpt3-1", "did you mean paper-10-gpt3-175b?"),  # the start, cut inside 175
        ("paper-5", f"did you mean {', '.join(PAPER_05[:-1])} or {PAPER_05[-1]}?"),
    ],
)
def test_a_start_cut_inside_a_word_or_a_number_is_refused_with_what_was_meant(given, meant):
    assert refusal(given).endswith(meant)


def test_a_name_nothing_resembles_lists_the_bundled_names():
    message = refusal("no-such-setting")
    assert message.startswith("no file 'no-such-setting' here and no bundled experiments config of that name (bundled:")
    assert all(n in message for n in NAMES)
    assert refusal("paper-11").startswith("no file 'paper-11' here")


def test_models_keep_exact_names_only():
    with pytest.raises(UserError, match="no file 'gpt3-1' here and no bundled models config of that name"):
        find_config("gpt3-1", "models", "--model")


def test_prefix_matches_and_near_names():
    names = ["x-1-a", "x-1_b", "x-10", "x-01.c", "y"]
    assert prefix_matches("x-1", names) == ["x-1-a", "x-1_b"]
    assert prefix_matches("x-01", names) == ["x-01.c"]
    assert prefix_matches("x-10", names) == ["x-10"]
    assert prefix_matches("", names) == []
    assert near_names("x-1", names) == ["x-1-a", "x-1_b", "x-01.c"]
    assert near_names("x-001-", names) == ["x-1-a"]
    assert near_names("x-", names) == ["x-1-a", "x-1_b", "x-10", "x-01.c"]
    assert near_names("", names) == [] and near_names("z", names) == []


def test_load_experiment_by_a_start_at_a_word_boundary():
    assert load_experiment("paper-04").name == "paper-04-gpt3-13b"
    with pytest.raises(UserError, match="paper-01-gpt3-1b or paper-10-gpt3-175b"):
        load_experiment("paper-1")


def test_plan_experiment_paper_1_is_one_line_naming_both(tmp_path: Path, capsys):
    out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", "--experiment", "paper-1", "--out", out)
    assert_one_line_error(p, "--experiment", "'paper-1'", "paper-01-gpt3-1b", "paper-10-gpt3-175b")
    assert not out.exists()
