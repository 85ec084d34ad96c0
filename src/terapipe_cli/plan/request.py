"""What to plan: a profile and the shape asked for (`PlanSetting`), checked against each other (`plan_request` ->
`PlanRequest`). Imports no torch.

A setting comes from a profile file and the options, or from an experiment file (docs/design.md §7,
`experiment_shape`) whose values the options given override; `terapipe plan` (cli/plan.py) reads the profile, or
estimates it for the experiment's hardware. Option errors name the command-line flag (``--stages``): that is the
name the user typed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from terapipe_cli.config.experiment import Experiment
from terapipe_cli.errors import UserError
from terapipe_cli.plan.costmodel import Profile
from terapipe_cli.plan.search import METHODS
from terapipe_cli.schedule.orders import DEFAULT_ORDER
from terapipe_cli.schedule.orders.zero_bubble import ZB_V
from terapipe_cli.schedule.partition import Partition, check_partition, refuses_tied
from terapipe_cli.schedule.schedule import ALL_ORDERS, order_of
from terapipe_cli.units import format_bytes

# How the plan's scheme is chosen: "formula", the exact optimum of the objective (docs/design.md §4); "simulated",
# the fastest in the simulator (§11) among that optimum and the schemes the search ranks next to it (`plan.choice`).
RANKS = ("simulated", "formula")
# How the layers are cut into chunks (`schedule.partition`): "balanced", the most even split by layers alone;
# "auto", the split the objective prices fastest, the embedding and the head counted (`plan.configs`).
PARTITIONS = ("auto", "balanced")
AUTO = "auto"


@dataclass(frozen=True)
class PlanSetting:
    """What `terapipe plan` plans on: a profile and the shape asked for (None: the profile's or the model's), from
    ``--profile`` and the options or from an experiment file."""

    profile: Profile
    profile_path: str | None  # what the plan records (absolute); None for a profile estimated on the fly
    stages: int
    batch_size: int
    data_parallel: int
    tensor_parallel: int | None
    token_step: int | None
    experiment: dict | None = None  # the plan's ``experiment`` record

    def request(self, **options) -> PlanRequest:
        """`plan_request` for this setting; ``options`` are the remaining ones (seq_len, epsilon, method, …)."""
        return plan_request(
            self.profile,
            stages=self.stages,
            batch_size=self.batch_size,
            data_parallel=self.data_parallel,
            tensor_parallel=self.tensor_parallel,
            token_step=self.token_step,
            **options,
        )


def stored_path(path: str | Path) -> str:
    """A path as a plan stores it: absolute, so a report or a run started from another folder finds the file."""
    return str(Path(path).absolute())


@dataclass(frozen=True)
class ExperimentShape:
    """An experiment's training shape with the options given over it: K, B per replica, D, T and g."""

    stages: int
    batch_size: int
    data_parallel: int
    tensor_parallel: int
    token_step: int
    record: dict  # the plan's ``experiment`` record: name, path, and the options that overrode the file


def experiment_shape(
    exp: Experiment,
    *,
    stages: int | None,
    batch_size: int | None,
    data_parallel: int | None,
    tensor_parallel: int | None,
    token_step: int | None,
) -> ExperimentShape:
    """The experiment's stages, data-parallel and tensor-parallel degrees and token step, each unless given; the
    batch per replica is ``batch_size`` if given, else the file's global batch over the data-parallel degree."""
    given = {"stages": stages, "data_parallel": data_parallel, "tensor_parallel": tensor_parallel}
    given.update(batch_size=batch_size, token_step=token_step)
    D = exp.data_parallel if data_parallel is None else data_parallel
    if batch_size is None and D >= 1 and exp.batch_size % D:
        raise UserError(
            f"{D} does not divide the global batch of {exp.batch_size} sequences of {exp.name}; give --batch",
            where="--data-parallel",
        )
    record = {
        "name": exp.name,
        "path": stored_path(exp.path),
        "overridden": {k: v for k, v in given.items() if v is not None},
    }
    return ExperimentShape(
        stages=exp.stages if stages is None else stages,
        batch_size=exp.batch_size // max(D, 1) if batch_size is None else batch_size,
        data_parallel=D,
        tensor_parallel=exp.tensor_parallel if tensor_parallel is None else tensor_parallel,
        token_step=exp.token_step if token_step is None else token_step,
        record=record,
    )


def experiment_setting(
    exp: Experiment, shape: ExperimentShape, profile: Profile, profile_path: str | Path | None
) -> PlanSetting:
    """The setting of an experiment's ``shape`` on ``profile`` (a file at ``profile_path``, which must be of the
    experiment's model, or None: the analytic estimate for its hardware)."""
    differs = None if profile_path is None else exp.model.difference(profile.model)
    if differs is not None:
        key, theirs, ours = differs
        raise UserError(
            f"is a profile of model {profile.model.name!r}, but {exp.name} trains {exp.model.name!r}: its field "
            f"'model.{key}' is {theirs!r}, the experiment's {ours!r}",
            where=str(profile_path),
        )
    s = shape
    stored = None if profile_path is None else stored_path(profile_path)
    return PlanSetting(
        profile, stored, s.stages, s.batch_size, s.data_parallel, s.tensor_parallel, s.token_step, s.record
    )


@dataclass(frozen=True)
class PlanRequest:
    """What to plan, checked against the profile; ``seq_len`` and ``token_step`` resolved to numbers."""

    stages: int
    batch_size: int
    seq_len: int
    token_step: int
    epsilon: float = 0.0
    method: str = "exact"
    data_parallel: int = 1
    memory_limit_gib: float | None = None
    tensor_parallel: int = 1
    order: str = DEFAULT_ORDER.name  # the schedule order the plan runs in (schedule.ALL_ORDERS)
    recompute: bool = False  # every stage re-runs its tiles' forward in their backward
    # Whether the planner may choose the order and which stages recompute to fit the memory limit (the user fixed
    # neither with --order / --recompute, --no-recompute).
    order_free: bool = True
    recompute_free: bool = True
    rank: str = "simulated"  # RANKS: how the plan's scheme is chosen among the exact search's best
    virtual: int | None = 1  # chunks per device v; None: the planner chooses (--virtual-stages auto)
    partition: Partition | None = None  # the layers of every chunk, fixed (--layers-per-stage)
    partition_mode: str = "balanced"  # PARTITIONS: how the layers are cut when ``partition`` is not fixed

    def with_config(self, partition: Partition, order: str | None = None) -> PlanRequest:
        """This request for one configuration: ``partition`` (and its v) fixed, and ``order`` if given."""
        changes = {"partition": partition, "virtual": partition.virtual, "partition_mode": "balanced"}
        if order is not None:
            changes.update(order=order, order_free=False)
        return replace(self, **changes)

    def fixed_partition(self, layers: int) -> Partition:
        """The partition of a request whose configuration is fixed: the given one, or the most even split."""
        if self.partition is not None:
            return self.partition
        virtual = self.virtual or 1
        return Partition.balanced(layers, self.stages, virtual, self.placement if virtual == 2 else "interleaved")

    @property
    def placement(self) -> str:
        """Where the chunks go: the order's placement when the order is fixed (ZB-V: the V), else interleaved."""
        return "interleaved" if self.order_free else order_of(self.order).placement


def plan_request(
    profile: Profile,
    *,
    stages: int,
    batch_size: int,
    seq_len: int | None = None,
    token_step: int | None = None,
    epsilon: float = 0.0,
    method: str = "exact",
    data_parallel: int = 1,
    memory_limit_gib: float | None = None,
    tensor_parallel: int | None = None,
    order: str | None = None,
    recompute: bool | None = None,
    rank: str = "simulated",
    virtual: int | str | None = 1,
    layers_per_stage: Sequence[int] | None = None,
    partition: str = "balanced",
) -> PlanRequest:
    """Check the options against each other and the profile; L, g and T default to the model's and the profile's.
    ``order`` and ``recompute`` None (or order "auto"): GPipe order without recomputation unless the memory limit or
    the simulator asks for more (`plan_for_profile`). ``virtual``: chunks per device, or "auto"/None for the planner
    to choose; ``layers_per_stage`` fixes every chunk's layers, else ``partition`` says how they are cut."""
    order = None if order == AUTO else order
    order_free, recompute_free = order is None, recompute is None
    order, recompute = order or DEFAULT_ORDER.name, bool(recompute)
    if order not in ALL_ORDERS:
        raise UserError(f"must be one of {', '.join(ALL_ORDERS + (AUTO,))}, got {order!r}", where="--order")
    model = profile.model
    if stages < 1:
        raise UserError(f"must be at least 1, got {stages}", where="--stages")
    if batch_size < 1:
        raise UserError(f"must be at least 1, got {batch_size}", where="--batch")
    if data_parallel < 1:
        raise UserError(f"must be at least 1, got {data_parallel}", where="--data-parallel")
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise UserError(f"must be a non-negative number of seconds, got {epsilon}", where="--epsilon")
    if memory_limit_gib is not None and not (memory_limit_gib > 0 and math.isfinite(memory_limit_gib)):
        raise UserError(f"must be a positive number of GiB, got {memory_limit_gib}", where="--memory-limit")
    if method not in METHODS:
        raise UserError(f"must be 'exact' or 'enumerate', got {method!r}", where="--method")
    if rank not in RANKS:
        raise UserError(f"must be one of {', '.join(RANKS)}, got {rank!r}", where="--rank")
    source = profile.path or "the profile"
    if stages > model.layers:
        raise UserError(
            f"{stages} stages are more than the {model.layers} layers of model {model.name} (in {source})",
            where="--stages",
        )
    placement = "interleaved" if order_free else order_of(order).placement
    if placement == "v":
        virtual = _check_on_the_v(profile, stages, virtual)
    virtual, fixed = _virtual_and_partition(model.layers, stages, virtual, layers_per_stage, partition, placement)
    L = model.seq_len if seq_len is None else seq_len
    g = profile.token_step if token_step is None else token_step
    if L < 1:
        raise UserError(f"must be at least 1, got {L}", where="--seq-len")
    if L > model.seq_len:
        raise UserError(f"{L} is longer than the model's seq_len {model.seq_len} (in {source})", where="--seq-len")
    if g < 1:
        raise UserError(f"must be at least 1, got {g}", where="--token-step")
    if L % g:
        raise UserError(f"the sequence length {L} is not a multiple of the token step {g}", where="--token-step")
    T = check_tensor_parallel(profile, tensor_parallel)
    return PlanRequest(
        stages,
        batch_size,
        L,
        g,
        epsilon,
        method,
        data_parallel,
        memory_limit_gib,
        T,
        order,
        recompute,
        order_free,
        recompute_free,
        rank,
        virtual,
        fixed,
        partition,
    )


def _check_on_the_v(profile: Profile, stages: int, virtual) -> int | str | None:
    """``--order zbv`` checked against the model and the other options: ZB-V runs two chunks per device in a V (device
    k holds chunks k and 2K − 1 − k), so device 0 holds both the embedding and the head. ``virtual`` as given, once
    it is 2 or auto."""
    model = profile.model
    if model.tie_embeddings and refuses_tied(ZB_V.placement):
        raise UserError(
            f"zbv puts the embedding and the LM head on device 0 (the V), which a model with tied embeddings "
            f"({model.name}, in {profile.path or 'the profile'}) cannot run yet; use --order zb1p (the split "
            "backward on one chunk per device), 1f1b or gpipe",
            where="--order",
        )
    if virtual not in (None, AUTO) and _whole(virtual) not in (2, None):
        raise UserError(
            f"must be 2 (or auto) with --order zbv, which runs two chunks per device in a V, got {virtual}; for "
            "another number of chunks per device use --order zb1p, 1f1b or gpipe",
            where="--virtual-stages",
        )
    if 2 * stages - 2 > model.layers:
        most = (model.layers + 2) // 2
        raise UserError(
            f"{stages} stages with --order zbv make {2 * stages} chunks (two per device, in a V), which need at least "
            f"{2 * stages - 2} layers (every chunk but the first and the last holds one); model {model.name} has "
            f"{model.layers}: use --stages {most} or fewer, or --order zb1p, 1f1b or gpipe",
            where="--stages",
        )
    return virtual


def _whole(value) -> int | None:
    """``value`` as a whole number; None when it is none (`_virtual_and_partition` says so in its line)."""
    try:
        return int(value)
    except ValueError:
        return None


def _virtual_and_partition(
    layers: int, stages: int, virtual, layers_per_stage, partition: str, placement: str = "interleaved"
) -> tuple[int | None, Partition | None]:
    """``--virtual-stages`` (a whole number, or "auto": None) and ``--layers-per-stage`` checked against each other:
    v and the fixed partition (None: chosen as ``partition`` says), on ``placement`` (the V: the layers of ZB-V's
    chunks, in model order)."""
    if partition not in PARTITIONS:
        raise UserError(f"must be one of {', '.join(PARTITIONS)}, got {partition!r}", where="--partition")
    if virtual in (None, AUTO):
        virtual = None
    elif isinstance(virtual, str):
        try:
            virtual = int(virtual)
        except ValueError:
            raise UserError(f"must be a whole number or auto, got {virtual!r}", where="--virtual-stages") from None
    if virtual is not None and virtual < 1:
        raise UserError(f"must be at least 1, got {virtual}", where="--virtual-stages")
    if virtual is not None and stages * virtual - 2 > layers:
        raise UserError(
            f"{stages} x {virtual} chunks need at least {stages * virtual - 2} layers (every chunk but the first and "
            f"the last holds one), the model has {layers}",
            where="--virtual-stages",
        )
    if layers_per_stage is None:
        return virtual, None
    counts = list(layers_per_stage)
    if virtual is None:
        virtual = 2 if placement == "v" else max(len(counts) // stages, 1)
    fixed = check_partition(
        counts, layers=layers, devices=stages, virtual=virtual, where="--layers-per-stage", placement=placement
    )
    return virtual, fixed


def check_tensor_parallel(profile: Profile, tensor_parallel: int | None) -> int:
    """T asked for (None: the profile's) must divide the model's heads and be the T the profile's times are for:
    a profile's tile times, parameters and activations are those of one device of a stage's T."""
    have = profile.tensor_parallel
    if tensor_parallel is None:
        return have
    model = profile.model
    model.check_tensor_parallel(tensor_parallel, where="--tensor-parallel")
    if tensor_parallel != have:
        how = "measured" if profile.source == "measured" else "estimated"
        hardware = profile.device.get("hardware_file") or "HARDWARE.toml"
        raise UserError(
            f"{tensor_parallel} asked for, but {profile.path or 'the profile'} was {how} at tensor parallelism "
            f"{have}; make a profile at {tensor_parallel}: `terapipe profile --model {profile.model_argument} "
            f"--tensor-parallel {tensor_parallel}` (measured here) or `terapipe profile --analytic --hardware "
            f"{hardware} --model {profile.model_argument} --tensor-parallel {tensor_parallel}`",
            where="--tensor-parallel",
        )
    return have


# Bounds on the planner's work (docs/design.md §5), checked before anything is allocated. A plan holds about
# DP_BYTES_PER_CELL bytes per (batch-slice row, prefix, slice length) cell: the DP tables of `search.solve` alone are
# 22.5–29 bytes (tracemalloc, rows 4–64, L/g 128–512: two float64 tables, a bool mask, the probes' rows), but the whole
# `terapipe plan` with every choice left to it (partitions, v, orders, recomputation, the memory pass) peaks at about
# 200: its maximum RSS (/usr/bin/time) grew 196–197 bytes per added cell with one row (Llama 3 8B at L = 131072,
# analytic H100 bf16, K = 8, B = 1, L/g 512 → 1024 → 2048) and 183 per row-cell with four (B = 4, L/g 256 → 512).
# They may take at most DP_MEMORY_FRACTION of the memory available. MAX_BATCH bounds the sequences per replica: the
# batch knapsack and the schedules of the baselines grow with it (B = 32768 took 34 s in the knapsack alone), while
# the pipelines of the published settings plan 2 to 128 sequences per replica.
DP_BYTES_PER_CELL = 200
DP_MEMORY_FRACTION = 0.5
MAX_BATCH = 8192


def dp_bytes(rows: int, units: int) -> float:
    """The DP tables' bytes for ``rows`` batch-slice sizes and L/g = ``units`` token steps."""
    return DP_BYTES_PER_CELL * rows * (units + 1) ** 2


def check_work(profile: Profile, request: PlanRequest, available_bytes: int | None) -> None:
    """Refuse, in one line with the limit and a way round, a plan whose search would exceed this machine: more than
    `MAX_BATCH` sequences per replica, or DP tables larger than `DP_MEMORY_FRACTION` of ``available_bytes``."""
    r = request
    if r.batch_size > MAX_BATCH:
        raise UserError(
            f"{r.batch_size} sequences per replica is more than the planner takes ({MAX_BATCH}); plan the replicas' "
            f"share with data parallelism (-d D plans B/D each), or a smaller batch",
            where="--batch",
        )
    if not available_bytes:
        return
    rows = min(r.batch_size, max(profile.batch_sizes))  # batch slices beyond the profile's are not searched
    units = r.seq_len // r.token_step
    budget = DP_MEMORY_FRACTION * available_bytes
    need = dp_bytes(rows, units)
    if need <= budget:
        return
    steps = [g for g in range(r.token_step, r.seq_len + 1, r.token_step) if r.seq_len % g == 0]
    fits = next((g for g in steps if dp_bytes(rows, r.seq_len // g) <= budget), None)
    way = f"use --token-step {fits} or more" if fits else "plan a shorter sequence"
    raise UserError(
        f"the search over {rows} batch-slice sizes x {units} token steps (L/g = {r.seq_len}/{r.token_step}) needs "
        f"about {format_bytes(need)}, more than the {format_bytes(budget)} it may take here (half of the memory "
        f"available); {way}",
        where="--token-step",
    )
