"""`terapipe_cli.ending`: a process ended by `end_process` exits as ``raise SystemExit`` would — its status, its exit
functions run, what it printed written out — without the interpreter's teardown; and where that teardown matters
(another thread still running, a profiler) it is the interpreter's own exit. Each case is a small Python process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT


def run(body: str) -> subprocess.CompletedProcess:
    program = textwrap.dedent(body)
    env = {"PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("code, status", [(0, 0), (None, 0), (3, 3), (130, 130)])
def test_the_status_is_the_programs_and_the_exit_functions_run(code, status):
    p = run(f"""
        import atexit, sys
        from terapipe_cli.ending import entry_point
        atexit.register(lambda: print("exit function ran", file=sys.stderr))
        def main():
            sys.stdout.write("printed, still buffered")  # a pipe: block-buffered, not yet written
            raise SystemExit({code!r})
        entry_point(main)
        print("not reached")
        """)
    assert p.returncode == status
    assert p.stdout == "printed, still buffered"
    assert p.stderr == "exit function ran\n"


def test_the_teardown_is_skipped():
    """An object still alive at the end is not finalized: the interpreter's module teardown, which would run its
    ``__del__``, does not happen (the negative control: a plain ``raise SystemExit`` does run it)."""
    program = """
        import sys
        from terapipe_cli.ending import entry_point
        class Held:
            def __del__(self):
                print("torn down", file=sys.stderr)
        held = Held()
        def main():
            return 0
        {ending}
        """
    fast = run(program.format(ending="entry_point(main)"))
    plain = run(program.format(ending="raise SystemExit(main())"))
    assert fast.returncode == plain.returncode == 0
    assert fast.stderr == "" and plain.stderr == "torn down\n"


def test_a_running_thread_or_a_profiler_gets_the_interpreters_own_exit():
    """A non-daemon thread still running is waited for, as the interpreter does; under a profiler (``python -m
    cProfile``) the process ends the interpreter's way, so the profiler writes what it gathered."""
    thread = run("""
        import threading, time
        from terapipe_cli.ending import entry_point
        def late():
            time.sleep(0.2)
            print("the thread finished")
        threading.Thread(target=late).start()
        entry_point(lambda: 5)
        """)
    assert thread.returncode == 5 and thread.stdout == "the thread finished\n"
    profiled = run("""
        import cProfile, sys
        from terapipe_cli.ending import entry_point
        class Held:
            def __del__(self):
                print("torn down", file=sys.stderr)
        held = Held()
        profiler = cProfile.Profile()
        profiler.enable()
        entry_point(lambda: 0)
        """)
    assert profiled.returncode == 0 and profiled.stderr == "torn down\n"


def test_a_message_as_the_status_is_printed_by_the_interpreter():
    p = run("""
        from terapipe_cli.ending import entry_point
        def main():
            raise SystemExit("terapipe: stopped")
        entry_point(main)
        """)
    assert p.returncode == 1 and p.stderr == "terapipe: stopped\n"
