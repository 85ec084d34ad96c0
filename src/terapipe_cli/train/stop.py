"""Stopping a run on a signal, with a checkpoint of the last step done (Megatron-LM's ``--exit-signal-handler``).

A scheduler ends a job with SIGTERM (Slurm can send SIGUSR1 ahead of its time limit), to the launcher, to every
process, or to one of them; a user presses Ctrl-C in the launcher's terminal. Either way:

1. The launcher (`LauncherSignals`) writes the signal's name to ``RUN/stop.request``; a worker's own handler
   (`WorkerSignals`) notes the signal it received. Neither interrupts a step.
2. At every step boundary each rank puts what it knows (0, or the signal's number: its own, or the request
   file's) into one all-reduce (max): every rank learns of a signal received anywhere at the same boundary, so
   all of them save the same step.
3. They save that step's checkpoint if it is not saved yet (its manifest written last, train/checkpoint.py), the
   folder's marking rank writes ``RUN/stopped.json`` (the signal and the step), and all exit 0.
4. The launcher finds ``stopped.json`` and ends with one line naming the saved step and the command that continues,
   exit 128 + the signal's number (143 for SIGTERM); Ctrl-C keeps its exit 130.

``--grace-s`` bounds the save: the launcher stops the workers with SIGKILL when it has not ended by then (a timer
armed with the first signal), and a worker that received the signal itself ends on its own (`WorkerSignals`'
timer). Files are written atomically and the manifest last, so the previous complete checkpoint stays intact.
A second signal stops at once, unless it is the first one again and not Ctrl-C (`repeated`): schedulers repeat
their request (Slurm pre-empts with SIGTERM as a notice and again as its kill sequence, milliseconds apart), and
their own SIGKILL bounds the wait. torchrun itself stops the workers with SIGTERM once one of them has failed: a
worker that finds the run failed (an error file written since it started, train/worker.py) then exits at once,
as before, instead of waiting for a step boundary that will not come.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException

from terapipe_cli.files import write_json_atomic, write_text_atomic

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a worker saves on these; the launcher also on SIGINT
REQUEST_FILE = "stop.request"  # the launcher's signal, for its workers (the signal's name)
STOPPED_FILE = "stopped.json"  # the workers' answer: {"signal": name, "step": the step saved}


DIVERGED_FILE = "errors/diverged.txt"  # a diverged run's cause, for the restarts of the same launch (`worker.train`)


def clear(run_dir: Path) -> None:
    """Before a launch: an earlier launch's request, answer and divergence no longer apply."""
    for name in (REQUEST_FILE, STOPPED_FILE, DIVERGED_FILE):
        (Path(run_dir) / name).unlink(missing_ok=True)


def read_stopped(run_dir: Path) -> dict | None:
    """The workers' answer after a stop (`STOPPED_FILE`), or None when they did not stop on a signal."""
    try:
        record = json.loads((Path(run_dir) / STOPPED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "signal" in record and "step" in record else None


def write_stopped(run_dir: Path, signum: int, step: int) -> None:
    write_json_atomic(Path(run_dir) / STOPPED_FILE, {"signal": signal.Signals(signum).name, "step": step})


def repeated(signum: int, first: int) -> bool:
    """Whether ``signum`` repeats the stop signal received first (SIGTERM or SIGUSR1 again): the same request, which
    does not stop at once as a second signal does. Ctrl-C twice does."""
    return signum == first and signum != signal.SIGINT


class SaveTimeout(Exception):
    """The checkpoint after a stop signal was not saved within --grace-s (the launcher names it in one line)."""


class WorkerSignals:
    """A worker's side: SIGTERM and SIGUSR1 noted (not acted on mid-step), the launcher's request file read at
    each step boundary: `requested` is what this rank puts into the all-reduce every rank makes there."""

    def __init__(self, run_dir: Path, grace_s: float, *, on_expiry: Callable[[str], None], failed: Callable[[], bool]):
        self.run_dir = Path(run_dir)
        self.grace_s = grace_s
        self.on_expiry = on_expiry  # ends this process with a one-line cause; called from the timer's thread
        self.failed = failed  # True once another rank has failed (torchrun's SIGTERM then means: end now)
        self.received = 0  # the signal this process received (0: none)
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if repeated(signum, self.received) and not self.failed():
            return
        if self.received or self.failed():
            # A second signal, or torchrun stopping the workers after a failure: end at once, by the signal itself
            # (the launcher ranks a rank it stopped below the one that failed first).
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        self._timer = threading.Timer(self.grace_s, self._expired, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _expired(self, signum: int) -> None:
        self.on_expiry(
            f"{signal.Signals(signum).name} received, and the checkpoint was not saved within "
            f"--grace-s {self.grace_s:g} s; the previous complete checkpoint is kept"
        )

    def requested(self) -> int:
        """The signal this rank knows of: its own, else the launcher's (0: none)."""
        if self.received:
            return self.received
        try:
            name = (self.run_dir / REQUEST_FILE).read_text().strip()
        except OSError:
            return 0
        return int(getattr(signal.Signals, name, signal.SIGTERM)) if name else 0

    def done(self) -> None:
        """The save finished: no timer ends this process any more."""
        if self._timer is not None:
            self._timer.cancel()


class LauncherSignals:
    """The launcher's side, around torchrun's agent: the first SIGTERM, SIGUSR1 or Ctrl-C asks the workers to save
    and stop (`REQUEST_FILE`) and arms the ``grace_s`` timer; a second signal, or the timer, stops the workers at
    once with SIGKILL (the agent stops them with the signal of the exception it meets, then raises it on)."""

    def __init__(self, run_dir: Path, grace_s: float) -> None:
        self.run_dir = Path(run_dir)
        self.grace_s = grace_s
        self.received = 0
        self.expired = False  # the grace period passed before the workers ended

    @property
    def ctrl_c(self) -> bool:
        return self.received == signal.SIGINT

    @contextmanager
    def handled(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers belong to the main thread; torchrun says the same
            return

        closed = False  # the handlers before are being restored: a late one is not acted on (below)

        def on_signal(signum, frame) -> None:
            if closed or repeated(signum, self.received):
                return
            if self.received:
                for s in (signal.SIGINT, *STOP_SIGNALS):
                    signal.signal(s, signal.SIG_IGN)  # the agent's clean-up is not cut short again
                raise SignalException("stopped again", sigval=signal.SIGKILL)
            self.received = signum
            try:
                write_text_atomic(self.run_dir / REQUEST_FILE, signal.Signals(signum).name + "\n")
            except Exception:  # noqa: BLE001 - no request file (a full disk): stop now, the last checkpoint is kept
                raise SignalException("cannot ask the workers to save", sigval=signal.SIGKILL) from None
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)

        def on_alarm(signum, frame) -> None:
            if closed:
                return
            self.expired = True
            raise SignalException("grace period over", sigval=signal.SIGKILL)

        handled = (signal.SIGINT, *STOP_SIGNALS, signal.SIGALRM)
        before = {s: signal.getsignal(s) for s in handled}
        for s in handled:
            signal.signal(s, on_alarm if s == signal.SIGALRM else on_signal)
        try:
            yield
        finally:
            # A signal another thread took runs its Python handler at the main thread's next instruction: maybe
            # within this loop, where on_signal would set SIG_IGN on the signals restored before it and leave it.
            closed = True
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, handler in before.items():
                signal.signal(s, handler)
            (self.run_dir / REQUEST_FILE).unlink(missing_ok=True)


def failed_since(run_dir: Path, started: float) -> bool:
    """Whether a rank wrote an error file (errors/rank_N.txt, train/worker.py) since ``started`` (time.time)."""
    try:
        return any(p.stat().st_mtime >= started for p in (Path(run_dir) / "errors").glob("rank_*.txt"))
    except OSError:
        return False
