"""A real two-node Slurm on this machine, for the tests of `terapipe launch-script --slurm` (and
scripts/slurm_time_limit.py): Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (scripts/setup.sh
installs them where it can).

Everything lives in one private folder: a ``munged`` on its own socket with a key of its own, a ``slurmctld`` and two
``slurmd -N NODE`` on free loopback ports, with their state, spool, pid and log files. The daemons run in the
foreground of processes started here and are stopped by those pids; a Slurm the machine already has (its
/etc/slurm, its munge socket, its ports) is never read or touched: the clients reach this one through ``SLURM_CONF``
in the environment `LoopbackSlurm.env` gives them. The first job id is drawn so that the jobs' rendezvous ports
(which come from their ids) are free. Node 0 is named as this machine, which resolves here, so that the rendezvous on
the allocation's first host (`train.cluster.endpoint_lines`) needs no /etc/hosts line; node 1 has a name of its own.
Both have the address 127.0.0.1 (``NodeAddr``). Tracking and tasks are the plain ones (``proctrack/linuxproc``,
``task/none``): no cgroups. A job in partition ``urgent`` pre-empts the default partition's, which Slurm requeues.
"""

from __future__ import annotations

import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
# Node 0 is this machine's own name, which resolves here (the rendezvous on the allocation's first host needs that);
# node 1 only needs a name of its own, one that Slurm sorts after it (the nodes of a job are in name order).
HOST = socket.gethostname().split(".")[0]
NODES = (HOST, f"{HOST}-1")
CPUS_PER_NODE = 16  # what each node claims (config_overrides): a job may ask for more than the machine has
REQUEUE_DELAY_S = 5  # a requeued job may start again this long after (the job credential's lifetime; Slurm: 120)


def missing_tools() -> list[str]:
    """The Slurm and munge programs this machine lacks (daemons are found in sbin too)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name, path=path) is None]


def skip_reason() -> str | None:
    """Why a real Slurm cannot run here (None: it can)."""
    missing = missing_tools()
    if missing:
        return f"needs Slurm and munge (slurmctld, slurmd, slurm-client, munge: scripts/setup.sh): no {missing[0]}"
    if os.geteuid() != 0:
        return "needs root: slurmd starts the tasks of a job as its user"
    try:
        socket.getaddrinfo(HOST, None)
    except OSError:
        return f"needs this machine's name {HOST!r} to resolve (node 0 is named so)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_job_id(jobs: int = 10) -> int:
    """A first job id whose next ``jobs`` jobs' rendezvous ports (`train.cluster.endpoint_lines`: from the job id)
    are free now, drawn at random: two clusters at once (the tests on two workers) do not share a port."""
    from terapipe_cli.train.cluster import DEFAULT_RDZV_PORT, RDZV_PORTS

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
            return True

    for offset in random.sample(range(RDZV_PORTS - jobs), 200):
        if all(free(DEFAULT_RDZV_PORT + offset + i) for i in range(jobs)):
            return RDZV_PORTS + offset
    raise RuntimeError(f"no {jobs} free ports in a row from {DEFAULT_RDZV_PORT}")


class LoopbackSlurm:
    """Start with `start`, stop with `stop` (also after a failed start); `env` is the clients' environment."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.conf = self.folder / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self._path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment for the clients and the jobs, without a surrounding Slurm job's variables."""
        own = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**own, "PATH": self._path, "SLURM_CONF": str(self.conf), **extra}

    def _program(self, name: str) -> str:
        return shutil.which(name, path=self._path) or name

    def _start(self, *argv: str, log: str) -> None:
        out = open(self.folder / log, "ab")  # noqa: SIM115 - the daemon's own stdout and stderr, kept with its log
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env())
        finally:
            out.close()
        self.procs.append(proc)

    def start(self, timeout_s: float = 60.0) -> None:
        f = self.folder
        munge = f / "munge"
        munge.mkdir(mode=0o755, parents=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.socket = munge / "munge.socket"
        self._start(self._program("munged"), "--foreground", "--force", f"--socket={self.socket}",
                    f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                    f"--seed-file={munge / 'munged.seed'}", log="munged.out")  # fmt: skip
        self._wait(lambda: self.socket.exists(), "munged's socket", timeout_s)
        ports = [free_port() for _ in range(1 + len(NODES))]
        self.conf.write_text(self._config(ports[0], ports[1:]))
        for d in ("state", *(f"spool-{n}" for n in NODES)):
            (f / d).mkdir()
        self._start(self._program("slurmctld"), "-D", "-i", "-f", str(self.conf), log="slurmctld.out")
        for node in NODES:
            self._start(self._program("slurmd"), "-D", "-N", node, "-f", str(self.conf), log=f"slurmd-{node}.out")
        self._wait(self._nodes_idle, "both nodes idle (sinfo)", timeout_s)

    def _config(self, controller_port: int, node_ports: list[int]) -> str:
        f, user = self.folder, getpass.getuser()
        nodes = [
            f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for n, p in zip(NODES, node_ports, strict=True)
        ]
        return "\n".join([
            "ClusterName=terapipe-test",
            f"FirstJobId={first_job_id()}",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={controller_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket},cred_expire={REQUEUE_DELAY_S}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool-%n'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={f / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # a requeued job starts once eligible, not at the next minute
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            *nodes,
            # A job in "urgent" pre-empts one in "main" (the default) and Slurm requeues it, as sites pre-empt.
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"PartitionName=main Nodes={','.join(NODES)} Default=YES PriorityTier=1 MaxTime=INFINITE State=UP",
            f"PartitionName=urgent Nodes={','.join(NODES)} PriorityTier=2 MaxTime=INFINITE State=UP",
        ]) + "\n"  # fmt: skip

    def _nodes_idle(self) -> bool:
        self._check_alive()
        p = subprocess.run([self._program("sinfo"), "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
        return p.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} ended with {proc.returncode}; see the logs in {self.folder}")

    def _wait(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s:g} s; see the logs in {self.folder}")
            time.sleep(0.1)

    # ------------------------------------------------------------------------------------------------- the jobs

    def run(self, *argv: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """A client command (``sbatch``, ``scancel``, ...) against this cluster."""
        p = subprocess.run([self._program(argv[0]), *argv[1:]], env=env or self.env(), capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
        return p

    def submit(self, script: Path, *, cwd: Path, env: dict | None = None) -> str:
        """``sbatch --parsable SCRIPT`` as a user submits it: the job id."""
        p = subprocess.run([self._program("sbatch"), "--parsable", str(script)], cwd=cwd, env=env or self.env(),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"sbatch {script}: exit {p.returncode}: {p.stderr.strip()}")
        return p.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...); {} once the job is forgotten."""
        p = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(word.split("=", 1) for word in p.stdout.split() if "=" in word) if p.returncode == 0 else {}

    def wait_for(self, ready, what: str, timeout_s: float = 120.0) -> None:
        """Poll ``ready`` (a file, the queue) until it holds; the daemons must stay up meanwhile."""
        self._wait(ready, what, timeout_s)

    def stop(self) -> None:
        """Cancel what still runs here, then stop the daemons this object started, by their pids."""
        if any(proc.poll() is None for proc in self.procs[1:]):
            self.run("scancel", "--full", "--signal=KILL", "--user", getpass.getuser(), check=False)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                p = self.run("squeue", "-h", check=False)
                if p.returncode != 0 or not p.stdout.strip():
                    break
                time.sleep(0.2)
        for proc in reversed(self.procs):  # the slurmds, the controller, munged last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
