"""Launch scripts for a plan on a cluster: the `terapipe train` command of every node, with the rendezvous filled in.

A plan runs D × K × T workers (`engine.mesh.Layout`). On N machines with G processes each, ``terapipe train
--nnodes N --node-rank i`` starts node i's G workers through torchrun, and ranks fill the nodes in order: node i
holds ranks i·G … (i+1)·G − 1. Ranks put the tensor dimension innermost, so T dividing G keeps every stage's T
tensor ranks on one machine: they all-reduce in every layer, and only a machine's own links are fast enough.

Everything before the last section (the folder) is pure: numbers and strings in, the scripts' text out (no torch,
no I/O), so the scripts can be written on a laptop. Every word put into a script is quoted with `shlex.quote`.
`check_out_folder` and `write_launch_folder` then put the files in place: the folder appears whole or not at all.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli.config.run import TABLE, RunConfig
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import Plan

DEFAULT_RDZV_PORT = 29500  # torchrun's own default port
# In a Slurm job the rendezvous port is DEFAULT_RDZV_PORT + the job id modulo this: two jobs that share a node do not
# collide (but for 1 in RDZV_PORTS), and every port stays below Linux's ephemeral range (32768 on).
RDZV_PORTS = 2000
COMMON_GPUS_PER_NODE = (1, 2, 4, 8)  # what machines usually have: the layouts an error suggests
MARK = "# Written by `terapipe launch-script`"  # every file carries it: --force replaces only such folders
SBATCH_FILE = "launch.sbatch"
RDZV_VARIABLE = "RDZV_ENDPOINT"  # the shell variable of an endpoint found when the job runs
_OWN_FILE = re.compile(r"node-\d+\.sh|" + re.escape(SBATCH_FILE))
_EXECUTABLE, _READABLE = 0o777, 0o666  # before the umask


def node_script_name(node: int) -> str:
    return f"node-{node}.sh"


def parse_endpoint(text: str, where: str = "--rdzv-endpoint") -> str:
    """``HOST:PORT`` checked (a host, a port from 1 to 65535; an IPv6 host in brackets) and written plainly."""
    example = f"e.g. node0:{DEFAULT_RDZV_PORT}"
    if not text or any(c.isspace() for c in text):
        raise UserError(f"expected HOST:PORT without spaces ({example}), got {text!r}", where=where)
    host, colon, port = text.rpartition(":")
    if not colon:
        raise UserError(f"expected HOST:PORT ({example}), got {text!r}: no port", where=where)
    if not host:
        raise UserError(f"expected HOST:PORT ({example}), got {text!r}: no host", where=where)
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise UserError(f"an IPv6 host goes in brackets ([::1]:{DEFAULT_RDZV_PORT}), got {text!r}", where=where)
    if not re.fullmatch(r"[0-9]+", port) or not 1 <= int(port) <= 65535:
        raise UserError(f"the port must be an integer from 1 to 65535, got {port!r} in {text!r}", where=where)
    return f"{host}:{int(port)}"


def parse_program(text: str, where: str = "--terapipe") -> tuple[str, ...]:
    """The words that start terapipe on the nodes (``terapipe``, or ``python -m terapipe_cli``)."""
    try:
        words = tuple(shlex.split(text))
    except ValueError as e:
        raise UserError(f"not a command line ({e}): {text!r}", where=where) from None
    if not words:
        raise UserError("must name the command that runs terapipe on the nodes, e.g. terapipe", where=where)
    return words


# ------------------------------------------------------------------------------------------------------ the layout


def run_layout(plan: Plan, config: RunConfig, *, nodes: int, where: str) -> Layout:
    """The D × K × T that ``terapipe train --plan PLAN --config FILE`` runs: the degrees of ``config`` (read from
    the file ``where``) where it sets them, else the plan's; a setting that cannot run on ``nodes`` is refused."""
    layout = Layout(
        config.data_parallel or plan.data_parallel, plan.stages, config.tensor_parallel or plan.tensor_parallel
    )
    if config.tensor_parallel is not None:
        plan.model.check_tensor_parallel(layout.tensor, where=f"{where}: field '{TABLE}.tensor_parallel'")
    if config.value("verify") and nodes > 1:
        raise UserError(
            "--verify runs its reference on one machine; it cannot run on several",
            where=f"{where}: field '{TABLE}.verify'",
        )
    return layout


def fitting_layouts(layout: Layout) -> list[tuple[int, int]]:
    """(nodes, processes per node) pairs that hold ``layout``, for the usual machine sizes (and T itself, which
    always fits): the processes per node divide the world and are a multiple of T."""
    sizes = sorted({*COMMON_GPUS_PER_NODE, layout.tensor})
    return [(layout.world // g, g) for g in sizes if layout.world % g == 0 and g % layout.tensor == 0]


def check_layout(layout: Layout, nodes: int, gpus_per_node: int) -> None:
    """N × G = D × K × T, and T divides G (a stage's tensor ranks stay inside one node); one line naming the flag
    and the layouts that would fit otherwise."""
    for value, name in ((nodes, "--nodes"), (gpus_per_node, "--gpus-per-node")):
        if value < 1:
            raise UserError(f"must be at least 1, got {value}", where=name)
    fits = "; ".join(f"--nodes {n} --gpus-per-node {g}" for n, g in fitting_layouts(layout))
    if nodes * gpus_per_node != layout.world:
        raise UserError(
            f"{nodes} × {gpus_per_node} = {nodes * gpus_per_node} processes, but the plan runs "
            f"{layout.shape_text()}; layouts that fit: {fits}",
            where="--nodes × --gpus-per-node",
        )
    if gpus_per_node % layout.tensor:
        raise UserError(
            f"{gpus_per_node} is not a multiple of the plan's tensor-parallel T = {layout.tensor}: a stage's T "
            f"processes all-reduce in every layer, so they stay inside one node; layouts that fit: {fits}",
            where="--gpus-per-node",
        )


@dataclass(frozen=True)
class NodePlace:
    """What one node runs: its ranks, and the replicas and stages they belong to."""

    node: int
    ranks: range
    replicas: tuple[int, ...]
    stages: tuple[int, ...]


def node_places(layout: Layout, gpus_per_node: int) -> list[NodePlace]:
    places = []
    for node in range(layout.world // gpus_per_node):
        ranks = range(node * gpus_per_node, (node + 1) * gpus_per_node)
        replicas = tuple(sorted({layout.replica(r) for r in ranks}))
        stages = tuple(sorted({layout.stage(r) for r in ranks}))
        places.append(NodePlace(node, ranks, replicas, stages))
    return places


def _places(place: NodePlace) -> str:
    """``ranks 0–3: replica 0, stages 0–1``."""
    parts = [(place.ranks, "rank"), (place.replicas, "replica"), (place.stages, "stage")]
    words = [f"{name}{'s' if len(values) > 1 else ''} {span(values)}" for values, name in parts]
    return f"{words[0]}: {words[1]}, {words[2]}"


def machines(nodes: int, gpus_per_node: int) -> str:
    """``2 nodes × 4 per node``."""
    return f"{nodes} node{'s' if nodes > 1 else ''} × {gpus_per_node} per node"


def span(values) -> str:
    """``3``, ``0–3`` or ``0, 2``: consecutive integers as a range."""
    values = list(values)
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}–{values[-1]}"
    return ", ".join(map(str, values))


# ------------------------------------------------------------------------------------------------------ the scripts


@dataclass(frozen=True)
class TrainCommand:
    """``terapipe train`` as every node runs it, but for its ``--node-rank``."""

    program: tuple[str, ...]  # the words that start terapipe (`parse_program`)
    plan: str  # absolute: the nodes start from other folders
    nnodes: int
    rdzv_endpoint: str | None  # None: port 29500 of the Slurm allocation's first host, found when the job runs
    out: str  # the run folder (absolute); one folder all nodes share, when the file system is shared
    settings: tuple[tuple[str, str], ...] = ()  # (flag, value) passed to train as given

    def groups(self, node_rank: str) -> list[list[str]]:
        """The command's shell words (quoted; ``node_rank`` as it stands, e.g. a variable), in lines that read
        well: the program, the plan, the rendezvous, the run folder, the settings."""
        q = shlex.quote
        endpoint = f'"${RDZV_VARIABLE}"' if self.rdzv_endpoint is None else q(self.rdzv_endpoint)
        rendezvous = ["--nnodes", str(self.nnodes)]
        rendezvous += ["--node-rank", node_rank] if node_rank else []
        lines = [[*map(q, self.program), "train"], ["--plan", q(self.plan)]]
        lines += [[*rendezvous, "--rdzv-endpoint", endpoint], ["--out", q(self.out)]]
        if self.settings:
            lines.append([word for pair in self.settings for word in map(q, pair)])
        return lines

    def line(self, node: int) -> str:
        """Node ``node``'s whole command on one line."""
        return " ".join(word for group in self.groups(str(node)) for word in group)


def _continued(groups: list[list[str]], indent: str = "  ") -> str:
    return f" \\\n{indent}".join(" ".join(g) for g in groups)


def _comment(text: str) -> str:
    """Text fit for a comment line: a path with a newline in it must not end the comment."""
    return "".join(c if c.isprintable() else "?" for c in text)


JOB_PORT = f"{DEFAULT_RDZV_PORT} + the Slurm job id modulo {RDZV_PORTS}"  # in words: where the rendezvous listens


def endpoint_lines(command: TrainCommand) -> list[str]:
    """The lines that set the endpoint when it is found at job time (none when it was given)."""
    if command.rdzv_endpoint is not None:
        return []
    nodelist = '"${SLURM_JOB_NODELIST:?not in a Slurm job: write the scripts again with --rdzv-endpoint HOST:PORT}"'
    # sed, not head: head stops reading at the first line, and under pipefail scontrol's SIGPIPE would end the job.
    return [
        f"# The rendezvous: on the first host of the allocation (node 0), at port {JOB_PORT}, so that",
        "# two jobs sharing a node do not collide.",
        f'{RDZV_VARIABLE}="$(scontrol show hostnames {nodelist} | sed -n 1p):'
        f'$(( {DEFAULT_RDZV_PORT} + SLURM_JOB_ID % {RDZV_PORTS} ))"',
    ]


def node_script(command: TrainCommand, layout: Layout, place: NodePlace) -> str:
    """``node-I.sh``: node I's `terapipe train`, with its rank and the rendezvous filled in."""
    n = command.nnodes
    where = (
        f"the rendezvous at {command.rdzv_endpoint}"
        if command.rdzv_endpoint is not None
        else f"the rendezvous at port {JOB_PORT} of the first host of the Slurm allocation"
    )
    header = [
        "#!/usr/bin/env bash",
        f"{MARK}: node {place.node} of {n} of a run of {_comment(command.plan)}",
        f"# ({layout.shape_text()}): this node runs {_places(place)}.",
        f"# Start {node_script_name(0)} … {node_script_name(n - 1)} one on each machine, in any order, e.g.",
        f"#   bash {node_script_name(place.node)}",
        f"# Node 0 hosts {where};",
        "# the others wait for it up to --rdzv-timeout.",
        "set -euo pipefail",
    ]
    body = ["exec " + _continued(command.groups(str(place.node)))]
    return "\n".join([*header, *endpoint_lines(command), *body]) + "\n"


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch file asks of Slurm besides the nodes: the site's own lines and when to warn of the end."""

    name: str
    cpus_per_task: int
    gpus_per_node: int  # 0: a CPU run asks for none (a cluster without GPUs refuses a GPU request)
    warn_s: int  # SIGUSR1 this long before the time limit: the step in progress and the save fit in it
    time: str | None = None  # --time, as Slurm reads it (minutes, or [D-]HH:MM:SS, ...)
    partition: str | None = None
    account: str | None = None


TIME_FORMAT = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}")
SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a partition or account: written into an #SBATCH line, unquoted


def parse_time(text: str, where: str = "--time") -> str:
    """A Slurm time limit as sbatch reads it: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    if not TIME_FORMAT.fullmatch(text) or not any(c != "0" for c in text if c.isdigit()):
        raise UserError(
            f"expected a Slurm time limit: minutes (90), HH:MM:SS (01:30:00) or D-HH:MM:SS (1-12:00:00), got {text!r}",
            where=where,
        )
    return text


def parse_slurm_name(text: str, where: str) -> str:
    if not SLURM_NAME.fullmatch(text):
        raise UserError(f"expected a Slurm name (letters, digits, . _ -), got {text!r}", where=where)
    return text


STOP_MARGIN_S = 10  # after the save: the processes end and the job requeues itself
MAX_SIGNAL_S = 65535  # the longest lead sbatch's --signal takes


def warn_seconds(plan: Plan, grace_s: float) -> int:
    """How long before the time limit Slurm warns the job (SIGUSR1): the step in progress (the plan's predicted
    step), then the save, which train allows ``grace_s`` (--grace-s), and the end of the processes."""
    return min(math.ceil((plan.predicted_s or 0.0) + grace_s) + STOP_MARGIN_S, MAX_SIGNAL_S)


def runs_on_gpus(plan: Plan, device: str) -> bool:
    """Whether a run asks Slurm for GPUs: ``cuda``, or under ``auto`` a plan made for a GPU (its profile's
    ``kind``). A plan that does not say is taken for a GPU's: asking for GPUs on a cluster without them fails at
    once, where training a GPU plan on CPUs would run, slowly."""
    if device != "auto":
        return device == "cuda"
    profile = plan.raw.get("profile") if isinstance(plan.raw.get("profile"), dict) else {}
    if profile.get("kind") in ("cpu", "cuda"):
        return profile["kind"] == "cuda"
    return True


# The exit codes of a `terapipe train` stopped by a signal after saving (train/stop.py: 128 + the signal).
STOPPED_EXITS = {"SIGUSR1": 128 + 10, "SIGTERM": 128 + 15}


def sbatch_script(command: TrainCommand, layout: Layout, job: SlurmJob, *, gpus_per_node: int) -> str:
    """``launch.sbatch``: one Slurm task per node, each its node's `terapipe train` (``$SLURM_NODEID`` its rank),
    started with --resume-if-present so that the job, requeued after a stop, continues the run.

    Stopping: train saves the step it is at on SIGTERM or SIGUSR1 and exits 128 + the signal (train/stop.py).
    SIGUSR1 comes ``warn_s`` before the time limit to the job's shell alone (``--signal=B:``), which forwards it to
    the steps. SIGTERM (pre-emption, scancel, the time limit itself) reaches every process of the job from Slurm, so
    the shell does not send it again (train takes a repeat as the same request; another signal after it would stop
    train at once, without saving). bash runs a trap only
    between commands, so srun runs in the background and the shell waits for it, again after each trap. Once srun
    has ended with a stop, the job requeues itself if it is still running (not cancelled, and not requeued by Slurm
    itself, as pre-emption with PreemptMode=REQUEUE does)."""
    n = command.nnodes
    name = re.sub(r"[^A-Za-z0-9._-]", "-", job.name)  # an #SBATCH line is not a shell line: nothing to quote
    groups = command.groups("")
    groups[-1] = [*groups[-1], "--resume-if-present"]
    train = "\n".join("  " + " ".join(g) for g in groups)
    srun = (
        f"srun --nodes={n} --ntasks-per-node=1 --cpus-per-task={job.cpus_per_task} --kill-on-bad-exit=1 "
        """bash -c 'exec "$@" --node-rank "$SLURM_NODEID"' terapipe-node "${train[@]}" &"""
    )
    asked = (("time", job.time), ("partition", job.partition), ("account", job.account))
    site = [f"#SBATCH --{key}={value}" for key, value in asked if value is not None]
    gpus = [f"#SBATCH --gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    usr1, term = STOPPED_EXITS["SIGUSR1"], STOPPED_EXITS["SIGTERM"]
    running = '[[ "$(squeue -h -j "$SLURM_JOB_ID" -o %T)" == RUNNING ]]'
    lines = [
        "#!/usr/bin/env bash",
        f"{MARK}: a run of {_comment(command.plan)}",
        f"# ({layout.shape_text()}) on {machines(n, gpus_per_node)}. Submit it with",
        f"#   sbatch {SBATCH_FILE}",
        "# adding what else your site asks for as #SBATCH lines below (launch-script writes --time, --partition and",
        "# --account). One task per node: each is a `terapipe train` that starts its node's workers through torchrun.",
        "# Stopped by pre-emption or ahead of the time limit, the run saves the step it is at and the job requeues",
        "# itself to continue it.",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={n}",
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        f"#SBATCH --cpus-per-task={job.cpus_per_task}",
        *site,
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{job.warn_s}",
        "set -euo pipefail",
        *endpoint_lines(command),
        "train=(",
        train,
        ")",
        f"# SIGUSR1 ({job.warn_s} s before the time limit, to this shell alone): forwarded to the steps, which",
        "# save and stop. SIGTERM (pre-emption, scancel, the time limit) reaches the steps from Slurm itself, and",
        "# the shell only outlives it. KILL follows after the site's KillWait (30 s by default).",
        "trap 'scancel --signal=USR1 \"$SLURM_JOB_ID\" || true' USR1",
        "trap ':' TERM",
        "# Each task's own shell expands $SLURM_NODEID (0 … N-1, its node) into --node-rank: hence the single quotes.",
        # srun is given --cpus-per-task again: since Slurm 22.05 a step no longer takes the job's from sbatch.
        srun,
        "srun_pid=$!",
        "# A trap ends `wait` early (bash runs traps only between commands): wait until srun has ended; a last wait",
        "# gives its exit status if a trap came just as it ended (127: it was already taken).",
        "status=0",
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" && status=0 || status=$?; done',
        'wait "$srun_pid" 2>/dev/null && status=0 || { last=$?; (( last == 127 )) || status=$last; }',
        f"# Stopped by a signal after saving ({term}: SIGTERM, {usr1}: SIGUSR1): continue in a requeued job,",
        "# unless the job is ending for good (cancelled) or Slurm requeues it itself (PreemptMode=REQUEUE).",
        f"if (( status == {term} || status == {usr1} )) && {running}; then",
        '  echo "terapipe: the run stopped and saved; requeueing job $SLURM_JOB_ID to continue it" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def launch_files(
    command: TrainCommand, layout: Layout, *, gpus_per_node: int, slurm: SlurmJob | None
) -> dict[str, str]:
    """Every file of the launch folder: name -> text (the node scripts, and with ``slurm`` the sbatch file)."""
    files = {node_script_name(p.node): node_script(command, layout, p) for p in node_places(layout, gpus_per_node)}
    if slurm is not None:
        files[SBATCH_FILE] = sbatch_script(command, layout, slurm, gpus_per_node=gpus_per_node)
    return files


# ------------------------------------------------------------------------------------------------------ the folder


def check_out_folder(out: Path, *, force: bool, flag: str = "--out") -> None:
    """Before anything is written: ``out`` is a new folder (only it is created), an empty one, or, with
    ``force``, one this command wrote before (its files only, each carrying `MARK`)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"{out} exists and is not a folder; give the folder to write the scripts in", where=flag)
    parent = out.absolute().parent
    if not out.exists():
        if not parent.is_dir():
            raise UserError(f"folder {parent} does not exist (only {out.name}/ would be created)", where=flag)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"cannot write {out} (folder {parent} is not writable)", where=flag)
        return
    entries = sorted(out.iterdir())
    if not entries:
        pass
    elif not all(_written_here(e) for e in entries):
        foreign = next(e for e in entries if not _written_here(e))
        raise UserError(
            f"{out} holds files not written by terapipe launch-script ({foreign.name}); give another folder",
            where=flag,
        )
    elif not force:
        raise UserError(f"{out} holds scripts written earlier; pass --force to replace them", where=flag)
    if not os.access(parent, os.W_OK | os.X_OK):  # the folder is replaced whole, through its parent
        raise UserError(f"cannot replace {out} (folder {parent} is not writable)", where=flag)


def _written_here(path: Path) -> bool:
    if not (path.is_file() and not path.is_symlink() and _OWN_FILE.fullmatch(path.name)):
        return False
    try:
        with path.open(errors="replace") as f:
            return any(line.startswith(MARK) for _, line in zip(range(2), f, strict=False))
    except OSError:
        return False


def write_launch_folder(out: Path, files: dict[str, str]) -> list[Path]:
    """Write ``files`` into a new folder next to ``out`` and rename it into place (an existing ``out``, checked by
    `check_out_folder`, is swapped out and removed): a failure leaves ``out`` as it was. Scripts are executable."""
    out = out.absolute()
    umask = _umask()
    try:
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    except OSError as e:
        raise UserError(f"cannot write here ({e.strerror})", where=str(out.parent)) from None
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        for name, text in files.items():
            path = staging / name
            path.write_text(text)
            os.chmod(path, (_EXECUTABLE if name.endswith(".sh") else _READABLE) & ~umask)
        os.chmod(staging, _EXECUTABLE & ~umask)  # mkdtemp makes a private folder
        if out.exists():
            os.rename(out, old)
        os.rename(staging, out)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        if isinstance(e, OSError):
            raise UserError(f"cannot write ({e.strerror or e})", where=str(out)) from None
        raise
    shutil.rmtree(old, ignore_errors=True)
    return [out / name for name in files]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
