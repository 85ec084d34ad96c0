"""How a terapipe process ends: `end_process`, the interpreter's exit less its teardown.

At exit the interpreter clears every module it imported, one by one, collecting garbage as it goes; a process that
has imported torch holds over a thousand modules, and their teardown is a sizeable share of a short command's CPU
time (docs/results.md, "Ending a process"). Nothing a command wrote depends on it: its files are closed and renamed
into place before it returns. So the entry points that start a fresh interpreter — the ``terapipe`` command, a
training worker or a profile rank started by torchrun, the scripts — end through `end_process`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def end_process(code: object = 0) -> NoReturn:
    """End this process with exit status ``code`` (an int; None is 0), as ``raise SystemExit(code)`` at the top of
    the program would, less the interpreter's teardown: the exit functions run (``atexit``'s: logging's, the
    multiprocessing children's, torch's), the standard streams are flushed, then the process ends (`os._exit`).

    The interpreter's own exit when another non-daemon thread is still running (it waits for them), when ``code`` is not
    an int (it prints it), or under a profiler or a tracer (``python -m cProfile``, coverage: they write what they
    gathered after the program returns). Only where the process began in this interpreter: a forked child (a CPU
    training worker) inherits its parent's exit functions, and ends as its forking library ends it."""
    if code is None:
        code = 0
    me = threading.current_thread()
    others = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
    watched = sys.getprofile() is not None or sys.gettrace() is not None
    if others or watched or isinstance(code, bool) or not isinstance(code, int):
        raise SystemExit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: what it held cannot be written anywhere
            pass
    os._exit(code)


def entry_point(main) -> NoReturn:
    """Run ``main()`` (a program's whole work: it returns, or raises ``SystemExit`` with its status) and end the
    process through `end_process`. An exception other than ``SystemExit`` propagates: the interpreter prints it."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    end_process(code)
