"""The one user-facing error type.

Anything the user can get wrong (a file, a field, an option) raises `UserError`. The CLI turns it into
one line on stderr and exit code 2 — never a traceback.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class UserError(ValueError):
    """A mistake in the user's input, reported as one line: ``<where>: <what is wrong>``.

    A ``ValueError``, as scipy.optimize raises for bad arguments, so library callers can catch it without
    knowing this type.
    """

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.message = " ".join(str(message).split())  # always one line
        self.where = where
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class Interrupted(Exception):
    """The user stopped the command (Ctrl-C): one line saying where things stand and how to go on.

    The CLI prints it and exits with 130 (128 + SIGINT), what a shell reports for a command ended by Ctrl-C.
    Not a ``KeyboardInterrupt``: the work was already stopped cleanly where it was raised.
    """

    exit_code = 130


class Stopped(Interrupted):
    """A signal (SIGTERM, SIGUSR1: a scheduler ending the job) stopped the command, which saved what it could
    first: one line, and exit 128 + the signal's number (143 for SIGTERM), what a process ended by it reports."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignal(BaseException):
    """A signal that ends a command — Ctrl-C's SIGINT, SIGTERM (``kill``, a scheduler), SIGHUP (the terminal gone),
    SIGUSR1 (Slurm's warning) — raised where the command is: every ``with`` and ``finally`` on the way out runs, so no
    temporary file is left behind. A ``BaseException``, as ``KeyboardInterrupt`` is, so that no ``except Exception``
    stops it (and not a ``KeyboardInterrupt``, which the CLI's framework turns into a bare exit code). The CLI ends
    with one line and exit 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
_DEFAULTS = (signal.SIG_DFL, signal.default_int_handler)  # what Python leaves them at: a handler set is kept


@contextmanager
def signals_raise() -> Iterator[None]:
    """Within: `ENDING_SIGNALS` raise `StopSignal` in the main thread (one ignored, as ``nohup`` leaves SIGHUP, or
    handled otherwise stays so); the handlers before are restored after. ``terapipe train``'s launcher handles them
    itself while its workers run (train/stop.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stop(signum: int, frame) -> None:
        raise StopSignal(signum)

    before = {s: signal.getsignal(s) for s in ENDING_SIGNALS}
    replaced = [s for s, handler in before.items() if any(handler is d for d in _DEFAULTS)]
    for s in replaced:
        signal.signal(s, raise_stop)
    try:
        yield
    finally:
        for s in replaced:
            signal.signal(s, before[s])


def ending_signals_off_this_thread() -> None:
    """Called first in a helper thread (or as a thread pool's initializer): the ending signals are never delivered
    to it. The kernel hands a signal to any one thread that does not block it, and one that a helper thread takes
    only sets Python's flag: a main thread blocked in a read (a pipe that stays open) would never run its handler."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, ENDING_SIGNALS)


@contextmanager
def threads_leave_signals_to_main() -> Iterator[None]:
    """Threads started within (rich's refresh thread, a progress ticker) inherit a signal mask without the ending
    signals, so only the main thread receives them (`ending_signals_off_this_thread` says why). The main thread
    blocks them only while the body starts its threads; one arriving meanwhile waits and comes when they are back."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextmanager
def signals_held() -> Iterator[None]:
    """Within: an ending signal with a Python handler (`signals_raise`'s, Ctrl-C's) waits until the block is done, then
    goes to that handler: a cleanup that removes temporary files is not cut short by a second Ctrl-C or a SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {s: signal.getsignal(s) for s in ENDING_SIGNALS}
    held = [s for s, handler in before.items() if callable(handler)]
    for s in held:
        signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s in held:
            signal.signal(s, before[s])
        if caught:
            before[caught[0]](caught[0], None)
