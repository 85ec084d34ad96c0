"""Everything ``terapipe train`` checks before any worker starts, and the run directory it then writes.

Bad input (a plan that does not fit the model or the data, an unreadable data file, a sequence longer than
the data, more workers than this machine allows, a run directory that already holds a run) is one
`UserError` here — exit 2, before torchrun is even imported.

`prepare_run` reads top to bottom: the options, the device, the run (a new one, or the one being resumed),
its data, the workers per machine, the run directory, and the launch settings. A new run resolves the optimizer
step's settings once (`_step_settings`: precision, lr schedule, clipping) and checks the precision against the
plan's; a resumed run keeps its own and refuses a different one given again.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import uuid
from dataclasses import dataclass
from pathlib import Path

from terapipe_cli import units
from terapipe_cli.config.device import resolve_device, resolve_precision
from terapipe_cli.engine.data import TokenData, check_data, load_data, split_data
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.optim import DEFAULT_GRAD_CLIP, DEFAULT_LR, LRSchedule
from terapipe_cli.errors import UserError
from terapipe_cli.plan.file import Plan, plan_from_dict, read_plan
from terapipe_cli.train import checkpoint
from terapipe_cli.train.launch import Launch
from terapipe_cli.train.rundir import RunArguments, read_config, settings_digest, update_arguments, write_config

CPU_WORKERS_PER_CORE = 4  # beyond this, single-thread workers only queue for the cores
DEFAULT_STEPS = 20  # a new run's length; a resumed run goes on to its own unless --steps says otherwise
DEFAULT_VAL_FRACTION = 0.1  # the data's last tenth held out for the validation loss
DROP_KV_GRADS_ENV = "TERAPIPE_TEST_DROP_KV_GRADS"  # test-only negative control: "1" drops the K/V hand-back
SKIP_TP_ALLREDUCE_ENV = "TERAPIPE_TEST_SKIP_TP_ALLREDUCE"  # test-only negative control: "1" skips one all-reduce
PLAN_FIELDS_OF_A_RUN = ("model", "stages", "batch_size", "seq_len", "slices")  # a resumed run's plan keeps them
# The optimizer step's options: a resumed run keeps the values it was created with (argument name: flag).
# What decides a run's numbers besides its plan: a resumed run keeps them, and refuses another value given again.
STEP_FLAGS = {
    "data": "--data",
    "seed": "--seed",
    "val_fraction": "--val-fraction",
    "precision": "--precision",
    "lr": "--lr",
    "warmup_steps": "--warmup-steps",
    "min_lr": "--min-lr",
    "grad_clip": "--grad-clip",
}


@dataclass(frozen=True)
class PreparedRun:
    plan: Plan
    args: RunArguments
    data: TokenData  # the part training draws from (the held-out part excluded)
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    launch: Launch

    @property
    def layout(self) -> Layout:
        return Layout(self.args.data_parallel, self.plan.stages, self.args.tensor_parallel)


@dataclass(frozen=True)
class _Run:
    """The run to start or continue: its plan (parsed and as written), arguments and folder."""

    plan: Plan
    plan_obj: dict
    args: RunArguments
    out: Path
    resume_step: int | None = None  # the checkpoint a resumed run continues from
    config: dict | None = None  # a resumed run's config.json, as read

    @property
    def layout(self) -> Layout:
        return Layout(self.args.data_parallel, self.plan.stages, self.args.tensor_parallel)


def negative_controls() -> dict[str, bool]:
    """The test-only negative controls asked for in the environment, as `prepare_run` arguments: the K/V
    hand-back dropped (``TERAPIPE_TEST_DROP_KV_GRADS=1``), the tensor-parallel backward all-reduce of the
    column-parallel inputs skipped (``TERAPIPE_TEST_SKIP_TP_ALLREDUCE=1``). Both must make --verify fail."""
    return {
        "kv_handback": os.environ.get(DROP_KV_GRADS_ENV) != "1",
        "tp_allreduce": os.environ.get(SKIP_TP_ALLREDUCE_ENV) != "1",
    }


def gpu_count() -> int:
    """The CUDA GPUs PyTorch sees on this machine."""
    import torch

    return torch.cuda.device_count()


def max_workers_per_node(device: str) -> tuple[int, str]:
    """How many workers one machine takes, and why: four per CPU core on CPU and CUDA alike. On CUDA each
    worker is still a process on the cores, and workers beyond the GPUs share them (`backend_for`)."""
    cores = os.cpu_count() or 1
    why = f"{CPU_WORKERS_PER_CORE} x {cores} CPU cores"
    if device == "cuda":
        why += f"; workers beyond the {_gpus(gpu_count())} share them"
    return CPU_WORKERS_PER_CORE * cores, why


def backend_for(device: str, workers_per_node: int = 1, n_gpus: int | None = None) -> str:
    """The process group's backend: gloo on the CPU; on CUDA, NCCL when each of a machine's
    ``workers_per_node`` workers has a GPU of its own (``n_gpus``, default the GPUs here), else gloo.

    Stages that share a GPU cannot use NCCL (it refuses two ranks on one device), and gloo cannot send CUDA
    tensors, so on that gloo group every message and collective goes through host memory (`p2p.host_staged`).
    """
    if device != "cuda":
        return "gloo"
    gpus = gpu_count() if n_gpus is None else n_gpus
    return "nccl" if workers_per_node <= gpus else "gloo"


def placement_note(device: str, workers_per_node: int, n_gpus: int | None = None) -> str:
    """How a machine's workers compute and talk, as `terapipe train`'s launch line says it."""
    backend = backend_for(device, workers_per_node, n_gpus)
    if device != "cuda":
        cores = os.cpu_count() or 1
        if workers_per_node > cores:  # allowed (`max_workers_per_node`), but the user should know
            return f"{backend} on cpu, {workers_per_node} workers sharing {cores} cores: each slower than alone"
        return f"{backend} on cpu"
    if backend == "nccl":
        return "nccl, one GPU per worker"
    gpus = _gpus(gpu_count() if n_gpus is None else n_gpus)
    return f"{workers_per_node} workers share {gpus}: {backend} through host memory"


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


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
    steps: int | None,
    data: Path | None,
    out: Path | None,
    seed: int | None,
    lr: float | None,
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
    tp_allreduce: bool = True,
    tensor_parallel: int | None = None,
    write: bool = True,
    precision: str | None = None,
    warmup_steps: int | None = None,
    min_lr: float | None = None,
    grad_clip: float | None = None,
    accept_precision: bool = False,
    rdzv_timeout_s: float = 300.0,
    val_fraction: float | None = None,
    eval_every: int | None = None,
) -> PreparedRun:
    """Validate the request; unless ``write`` is False, write config.json and plan.json into the run dir.

    ``data``, ``seed``, ``lr``, ``precision``, ``warmup_steps``, ``min_lr``, ``grad_clip``, ``val_fraction``,
    ``eval_every``: None is the default (a new run) or the run's own value (a resumed one). On several nodes only
    node 0 writes here, with a fresh launch id; the other nodes' workers take node 0's config once the nodes have
    met (`rundir.join_run_folder`)."""
    check_options(
        steps=DEFAULT_STEPS if steps is None else steps,
        checkpoint_every=checkpoint_every,
        threads=threads,
        timeout_s=timeout_s,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        verify=verify,
        resume=resume,
        rdzv_timeout_s=rdzv_timeout_s,
    )
    dev = resolve_device(device)
    data_path = str(data.resolve()) if data is not None else None
    step_flags = dict(precision=precision, lr=lr, warmup_steps=warmup_steps, min_lr=min_lr, grad_clip=grad_clip)
    # What a resumed run may change: its length and how it runs, never the numbers.
    settings = {"steps": steps, "checkpoint_every": checkpoint_every, "threads": threads, "timeout_s": timeout_s}
    replicas = {"data_parallel": data_parallel, "tensor_parallel": tensor_parallel}
    if resume:
        run = _resumed_run(out, plan_path, replicas, settings, eval_every)  # steps None: the run's own total
        numbers = dict(step_flags, data=data_path, seed=seed, val_fraction=val_fraction)
        _check_same_step_settings(run.args, numbers, dev)
    else:
        steps = settings["steps"] = DEFAULT_STEPS if steps is None else steps
        val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
        numbers = {"data": data_path, "seed": 0 if seed is None else seed, "val_fraction": val_fraction}
        numbers.update(_step_settings(step_flags, steps, dev), accept_precision=accept_precision)
        numbers.update(verify=verify, kv_handback=kv_handback, tp_allreduce=tp_allreduce)
        settings["eval_every"] = _eval_every(eval_every, steps, val_fraction)
        run = _new_run(plan_path, out, replicas, {**settings, **numbers}, joins_node_0=node_rank > 0)
        _check_plan_precision(run, accept_precision)
    token_data = load_data(run.args.data)
    check_data(token_data, vocab=run.plan.model.vocab, seq_len=run.plan.seq_len)
    token_data, _ = split_data(token_data, run.args.val_fraction, run.plan.seq_len)
    per_node = workers_per_node(run.layout, nnodes, dev)
    backend = backend_for(dev, per_node)
    plan_obj, arguments = _config_fields(run, settings)
    if write and node_rank == 0:
        _write_run_dir(run, arguments, device=dev, backend=backend, nnodes=nnodes)
    launch = Launch(
        run_dir=run.out.resolve(),
        nproc_per_node=per_node,
        stages=run.plan.stages,
        tensor_parallel=run.args.tensor_parallel,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        resume_step=run.resume_step,
        threads=threads,
        device=dev,
        backend=backend,
        timeout_s=timeout_s,
        rdzv_timeout_s=rdzv_timeout_s,
        settings_digest=settings_digest(plan_obj, arguments),
    )
    return PreparedRun(run.plan, run.args, token_data, dev, backend, launch)


def check_options(
    *,
    steps: int,
    checkpoint_every: int,
    threads: int,
    timeout_s: float,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    verify: bool,
    resume: bool,
    rdzv_timeout_s: float = 300.0,
) -> None:
    """The options' own ranges and combinations (before any file is read)."""
    if steps < 1:
        raise UserError(f"must be at least 1, got {steps}", where="--steps")
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
    if not rdzv_timeout_s > 0:
        raise UserError(f"must be positive, got {rdzv_timeout_s}", where="--rdzv-timeout")
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError("a run on several machines needs --rdzv-endpoint HOST:PORT", where="--nnodes")
    if verify and resume:
        raise UserError("--verify compares a whole run from step 1; it cannot follow --resume", where="--verify")
    if verify and nnodes > 1:
        raise UserError("--verify runs the reference on this machine; use it with --nnodes 1", where="--verify")


def _step_settings(flags: dict, steps: int, device: str) -> dict:
    """A new run's optimizer-step arguments, defaults filled in and checked (docs/design.md §6a)."""
    lr = DEFAULT_LR if flags["lr"] is None else flags["lr"]
    schedule = LRSchedule.default(lr, steps, flags["warmup_steps"], flags["min_lr"])
    grad_clip = DEFAULT_GRAD_CLIP if flags["grad_clip"] is None else flags["grad_clip"]
    if not (grad_clip >= 0 and math.isfinite(grad_clip)):
        raise UserError(f"must be 0 (no clipping) or a positive number, got {grad_clip}", where="--grad-clip")
    return {
        "precision": resolve_precision(flags["precision"], device),
        "lr": schedule.lr,
        "warmup_steps": schedule.warmup_steps,
        "min_lr": schedule.min_lr,
        "decay_steps": steps,
        "grad_clip": float(grad_clip),
    }


def _eval_every(given: int | None, steps: int, val_fraction: float) -> int:
    """Validation every N steps: as given, else ten times a run of 10 steps or more, and once, after the last
    step, in a shorter one (never without held-out data)."""
    if given is not None and given < 0:
        raise UserError(f"must be 0 (never) or a number of steps, got {given}", where="--eval-every")
    if val_fraction == 0:
        return 0
    return (steps // 10 if steps >= 10 else steps) if given is None else given


def _check_same_step_settings(saved: RunArguments, flags: dict, device: str) -> None:
    """A resumed run keeps its data, seed, held-out part, precision, lr schedule and clipping: a different value
    given again is refused, naming it."""
    for name, given in flags.items():
        if given is None:
            continue
        if name == "precision":
            given = resolve_precision(given, device)
        kept = getattr(saved, name)
        if given != kept:
            unset = {"data": "the embedded default data (no --data)", "min_lr": "no --min-lr (a constant lr)"}
            was = f"{STEP_FLAGS[name]} {kept}" if kept is not None else unset.get(name, f"no {STEP_FLAGS[name]}")
            raise UserError(
                f"the run being resumed was trained with {was}; a resumed run keeps it "
                f"(leave the option out, or start a new run with --out)",
                where=STEP_FLAGS[name],
            )


def _check_plan_precision(run: _Run, accept: bool) -> None:
    """The plan's times are for its profile's precision: training in another one is refused unless accepted."""
    planned, used = run.plan.precision, run.args.precision
    if planned != used and not accept:
        raise UserError(
            f"the plan was made for {planned} (its profile was measured in {planned}) but this run trains in "
            f"{used}: re-profile with `terapipe profile --precision {used}` and re-plan, or pass --accept-precision "
            f"to train in {used} on this plan anyway",
            where=str(run.plan.path or "--plan"),
        )


def _new_run(plan_path: Path | None, out: Path | None, replicas: dict, arguments: dict, *, joins_node_0: bool) -> _Run:
    """A run from a plan file into a fresh folder (default: runs/<local time>), with ``replicas``' data_parallel
    and tensor_parallel (None: the plan's) and the other `RunArguments` from ``arguments``. A node other than
    node 0 (``joins_node_0``) may find node 0's config.json in a shared folder: its workers decide (§6)."""
    if plan_path is None:
        raise UserError("missing option '--plan' (a plan JSON from `terapipe plan`)", where="terapipe train")
    plan = read_plan(plan_path)
    if out is None:
        out = Path("runs") / units.folder_stamp()
    if (out / "config.json").exists() and not joins_node_0:
        raise UserError("already holds a run: use --resume to continue it, or another --out", where=str(out))
    data_parallel = plan.data_parallel if replicas["data_parallel"] is None else replicas["data_parallel"]
    if data_parallel < 1:
        raise UserError(f"must be at least 1, got {data_parallel}", where="--data-parallel")
    tensor = plan.tensor_parallel if replicas["tensor_parallel"] is None else replicas["tensor_parallel"]
    plan.model.check_tensor_parallel(tensor, where="--tensor-parallel")
    args = RunArguments(**arguments, data_parallel=data_parallel, tensor_parallel=tensor)
    return _Run(plan, dict(plan.raw), args, out)


def _resumed_run(
    out: Path | None, plan_path: Path | None, replicas: dict, settings: dict, eval_every: int | None
) -> _Run:
    """The run in ``out``, continued from its last complete checkpoint to the new number of steps.

    Everything that decides the numbers (plan, data, seed, lr, replicas) comes from the run itself; a plan or
    a replica count or tensor-parallel degree given again must agree with it.
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
    for name, flag in (("data_parallel", "--data-parallel"), ("tensor_parallel", "--tensor-parallel")):
        given, kept = replicas[name], getattr(saved, name)
        if given is not None and given != kept:
            raise UserError(f"the run used {flag} {kept}; resume with the same (or leave it out)", where=flag)
    resume_step = checkpoint.latest_complete(out)
    if resume_step is None:
        raise UserError("no complete checkpoint to resume from", where=str(out / "checkpoints"))
    if settings["steps"] is None:
        settings["steps"] = saved.steps
    if settings["steps"] <= resume_step:
        raise UserError(
            f"the run already reached step {resume_step}; ask for more steps (--steps N, N > {resume_step})",
            where="--steps",
        )
    if eval_every is not None:  # how often to evaluate may change; what is held out may not
        settings["eval_every"] = _eval_every(eval_every, settings["steps"], saved.val_fraction)
    args = dataclasses.replace(saved, **settings, verify=False)
    return _Run(plan, config["plan"], args, out, resume_step, config)


def workers_per_node(layout: Layout, nnodes: int, device: str) -> int:
    """D x K x T workers split evenly over the machines, no more per machine than it allows
    (`max_workers_per_node`; on CUDA more workers than GPUs is allowed: they share the GPUs, see `backend_for`)."""
    if layout.world % nnodes:
        raise UserError(f"{layout.shape_text()} do not split evenly over {nnodes} machines", where="--nnodes")
    per_node = layout.world // nnodes
    allowed, why = max_workers_per_node(device)
    if per_node > allowed:
        raise UserError(
            f"{layout.shape_text()}{f', {per_node} per machine' if nnodes > 1 else ''}: more than allowed here "
            f"({allowed}: {why})",
            where="--data-parallel / --tensor-parallel / plan field 'stages'",
        )
    return per_node


def _config_fields(run: _Run, settings: dict) -> tuple[dict, dict]:
    """The plan and arguments config.json holds for this launch: a new run's own, or a resumed run's with its
    new length and settings (the plan and the numbers' arguments stay the run's own)."""
    if run.config is not None:
        return run.config["plan"], {**run.config["arguments"], **settings, "verify": False}
    return run.plan_obj, dataclasses.asdict(run.args)


def _write_run_dir(run: _Run, arguments: dict, *, device: str, backend: str, nnodes: int) -> None:
    """A new run's config.json and plan.json; a resumed run's config.json with its new arguments. Either way
    with a new launch id."""
    launch_id = uuid.uuid4().hex
    if run.config is not None:
        update_arguments(run.out, run.config, launch_id, **arguments)
        return
    write_config(
        run.out,
        launch_id=launch_id,
        plan=run.plan_obj,
        args=run.args,
        world_size=run.layout.world,
        device=device,
        backend=backend,
        nnodes=nnodes,
        versions=versions(),
        created=units.utc_timestamp(),
    )
