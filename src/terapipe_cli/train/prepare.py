"""Everything ``terapipe train`` checks before any worker starts, and the run directory it then writes.

Bad input (a plan that does not fit the model or the data, an unreadable data file, a sequence longer than the
data, an illegal schedule, more workers than this machine allows, a run directory that already holds a run) is one
`UserError` here — exit 2, before torchrun is even imported. Errors about a setting name its `RunConfig` field
(``where="lr"``); the command line turns that into the flag or the file's field the value came from.

`prepare_run` reads top to bottom: the settings' own ranges, the device, the run (a new one, or the one being
resumed), its data, the workers per machine, the run directory, and the launch settings. A new run resolves its
settings once (`_new_arguments`: defaults, precision — the plan's unless asked —, lr schedule, clipping, AdamW's
settings) and checks the precision against the plan's; a resumed run keeps what decides its numbers
(``Doc.resume``) and refuses another value given again.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from terapipe_cli import units
from terapipe_cli.config.controls import Controls
from terapipe_cli.config.device import default_precision, resolve_device, resolve_precision, runs_natively
from terapipe_cli.config.fields import component_of, out_of_bounds
from terapipe_cli.config.optimizer import OptimizerConfig
from terapipe_cli.config.run import (
    DEFAULT_STEPS,
    LRSchedule,
    RunArguments,
    RunConfig,
    as_option,
    data_sources,
    flag,
    resolve_logs,
    run_fields,
)
from terapipe_cli.corpus.identity import check_unchanged, identify_sources
from terapipe_cli.engine.data import TokenData, document_mask_note, load_data, resolve_document_mask, run_data
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError
from terapipe_cli.files import check_free_space, read_user_text
from terapipe_cli.plan.file import Plan, plan_from_dict, read_plan, replan_advice
from terapipe_cli.schedule.schedule import parse_schedule
from terapipe_cli.train import checkpoint, init_from
from terapipe_cli.train.init_from import Source
from terapipe_cli.train.launch import Launch
from terapipe_cli.train.placement import backend_for, workers_per_node
from terapipe_cli.train.rundir import (
    close_segment,
    has_trained,
    read_config,
    settings_digest,
    update_arguments,
    write_config,
)
from terapipe_cli.version import __version__


@dataclass(frozen=True)
class PreparedRun:
    plan: Plan
    args: RunArguments
    data: TokenData  # the part training draws from (the held-out part excluded)
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    launch: Launch
    data_line: str = ""  # what the data file holds, in one line (`TokenData.start_line`), printed at start

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
    replanned: bool = False  # a resumed run continuing under another plan, D or T

    @property
    def layout(self) -> Layout:
        return Layout(self.args.data_parallel, self.plan.stages, self.args.tensor_parallel)


def versions() -> dict:
    return {
        "terapipe": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def prepare_run(
    config: RunConfig, *, resume: bool = False, write: bool = True, controls: Controls | None = None
) -> PreparedRun:
    """Validate ``config`` (None fields: the defaults of a new run, or a resumed run's own values); unless
    ``write`` is False, write the run folder (config.json, plan.json, run.toml). On several nodes only node 0 writes
    here, with a fresh launch id; the other nodes' workers take node 0's config once the nodes have met
    (`rundir.join_run_folder`). ``controls``: the test-only switches of this launch (`config.controls.Controls`; a
    resumed run carries only these, not its earlier launches')."""
    check_settings(config, resume=resume)
    controls = controls or Controls()
    try:
        device = resolve_device(config.value("device"))
    except UserError as e:
        raise UserError(e.message, where="device") from None
    node_rank, nnodes = config.value("node_rank"), config.value("nnodes")
    if resume:
        run = _resumed_run(config, device)
        run = dataclasses.replace(run, args=dataclasses.replace(run.args, controls=controls.record()))
    else:
        run = _new_run(config, device, controls, joins_node_0=node_rank > 0)
    token_data, _, data_line = run_data(run.args, seq_len=run.plan.seq_len, vocab=run.plan.model.vocab)
    data_line += document_mask_note(run.args.document_mask, run.args.eos_id)
    per_node = workers_per_node(run.layout, nnodes, device)
    backend = backend_for(device, per_node)
    plan_obj, arguments = _config_fields(run)
    rendezvous = {"rdzv_endpoint": config.rdzv_endpoint, "rdzv_timeout_s": config.value("rdzv_timeout_s")}
    if write:
        check_checkpoint_room(run.out, run.plan)
    if write and node_rank == 0:
        _write_run_dir(run, arguments, device=device, backend=backend, nnodes=nnodes, rendezvous=rendezvous)
    launch = Launch(
        run_dir=run.out.resolve(),
        nproc_per_node=per_node,
        stages=run.plan.stages,
        tensor_parallel=run.args.tensor_parallel,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=config.rdzv_endpoint,
        resume_step=run.resume_step,
        threads=run.args.threads,
        device=device,
        backend=backend,
        timeout_s=run.args.timeout_s,
        rdzv_timeout_s=rendezvous["rdzv_timeout_s"],
        settings_digest=settings_digest(plan_obj, arguments),
        max_restarts=run.args.max_restarts,
        grace_s=run.args.grace_s,
    )
    return PreparedRun(run.plan, run.args, token_data, device, backend, launch, data_line)


class RunComplete(Exception):
    """``--resume-if-present`` found the run in --out at the steps asked already: nothing to train (the message)."""


def start_or_continue(config: RunConfig, *, resume: bool) -> tuple[RunConfig, bool]:
    """The settings and whether this launch continues the run in --out: with --resume it does; with
    --resume-if-present it does where a step of a run completed there (`has_trained`), and starts in a new folder or
    one a launch left before its first step (as a new run does). A continued run comes from its own checkpoint, so
    --init-from, which starts one, is dropped. Raises `RunComplete` when the run already reached the steps asked."""
    if resume or not config.value("resume_if_present"):
        return config, resume
    if config.out is None:
        raise UserError("needs --out, the run directory to start or continue", where="resume_if_present")
    out = Path(config.out)
    if not ((out / "config.json").is_file() and has_trained(out)):
        return config, False
    _, saved = read_config(out)
    steps = saved.steps if config.steps is None else config.steps
    reached = checkpoint.latest_complete(out)
    if reached is not None and reached >= steps:
        raise RunComplete(f"{out}: the run already reached step {reached} (--steps {steps}): nothing to train")
    return dataclasses.replace(config, init_from=None), True


def check_settings(config: RunConfig, *, resume: bool) -> None:
    """Each setting given within its field's bounds, and the combinations that cannot work (before any file is
    read); errors name the field."""
    docs = run_fields()
    for name, value in config.given().items():
        problem = out_of_bounds(value, docs[name])
        if problem is not None:
            raise UserError(problem, where=name)
    component_of(OptimizerConfig, config)  # AdamW's own checks (finite values)
    nnodes, node_rank = config.value("nnodes"), config.value("node_rank")
    if not 0 <= node_rank < nnodes:
        raise UserError(
            f"--node-rank must be in [0, --nnodes), got {node_rank} with --nnodes {nnodes}", where="node_rank"
        )
    if nnodes > 1 and not config.rdzv_endpoint:
        raise UserError("a run on several machines needs --rdzv-endpoint HOST:PORT", where="nnodes")
    if config.rdzv_endpoint is not None:
        check_endpoint(config.rdzv_endpoint)
    if config.value("verify") and resume:
        raise UserError("--verify compares a whole run from step 1; it cannot follow --resume", where="verify")
    if config.init_from is not None and resume:
        raise UserError(
            "--init-from starts a new run from pretrained weights; --resume continues a run from its own checkpoint "
            "(give one of them)",
            where="init_from",
        )
    if config.value("verify") and nnodes > 1:
        raise UserError("--verify runs the reference on this machine; use it with --nnodes 1", where="verify")
    if config.eval_every is not None and config.eval_every < 0:
        raise UserError(f"must be 0 (never) or a number of steps, got {config.eval_every}", where="eval_every")
    if config.grad_clip is not None and not (config.grad_clip >= 0 and math.isfinite(config.grad_clip)):
        raise UserError(f"must be 0 (no clipping) or a positive number, got {config.grad_clip}", where="grad_clip")


def check_endpoint(endpoint: str) -> None:
    """``--rdzv-endpoint`` as torchrun reads it (its own parser), with the port node 0 listens on: checked before
    anything is written, since torchrun would refuse it only after the run folder exists."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        port = parse_rendezvous_endpoint(endpoint, default_port=-1)[1]
    except ValueError as e:
        if "port" not in str(e):
            raise UserError(f"must be HOST:PORT: {e}", where="rdzv_endpoint") from None
        port = -1
    if not 0 < port < 2**16:
        host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
        raise UserError(
            f"must be HOST:PORT with the port node 0 listens on (1-65535), e.g. {host}:29500; got {endpoint!r}",
            where="rdzv_endpoint",
        )


def _new_arguments(
    config: RunConfig, device: str, plan: Plan, controls: Controls, source: Source | None = None
) -> RunArguments:
    """A new run's settings, every default filled in and checked (docs/design.md §6a); ``source``: the weights it
    starts from (`init_from`)."""
    steps = config.steps or DEFAULT_STEPS
    schedule = LRSchedule.default(config.value("lr"), steps, config.warmup_steps, config.min_lr)
    data_parallel = plan.data_parallel if config.data_parallel is None else config.data_parallel
    tensor_parallel = plan.tensor_parallel if config.tensor_parallel is None else config.tensor_parallel
    plan.model.check_tensor_parallel(tensor_parallel, where="tensor_parallel")
    val_fraction = config.value("val_fraction")
    files = [load_data(Path(p).resolve(), config.token_dtype) for _, p in data_sources(config.data)] or [
        load_data(None)
    ]
    document_mask, eos_id = resolve_document_mask(files, config.document_mask, config.eos_id, vocab=plan.model.vocab)
    if config.val_data is not None and config.val_fraction is not None:
        raise UserError(
            "give --val-data (a file of its own) or --val-fraction (a part of --data), not both", where="val_data"
        )
    val_data = None if config.val_data is None else str(Path(config.val_data).resolve())
    held_out = [] if val_data is None else [load_data(val_data, config.token_dtype)]
    # One tokenizer's ids, every file's contents kept for --resume to check (the embedded text: nothing to keep).
    fingerprints = identify_sources([*(files if config.data is not None else []), *held_out])
    if val_data is not None:
        val_fraction = 0.0  # the held-out loss comes from its own file; training takes all of --data
    sampling = config.sampling or ("random" if files[0].kind == "text" else "epoch")
    # A setting that reaches the workers as given (its fallback filled in) needs no line here: every field of
    # RunArguments that is a RunConfig setting is taken from it, unless resolved below.
    settings = {f.name for f in dataclasses.fields(RunConfig)}
    given = {f.name: config.value(f.name) for f in dataclasses.fields(RunArguments) if f.name in settings}
    resolved = dict(
        steps=steps,
        data=_data_path(config),
        data_mix=_data_mix(config),
        lr=schedule.lr,
        data_parallel=data_parallel,
        timeout_s=float(config.value("timeout_s")),
        loss_chunk_tokens=config.loss_chunk_tokens,
        precision=_run_precision(config.precision, device, plan),
        warmup_steps=schedule.warmup_steps,
        min_lr=schedule.min_lr,
        decay_steps=config.decay_steps or steps,
        grad_clip=float(config.value("grad_clip")),
        tensor_parallel=tensor_parallel,
        controls=controls.record(),
        val_fraction=val_fraction,
        eval_every=_eval_every(config.eval_every, steps, val_fraction > 0 or val_data is not None),
        schedule=_schedule_text(config, plan),
        log=resolve_logs(config.log),
        grace_s=float(config.value("grace_s")),
        init_from=None if source is None else str(source.path),
        init_step=None if source is None else source.step,
        document_mask=document_mask,
        eos_id=eos_id,
        val_data=val_data,
        sampling=sampling,
        data_fingerprints=fingerprints,
        **dataclasses.asdict(component_of(OptimizerConfig, config)),
    )
    return RunArguments(**given | resolved)


def _data_path(config: RunConfig) -> str | None:
    """The data file (a mixture's first source), resolved; None: the embedded text."""
    sources = data_sources(config.data)
    return str(Path(sources[0][1]).resolve()) if sources else None


def _data_mix(config: RunConfig) -> list[str] | None:
    """A mixture's sources as the run keeps them, ``WEIGHT:PATH`` with the weights normalised; None for one source.
    Several sources each need a positive weight (one line otherwise)."""
    sources = data_sources(config.data)
    if len(sources) < 2:
        return None
    weights = [w for w, _ in sources]
    if any(w is None or not 0 < w < float("inf") for w in weights):
        raise UserError(
            f"several sources each need a positive weight, e.g. --data 0.7:web --data 0.3:code; got {config.data}",
            where="data",
        )
    total = sum(weights)
    return [f"{w / total!r}:{Path(p).resolve()}" for w, p in sources]


def _schedule_text(config: RunConfig, plan: Plan) -> str | None:
    """The schedule file given (checked against the plan: legal, and for its tiles), as the run keeps it."""
    if config.schedule is None:
        return None
    path = Path(config.schedule)
    text = read_user_text(path, name="schedule file", expected="a schedule (CSV file)")
    return parse_schedule(
        text, plan.slices, plan.stages, plan.recompute, where=str(path), partition=plan.partition
    ).to_csv()


def _eval_every(given: int | None, steps: int, held_out: bool) -> int:
    """Validation every N steps: as given, else ten times a run of 10 steps or more, and once, after the last
    step, in a shorter one (never without held-out data)."""
    if not held_out:
        return 0
    return (steps // 10 if steps >= 10 else steps) if given is None else given


def _run_precision(asked: str | None, device: str, plan: Plan) -> str:
    """``--precision`` as given (checked for ``device``: `resolve_precision`), else the plan's, which its times
    are for. The one precision a device cannot run (bf16 on a GPU older than Ampere, which has no native bf16;
    CPU autocast runs bf16 and fp16 both) is one line saying which to pass instead and how to get a plan for it."""
    if asked not in (None, "auto"):
        return resolve_precision(asked, device)
    if runs_natively(plan.precision, device):
        return plan.precision
    instead = default_precision(device)
    raise UserError(
        f"the plan was made for {plan.precision}, which this GPU does not compute natively (it is older than "
        f"Ampere): pass --precision {instead} --accept-precision to train in {instead} on this plan anyway (its "
        f"predicted times do not hold), or {replan_advice(plan, instead)}",
        where="precision",
    )


def _check_plan_precision(run: _Run) -> None:
    """The plan's times are for its profile's precision: training in another one is refused unless accepted."""
    planned, used = run.plan.precision, run.args.precision
    if planned != used and not run.args.accept_precision:
        raise UserError(
            f"the plan was made for {planned} but this run trains in {used}: {replan_advice(run.plan, used)}, or "
            f"pass --accept-precision to train in {used} on this plan anyway",
            where=str(run.plan.path or "--plan"),
        )


def _new_run(config: RunConfig, device: str, controls: Controls, *, joins_node_0: bool) -> _Run:
    """A run from a plan file into a fresh folder (default: runs/<local time>). A node other than node 0
    (``joins_node_0``) may find node 0's config.json in a shared folder: its workers decide (§6)."""
    if config.plan is None:
        raise UserError("missing option '--plan' (a plan JSON from `terapipe plan`)", where="terapipe train")
    plan = read_plan(config.plan)
    out = Path(config.out) if config.out is not None else Path("runs") / units.folder_stamp()
    if (out / "config.json").exists() and not joins_node_0 and has_trained(out):
        raise UserError("already holds a run: use --resume to continue it, or another --out", where=str(out))
    source = _init_source(config, plan)
    run = _Run(plan, dict(plan.raw), _new_arguments(config, device, plan, controls, source), out)
    _check_plan_precision(run)
    return run


def _init_source(config: RunConfig, plan: Plan) -> Source | None:
    """``--init-from SRC``: readable, of the plan's model, every tensor there (`init_from.check_source`), said in one
    line before anything is written; None without it."""
    if config.init_from is None:
        return None
    source = init_from.open_source(config.init_from)
    print(init_from.check_source(source, plan.model), file=sys.stderr, flush=True)
    return source


def _resumed_run(config: RunConfig, device: str) -> _Run:
    """The run in ``config.out``, continued from its last complete checkpoint to the new number of steps.

    Everything that decides the numbers comes from the run itself: a setting the run keeps (``Doc.resume`` "keep")
    given again with another value is refused, naming it. A new plan of the same model, D or T ("layout") continue
    the run under another layout from the same step (the checkpoint is the model, not the layout: §6e).
    """
    if config.out is None:
        raise UserError("--resume needs --out, the run directory to continue", where="resume")
    out = Path(config.out)
    if not (out / "config.json").exists():
        raise UserError("no run to resume here (config.json is missing)", where=str(out))
    saved_config, saved = read_config(out)
    plan = plan_from_dict(saved_config["plan"], f"{out / 'config.json'}: field 'plan'")
    new_plan = read_plan(config.plan) if config.plan is not None else None
    conflicts = _plan_conflicts(config, new_plan, plan, out) + _kept_conflicts(config, saved, plan, device)
    steps = saved.steps if config.steps is None else config.steps
    reached = checkpoint.latest_complete(out)
    if reached is not None and steps <= reached:
        option = f"--steps {steps}" if config.steps is not None else f"no --steps (the run's own {steps})"
        more = f"ask for more steps (--steps N, N > {reached})"
        error = UserError(f"the run already reached step {reached}; {more}", where="steps")
        conflicts.append(_Conflict(option, f"the run already reached step {reached}: ask for more", error))
    _refuse(conflicts, out)
    sources = [p for _, p in data_sources(saved.data_mix or saved.data)] + [p for p in [saved.val_data] if p]
    warning, fingerprints = check_unchanged(saved.data_fingerprints, sources)
    if warning is not None:
        print(f"terapipe: {warning}", file=sys.stderr, flush=True)
    resume_step, passed_over = checkpoint.latest_verified(out)  # checksums checked: a damaged one is passed over
    if resume_step is None and not has_trained(out):
        raise UserError("never completed a step: start it with the same command without --resume", where=str(out))
    if resume_step is None:
        why = f": {'; '.join(passed_over)}" if passed_over else ""
        raise UserError(f"no complete checkpoint to resume from{why}", where=str(out / "checkpoints"))
    if passed_over:
        print(f"terapipe: {'; '.join(passed_over)}: resuming from step {resume_step}", file=sys.stderr, flush=True)
    changes = {"steps": steps, "verify": False, "data_fingerprints": fingerprints}
    arguments = {f.name for f in dataclasses.fields(RunArguments)}
    for name, doc in run_fields().items():  # what else a resumed run may change, as given, where its arguments hold it
        if doc.resume == "change" and name in arguments and name not in changes and getattr(config, name) is not None:
            changes[name] = getattr(config, name)
    if config.eval_every is not None:  # how often to evaluate may change; what is held out may not
        changes["eval_every"] = _eval_every(
            config.eval_every, steps, saved.val_fraction > 0 or saved.val_data is not None
        )
    changes["log"] = resolve_logs(config.log if config.log is not None else saved.log)
    changes.update(_layout_changes(config, new_plan, saved))
    if config.precision is not None:
        changes["precision"] = _run_precision(config.precision, device, new_plan or plan)
    if config.accept_precision is not None:
        changes["accept_precision"] = config.accept_precision
    args = dataclasses.replace(saved, **changes)
    checkpoint_origin(out, resume_step, plan)
    if new_plan is not None and dict(new_plan.raw) == saved_config["plan"]:
        new_plan = None  # the run's own plan given again
    if new_plan is None and args.data_parallel == saved.data_parallel and args.tensor_parallel == saved.tensor_parallel:
        run = _Run(plan, saved_config["plan"], args, out, resume_step, saved_config)
    else:
        new_plan = new_plan or plan
        new_plan.model.check_tensor_parallel(args.tensor_parallel, where="tensor_parallel")
        _say_what_changes(plan, saved, new_plan, args, resume_step)
        run = _Run(new_plan, dict(new_plan.raw), args, out, resume_step, saved_config, replanned=True)
    if run.replanned or args.precision != saved.precision:
        _check_plan_precision(run)  # the plan's times are for its precision, as for a new run
    if args.precision != saved.precision:
        print(
            f"terapipe: the run continues in {args.precision} from step {resume_step} (it trained in "
            f"{saved.precision}): its numbers from here differ from the run continued in {saved.precision}",
            file=sys.stderr,
            flush=True,
        )
    return run


@dataclass(frozen=True)
class _Conflict:
    """A setting given to ``--resume`` that the run cannot take: the option as given, why not (a few words, for a
    list of several), and its own one-line error when it is the only one."""

    option: str
    why: str
    error: UserError


def _refuse(conflicts: list[_Conflict], out: Path) -> None:
    """Every conflicting setting at once: one alone is its own error; several are one line that names them all."""
    if len(conflicts) == 1:
        raise conflicts[0].error
    if conflicts:
        listed = "; ".join(f"{c.option} ({c.why})" for c in conflicts)
        raise UserError(
            f"{len(conflicts)} settings conflict with the run being resumed: {listed}; leave out what a resumed run "
            "keeps (or start a new run with --out)",
            where=str(out),
        )


def _plan_conflicts(config: RunConfig, given: Plan | None, plan: Plan, out: Path) -> list[_Conflict]:
    """A --plan given to --resume may lay the run out anew (another K, partition, virtual stages, slicing, order,
    D or T: docs/design.md §6e) but must be a plan of the run's model, the first differing field named."""
    differs = None if given is None else plan.model.difference(given.model)  # the name is a label, not the model
    if differs is None:
        return []
    key, theirs, ours = differs
    error = UserError(
        f"its model differs from the run's in field 'model.{key}' ({theirs!r}, the run's {ours!r}): "
        f"a run continues only with its own model (a new run can start from its weights with --init-from {out})",
        where=str(config.plan),
    )
    return [_Conflict(f"--plan {config.plan}", f"its field 'model.{key}' differs from the run's model", error)]


def _layout_changes(config: RunConfig, new_plan: Plan | None, saved: RunArguments) -> dict:
    """A resumed run's D and T: as given, else the new plan's, else the run's own."""
    changes = {}
    for name in ("data_parallel", "tensor_parallel"):
        given = getattr(config, name)
        changes[name] = given if given is not None else getattr(new_plan or saved, name)
    if new_plan is not None and saved.schedule is not None and config.schedule is None:
        changes["schedule"] = None  # a hand-written schedule was for the old plan's tiles
    return changes


def _say_what_changes(plan: Plan, saved: RunArguments, new_plan: Plan, args: RunArguments, step: int) -> None:
    """One line saying the run continues under another layout and, where the steps' numbers change (another global
    batch), that too: before training, so nobody compares the wrong curves."""
    before = Layout(saved.data_parallel, plan.stages, saved.tensor_parallel)
    after = Layout(args.data_parallel, new_plan.stages, args.tensor_parallel)
    parts = [
        f"D × K × T {before.data} × {before.stages} × {before.tensor} -> {after.data} × {after.stages} × {after.tensor}"
    ]
    if plan.virtual_stages != new_plan.virtual_stages:
        parts.append(f"virtual stages {plan.virtual_stages} -> {new_plan.virtual_stages}")
    if plan.partition.to_list() != new_plan.partition.to_list():
        parts.append(f"layers {plan.partition.text()} -> {new_plan.partition.text()}")
    print(f"terapipe: resuming step {step} under a new layout: {', '.join(parts)}", file=sys.stderr, flush=True)
    was, now = plan.batch_size * saved.data_parallel, new_plan.batch_size * args.data_parallel
    if was != now:
        print(
            f"terapipe: the global batch changes from {was} to {now} sequences per step: the steps after {step} "
            "differ from the run continued under its old plan",
            file=sys.stderr,
            flush=True,
        )


def checkpoint_origin(out: Path, step: int, plan: Plan) -> None:
    """Every file of the checkpoint to continue from is one of this run's model (its tensors' names and origin
    read, memory-mapped): another run's file under a valid manifest is one line here, not a worker's failure."""
    try:
        checkpoint.read_state(out, step, set(), model_config=plan.model.to_dict())
    except checkpoint.CheckpointMismatch as e:
        raise UserError(str(e), where=str(out / "checkpoints")) from None


def _kept_conflicts(config: RunConfig, saved: RunArguments, plan: Plan, device: str) -> list[_Conflict]:
    """A resumed run keeps its data, seed, held-out part, lr schedule, clipping, optimizer settings and schedule:
    each different value given again is a conflict, naming it and the run's own."""
    conflicts = []
    for name, doc in run_fields().items():
        given = getattr(config, name)
        if doc.resume != "keep" or given is None:
            continue
        kept = getattr(saved, name)
        if name == "data":
            given, kept = (_data_path(config), _data_mix(config)), (saved.data, saved.data_mix)
        elif name == "val_data":
            given = str(Path(given).resolve())
        elif name == "schedule":
            given = _schedule_text(config, plan)
        if name == "decay_steps" and kept is None:
            kept = saved.steps
        if given == kept:
            continue
        if name == "data":
            kept = saved.data_mix or saved.data
        option = f"{flag(name)} (another schedule)" if name == "schedule" else as_option(name, getattr(config, name))
        unset = {
            "data": "the embedded default data (no --data)",
            "min_lr": "no --min-lr (a constant lr)",
            "schedule": "the plan's own schedule (no --schedule)",
        }
        shown = f"{flag(name)} its own schedule" if name == "schedule" else as_option(name, kept)
        was = shown if kept is not None else unset.get(name, f"no {flag(name)}")
        error = UserError(
            f"the run being resumed was trained with {was}; a resumed run keeps it "
            f"(leave the option out, or start a new run with --out)",
            where=name,
        )
        conflicts.append(_Conflict(option, f"the run was trained with {was}", error))
    return conflicts


def _config_fields(run: _Run) -> tuple[dict, dict]:
    """The plan and arguments config.json holds for this launch: a new run's own, or a resumed run's with its
    new length and settings (the plan and the numbers' arguments stay the run's own)."""
    if run.config is not None:
        return run.plan_obj, {**run.config["arguments"], **dataclasses.asdict(run.args)}
    return run.plan_obj, dataclasses.asdict(run.args)


def check_checkpoint_room(out: Path, plan: Plan) -> None:
    """Room for one checkpoint on ``out``'s disk before a launch: its stage files hold every parameter in fp32 with
    AdamW's two moments (12 bytes a parameter); "disk full" in one line, exit 2, when the disk has less free (each
    file checks again before it is written, `checkpoint.save_stage`)."""
    parameters = sum(math.prod(shape) for shape in plan.model.spec.tensor_shapes(plan.model).values())
    estimate = f"a checkpoint of {parameters:,} parameters: fp32 weights and AdamW's two moments"
    check_free_space(out / "checkpoints", 12 * parameters, estimate=estimate)


def _write_run_dir(run: _Run, arguments: dict, *, device: str, backend: str, nnodes: int, rendezvous: dict) -> None:
    """A new run's folder (`rundir.write_config`); a resumed run's config.json with its new arguments. Either way
    with a new launch id."""
    launch_id = uuid.uuid4().hex
    if run.config is not None:
        new_plan = {"plan": run.plan_obj, "world_size": run.layout.world} if run.replanned else {}
        close_segment(run.out, run.config, run.resume_step, replanned=run.replanned)  # the old plan's steps
        update_arguments(run.out, run.config, launch_id, **new_plan, **arguments)
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
        rendezvous=rendezvous,
    )
