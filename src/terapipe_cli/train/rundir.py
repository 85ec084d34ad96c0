"""The run directory written by ``terapipe train`` (read by the report). Every JSON file has a schema.

runs/NAME/
  config.json        terapipe.run/1: {"plan": <the plan object>, "arguments": {steps, data, seed, lr,
                     data_parallel, checkpoint_every, threads, timeout_s, verify, precision,
                     warmup_steps, min_lr, decay_steps, grad_clip, accept_precision, tensor_parallel,
                     val_fraction, eval_every, log, schedule, ...}
                     (config.run.RunArguments, each key's doc there),
                     "world_size" (D × K × T), "stages", "device", "backend", "nnodes", "versions": {...}, "created",
                     "launch_id" (new at every launch by node 0; how another node tells node 0's folder from its own)}
  plan.json          the plan as given (terapipe.plan/1)
  run.toml           the run's resolved settings as a [train] table: `terapipe train --config run.toml --out NEW`
                     trains it again (config.run.RunConfig)
  schedule.csv       the schedule the run was given with --schedule (only then; schedule.schedule)
  tokenizer/         a corpus run's own tokenizer: the corpus's files and its summary (train.tokenizer)
  metrics.jsonl      one JSON object per line and step (terapipe.metrics/1): {"schema", "step", "loss",
                     "lr" (this step's), "grad_norm" (global, before clipping; null on a skipped step),
                     "tokens" (trained on so far, all replicas), "epoch" (epochs of the training data drawn so
                     far, engine.data.epochs_done),
                     "skipped" (fp16: the step was skipped for an inf/nan gradient), "loss_scale" (fp16 only:
                     the scale for the next step), "iteration_s", "tokens_per_s",
                     "memory_bytes" (peak, largest rank), "memory_bytes_per_rank": [...] (each worker's own peak:
                     CUDA max allocated, on CPU its peak resident set, VmHWM), "saved_bytes_per_rank": [...] (the
                     most each rank's stage kept for its backward during the step, counted by engine.stage.SavedBytes),
                     "live_bytes_per_rank": [...] (with --track-memory on a CPU, the first step of a launch only:
                     the most bytes live at once during the step, engine.live.LiveBytes; gradients count as state),
                     "val_loss" (only on evaluated steps: the held-out loss after the step's update)}
  metrics.csv        the same numbers, a row per step (only with --log csv; train/metrics.py names the columns)
  tensorboard/       the same numbers as TensorBoard event files (only with --log tensorboard)
  timelines/rank_00000.json   terapipe.timeline/1 (see schedule/timeline.py): every tile of every step, F and B
  segments/steps_from_000001/  a run resumed under another plan, D or T: the steps it trained under each earlier
                     one (`close_segment`): that plan's config.json, its ranks' timelines/, and segment.json
                     (terapipe.run-segment/1: {"first_step", "last_step"}); the run's own files hold the steps after
  checkpoints/step_000010/...  see checkpoint.py (the optimizer state carries the fp16 loss scale)
  errors/rank_00001.txt       the traceback of a worker that failed (only then)
  errors/torchrun.log         torchrun's own log of a launch that failed or was interrupted (only then); a launch
                     that succeeds removes errors/
  verify/grads_stage_000.pt   {"step", "grads"}: each stage's whole gradients (unscaled, clipped) at the first step
                     not skipped, by name (only with --verify)
  summary.json       terapipe.run-summary/1: {"status": "complete", "steps", "first_loss", "final_loss",
                     "final_val_loss", "median_iteration_s", "tokens_per_s", "wall_s", "skipped_steps", "verify": {...}
                     (with --verify; see train/verify.py)}
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from terapipe_cli import units
from terapipe_cli.config.run import SCHEDULE_FILE, RunArguments, run_toml
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_json, read_user_text, write_json_atomic, write_text_atomic
from terapipe_cli.plan.file import Plan
from terapipe_cli.schedule.schedule import Schedule, parse_schedule
from terapipe_cli.train.tokenizer import record_tokenizer

RUN_SCHEMA = "terapipe.run/1"
RUN_TOML = "run.toml"
METRICS_SCHEMA = "terapipe.metrics/1"
SUMMARY_SCHEMA = "terapipe.run-summary/1"


def write_config(
    run_dir: Path,
    *,
    plan: dict,
    args: RunArguments,
    world_size: int,
    device: str,
    backend: str,
    nnodes: int,
    versions: dict,
    created: str,
    launch_id: str = "",
    rendezvous: dict | None = None,
) -> None:
    """A new run's files: plan.json, run.toml (its resolved settings, to train it again), the schedule it was given
    (if any), and config.json last. ``rendezvous``: ``rdzv_endpoint`` and ``rdzv_timeout_s`` of a run on several
    machines."""
    rendezvous = rendezvous or {"rdzv_endpoint": None, "rdzv_timeout_s": 300.0}
    write_json_atomic(run_dir / "plan.json", plan)
    if args.schedule is not None:
        write_text_atomic(run_dir / SCHEDULE_FILE, args.schedule)
    else:
        (run_dir / SCHEDULE_FILE).unlink(missing_ok=True)  # left by an earlier launch that never trained here
    write_run_toml(run_dir, args, device=device, nnodes=nnodes, rendezvous=rendezvous)
    record_tokenizer(run_dir, args.data)  # RUN/tokenizer/: the corpus's tokenizer, for sample and export
    write_json_atomic(
        run_dir / "config.json",
        {
            "schema": RUN_SCHEMA,
            "plan": plan,
            "arguments": asdict(args),
            "world_size": world_size,
            "stages": plan["stages"],
            "device": device,
            "backend": backend,
            "nnodes": nnodes,
            "versions": versions,
            "created": created,
            "launch_id": launch_id,
            "rendezvous": rendezvous,
        },
    )


def has_trained(run_dir: Path) -> bool:
    """Whether a step of the run in ``run_dir`` completed: a record in metrics.jsonl (node 0's folder) or any
    checkpoint (every folder; one is written only after a completed step). A folder that a launch left before its
    first step (the other nodes never joined, a worker failed at start-up) holds settings but no run: the same
    command starts it again there."""
    checkpoints = run_dir / "checkpoints"
    return (checkpoints.is_dir() and any(checkpoints.iterdir())) or bool(read_metrics(run_dir))


def settings_digest(plan: dict, arguments: dict) -> str:
    """A short hash of what decides a run's numbers and length: the plan and the arguments. Every node of a
    multi-node launch computes its own; a node whose digest is not node 0's was started with another command."""
    text = json.dumps({"plan": plan, "arguments": arguments}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def join_run_folder(run_dir: Path, config: dict, *, node_rank: int, resuming: bool) -> bool:
    """Called on each node by one worker once the nodes have met, with node 0's ``config``: True when
    ``run_dir`` is node 0's own folder (shared, or this is node 0), False when it is this node's own
    (node-local), into which node 0's config.json and plan.json are then written (docs/design.md §6).

    Node 0's launcher wrote config.json with a fresh ``launch_id`` before the rendezvous, so a node that sees
    that id in its folder shares node 0's. Any other config.json here is this node's copy of the run being
    resumed, or, for a new run, an older run: that is refused.
    """
    path = run_dir / "config.json"
    if node_rank == 0:
        return True
    here = read_json(path, schema=RUN_SCHEMA, what="run config") if path.exists() else None
    if here is not None and here.get("launch_id") == config["launch_id"]:
        return True
    if here is not None and not resuming and has_trained(run_dir):
        raise UserError("already holds another run: give this node another --out, or an empty one", where=str(path))
    write_json_atomic(run_dir / "plan.json", config["plan"])
    write_json_atomic(path, config)
    return False


def update_arguments(
    run_dir: Path, config: dict, launch_id: str, *, plan: dict | None = None, world_size: int | None = None, **changes
) -> None:
    """Rewrite config.json with some arguments changed (a resumed run's new length and settings) and this
    launch's id, and run.toml to match; ``plan``: a resumed run's new plan (another layout, docs/design.md §6e),
    written to plan.json too, with its ``world_size``."""
    updated = {**config, "arguments": {**config["arguments"], **changes}, "launch_id": launch_id}
    if plan is not None:
        updated.update(plan=plan, stages=plan["stages"], world_size=world_size)
        write_json_atomic(run_dir / "plan.json", plan)
    args = RunArguments.from_dict(updated["arguments"], str(run_dir / "config.json"))
    rendezvous = config.get("rendezvous") or {"rdzv_endpoint": None, "rdzv_timeout_s": 300.0}
    write_run_toml(run_dir, args, device=config["device"], nnodes=config["nnodes"], rendezvous=rendezvous)
    write_json_atomic(run_dir / "config.json", updated)


def write_run_toml(run_dir: Path, args: RunArguments, *, device: str, nnodes: int, rendezvous: dict) -> None:
    text = run_toml(args, plan="plan.json", device=device, nnodes=nnodes, **rendezvous)
    write_text_atomic(run_dir / RUN_TOML, text)


def read_config(run_dir: Path) -> tuple[dict, RunArguments]:
    """The run's config: (raw object, arguments)."""
    path = run_dir / "config.json"
    obj = read_json(path, schema=RUN_SCHEMA, what="run config")
    arguments = Fields(obj, str(path)).sub("arguments").obj
    return obj, RunArguments.from_dict(arguments, str(path))


def append_metrics(run_dir: Path, record: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"schema": METRICS_SCHEMA, **record}) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    """The steps' records of metrics.jsonl (not its events, `read_events`)."""
    return [r for r in _records(run_dir) if r.get("schema") == METRICS_SCHEMA]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    lines = read_user_text(path, name="metrics file", expected="metrics (a JSON-lines file)").splitlines()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                break  # a last line cut short by a killed run
            raise UserError(f"corrupt line {n + 1}: {e.msg}", where=str(path)) from None
        if not isinstance(rec, dict):
            raise UserError(f"corrupt line {n + 1}: not a JSON object", where=str(path))
        step = rec.get("step")
        if rec.get("schema") == METRICS_SCHEMA and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
            raise UserError(f"line {n + 1}: field 'step' must be a positive integer, got {step!r}", where=str(path))
        out.append(rec)
    return out


def keep_metrics_until(run_dir: Path, step: int) -> None:
    """On resume: drop the records of steps after the checkpoint (they will be run again); events stay."""
    kept = [r for r in read_metrics(run_dir) if r["step"] <= step] + read_events(run_dir)
    write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in kept))


# What happened to the run between steps (a restart after a worker failed, train/worker.py), in metrics.jsonl among
# the steps' records: {"schema": EVENT_SCHEMA, "event": "restart", "restart": n, "resumed_from": step, "time": ...}.
# `read_metrics` returns the steps only; `read_events` these.
EVENT_SCHEMA = "terapipe.run-event/1"


def append_event(run_dir: Path, record: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"schema": EVENT_SCHEMA, **record, "time": units.utc_timestamp()}) + "\n")


def read_events(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if r.get("schema") == EVENT_SCHEMA]


SEGMENT_SCHEMA = "terapipe.run-segment/1"
SEGMENTS = "segments"


def segment_dirs(run_dir: Path) -> list[tuple[Path, int, int]]:
    """The run's earlier segments in step order: (folder, first step, last step). A folder without its
    segment.json (written last) is not one."""
    out = []
    for folder in sorted((run_dir / SEGMENTS).glob("steps_from_*")):
        path = folder / "segment.json"
        if path.is_file():
            f = Fields(read_json(path, schema=SEGMENT_SCHEMA, what="run segment"), str(path))
            first, last = f.int("first_step", minimum=1), f.int("last_step", minimum=1)
            out.append((folder, first, last))
    return out


def close_segment(run_dir: Path, config: dict, resume_step: int, *, replanned: bool) -> None:
    """On ``--resume`` from ``resume_step``: the steps after it are trained again, so an earlier segment ends there
    at the latest (one that starts later is dropped). Under another plan, D or T (``replanned``), the steps trained
    under the old one become a segment: its ``config`` (plan and arguments) and its ranks' timelines, which
    describe other stages than the new ranks run, moved to ``segments/steps_from_N/`` for the report."""
    first = 1
    for folder, start, last in segment_dirs(run_dir):
        if start > resume_step:
            shutil.rmtree(folder)
            continue
        if last > resume_step:
            write_json_atomic(folder / "segment.json", _segment(start, resume_step))
        first = min(last, resume_step) + 1
    for folder in (run_dir / SEGMENTS).glob("steps_from_*"):  # left by a launch stopped while closing one
        if not (folder / "segment.json").is_file():
            shutil.rmtree(folder)
    if not replanned:
        return
    timelines = run_dir / "timelines"
    if first > resume_step or not timelines.is_dir():  # nothing trained under the old plan is kept
        shutil.rmtree(timelines, ignore_errors=True)
        return
    folder = run_dir / SEGMENTS / f"steps_from_{first:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    os.replace(timelines, folder / "timelines")
    write_json_atomic(folder / "config.json", config)
    write_json_atomic(folder / "segment.json", _segment(first, resume_step))


def _segment(first: int, last: int) -> dict:
    return {"schema": SEGMENT_SCHEMA, "first_step": first, "last_step": last}


def timeline_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "timelines" / f"rank_{rank:05d}.json"


def verify_grads_path(run_dir: Path, stage: int) -> Path:
    return run_dir / "verify" / f"grads_stage_{stage:03d}.pt"


def write_summary(run_dir: Path, summary: dict) -> None:
    write_json_atomic(run_dir / "summary.json", {"schema": SUMMARY_SCHEMA, **summary})


def read_summary(run_dir: Path) -> dict:
    return read_json(run_dir / "summary.json", schema=SUMMARY_SCHEMA, what="run summary")


LOCK_FILE = ".terapipe.lock"


def _holder(run_dir: Path) -> str:
    try:
        pid = (run_dir / LOCK_FILE).read_text().strip()
    except OSError:
        pid = ""
    return f" (pid {pid})" if pid else ""


def check_not_live(run_dir: Path | None, what: str) -> None:
    """One line if a `terapipe train` is running in ``run_dir`` right now (it holds the folder's lock)."""
    if run_dir is None or not (run_dir / LOCK_FILE).is_file():
        return
    with open(run_dir / LOCK_FILE, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"a `terapipe train` is running in this folder{_holder(run_dir)}: {what} once it has ended",
                where=str(run_dir),
            ) from None
        fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def run_lock(run_dir: Path):
    """Hold the run folder's lock while training in it, so that a second train, ``--resume`` or report refuses
    (`check_not_live`). An advisory ``flock``: the operating system drops it when the holder ends, however it ends."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_FILE, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"a `terapipe train` is running in this folder{_holder(run_dir)}", where=str(run_dir)
            ) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_schedule(plan: Plan, args: RunArguments, *, where: str) -> Schedule:
    """The schedule a run walks: the one it was given (``arguments.schedule``, checked again) or its plan's."""
    if args.schedule is None:
        return Schedule.of_plan(plan)
    where = f"{where}: field 'arguments.schedule'"
    return parse_schedule(
        args.schedule, plan.slices, plan.stages, plan.recompute, where=where, partition=plan.partition
    )
