"""`terapipe plan --tune N` under a fake clock: the training of each candidate (`train.tune.train_steps`) replaced by
made-up step times, so the choice is checked without training anything and whatever the machine's load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from terapipe_cli.plan import tune

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
EXAMPLE = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"
# This machine, as the test has it: the device the measured profile was made on.
HERE = {"kind": "cpu", "name": json.loads(MEASURED.read_text())["device"]["name"]}


@pytest.fixture
def fake_training(monkeypatch):
    """Each candidate trains in made-up seconds: the first plan trained 2 s a step, the second 1 s, any other 1.5 s
    (the warm-up step 9 s); ``calls`` lists the plans trained, in order."""
    calls: list[str] = []
    seconds: dict[str, float] = {}

    def train_steps(plan: dict, steps: int, *, device: str) -> list[float]:
        assert device == "cpu"
        key = json.dumps([plan.get("scheme"), plan["slices"], plan["order"], plan.get("layers_per_stage")])
        seconds.setdefault(key, (2.0, 1.0)[len(seconds)] if len(seconds) < 2 else 1.5)
        calls.append(key)
        return [9.0] + [seconds[key]] * (steps - 1)

    monkeypatch.setattr("terapipe_cli.train.tune.this_device", lambda profile: HERE)
    monkeypatch.setattr("terapipe_cli.train.tune.train_steps", train_steps)
    return calls


def test_tune_writes_the_measured_fastest_where_the_simulator_ranked_it_second(tmp_path, capsys, fake_training):
    out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", "--profile", MEASURED, "-k", "2", "-b", "4", "--tune", "2", "--out", out, "-q")
    assert p.returncode == 0, p.stdout + p.stderr
    plan = json.loads(out.read_text())
    tuning = plan["tuning"]
    assert tuning["device"] == HERE["name"] and tuning["rounds"] == tune.ROUNDS
    found = tuning["candidates"]
    assert len(found) == 3 and [c["scheme"] for c in found][-1] == "gpipe"  # the best 2, then the GPipe scheme
    # Interleaved: every candidate once per round, in the same order.
    assert fake_training == fake_training[:3] * tune.ROUNDS and len(set(fake_training)) == 3
    predicted = [c["predicted_s"] for c in found]
    assert predicted[0] <= predicted[1]  # the simulator's order
    chosen = [c for c in found if c["chosen"]]
    assert chosen == [found[1]]  # measured 1 s, the fastest, though predicted slower than the first
    timed = tune.ROUNDS * (tune.STEPS - tune.WARMUP_STEPS)
    assert found[1]["measured"] == {"median_s": 1.0, "min_s": 1.0, "max_s": 1.0, "steps": timed}
    assert found[0]["measured"]["median_s"] == 2.0  # the warm-up's 9 s never counted
    # The plan file runs the chosen candidate.
    assert plan["short_form"] == found[1]["short_form"] and plan["order"] == found[1]["order"]
    assert plan.get("virtual_stages", 1) == found[1]["virtual_stages"]
    assert "the plan is the measured fastest" in p.stdout and "predicted" in p.stdout


H100 = ROOT / "configs" / "profiles" / "gpt3-1b-h100-bf16-measured.json"
REFUSED = [
    # (id, the plan's arguments, words of the one line)
    (
        "a profile of another CPU",
        ("--profile", "foreign", "-k", "2", "-b", "2"),
        ("--tune", "Intel Xeon", HERE["name"]),
    ),
    ("a profile of a GPU", ("--profile", H100, "-k", "2", "-b", "2"), ("--tune", "(cuda)", "(cpu)")),
    ("an analytic profile", ("--profile", "analytic", "-k", "2", "-b", "2"), ("--tune", "'analytic' profile")),
    ("an example profile", ("--profile", EXAMPLE, "-k", "2", "-b", "2"), ("--tune", "'example' profile")),
]
REFUSED_OPTIONS = [
    ("no candidate", ("--tune", "0"), ("--tune", "at least 1")),
    ("a fixed scheme", ("--tune", "2", "--scheme", "gpipe"), ("--tune", "--scheme gpipe")),
    ("a corpus's documents", ("--tune", "2", "--data", "corpus"), ("--tune", "--data", "embedded text")),
]


@pytest.mark.parametrize(
    "args, words",
    [(r[1] + ("--tune", "2"), r[2]) for r in REFUSED]
    + [(("--profile", MEASURED, "-k", "2", "-b", "2", *r[1]), r[2]) for r in REFUSED_OPTIONS],
    ids=[r[0] for r in REFUSED + REFUSED_OPTIONS],
)
def test_tune_refuses_in_one_line(tmp_path, capsys, fake_training, args, words):
    """Before anything is planned: one line, exit 2, nothing trained, no file."""
    raw = json.loads(MEASURED.read_text())
    foreign = tmp_path / "xeon.json"
    foreign.write_text(json.dumps({**raw, "device": {**raw["device"], "name": "Intel Xeon Platinum 8480+"}}))
    analytic = tmp_path / "analytic.json"  # its numbers as an estimate's: never timed on this machine
    analytic.write_text(json.dumps({**raw, "source": "analytic"}))
    work = tmp_path / "work"
    work.mkdir()
    args = [{"foreign": foreign, "analytic": analytic}.get(a, a) if isinstance(a, str) else a for a in args]
    p = run_cli(capsys, "plan", *args, "--out", "p.json", cwd=work)
    assert_one_line_error(p, *words)
    assert fake_training == [] and list(work.iterdir()) == []


def test_this_device_is_named_as_a_profile_names_it():
    from terapipe_cli.plan.costmodel import read_profile
    from terapipe_cli.profile.probe import _cpu_name
    from terapipe_cli.train.tune import this_device

    assert this_device(read_profile(MEASURED)) == {"kind": "cpu", "name": _cpu_name()}
