"""The runtime's test-only switches in one record (`config.controls.Controls`): read from one environment variable,
kept in a run's arguments (so torchrun's workers get them from config.json), none recorded for a correct run, and a
run from before the record (its three switches each an argument) read into it."""

from __future__ import annotations

import pytest
from conftest import run_arguments

from terapipe_cli.config.controls import CONTROLS_ENV, Controls
from terapipe_cli.config.run import RunArguments
from terapipe_cli.errors import UserError


def test_the_environment_sets_switches_and_nothing_set_is_the_correct_run():
    assert Controls.from_environment({}) == Controls() and Controls().record() is None
    got = Controls.from_environment({CONTROLS_ENV: "kv_handback=off, fault=kill:1:3,cache_masked=0"})
    assert got == Controls(kv_handback=False, cache_masked=False, fault="kill:1:3")
    assert got.record() == {"kv_handback": False, "cache_masked": False, "fault": "kill:1:3"}
    assert Controls.of(got.record()) == got and Controls.of(None) == Controls()


@pytest.mark.parametrize(("text", "words"), [("kv_handbak=off", "no test switch"), ("kv_handback=maybe", "on or off")])
def test_a_switch_it_cannot_be_is_one_line(text, words):
    with pytest.raises(UserError) as e:
        Controls.from_environment({CONTROLS_ENV: text})
    assert words in str(e.value) and CONTROLS_ENV in str(e.value)


def test_a_run_keeps_its_switches_and_an_older_run_reads_into_the_record():
    args = run_arguments(kv_handback=False, fault="raise:0:2")
    assert args.switches == Controls(kv_handback=False, fault="raise:0:2")
    assert run_arguments().switches == Controls() and run_arguments().controls is None
    obj = {k: v for k, v in vars(run_arguments()).items() if k != "controls"}
    older = RunArguments.from_dict({**obj, "kv_handback": True, "tp_allreduce": False, "vocab_allreduce": True}, "x")
    assert older.switches == Controls(tp_allreduce=False)
