"""Everything ``terapipe train`` checks before any worker starts, and the run directory it then writes.

Bad input (a plan that does not fit the model or the data, an unreadable data file, a sequence longer than
the data, more workers than this machine allows, a run directory that already holds a run) is one
`UserError` here — exit 2, before torchrun is even imported.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from terapipe_cli.device import resolve_device
from terapipe_cli.errors import UserError
from terapipe_cli.plan import Plan, plan_from_dict, read_plan
from terapipe_cli.runtime import checkpoint
from terapipe_cli.runtime.data import TokenData, check_data, load_data
from terapipe_cli.runtime.launch import Launch
from terapipe_cli.runtime.rundir import RunArguments, read_config, update_arguments, write_config

CPU_WORKERS_PER_CORE = 4  # beyond this, single-thread workers only queue for the cores


@dataclass(frozen=True)
class PreparedRun:
    plan: Plan
    args: RunArguments
    data: TokenData
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    launch: Launch


def max_workers_per_node(device: str) -> tuple[int, str]:
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        return n, f"{n} GPU(s)"
    cores = os.cpu_count() or 1
    return CPU_WORKERS_PER_CORE * cores, f"{CPU_WORKERS_PER_CORE} x {cores} CPU cores"


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
    dev = resolve_device(device)
    resume_step = None

    if resume:
        if out is None:
            raise UserError("--resume needs --out, the run directory to continue", where="--resume")
        if not (out / "config.json").exists():
            raise UserError("no run to resume here (config.json is missing)", where=str(out))
        config, saved = read_config(out)
        run_plan = plan_from_dict(config["plan"], f"{out / 'config.json'}: field 'plan'")
        if plan_path is not None:
            given = read_plan(plan_path)
            for key in ("model", "stages", "batch_size", "seq_len", "slices"):
                if getattr(given, key) != getattr(run_plan, key):
                    raise UserError(
                        f"field '{key}' differs from the plan of the run being resumed ({out})", where=str(plan_path)
                    )
        if data_parallel is not None and data_parallel != saved.data_parallel:
            raise UserError(
                f"the run used {saved.data_parallel} replicas; resume with the same", where="--data-parallel"
            )
        resume_step = checkpoint.latest_complete(out)
        if resume_step is None:
            raise UserError("no complete checkpoint to resume from", where=str(out / "checkpoints"))
        if steps <= resume_step:
            raise UserError(f"the run already reached step {resume_step}; ask for more steps", where="--steps")
        # Everything that decides the numbers comes from the run itself; only the length may grow.
        args = RunArguments(
            steps=steps,
            data=saved.data,
            seed=saved.seed,
            lr=saved.lr,
            data_parallel=saved.data_parallel,
            checkpoint_every=checkpoint_every,
            threads=threads,
            timeout_s=timeout_s,
            verify=False,
            kv_handback=saved.kv_handback,
        )
        plan_obj = config["plan"]
    else:
        if plan_path is None:
            raise UserError("missing option '--plan' (a plan JSON from `terapipe plan`)", where="terapipe train")
        run_plan = read_plan(plan_path)
        plan_obj = dict(run_plan.raw)
        if out is None:
            out = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
        if (out / "config.json").exists():
            raise UserError("already holds a run: use --resume to continue it, or another --out", where=str(out))
        d = run_plan.data_parallel if data_parallel is None else data_parallel
        if d < 1:
            raise UserError(f"must be at least 1, got {d}", where="--data-parallel")
        args = RunArguments(
            steps=steps,
            data=str(data.resolve()) if data is not None else None,
            seed=seed,
            lr=lr,
            data_parallel=d,
            checkpoint_every=checkpoint_every,
            threads=threads,
            timeout_s=timeout_s,
            verify=verify,
            kv_handback=kv_handback,
        )

    token_data = load_data(args.data)
    check_data(token_data, vocab=run_plan.model.vocab, seq_len=run_plan.seq_len)

    world = run_plan.stages * args.data_parallel
    if world % nnodes:
        raise UserError(
            f"{world} workers (K={run_plan.stages} x D={args.data_parallel}) do not split evenly over "
            f"{nnodes} machines",
            where="--nnodes",
        )
    per_node = world // nnodes
    allowed, why = max_workers_per_node(dev)
    if per_node > allowed:
        raise UserError(
            f"K x D = {run_plan.stages} x {args.data_parallel} = {per_node} workers per machine, more "
            f"than allowed here ({allowed}: {why})",
            where="--data-parallel / plan field 'stages'",
        )
    backend = "nccl" if dev == "cuda" else "gloo"
    if write and not resume:
        write_config(
            out,
            plan=plan_obj,
            args=args,
            world_size=world,
            device=dev,
            backend=backend,
            nnodes=nnodes,
            versions=versions(),
            created=datetime.now(UTC).isoformat(timespec="seconds"),
        )
    elif write:
        # Record the new length and settings; the plan and the numbers' arguments stay the run's own.
        update_arguments(
            out,
            config,
            steps=steps,
            checkpoint_every=checkpoint_every,
            threads=threads,
            timeout_s=timeout_s,
            verify=False,
        )
    spec = Launch(
        run_dir=out.resolve(),
        nproc_per_node=per_node,
        stages=run_plan.stages,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        resume_step=resume_step,
        threads=threads,
        device=dev,
    )
    return PreparedRun(run_plan, args, token_data, dev, backend, spec)
