"""The one user-facing error type.

Anything the user can get wrong (a file, a field, an option) raises `UserError`. The CLI turns it into
one line on stderr and exit code 2 — never a traceback.
"""

from __future__ import annotations


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
