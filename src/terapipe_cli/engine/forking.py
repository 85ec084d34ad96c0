"""torchrun's agent in a process that has imported torch, its workers forked from it: a worker then starts at once,
where a fresh interpreter spends seconds of CPU importing torch on a small machine (docs/results.md, "Ending a
process"). The training launcher (`train.launch`, on the CPU) runs the agent in its own process; the measurements of
`terapipe profile` that need several processes (`profile.comm`) run it in a forked child they can time out
(`run_agent_in_child`).

Only for the CPU: a child forked from a process that has asked the CUDA driver anything cannot use the GPU, so CUDA
workers stay fresh interpreters (torchrun's own ``python -m``).

A forked worker starts as a fresh one would: in a session of its own (a terminal's Ctrl-C reaches the launcher
alone), the ending signals at their defaults (not its parent's handlers), and standard streams of its own on the
same descriptors — another thread of the parent may have held the old ones' locks at the fork, and their buffers
hold the parent's unwritten text.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.launcher.api import elastic_launch

_ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)


def import_what_a_backward_loads() -> None:
    """What a worker's first backward with given gradients loads (autograd checks their shapes with torch's symbolic
    shapes, which import sympy: most of a second of CPU), imported in the process that forks the workers, so that
    every worker inherits it."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401


def launch_forked(args, *, own_session: bool, log_before: tuple = ()) -> None:
    """torchrun's agent in this process with the parsed torchrun ``args`` (``--module M ...``), as
    ``torch.distributed.run.run`` runs it, but each worker forked from this process to run ``M.main(ARGS)``, in
    a session of its own if ``own_session`` (else in this process's, which a time-out ends at once).
    ``log_before``: the torch.distributed logger's (handlers, propagate) a worker restores, when the caller
    captures the agent's log. Raises what the agent raises (``ChildFailedError``, ``SignalException``, ...)."""
    if args.standalone:  # what `torchrun.run` does before it reads the arguments
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, cmd_args = torchrun.config_from_args(args)
    config.start_method = "fork"
    at = cmd_args.index("-m") + 1  # ["-u", "-m", M, ARGS...]
    module, worker_args = cmd_args[at], cmd_args[at + 1 :]
    elastic_launch(config=config, entrypoint=forked_worker)((module, own_session, log_before), *worker_args)


def forked_worker(how: tuple, *argv: str) -> None:
    """A worker forked by the agent: started as a fresh one would be (module docstring), then ``module.main``;
    ``how``: (module, own_session, log_before) of `launch_forked`."""
    module, own_session, log_before = how
    if own_session:
        os.setsid()
    if log_before:  # before `start_as_new`, which points its stream handlers at the new streams
        logger = logging.getLogger("torch.distributed")
        logger.handlers, logger.propagate = log_before
    start_as_new()
    importlib.import_module(module).main(list(argv))


def start_as_new() -> None:
    """In a forked child: the ending signals at their defaults, and standard streams of its own on descriptors 1
    and 2 (log handlers that wrote to the old ones write to these)."""
    for signum in _ENDING:
        signal.signal(signum, signal.SIG_DFL)
    old = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="backslashreplace")
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for handler in (h for lg in loggers for h in getattr(lg, "handlers", ())):
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in old:
            handler.stream = getattr(sys, old[id(handler.stream)])


def run_agent_in_child(args: Sequence[str], *, output: Path, timeout_s: float) -> int | None:
    """torchrun with ``args`` (``--module M ...``) as `launch_forked` runs it, in a child forked from this process,
    in a session of its own with its workers, everything they print going to ``output``: its exit code (0: every
    worker succeeded), or None when it did not end within ``timeout_s`` (it and its workers are then killed)."""
    parsed = torchrun.parse_args(list(args))
    with open(output, "wb") as out:
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                os.setsid()
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                start_as_new()
                launch_forked(parsed, own_session=False)
                code = 0
            except BaseException:
                try:
                    sys.stderr.write(traceback.format_exc())
                    sys.stderr.flush()
                except BaseException:
                    pass
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
    except BaseException:  # Ctrl-C or a stop signal in the caller: the child's session ends with it
        _end_session(pid)
        raise
    _end_session(pid)
    return None


def _end_session(pid: int) -> None:
    """Kill the session ``pid`` leads (a child of this process: the agent and its workers) and reap the child."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
