"""Launch the stage workers through torchrun, and turn a worker failure into one line; the one home of the
torchrun command and its environment (`rendezvous_args`, `torchrun_argv`, `package_env`), which the link
measurement of `terapipe profile` also runs through (`run_torchrun`).

The command is ``python -m torch.distributed.run <torchrun_args(...)>``; `launch` runs the same arguments in this
process through torchrun's agent (``torch.distributed.run.run``, not ``main``, whose ``@record`` would print
torchrun's failure table), so ``--dry-run`` prints a command that runs the same workers. On the CPU the agent forks
them from this process instead of starting a fresh interpreter each (`start_method`). torchrun's own failure
handling does the rest: when a worker exits non-zero or is killed, it stops the others and raises
``ChildFailedError`` with the failed ranks' exit codes and error files (written by the workers; forked workers
report the first that failed), which `launch` reduces to the
root cause: a rank that raised or was killed; else one that lost contact with a neighbour (`PeerLost`, which
names the neighbour and says whether the connection closed or a wait timed out, as when a rank hangs);
last, one merely stopped with SIGTERM by torchrun after the first failure. Workers that only a stop signal ended
(one that came before a worker could note it: its first seconds) were stopped, not broken: `stopped_at_once`.

Ctrl-C, SIGTERM, SIGUSR1: a terminal sends SIGINT to its foreground process group, which is this launcher alone
(torchrun's agent runs in it; every worker runs in a session of its own); a scheduler sends SIGTERM to the
launcher, to every process, or to some. The workers save the step they are at and stop (train/stop.py: the
launcher asks them through a file, and they agree on the step through an all-reduce), and `launch` raises
`Interrupted` (Ctrl-C, exit 130) or `Stopped` (exit 143 for SIGTERM) with the one line that names the checkpoint
and says how to continue; past --grace-s, or on a second signal, it stops them at once and says the previous
checkpoint is kept. Whatever
torchrun logs goes into the run folder (``errors/torchrun.log``) when the launch fails or is interrupted, never
onto the terminal; a launch that succeeds clears the error files an earlier attempt left there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch.distributed import DistError
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from terapipe_cli.engine.forking import import_what_a_backward_loads, launch_forked
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.torchrun import package_env, rendezvous_args, torchrun_argv
from terapipe_cli.errors import Interrupted, Stopped, UserError
from terapipe_cli.files import write_text_atomic
from terapipe_cli.train import checkpoint, stop
from terapipe_cli.train.rundir import has_trained, read_config, read_metrics
from terapipe_cli.train.stop import LauncherSignals, SaveTimeout

WORKER_MODULE = "terapipe_cli.train.worker"


class WorkerFailed(Exception):
    """The distributed job failed; the message names the rank and the cause (one line)."""

    exit_code = 1


class RunDiverged(WorkerFailed):
    """The workers stopped on a non-finite loss (`worker.Diverged`); the message says at which step and what is kept."""

    exit_code = 3  # `worker.Diverged.exit_code`


@dataclass(frozen=True)
class Launch:
    run_dir: Path
    nproc_per_node: int
    stages: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    resume_step: int | None = None
    threads: int = 1
    device: str = "cpu"
    backend: str = "gloo"
    timeout_s: float = 120.0  # every distributed wait of the workers (--timeout-s)
    rdzv_timeout_s: float = 300.0  # how long the nodes wait for each other at the rendezvous (--rdzv-timeout)
    settings_digest: str = ""  # `rundir.settings_digest` of this node's request: every node's must be node 0's
    tensor_parallel: int = 1  # T processes per stage
    max_restarts: int = 0  # torchrun restarts all workers after a failure, at most this many times (--max-restarts)
    grace_s: float = 60.0  # the time to save after a stop signal (--grace-s)

    @property
    def layout(self) -> Layout:
        """Where each rank sits: D replicas × K stages × T tensor ranks over all nodes' workers."""
        world = self.nproc_per_node * self.nnodes
        return Layout(world // (self.stages * self.tensor_parallel), self.stages, self.tensor_parallel)


def torchrun_args(spec: Launch) -> list[str]:
    """torchrun's arguments for the stage workers of ``spec``."""
    args = rendezvous_args(
        spec.nproc_per_node,
        nnodes=spec.nnodes,
        node_rank=spec.node_rank,
        rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_timeout_s=spec.rdzv_timeout_s if spec.nnodes > 1 else None,
        max_restarts=spec.max_restarts,  # the workers torchrun restarts continue from the last checkpoint
    )
    args += ["--module", WORKER_MODULE, "--run-dir", str(spec.run_dir)]
    args += ["--device", spec.device, "--backend", spec.backend, "--timeout-s", f"{spec.timeout_s:g}"]
    args += ["--settings", spec.settings_digest]
    if spec.resume_step is not None:
        args += ["--resume-step", str(spec.resume_step)]
    return args


def worker_env(spec: Launch) -> dict[str, str]:
    """Environment the stage workers need beyond the caller's (`package_env`)."""
    env = package_env(spec.threads)
    if spec.max_restarts:
        # The restarted workers' process group must not share the rendezvous' store: there they can read the
        # addresses the previous attempt's workers published and fail to connect (pytorch/pytorch#135712).
        env[SEPARATE_STORE_ENV] = "1"
    return env


SEPARATE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # read by torchrun's c10d rendezvous (the agent)


def command_line(spec: Launch) -> str:
    """The shell command `launch` runs, environment first, for ``--dry-run`` to print."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in worker_env(spec).items())
    return f"{env} " + shlex.join(torchrun_argv(torchrun_args(spec)))


def launch(spec: Launch) -> None:
    """Run the workers to completion; raise WorkerFailed naming the failed rank and its cause, or Interrupted
    (Ctrl-C) saying how to continue."""
    os.environ.update(worker_env(spec))
    args = torchrun.parse_args(torchrun_args(spec))
    args.signals_to_handle = AGENT_SIGNALS  # not SIGINT, SIGTERM, SIGUSR1: `LauncherSignals`' (train/stop.py)
    stop.clear(spec.run_dir)
    signals = LauncherSignals(spec.run_dir, spec.grace_s)
    try:
        with _torchrun_log(spec.run_dir) as log_before, signals.handled():
            run_workers(args, start_method(spec), log_before)
    except ChildFailedError as e:
        diverged = diverged_message(e.failures, spec)
        if diverged is not None:
            raise RunDiverged(diverged) from None
        timeout = [r for r, f in e.failures.items() if _message(f).startswith(SaveTimeout.__name__)]
        if timeout:  # a worker's own --grace-s ran out (it received the signal itself)
            raise not_saved(spec, signal.SIGTERM) from None
        stopped = stopped_at_once(e.failures, spec)
        if stopped is not None:
            raise stopped from None
        raise WorkerFailed(describe_failure(e.failures, spec)) from None
    except SignalException as e:
        if signals.received:  # a second signal, or --grace-s ran out: stopped at once
            raise not_saved(spec, signals.received) from None
        raise WorkerFailed(f"the launcher received {e.sigval.name}; workers stopped") from None
    except DistError as e:  # the rendezvous: a node that never came, or node 0's that never answered
        raise WorkerFailed(describe_rendezvous_failure(e, spec)) from None
    except json.JSONDecodeError:  # a worker error file torchrun cannot read (worker.record_for_torchrun)
        raise WorkerFailed(describe_unreadable_failure(spec)) from None
    clear_errors(spec.run_dir)
    stopped = stop.read_stopped(spec.run_dir)
    if signals.ctrl_c and stopped is not None:
        raise Interrupted(interrupted_message(spec.run_dir))
    if stopped is not None:
        signum = signal.Signals[stopped["signal"]]
        raise Stopped(f"stopped by {signum.name} after step {stopped['step']}; {saved_line(spec.run_dir)}", signum)


def start_method(spec: Launch) -> str:
    """How the workers start. On the CPU, forked from this process by torchrun's agent (``fork``): torch and the package
    are imported already, so a worker starts at once, where a fresh interpreter spends seconds of CPU importing torch on
    a small machine (a two-worker launch of a tiny model spent most of its CPU there: docs/results.md, "Ending a
    process"). With CUDA, each a fresh interpreter (``spawn``: torchrun's own ``python -m``): a child forked from a
    process that has asked the CUDA driver anything (as ``--device auto`` does) cannot use the GPU."""
    return "fork" if spec.device == "cpu" else "spawn"


def run_workers(args, method: str, log_before: tuple = ()) -> None:
    """torchrun's agent in this process with the parsed ``args``, as ``torch.distributed.run.run`` runs it: its
    workers fresh interpreters (``spawn``) or forked from this process, each in a session of its own (``fork``:
    `engine.forking`). ``log_before``: the torch.distributed logger's handlers and propagation before
    `_torchrun_log`, which a forked worker restores (its log goes to its stderr, as a fresh worker's does)."""
    if method == "spawn":
        torchrun.run(args)
    else:
        import_what_a_backward_loads()  # once here rather than once in every worker
        launch_forked(args, own_session=True, log_before=log_before)


# torchrun's agent handles these signals by stopping the workers with the same signal and raising; SIGINT, SIGTERM
# and SIGUSR1 are left out: `stop.LauncherSignals` asks the workers to save first. Only in `launch`: the torchrun of
# a pasted --dry-run command keeps its own handling.
AGENT_SIGNALS = "SIGHUP,SIGQUIT"


def not_saved(spec: Launch, signum: int) -> Interrupted:
    """The one line when a stop signal's save did not finish (--grace-s, or a second signal)."""
    if signum == signal.SIGINT:
        return Interrupted(interrupted_message(spec.run_dir))
    name = signal.Signals(signum).name
    return Stopped(
        f"stopped by {name} before a checkpoint was saved within --grace-s {spec.grace_s:g} s; "
        f"{saved_line(spec.run_dir)}",
        signum,
    )


TORCHRUN_LOG = "torchrun.log"


@contextmanager
def _torchrun_log(run_dir: Path) -> Iterator[tuple]:
    """Keep torchrun's log off the terminal (its warnings and failure table; `launch` says what failed in one
    line) and write it to ``run_dir/errors/torchrun.log`` if the launch does not succeed."""
    logger = logging.getLogger("torch.distributed")  # every torchrun logger ends here (torch: propagate=False)
    kept = _KeptLog()
    before = (logger.handlers[:], logger.propagate)
    logger.handlers, logger.propagate = [kept], False
    try:
        yield before
    except BaseException:
        if kept.lines:
            _write_error_file(run_dir / "errors" / TORCHRUN_LOG, "\n".join(kept.lines) + "\n")
        raise
    finally:
        logger.handlers, logger.propagate = before


class _KeptLog(logging.Handler):
    """A log handler that keeps the formatted lines."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _write_error_file(path: Path, text: str) -> None:
    try:
        write_text_atomic(path, text)
    except OSError:
        pass  # the folder is gone or read-only: the one line on the terminal still says what happened


def clear_errors(run_dir: Path) -> None:
    """After a launch that succeeded: the error files an earlier, failed or interrupted, attempt left in the
    run folder no longer describe it."""
    errors = Path(run_dir) / "errors"
    for path in [*errors.glob("rank_*.txt"), errors / TORCHRUN_LOG]:
        path.unlink(missing_ok=True)
    try:
        errors.rmdir()
    except OSError:
        pass  # not there, or holds something else


def interrupted_message(run_dir: Path, *, restart: str | None = None, then: str = "") -> str:
    """One line for a run stopped by Ctrl-C: the step it was in, its last complete checkpoint, and the command
    that continues from there (``then``: what to run after it); ``restart``: what to do when there is no
    checkpoint yet (default: start again elsewhere)."""
    run_dir = Path(run_dir)
    try:
        done = max((int(r["step"]) for r in read_metrics(run_dir)), default=0)
        steps = read_config(run_dir)[1].steps
    except (UserError, KeyError, TypeError, ValueError):
        done, steps = 0, None
    where = f"interrupted at step {done + 1}" if steps is None or done < steps else f"interrupted after step {done}"
    return f"{where}; {saved_line(run_dir, restart=restart, steps=steps)}{then}"


def saved_line(run_dir: Path, *, restart: str | None = None, steps: int | None = None) -> str:
    """The last complete checkpoint and the command that continues from it (``restart``: what to do without one)."""
    saved = checkpoint.latest_complete(run_dir)
    if saved is None:
        again = restart or f"start again with another --out (or delete {shlex.quote(str(run_dir))})"
        return f"no complete checkpoint yet, nothing to resume: {again}"
    if steps is None:
        try:
            steps = read_config(run_dir)[1].steps
        except (UserError, KeyError, TypeError, ValueError):
            steps = None
    command = ["terapipe", "train", "--resume", "--out", str(run_dir)] + (["--steps", str(steps)] if steps else [])
    return f"the last complete checkpoint is step {saved}; continue with: {shlex.join(command)}"


# The signals a scheduler or a user stops a job with: a worker ended by one (exit code -signum) was stopped, not broken.
STOP_EXIT_CODES = {-s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}


def stopped_at_once(failures: dict, spec: Launch) -> Stopped | None:
    """Workers that a stop signal ended at once — one received before a worker's handler is installed (its first
    seconds: the interpreter, torch's import) or a second one — are a stop, not a crash: when every failed rank was
    ended by SIGTERM, SIGUSR1, SIGHUP or SIGINT (none raised), the one line names the first and the signal, and what
    is kept (exit 128 + the signal's number, as when the workers saved first); else None."""
    if not failures or any(f.exitcode not in STOP_EXIT_CODES for f in failures.values()):
        return None
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    signum = signal.Signals(-failures[rank].exitcode)
    who = f"worker rank {rank} ({spec.layout.describe(rank)})"
    if not has_trained(spec.run_dir):
        return Stopped(
            f"stopped by {signum.name} during start-up: {who} ended on it before the first step; nothing was "
            f"trained, and the same command starts the run again in {spec.run_dir}",
            signum,
        )
    return Stopped(
        f"stopped by {signum.name}: {who} ended on it at once (during start-up, or at a second signal); "
        f"{saved_line(spec.run_dir)}",
        signum,
    )


def describe_rendezvous_failure(error: Exception, spec: Launch) -> str:
    """One line for a rendezvous that failed: which node is missing, where, and after how long."""
    where, waited = spec.rdzv_endpoint, f"{spec.rdzv_timeout_s:g} s"
    text = " ".join(str(error).split())
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined and spec.node_rank == 0:
        n, total = int(joined.group(1)), int(joined.group(2))
        missing = f"node 1 of {total} did not" if total == 2 else f"only {n} of {total} nodes did"
        return f"{missing} join within {waited} at {where} (start the same command there with its --node-rank)"
    if spec.node_rank > 0 and "connect" in text:
        return (
            f"node {spec.node_rank} of {spec.nnodes} found no rendezvous at {where} within {waited}: "
            "is node 0 started, and is the address reachable from here?"
        )
    return f"the rendezvous at {where} failed on node {spec.node_rank} of {spec.nnodes}: {text[:300]}"


def _message(failure) -> str:
    m = failure.message
    if isinstance(m, dict):
        m = m.get("message", "")
    return " ".join(str(m).split())


def describe_unreadable_failure(spec: Launch) -> str:
    """One line when torchrun could not read a worker's error file: the ranks whose tracebacks were written."""
    errors = spec.run_dir / "errors"
    logs = sorted(errors.glob("rank_*.txt"))
    if not logs:
        return f"a worker failed and its error file could not be read; torchrun's log is in {errors / TORCHRUN_LOG}"
    rank = int(logs[0].stem.removeprefix("rank_"))
    cause = " ".join((logs[0].read_text(errors="replace").strip().splitlines() or [""])[-1].split())[:400]
    return f"worker rank {rank} ({spec.layout.describe(rank)}) failed: {cause} — traceback in {logs[0]}"


def diverged_message(failures: dict, spec: Launch) -> str | None:
    """One line for workers that stopped on a non-finite loss (`worker.Diverged`, all at the same step): the step,
    the checkpoint kept and what to change; None for any other failure."""
    cause = next((m for m in map(_message, failures.values()) if m.startswith("Diverged: ")), None)
    if cause is None:
        return None
    saved = checkpoint.latest_complete(spec.run_dir)
    kept = "no checkpoint was written" if saved is None else f"the last checkpoint (step {saved}) is kept"
    return (
        f"training diverged at {cause.removeprefix('Diverged: ')}: stopped before saving that step; {kept}; "
        "train again with another --out and a lower --lr, more --warmup-steps or a --grad-clip"
    )


def describe_failure(failures: dict, spec: Launch) -> str:
    """One line: the root-cause rank and its cause, then the ranks that failed after it."""

    def priority(rank: int) -> int:
        f = failures[rank]
        if f.exitcode == -15:
            return 2  # SIGTERM: usually torchrun stopping the others after the first failure
        if _message(f).startswith("PeerLost"):
            return 1  # lost its neighbour (closed connection or a timeout): a consequence, names the peer
        return 0  # raised, or was killed

    rank = min(failures, key=lambda r: (priority(r), failures[r].timestamp, r))
    f = failures[rank]
    if f.exitcode < 0:
        cause = f"killed by signal {f.signal_name()} (exit code {f.exitcode})"
    else:
        cause = _message(f) if f.error_file != "<N/A>" else f"exited with code {f.exitcode}"
        if len(cause) > 400:
            cause = cause[:400] + "..."
    where = f"rank {rank} ({spec.layout.describe(rank)})"
    others = sorted(r for r in failures if r != rank)
    tail = f"; ranks {others} then failed too" if others else ""
    log = spec.run_dir / "errors" / f"rank_{rank:05d}.txt"
    hint = f" — traceback in {log}" if log.exists() else ""
    return f"worker {where} failed: {cause}{hint}{tail}"
