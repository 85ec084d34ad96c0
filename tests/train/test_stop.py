"""The signal protocol's two ends in one process (train/stop.py): the launcher turns its first signal into the
workers' request file and arms --grace-s, a second signal or the end of the grace period stops the workers at once;
a worker knows of a signal it received or its launcher's request. The real processes are test_cluster.py's."""

from __future__ import annotations

import os
import signal
import time

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from terapipe_cli.train import stop


def test_the_launcher_asks_its_workers_then_stops_them_at_a_second_signal(tmp_path):
    signals = stop.LauncherSignals(tmp_path, grace_s=60)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SignalException) as e:
        with signals.handled():
            os.kill(os.getpid(), signal.SIGUSR1)
            assert signals.received == signal.SIGUSR1 and not signals.ctrl_c
            assert (tmp_path / stop.REQUEST_FILE).read_text() == "SIGUSR1\n"
            worker = stop.WorkerSignals(tmp_path, 60, on_expiry=print, failed=lambda: False)
            assert worker.requested() == signal.SIGUSR1  # what the workers read at their next step boundary
            os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.sigval == signal.SIGKILL and not signals.expired
    assert signal.getsignal(signal.SIGTERM) == before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert not (tmp_path / stop.REQUEST_FILE).exists()


def test_the_grace_period_ends_the_wait_for_the_save(tmp_path):
    signals = stop.LauncherSignals(tmp_path, grace_s=0.05)
    with pytest.raises(SignalException) as e:
        with signals.handled():
            os.kill(os.getpid(), signal.SIGINT)
            assert signals.ctrl_c
            time.sleep(30)  # the workers' save, taking too long
    assert e.value.sigval == signal.SIGKILL and signals.expired


def test_a_worker_notes_its_own_signal_and_its_timer_ends_it_after_the_grace_period(tmp_path):
    ended = []
    worker = stop.WorkerSignals(tmp_path, 0.05, on_expiry=ended.append, failed=lambda: False)
    before = {s: signal.getsignal(s) for s in stop.STOP_SIGNALS}
    try:
        worker.install()
        assert worker.requested() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert worker.requested() == signal.SIGTERM
        deadline = time.monotonic() + 30
        while not ended and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ended == ["SIGTERM received, and the checkpoint was not saved within --grace-s 0.05 s; the previous "
                         "complete checkpoint is kept"]  # fmt: skip
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_the_workers_answer_names_the_signal_and_the_step(tmp_path):
    assert stop.read_stopped(tmp_path) is None
    stop.write_stopped(tmp_path, signal.SIGTERM, 7)
    assert stop.read_stopped(tmp_path) == {"signal": "SIGTERM", "step": 7}
    stop.clear(tmp_path)
    assert stop.read_stopped(tmp_path) is None


def test_a_save_past_the_grace_period_is_one_line_naming_the_checkpoint_kept(tmp_path):
    from fake_runs import checkpointed_run

    from terapipe_cli.errors import Stopped
    from terapipe_cli.train.launch import Launch, not_saved

    run = checkpointed_run(tmp_path / "run", step=3)
    error = not_saved(Launch(run_dir=run, nproc_per_node=2, stages=2, grace_s=30), signal.SIGTERM)
    assert isinstance(error, Stopped) and error.exit_code == 143
    assert str(error) == (
        f"stopped by SIGTERM before a checkpoint was saved within --grace-s 30 s; the last complete checkpoint is "
        f"step 3; continue with: terapipe train --resume --out {run} --steps 3"
    )


def test_a_repeated_sigterm_is_the_same_request_and_another_signal_stops_at_once(tmp_path):
    """Slurm pre-empts with SIGTERM twice within milliseconds (a notice, then its kill sequence): the launcher and a
    worker take the repeat as the same request and go on saving; another signal after it still stops at once."""
    signals = stop.LauncherSignals(tmp_path, grace_s=60)
    with pytest.raises(SignalException) as e:
        with signals.handled():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.received == signal.SIGTERM and (tmp_path / stop.REQUEST_FILE).read_text() == "SIGTERM\n"
            os.kill(os.getpid(), signal.SIGUSR1)
    assert e.value.sigval == signal.SIGKILL and not signals.expired
    worker = stop.WorkerSignals(tmp_path, 60, on_expiry=print, failed=lambda: False)
    before = {s: signal.getsignal(s) for s in stop.STOP_SIGNALS}
    try:
        worker.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this process
        assert worker.requested() == signal.SIGTERM
    finally:
        worker.done()
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_signal_handled_while_the_handlers_are_restored_leaves_them_restored(tmp_path, monkeypatch):
    """A signal another thread took runs its Python handler at the main thread's next instruction, which can be within
    the restoring of the handlers: it changes nothing there (it once set SIG_IGN on the signals already restored,
    and a later Ctrl-C or SIGTERM in this process, or in a process it started, did nothing)."""
    watched = (signal.SIGINT, *stop.STOP_SIGNALS, signal.SIGALRM)
    before = {s: signal.getsignal(s) for s in watched}
    restore = signal.signal
    late = []

    def restoring(signum, handler):
        previous = restore(signum, handler)
        if signum == signal.SIGINT and handler is before[signal.SIGINT] and not late:
            late.append(signum)
            signal.raise_signal(signal.SIGUSR1)  # runs SIGUSR1's handler now, still the launcher's
            signal.raise_signal(signal.SIGALRM)
        return previous

    signals = stop.LauncherSignals(tmp_path, grace_s=60)
    with signals.handled():
        signal.raise_signal(signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        monkeypatch.setattr(stop.signal, "signal", restoring)
    monkeypatch.undo()
    assert late and {s: signal.getsignal(s) for s in watched} == before and not signals.expired
