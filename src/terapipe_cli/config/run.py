"""One training run, described once (torchtitan's job config): what is asked (`RunConfig`) and what a run keeps
(`RunArguments`, the resolved values in its ``config.json``).

`RunConfig` is what `terapipe train` takes, from its flags or from a TOML file (``terapipe train --config
run.toml``; flags override the file)::

    [train]
    plan = "plan.json"        # paths are relative to this file
    steps = 200
    lr = 6e-4
    warmup_steps = 20
    precision = "bf16"

Every field carries its one-line doc; the typer options of `terapipe train` (cli/train.py), the keys this file may
hold, and what a resumed run must keep (``Doc.resume``: "keep", refused if given differently; "layout", the plan
and its D and T, which a resumed run may change to continue under another layout; "announce", which may change
with one line saying the numbers from then on differ (the precision); "change", free) all derive from the fields,
and so does the report's check that a baseline trained with the same settings
(`report.runs.same_settings`). A value left out (None) takes its default when the run is prepared
(`train.prepare`): the field's ``fallback``, or one computed from the run; the run folder then keeps the resolved
configuration as ``run.toml`` (`run_toml`), so ``terapipe train --config RUN/run.toml --out NEW`` trains the same
run again. A component's settings are declared with it and included whole (`include_settings`): AdamW's,
`config.optimizer.OptimizerConfig` (``--weight-decay``, ``--beta1``, ``--beta2``, ``--eps``,
``--no-decay-embeddings``), are fields of `RunConfig` and of `RunArguments` as if written here.

`LRSchedule` is the learning rate per step (linear warm-up, then cosine decay to a floor, as nanoGPT's
``get_lr``), with its defaults (`LRSchedule.default`).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from terapipe_cli.config.controls import Controls
from terapipe_cli.config.device import PRECISIONS, device_setting, precision_setting
from terapipe_cli.config.fields import (
    Doc,
    Fallbacks,
    component_of,
    doc_of,
    flag_of,
    include_settings,
    read_fields,
    setting,
    to_toml,
    toml_table,
)
from terapipe_cli.config.optimizer import OPTIMIZER, OptimizerConfig
from terapipe_cli.corpus.formats import TOKEN_DTYPES
from terapipe_cli.errors import UserError
from terapipe_cli.extras import require

# The peak learning rate of `terapipe train` and of the demo, one default for both. 3e-4 is between GPT-3's peaks
# for its 125M-1.3B shapes (6e-4, 2e-4) and trains the tiny demo model smoothly (its loss falls without a jump in
# 30 steps; 1e-3 spikes in the first steps after a 3-step warm-up). Bigger models want less, tiny ones bear more.
DEFAULT_LR = 3e-4
DEFAULT_GRAD_CLIP = 1.0
DEFAULT_STEPS = 20  # a new run's length; a resumed run goes on to its own unless --steps says otherwise
DEFAULT_VAL_FRACTION = 0.1  # the data's last tenth held out for the validation loss
WARMUP_FRACTION = 0.1  # the default warm-up: this share of the run's steps ...
MIN_WARMUP_STEPS = 3  # ... but at least this many (a third of the run, at least one, when it is shorter than 9)
MIN_LR_FRACTION = 0.1  # the default floor of the cosine decay: this share of the peak lr (as nanoGPT)
# Stopping on a signal: the default time to save (Slurm's KillWait and Kubernetes' grace period default
# to 30 s, so a job that must save large stages sets its scheduler's grace and --grace-s together), and the complete
# checkpoints kept (2: the previous one survives while the newest is written and checked; torchtitan's keep_latest_k).
DEFAULT_GRACE_S = 60.0
DEFAULT_KEEP_CHECKPOINTS = 2

# How a step's windows are drawn (`engine.data.window_offsets`): random offsets, or shuffled non-overlapping
# windows epoch by epoch (Megatron-LM's); a new run on token ids takes epochs, on text (bytes) random windows.
SAMPLINGS = ("random", "epoch")

# Where each step's metrics go (`--log`, train/metrics.py): metrics.jsonl always, the others when asked.
LOGS = ("jsonl", "csv", "tensorboard")

REQUIRED = MISSING  # a `setting` without a default
RUN, LAYOUT, NODES = "Run", "Processes", "Several machines"  # help panels (and `OPTIMIZER`)


@dataclass(frozen=True)
@include_settings(OptimizerConfig, optional=True)  # --weight-decay, --beta1, ...: declared with the optimizer
class RunConfig(Fallbacks):
    """What `terapipe train` is asked to do; None: the default (a new run) or the run's own value (a resumed one)."""

    plan: str | None = setting(
        "Plan JSON from `terapipe plan` (with --resume: another plan of the same model, continuing the run under its "
        "layout).",
        path=True,
        panel=RUN,
        resume="layout",
    )
    schedule: str | None = setting(
        "A schedule file (CSV, one row of actions per stage such as 0F3.2) to walk instead of the plan's order; "
        "checked for legality first.",
        path=True,
        panel=RUN,
        resume="keep",
    )
    out: str | None = setting("Run directory.", shown="runs/<timestamp>", path=True, panel=RUN)
    resume_if_present: bool | None = setting(
        "Continue the run in --out as --resume does when it holds one, else start it there: for a job script that "
        "may run again (requeued or resubmitted). A run of another model there is refused; one already at --steps "
        "has nothing to train (exit 0).",
        fallback=False,
        panel=RUN,
    )
    steps: int | None = setting(
        "Training steps (with --resume: the new total).",
        minimum=1,
        shown=f"{DEFAULT_STEPS}; with --resume, the run's",
        panel=RUN,
        resume="change",
    )
    data: list[str] | None = setting(
        "Text file (read as bytes) or token ids: a Megatron corpus (PREFIX of .bin + .idx), an llm.c .bin, a .npy, "
        "or a headerless .bin with --token-dtype. Repeat it with weights for a mixture: --data 0.7:web --data "
        "0.3:code (weights normalised).",
        shown="the embedded text",
        panel=RUN,
        resume="keep",
    )
    token_dtype: str | None = setting(
        "The type of a headerless .bin's ids: uint16 (nanoGPT's) or uint32; other formats say theirs.",
        choices=TOKEN_DTYPES,
        panel=RUN,
        resume="keep",
    )
    document_mask: bool | None = setting(
        "Attend within each packed document only (block-causal across token slices; positions restart at each "
        "document); --no-document-mask attends across them. Elsewhere than a Megatron corpus the documents end at "
        "each --eos-id.",
        shown="on for a Megatron corpus (it records its documents), off elsewhere",
        panel=RUN,
        resume="keep",
    )
    eos_id: int | None = setting(
        "The id that ends each document of a file that records none, for --document-mask.",
        minimum=0,
        shown="the run tokenizer's: a line break in text, GPT-2's <|endoftext|> in other token files",
        panel=RUN,
        resume="keep",
    )
    seed: int | None = setting("Seed of the weights and of the batches.", fallback=0, panel=RUN, resume="keep")
    init_from: str | None = setting(
        "Start from pretrained weights: a transformers folder (config.json + safetensors), a terapipe export "
        "(model.pt) or a run folder (its newest checkpoint); the plan's model must be SRC's. A new run only.",
        shown="the seed's weights",
        path=True,
        panel=RUN,
        resume="keep",
    )
    val_fraction: float | None = setting(
        "The data's last part held out for the validation loss; 0 trains on all of it.",
        minimum=0,
        fallback=DEFAULT_VAL_FRACTION,
        panel=RUN,
        resume="keep",
    )
    val_data: str | None = setting(
        "A file of its own (any --data format) for the validation loss, instead of --val-fraction's held-out part.",
        path=True,
        panel=RUN,
        resume="keep",
    )
    sampling: str | None = setting(
        "How each step's windows are drawn: random (random offsets) or epoch (shuffled, non-overlapping windows, "
        "each once per epoch, as Megatron-LM's dataset).",
        choices=SAMPLINGS,
        shown="epoch for token ids, random for text",
        panel=RUN,
        resume="keep",
    )
    eval_every: int | None = setting(
        "Validation loss every N steps and after the last (forward only, same pipeline); 0: never.",
        shown="a tenth of --steps; a run under 10 steps: after the last",
        panel=RUN,
        resume="change",
    )
    log: list[str] | None = setting(
        "Also write each step's metrics for TensorBoard (RUN/tensorboard/) or as CSV (RUN/metrics.csv): "
        "--log tensorboard,csv (or --log repeated); metrics.jsonl is always written.",
        shown="jsonl",
        panel=RUN,
        resume="change",
    )
    checkpoint_every: int | None = setting(
        "Checkpoint every N steps (and after the last).", minimum=1, fallback=10, panel=RUN, resume="change"
    )
    keep_checkpoints: int | None = setting(
        "Complete checkpoints kept; older ones are removed once a newer one is complete.",
        minimum=1,
        fallback=DEFAULT_KEEP_CHECKPOINTS,
        panel=RUN,
        resume="change",
    )
    grace_s: float | None = setting(
        "On SIGTERM, SIGUSR1 or Ctrl-C: seconds to save a checkpoint of the step done before stopping (past that, "
        "the previous checkpoint is kept).",
        positive=True,
        fallback=DEFAULT_GRACE_S,
        panel=RUN,
        resume="change",
    )
    max_restarts: int | None = setting(
        "When a worker dies, restart all workers from the last complete checkpoint, at most N times.",
        minimum=0,
        fallback=0,
        panel=RUN,
        resume="change",
    )
    verify: bool | None = setting(
        "Compare with a single-process reference; exit 1 on a mismatch.", fallback=False, panel=RUN
    )
    track_memory: bool | None = setting(
        "On a CPU, run the first step of each launch under a tracker of every tensor made: the most bytes live at "
        "once per rank, in metrics.jsonl and the report next to the plan's estimate (that step runs slower). On a "
        "GPU, CUDA's max allocated is always recorded.",
        fallback=False,
        panel=RUN,
        resume="change",
    )
    loss_chunk_tokens: int | None = setting(
        "Tokens the last stage's LM head and loss run at a time, forward and backward (their logits never all at "
        "once); 0 makes a tile's whole logits at once.",
        minimum=0,
        shown="the plan's",
        panel=RUN,
        resume="change",
    )
    lr: float | None = setting(
        "Peak AdamW learning rate, e.g. --lr 6e-4. The default (the demo's too) lies between GPT-3's peaks for its "
        "125M-1.3B shapes and trains the tiny model without a spike; bigger models want less.",
        positive=True,
        fallback=DEFAULT_LR,
        panel=OPTIMIZER,
        resume="keep",
    )
    warmup_steps: int | None = setting(
        "Steps of linear lr warm-up up to --lr, e.g. --warmup-steps 100.",
        shown="10% of --steps, at least 3 (a third of a shorter run)",
        panel=OPTIMIZER,
        resume="keep",
    )
    min_lr: float | None = setting(
        "The lr the cosine decay reaches at the last step, e.g. --min-lr 6e-5.",
        shown=f"{MIN_LR_FRACTION:g} x --lr",
        panel=OPTIMIZER,
        resume="keep",
    )
    decay_steps: int | None = setting(
        "The step at which the cosine decay reaches --min-lr.",
        minimum=1,
        shown="--steps",
        panel=OPTIMIZER,
        resume="keep",
    )
    grad_clip: float | None = setting(
        "Clip the gradients to this global norm over all stages, e.g. --grad-clip 0.5; 0 does not clip (the norm "
        "is logged either way).",
        fallback=DEFAULT_GRAD_CLIP,
        panel=OPTIMIZER,
        resume="keep",
    )
    precision: str | None = precision_setting("the plan's", panel=OPTIMIZER, resume="announce")
    accept_precision: bool | None = setting(
        "Train at --precision even though the plan was profiled at another (its predicted times do not hold).",
        fallback=False,
        panel=OPTIMIZER,
    )
    data_parallel: int | None = setting(
        "Data-parallel replicas D.", short="-d", minimum=1, shown="the plan's", panel=LAYOUT, resume="layout"
    )
    tensor_parallel: int | None = setting(
        "Tensor-parallel processes T per stage, splitting heads and MLP.",
        short="-t",
        minimum=1,
        shown="the plan's",
        panel=LAYOUT,
        resume="layout",
    )
    device: str | None = device_setting(panel=LAYOUT, resume="change")
    threads: int | None = setting("CPU threads per worker.", minimum=1, fallback=1, panel=LAYOUT, resume="change")
    timeout_s: float | None = setting(
        "Limit on every distributed wait (seconds).", positive=True, fallback=120.0, panel=LAYOUT, resume="change"
    )
    nnodes: int | None = setting(
        "Machines; run the same command on each (--out: one shared folder, or one per node).",
        minimum=1,
        fallback=1,
        panel=NODES,
        resume="change",
    )
    node_rank: int | None = setting(
        "This machine's rank among --nnodes.", minimum=0, fallback=0, panel=NODES, resume="change"
    )
    rdzv_endpoint: str | None = setting("HOST:PORT of the rendezvous on node 0.", panel=NODES, resume="change")
    rdzv_timeout_s: float | None = setting(
        "Seconds the nodes wait for each other at the rendezvous, e.g. 60.",
        flag="--rdzv-timeout",
        positive=True,
        fallback=300.0,
        panel=NODES,
        resume="change",
    )

    @classmethod
    def of_run(cls, args: RunArguments, **changes) -> RunConfig:
        """The settings that train a run with resolved ``args`` again (a run from before the lr schedule existed:
        its constant lr written out), with ``changes`` over them."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["data"] = list(args.data_mix) if args.data_mix else None if args.data is None else [args.data]
        schedule = LRSchedule.of_run(args)
        values.update(min_lr=schedule.min_lr, decay_steps=schedule.total_steps, schedule=None)
        return cls(**{**values, **changes})

    def given(self) -> dict:
        """The fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


TABLE = "train"
SCHEDULE_FILE = "schedule.csv"  # a run's own schedule, when it has one, in its folder


def run_fields() -> dict[str, Doc]:
    """Every field of `RunConfig` with its `Doc`, in order."""
    return {f.name: doc_of(f) for f in fields(RunConfig)}


def flag(name: str) -> str:
    """The command-line flag of a `RunConfig` field (``warmup_steps`` -> ``--warmup-steps``)."""
    return next(flag_of(f) for f in fields(RunConfig) if f.name == name)


def as_option(name: str, value) -> str:
    """A `RunConfig` setting as a command line gives it: ``--lr 0.001``; a switch ``--verify`` or ``--no-verify``; a
    list the option repeated (``--data 0.7:web --data 0.3:code``)."""
    if isinstance(value, bool):
        return flag(name) if value else f"--no-{flag(name)[2:]}"
    if isinstance(value, list):
        return " ".join(f"{flag(name)} {v}" for v in value)
    return f"{flag(name)} {value}"


def load_run_config(path: str | Path) -> RunConfig:
    """A `RunConfig` from the ``[train]`` table of a TOML file; paths in it are relative to the file."""
    path = Path(path)
    table = toml_table(path, TABLE, "run config")
    if isinstance(table.get("data"), str):  # one source, as a run.toml from before mixtures wrote it
        table = {**table, "data": [table["data"]]}
    values = read_fields(RunConfig, table, str(path), prefix=f"{TABLE}.", what="run setting", base=path.parent)
    if values.get("data") is not None:  # relative to this file, each source's path
        where = f"{path}: field '{TABLE}.data'"
        values["data"] = [_relative_source(entry, path.parent, where) for entry in values["data"]]
    return RunConfig(**values)


def data_sources(
    given: str | Path | list[str] | None, *, where: str = "data", base: Path | None = None
) -> list[tuple[float | None, str]]:
    """``--data`` as given (one path, or entries of a mixture): (its weight or None, its path) per source. An entry
    ``W:PATH`` has the weight W when W reads as a number, which must be positive and finite (one source's too);
    when W is no number, the whole entry is a path if a file (or Megatron corpus) of that name exists (relative to
    ``base``), and otherwise W is refused as a weight that is no number, unless it looks like a folder (a "/" in
    it). Errors name ``where``."""
    if given is None:
        return []
    out = []
    for entry in [given] if isinstance(given, (str, Path)) else given:
        entry = str(entry)
        head, sep, tail = entry.partition(":")
        if not sep:
            out.append((None, entry))
            continue
        try:
            weight = float(head)
        except ValueError:
            if "/" in head or _names_data(entry, base):
                out.append((None, entry))
                continue
            raise UserError(
                f"the weight {head!r} of {entry!r} is not a number (a source is PATH, or WEIGHT:PATH as in 0.7:web)",
                where=where,
            ) from None
        if not 0 < weight < math.inf:  # NaN too
            raise UserError(f"the weight of {entry!r} must be a positive number, got {head}", where=where)
        out.append((weight, tail))
    return out


def _names_data(entry: str, base: Path | None) -> bool:
    """Whether a data file, or a Megatron corpus's .bin or .idx, is named by ``entry`` (relative to ``base``)."""
    path = Path(entry).expanduser()
    path = path if base is None or path.is_absolute() else base / path
    return any(Path(f"{path}{suffix}").exists() for suffix in ("", ".bin", ".idx"))


def _relative_source(entry: str, base: Path, where: str) -> str:
    ((weight, path),) = data_sources([entry], where=where, base=base)
    p = Path(path).expanduser()
    p = p if p.is_absolute() else base / p
    return str(p) if weight is None else f"{weight!r}:{p}"


@dataclass(frozen=True)
@include_settings(OptimizerConfig)  # AdamW's settings (a run from before them: their defaults, what it used)
class RunArguments:
    """A run's resolved settings, as its ``config.json`` keeps them under "arguments" (train/rundir.py). The
    defaults are what a run from before each field existed did."""

    steps: int = setting("Training steps.", REQUIRED, minimum=1)
    data: str | None = setting("The data file (None: the embedded text); a mixture's first source.", REQUIRED)
    seed: int = setting("Seed of the weights and of the batches.", REQUIRED)
    lr: float = setting("Peak learning rate.", REQUIRED, positive=True)
    data_parallel: int = setting("Data-parallel replicas D.", REQUIRED, minimum=1)
    checkpoint_every: int = setting("Checkpoint interval in steps.", REQUIRED, minimum=1)
    threads: int = setting("CPU threads per worker.", REQUIRED, minimum=1)
    timeout_s: float = setting("Limit on every distributed wait.", REQUIRED, positive=True)
    verify: bool = setting("Compared with a single-process reference.", REQUIRED)
    precision: str = setting("fp32, bf16 or fp16.", "fp32", choices=PRECISIONS)
    warmup_steps: int = setting("Linear warm-up steps.", 0, minimum=0)
    min_lr: float | None = setting("The floor of the cosine decay (None: lr, no decay).", minimum=0)
    decay_steps: int | None = setting("The step the decay reaches min_lr (None: steps); kept by --resume.", minimum=1)
    grad_clip: float = setting("The global-norm limit (0: measured, not clipped).", 0.0, minimum=0)
    accept_precision: bool = setting("Allowed a precision other than the plan's.", False)
    tensor_parallel: int = setting("Tensor-parallel processes T per stage.", 1, minimum=1)
    val_fraction: float = setting("The data's last part held out (0: none).", 0.0, minimum=0)
    eval_every: int = setting("Validation every N steps and after the last (0: never).", 0, minimum=0)
    log: list[str] | None = setting("Where each step's metrics go (`LOGS`; None: metrics.jsonl alone).")
    schedule: str | None = setting("The schedule walked instead of the plan's order (`schedule.schedule`, CSV text).")
    keep_checkpoints: int = setting("Complete checkpoints kept.", DEFAULT_KEEP_CHECKPOINTS, minimum=1)
    grace_s: float = setting("Seconds to save a checkpoint after a stop signal.", DEFAULT_GRACE_S, positive=True)
    max_restarts: int = setting("Restarts of all workers from the last checkpoint when one dies.", 0, minimum=0)
    token_dtype: str | None = setting("The type of a headerless .bin's ids (None: not given).", choices=TOKEN_DTYPES)
    init_from: str | None = setting("The weights the run started from (`train.init_from`; None: the seed's).")
    init_step: int | None = setting("The checkpoint of init_from read, when it is a run folder.", minimum=1)
    document_mask: bool = setting("Block-causal attention within packed documents (`data.step_documents`).", False)
    eos_id: int | None = setting("The id ending each document of a file that records none (document_mask).", minimum=0)
    val_data: str | None = setting("The validation loss's own file (None: the data's held-out part).")
    sampling: str = setting("How each step's windows are drawn (`SAMPLINGS`).", "random", choices=SAMPLINGS)
    data_mix: list[str] | None = setting("A mixture's sources, WEIGHT:PATH each, weights normalised (None: one).")
    track_memory: bool = setting(
        "The first step of each launch on a CPU tracked for its live bytes (engine.live).", False
    )
    loss_chunk_tokens: int | None = setting(
        "The last stage's head and loss tokens at a time (None: the plan's; 0: a tile's whole logits at once).",
        minimum=0,
    )
    controls: dict | None = setting(
        "The test-only switches set at its launch (`config.controls.Controls.record`; None: none, the correct run)."
    )
    data_fingerprints: dict | None = setting(
        "Each data file's fingerprint, path -> `corpus.identity.fingerprint`, checked by --resume (None: a run from "
        "before runs kept them; the embedded text has none)."
    )

    @classmethod
    def from_dict(cls, obj: dict, where: str) -> RunArguments:
        if "token_dtype" not in obj and str(obj.get("data")).endswith(".bin"):
            obj = {**obj, "token_dtype": "uint16"}  # a run from before --token-dtype read every .bin as uint16 ids
        old = {k: obj[k] for k in ("kv_handback", "tp_allreduce", "vocab_allreduce") if k in obj}
        if old:  # a run from before the switches were one record: each its own argument
            obj = {k: v for k, v in obj.items() if k not in old}
            obj["controls"] = Controls(**{k: bool(v) for k, v in old.items()}).record()
        return cls(**read_fields(cls, obj, where, prefix="arguments.", what="run argument"))

    @property
    def switches(self) -> Controls:
        """The run's test-only switches (`config.controls.Controls`; all off for a correct run)."""
        return Controls.of(self.controls)

    @property
    def optimizer(self) -> OptimizerConfig:
        """The run's AdamW settings, as `engine.optim.make_optimizer` takes them."""
        return component_of(OptimizerConfig, self)


def run_toml(args: RunArguments, *, plan: str, device: str, nnodes: int, rdzv_endpoint: str | None,
             rdzv_timeout_s: float) -> str:  # fmt: skip
    """The resolved configuration of a run as a ``[train]`` table for ``terapipe train --config`` (`RunConfig`'s
    fields; ``plan`` and the schedule file as the run folder names them). Only ``out`` (and ``node_rank``, which
    differs from machine to machine) is left for the new run."""
    config = RunConfig.of_run(
        args, plan=plan, schedule=None if args.schedule is None else SCHEDULE_FILE, device=device, nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint, rdzv_timeout_s=rdzv_timeout_s,
    )  # fmt: skip
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("out", "node_rank")}
    header = (
        "# The resolved settings of this run, written by `terapipe train`: train it again with\n"
        "#   terapipe train --config run.toml --out NEW_FOLDER\n"
        "# (paths are relative to this file; on several machines add --node-rank on each).\n"
    )
    comments = {"data": "the embedded text", "rdzv_endpoint": "one machine"}  # what each left out means
    return header + to_toml(TABLE, values, comments)


def resolve_logs(given: list[str] | None) -> list[str]:
    """``--log`` as a run keeps it: every value given (repeated, or comma lists) known, each once, in `LOGS` order,
    jsonl always; tensorboard only where its package is installed (an optional extra)."""
    names = {name.strip() for value in given or [] for name in value.split(",") if name.strip()}
    unknown = sorted(names - set(LOGS))
    if unknown:
        raise UserError(f"must be {', '.join(LOGS)} (repeat it, or a comma list), got {unknown[0]!r}", where="log")
    if "tensorboard" in names:
        require("tensorboard", where="log")
    return [name for name in LOGS if name in names or name == "jsonl"]


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate per step (1-based): ``warmup_steps`` linear steps up to ``lr``, cosine down to ``min_lr``
    at ``total_steps``, and ``min_lr`` after that (a run extended by ``--resume`` keeps the floor)."""

    lr: float
    total_steps: int
    warmup_steps: int
    min_lr: float

    @classmethod
    def default(
        cls, lr: float, total_steps: int, warmup_steps: int | None = None, min_lr: float | None = None
    ) -> LRSchedule:
        """The schedule with the defaults filled in and every value checked (one-line errors name the field)."""
        if not (lr > 0 and math.isfinite(lr)):
            raise UserError(f"must be a positive number, got {lr}", where="lr")
        if warmup_steps is None:
            # One warm-up step is too few for a short run: measured on a 6-layer model at lr 1e-3, 10 steps with
            # 1 warm-up step bumped the loss from 4.51 to 5.80 at step 4 (gradient norm 37.6); with 3, 4.54 to 4.65.
            floor = min(MIN_WARMUP_STEPS, max(1, total_steps // 3))
            warmup_steps = max(floor, round(WARMUP_FRACTION * total_steps))
        if warmup_steps < 0:
            raise UserError(f"must be 0 or more, got {warmup_steps}", where="warmup_steps")
        if min_lr is None:
            min_lr = MIN_LR_FRACTION * lr
        if not (0 <= min_lr <= lr and math.isfinite(min_lr)):
            raise UserError(f"must be between 0 and --lr ({lr:g}), got {min_lr:g}", where="min_lr")
        return cls(lr=float(lr), total_steps=int(total_steps), warmup_steps=int(warmup_steps), min_lr=float(min_lr))

    @classmethod
    def of_run(cls, args: RunArguments) -> LRSchedule:
        """The schedule of a run's resolved arguments (a run from before the schedule existed has a constant lr)."""
        min_lr = args.lr if args.min_lr is None else args.min_lr
        total = args.steps if args.decay_steps is None else args.decay_steps
        return cls(lr=args.lr, total_steps=total, warmup_steps=args.warmup_steps, min_lr=min_lr)

    def __call__(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)

    def note(self, steps: int) -> str | None:
        """One line on what the lr does over a run of ``steps`` when that is not a warm-up and then a decay that ends
        at the last step: a warm-up as long as the run or longer, a decay that ends after the run (a resumed run keeps
        its --decay-steps) or before it. None when the schedule fits the run."""
        if self.warmup_steps >= steps:
            top = self(steps)
            return (
                f"the warm-up ({self.warmup_steps} steps) is as long as the run ({steps} steps) or longer: the lr "
                f"climbs to {top:.3g} ({top / self.lr:.1%} of --lr {self.lr:g}) and never decays"
            )
        if self.min_lr == self.lr or self.total_steps == steps:
            return None
        if self.total_steps > steps:
            return (
                f"the cosine decay reaches --min-lr {self.min_lr:g} at step {self.total_steps} (--decay-steps, which a "
                f"resumed run keeps), after the run's last step {steps}: the lr ends at {self(steps):.3g}"
            )
        return (
            f"the cosine decay reaches --min-lr {self.min_lr:g} at step {self.total_steps} (--decay-steps, which a "
            f"resumed run keeps): the last {steps - self.total_steps} of the run's {steps} steps stay at it"
        )

    def to_dict(self) -> dict:
        return {
            "lr": self.lr,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "min_lr": self.min_lr,
        }
