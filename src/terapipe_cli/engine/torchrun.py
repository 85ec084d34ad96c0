"""How ranks are started: torchrun's command line and the environment its workers need. The training launcher
(`train.launch`) and the measurements of `terapipe profile` that need several processes (`profile.comm`,
`profile.tensor_parallel`) all start their workers through here. Imports no torch.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from terapipe_cli.errors import threads_leave_signals_to_main


def rendezvous_args(
    nproc_per_node: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_timeout_s: float | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's process arguments: standalone on one machine, or the given static rendezvous across nodes
    (node 0 hosts it at the endpoint; node ``R``'s ranks are R x nproc_per_node onwards), waiting at most
    ``rdzv_timeout_s`` for the other nodes. After a failed worker the agent restarts all of them at most
    ``max_restarts`` times (then the job fails), and it looks at its workers every 0.1 s."""
    args = ["--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]
    if nnodes == 1 and rdzv_endpoint is None:
        return ["--standalone", "--nnodes", "1", *args]
    endpoint = rdzv_endpoint or "localhost:29500"
    args = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint, *args]
    if rdzv_timeout_s is not None:
        args += ["--rdzv-conf", f"timeout={math.ceil(rdzv_timeout_s)}"]
    return args


def torchrun_argv(args: Sequence[str]) -> list[str]:
    """The whole command: this Python running torchrun (``torch.distributed.run``) with ``args``."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def package_env(threads: int) -> dict[str, str]:
    """Environment torchrun's workers need beyond the caller's: their thread count, and this package first on
    the path, so they import it however the caller did (installed, or ``PYTHONPATH=src`` from any folder)."""
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds terapipe_cli/
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_root]
    return {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join([package_root, *paths])}


def run_torchrun(args: Sequence[str], *, threads: int, timeout_s: float) -> subprocess.CompletedProcess:
    """Run torchrun with ``args`` as a child process, output captured, in its own session (so that a
    timeout stops torchrun and not the caller's terminal); raises ``subprocess.TimeoutExpired``."""
    env = dict(os.environ, **package_env(threads))
    return subprocess.run(
        torchrun_argv(args), env=env, capture_output=True, text=True, timeout=timeout_s, start_new_session=True
    )


POLL_S = 0.2  # how often a progress bar follows the workers: redrawn five times a second, it reads as live


@contextmanager
def polling(look: Callable[[], None], every_s: float = POLL_S) -> Iterator[None]:
    """While the body runs (workers that train or measure), a thread calls ``look`` every ``every_s`` seconds to
    follow what rank 0 writes (a progress bar's), and the body's end calls it once more."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            look()

    thread = threading.Thread(target=loop, name="terapipe-polling", daemon=True)
    with threads_leave_signals_to_main():
        thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        look()
