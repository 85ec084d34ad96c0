"""Everything ``terapipe train`` checks before any worker starts, and the run directory it then writes.

Bad input (a plan that does not fit the model or the data, an unreadable data file, a sequence longer than
the data, more workers than this machine allows, a run directory that already holds a run) is one
`UserError` here — exit 2, before torchrun is even imported.

`prepare_run` reads top to bottom: the options, the device, the run (a new one, or the one being resumed),
its data, the workers per machine, the run directory, and the launch settings.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli import units
from terapipe_cli.device import resolve_device
from terapipe_cli.errors import UserError
from terapipe_cli.plan import Plan, plan_from_dict, read_plan
from terapipe_cli.runtime import checkpoint
from terapipe_cli.runtime.data import TokenData, check_data, load_data
from terapipe_cli.runtime.launch import Launch
from terapipe_cli.runtime.rundir import RunArguments, read_config, update_arguments, write_config

CPU_WORKERS_PER_CORE = 4  # beyond this, single-thread workers only queue for the cores
DROP_KV_GRADS_ENV = "TERAPIPE_TEST_DROP_KV_GRADS"  # test-only negative control: "1" drops the K/V hand-back
PLAN_FIELDS_OF_A_RUN = ("model", "stages", "batch_size", "seq_len", "slices")  # a resumed run's plan keeps them


@dataclass(frozen=True)
class PreparedRun:
    plan: Plan
    args: RunArguments
    data: TokenData
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    launch: Launch


@dataclass(frozen=True)
class _Run:
    """The run to start or continue: its plan (parsed and as written), arguments and folder."""

    plan: Plan
    plan_obj: dict
    args: RunArguments
    out: Path
    resume_step: int | None = None  # the checkpoint a resumed run continues from
    config: dict | None = None  # a resumed run's config.json, as read


def kv_handback_requested() -> bool:
    """False only when the test-only negative control (``TERAPIPE_TEST_DROP_KV_GRADS=1``) asks to drop it."""
    return os.environ.get(DROP_KV_GRADS_ENV) != "1"


def max_workers_per_node(device: str) -> tuple[int, str]:
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        return n, f"{n} GPU(s)"
    cores = os.cpu_count() or 1
    return CPU_WORKERS_PER_CORE * cores, f"{CPU_WORKERS_PER_CORE} x {cores} CPU cores"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def versions() -> dict:
    import numpy
    import torch

    import terapipe_cli

    return {
        "terapipe": terapipe_cli.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def prepare_run(
    *,
    plan_path: Path | None,
    steps: int,
    data: Path | None,
    out: Path | None,
    seed: int,
    lr: float,
    data_parallel: int | None,
    verify: bool,
    resume: bool,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    checkpoint_every: int,
    threads: int,
    timeout_s: float,
    device: str,
    kv_handback: bool = True,
    write: bool = True,
) -> PreparedRun:
    """Validate the request; unless ``write`` is False, write config.json and plan.json into the run dir."""
    check_options(
        steps=steps,
        lr=lr,
        checkpoint_every=checkpoint_every,
        threads=threads,
        timeout_s=timeout_s,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        verify=verify,
        resume=resume,
    )
    dev = resolve_device(device)
    # What a resumed run may change: its length and how it runs, never the numbers.
    settings = {"steps": steps, "checkpoint_every": checkpoint_every, "threads": threads, "timeout_s": timeout_s}
    if resume:
        run = _resumed_run(out, plan_path, data_parallel, settings)
    else:
        numbers = {"data": str(data.resolve()) if data is not None else None, "seed": seed, "lr": lr}
        run = _new_run(
            plan_path, out, data_parallel, {**settings, **numbers, "verify": verify, "kv_handback": kv_handback}
        )
    token_data = load_data(run.args.data)
    check_data(token_data, vocab=run.plan.model.vocab, seq_len=run.plan.seq_len)
    per_node = workers_per_node(run.plan.stages, run.args.data_parallel, nnodes, dev)
    if write:
        _write_run_dir(run, settings, device=dev, nnodes=nnodes)
    launch = Launch(
        run_dir=run.out.resolve(),
        nproc_per_node=per_node,
        stages=run.plan.stages,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        resume_step=run.resume_step,
        threads=threads,
        device=dev,
    )
    return PreparedRun(run.plan, run.args, token_data, dev, backend_for(dev), launch)


def check_options(
    *,
    steps: int,
    lr: float,
    checkpoint_every: int,
    threads: int,
    timeout_s: float,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    verify: bool,
    resume: bool,
) -> None:
    """The options' own ranges and combinations (before any file is read)."""
    if steps < 1:
        raise UserError(f"must be at least 1, got {steps}", where="--steps")
    if not lr > 0:
        raise UserError(f"must be positive, got {lr}", where="--lr")
    if checkpoint_every < 1:
        raise UserError(f"must be at least 1, got {checkpoint_every}", where="--checkpoint-every")
    if threads < 1:
        raise UserError(f"must be at least 1, got {threads}", where="--threads")
    if not timeout_s > 0:
        raise UserError(f"must be positive, got {timeout_s}", where="--timeout-s")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UserError(
            f"--node-rank must be in [0, --nnodes) and --nnodes at least 1, got {node_rank}, {nnodes}",
            where="--node-rank",
        )
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError("a run on several machines needs --rdzv-endpoint HOST:PORT", where="--nnodes")
    if verify and resume:
        raise UserError("--verify compares a whole run from step 1; it cannot follow --resume", where="--verify")
    if verify and nnodes > 1:
        raise UserError("--verify runs the reference on this machine; use it with --nnodes 1", where="--verify")


def _new_run(plan_path: Path | None, out: Path | None, data_parallel: int | None, arguments: dict) -> _Run:
    """A run from a plan file into a fresh folder (default: runs/<local time>), with ``data_parallel``
    replicas (None: the plan's) and the other `RunArguments` from ``arguments``."""
    if plan_path is None:
        raise UserError("missing option '--plan' (a plan JSON from `terapipe plan`)", where="terapipe train")
    plan = read_plan(plan_path)
    if out is None:
        out = Path("runs") / units.folder_stamp()
    if (out / "config.json").exists():
        raise UserError("already holds a run: use --resume to continue it, or another --out", where=str(out))
    replicas = plan.data_parallel if data_parallel is None else data_parallel
    if replicas < 1:
        raise UserError(f"must be at least 1, got {replicas}", where="--data-parallel")
    return _Run(plan, dict(plan.raw), RunArguments(**arguments, data_parallel=replicas), out)


def _resumed_run(out: Path | None, plan_path: Path | None, data_parallel: int | None, settings: dict) -> _Run:
    """The run in ``out``, continued from its last complete checkpoint to the new number of steps.

    Everything that decides the numbers (plan, data, seed, lr, replicas) comes from the run itself; a plan or
    a replica count given again must agree with it.
    """
    if out is None:
        raise UserError("--resume needs --out, the run directory to continue", where="--resume")
    if not (out / "config.json").exists():
        raise UserError("no run to resume here (config.json is missing)", where=str(out))
    config, saved = read_config(out)
    plan = plan_from_dict(config["plan"], f"{out / 'config.json'}: field 'plan'")
    if plan_path is not None:
        given = read_plan(plan_path)
        for key in PLAN_FIELDS_OF_A_RUN:
            if getattr(given, key) != getattr(plan, key):
                raise UserError(
                    f"field '{key}' differs from the plan of the run being resumed ({out})", where=str(plan_path)
                )
    if data_parallel is not None and data_parallel != saved.data_parallel:
        raise UserError(f"the run used {saved.data_parallel} replicas; resume with the same", where="--data-parallel")
    resume_step = checkpoint.latest_complete(out)
    if resume_step is None:
        raise UserError("no complete checkpoint to resume from", where=str(out / "checkpoints"))
    if settings["steps"] <= resume_step:
        raise UserError(f"the run already reached step {resume_step}; ask for more steps", where="--steps")
    args = dataclasses.replace(saved, **settings, verify=False)
    return _Run(plan, config["plan"], args, out, resume_step, config)


def workers_per_node(stages: int, data_parallel: int, nnodes: int, device: str) -> int:
    """K x D workers split evenly over the machines, no more per machine than it allows."""
    world = stages * data_parallel
    if world % nnodes:
        raise UserError(
            f"{world} workers (K={stages} x D={data_parallel}) do not split evenly over {nnodes} machines",
            where="--nnodes",
        )
    per_node = world // nnodes
    allowed, why = max_workers_per_node(device)
    if per_node > allowed:
        raise UserError(
            f"K x D = {stages} x {data_parallel} = {per_node} workers per machine, more "
            f"than allowed here ({allowed}: {why})",
            where="--data-parallel / plan field 'stages'",
        )
    return per_node


def _write_run_dir(run: _Run, settings: dict, *, device: str, nnodes: int) -> None:
    """A new run's config.json and plan.json; a resumed run's config.json with its new length and settings."""
    if run.config is not None:
        # The plan and the numbers' arguments stay the run's own.
        update_arguments(run.out, run.config, **settings, verify=False)
        return
    write_config(
        run.out,
        plan=run.plan_obj,
        args=run.args,
        world_size=run.plan.stages * run.args.data_parallel,
        device=device,
        backend=backend_for(device),
        nnodes=nnodes,
        versions=versions(),
        created=units.utc_timestamp(),
    )
