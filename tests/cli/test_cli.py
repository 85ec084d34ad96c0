"""The `terapipe` command itself: version, short help."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli, terapipe

from terapipe_cli import __version__
from terapipe_cli.errors import ENDING_SIGNALS


def test_version_and_short_help(capsys):
    p = terapipe("--version")  # a real process; the help pages in this one
    assert p.returncode == 0 and p.stdout.strip() == f"terapipe {__version__}"
    for args in (("-h",), ("plan", "-h"), ("train", "-h")):
        p = run_cli(capsys, *args)
        assert p.returncode == 0 and "Usage: terapipe" in p.stdout, args


def test_configs_lists_the_bundled_names():
    from terapipe_cli.config.bundled import bundled_names

    p = terapipe("configs")
    assert p.returncode == 0, p.stderr
    for kind in ("models", "hardware", "experiments"):
        for name in bundled_names(kind):
            assert name in p.stdout, (kind, name)


def test_each_commands_line_in_the_help_is_a_whole_sentence():
    """`terapipe --help` shows each command's first paragraph: it must end a sentence, not stop at a colon."""
    import typer

    from terapipe_cli.cli import app

    for name, command in typer.main.get_command(app).commands.items():
        first = " ".join(command.help.split("\n\n")[0].split())
        assert first.endswith("."), (name, first)


def test_profile_help_says_model_takes_a_transformers_folder(capsys):
    from conftest import run_cli

    p = run_cli(capsys, "profile", "--help")
    assert p.returncode == 0 and "transformers folder" in " ".join(p.stdout.replace("│", " ").split()), p.stdout


# In a fresh process: the command's module (numpy's BLAS threads start on import), a rich progress bar, the plain
# progress ticker and a pool with the signals off, each thread's blocked signals read from /proc.
THREADS_AND_THEIR_MASKS = """
import json, os, signal, sys, threading
from concurrent.futures import ThreadPoolExecutor
import terapipe_cli.cli
from terapipe_cli.cli.console import PlainProgress, ProgressBar, make_console, plain_progress
from terapipe_cli.errors import ending_signals_off_this_thread

def masks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        status = open(f"/proc/self/task/{tid}/status").read()
        out[int(tid)] = int(status.split("SigBlk:")[1].split()[0], 16)
    return out

with ProgressBar(make_console(stderr=True)), plain_progress(PlainProgress("x", sys.stderr)):
    with ThreadPoolExecutor(max_workers=1, initializer=ending_signals_off_this_thread) as pool:
        pool.submit(lambda: None).result()
        print(json.dumps({"main": threading.main_thread().native_id, "masks": masks()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads' signal masks from /proc")
def test_only_the_main_thread_takes_an_ending_signal():
    """A signal the kernel hands to a helper thread only sets Python's flag: the main thread, blocked in a read of a
    pipe that stays open, would never run its handler (`data tokenize` hung so). Every thread the command starts
    blocks the ending signals; the main thread blocks none."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-c", THREADS_AND_THEIR_MASKS], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    main, masks = seen["main"], {int(k): v for k, v in seen["masks"].items()}
    ending = sum(1 << (s - 1) for s in ENDING_SIGNALS)
    assert len(masks) >= 4  # the main thread, numpy's, rich's, the ticker, the pool's
    assert masks.pop(main) & ending == 0
    assert all(mask & ending == ending for mask in masks.values()), {t: hex(m) for t, m in masks.items()}
