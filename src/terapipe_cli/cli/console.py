"""The one way commands make their rich Console, so that tables stay readable when the output is piped."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from terapipe_cli.errors import threads_leave_signals_to_main
from terapipe_cli.units import format_duration

# Piped output has no terminal to measure, and rich would then fit every table into 80 columns, wrapping a
# plan's slicing one word per line. A file or a pager can take long lines; the widest table (the plan's) fits.
PIPED_WIDTH = 160


def make_console(*, stderr: bool = False, **options) -> Console:
    """A Console for a command's output (``options`` go to rich): on a terminal, the terminal's width; when
    the output is not a terminal and COLUMNS is not set, at least `PIPED_WIDTH` columns."""
    stream = sys.stderr if stderr else sys.stdout
    if "width" not in options and not os.environ.get("COLUMNS", "").isdigit() and not _is_terminal(stream):
        options["width"] = max(_terminal_width(), PIPED_WIDTH)
    return Console(stderr=stderr, **options)


def _terminal_width() -> int:
    """The width of the terminal on any of the standard streams (``cmd | less``: stderr's), else 0."""
    for fd in (1, 2, 0):
        try:
            return os.get_terminal_size(fd).columns
        except OSError:
            continue
    return 0


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


class ProgressBar:
    """A rich progress bar with an ETA, one task per phase (`profile`'s measurements, ``--verify``'s reference runs,
    the report's baseline); ``with ProgressBar(console) as update``: ``update(phase, done, total)``."""

    def __init__(self, console: Console) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, int] = {}

    def update(self, phase: str, done: float, total: float) -> None:
        key = phase.split(" (")[0]
        if key not in self.tasks:
            self.tasks[key] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[key], completed=done, total=total, description=phase)

    def __enter__(self):
        with threads_leave_signals_to_main():  # rich's refresh thread
            self.bar.__enter__()
        return self.update

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)


class PlainProgress:
    """Progress where stderr is not a terminal (a pipe, a log file), which a moving line cannot reach: once the work
    has run ``after_s`` seconds, a plain line every ``every_s`` seconds saying the latest news and the time so far,
    as pip and torchrun write into logs. ``update(text)`` is told the news; ``tick()`` writes when a line is due
    (`plain_progress` calls it every second; tests call it with their own ``clock``)."""

    def __init__(
        self,
        head: str,
        stream,
        *,
        after_s: float = 5.0,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.head, self.stream, self.after_s, self.every_s, self.clock = head, stream, after_s, every_s, clock
        self.start, self.last = clock(), None
        self.text: str | None = None
        self.lock = threading.Lock()

    def update(self, text: str) -> None:
        with self.lock:
            self.text = text
        self.tick()

    def tick(self) -> None:
        with self.lock:
            now = self.clock()
            elapsed = now - self.start
            if elapsed < self.after_s or (self.last is not None and now - self.last < self.every_s):
                return
            self.last = now
            news = f" — {self.text}" if self.text else " …"
            print(f"{self.head}{news} ({format_duration(elapsed)} so far)", file=self.stream, flush=True)


@contextmanager
def plain_progress(progress: PlainProgress) -> Iterator[PlainProgress]:
    """``progress`` ticked every second while the body runs (a search can go long between two pieces of news)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(1.0):
            progress.tick()

    thread = threading.Thread(target=loop, name="terapipe-progress", daemon=True)
    with threads_leave_signals_to_main():
        thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()
