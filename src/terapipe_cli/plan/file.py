"""The plan: a slicing scheme and everything needed to run it. Schema ``terapipe.plan/1``. Imports no torch.

A *scheme* is a list of batch slices, each ``(b, [token slice lengths])`` (docs/design.md §2). The stable keys other
tools read are ``schema, model, stages, batch_size, seq_len, token_step, slices, predicted_s, t_max_s,
baselines.{gpipe,uniform}.{slices,predicted_s}, solver, profile, precision, tensor_parallel``; other fields may
be added freely. ``precision`` is the compute precision the plan was priced at (the profile's); a plan without it is
fp32. ``tensor_parallel`` is T, the processes of each stage (the profile's; 1 when absent): `terapipe train` runs
D·K·T workers. A plan made with `terapipe plan --experiment` also records ``experiment`` (the file's name and path).
A plan with ``data_parallel`` > 1 made by `terapipe plan` also has ``data_parallel_allreduce``: ``{"priced":
true, "seconds": s, "link": {...}}`` when the profile priced the replicas' gradient all-reduce, or ``{"priced":
false, "seconds": null, "why": "unknown — not priced: ..."}`` when the profile has no ``data_parallel_link``
(or no ``params_per_layer``) and the plan was made without it (docs/design.md §8).
``profile`` names the profile the plan was priced by: ``path``, ``sha256``, ``source``, ``device``, ``kind`` (cpu or
cuda), ``created`` (the profile's), ``provenance`` (where its numbers come from, in words,
`plan.domain.provenance`), for analytic profiles ``hardware_file`` and ``constants``, and ``domain``
(``batch_slices``: the smallest and largest batch slice priced;
``grid``: the file's batch sizes; ``added``: sizes an analytic profile was priced at beyond them). Each baseline has
``peak_bytes`` (its fullest stage's estimated peak in the plan's order and recomputation) and ``exceeds_limit``. A
plan that runs a baseline (`terapipe plan --scheme`, or the report's GPipe run) says ``scheme`` ("gpipe" or
"uniform") and its ``microbatch``. ``attention`` says how tiles' attention was priced: ``{"context": "prefix"}``
(the whole prefix, full causal attention) or, for `terapipe plan --data CORPUS`, ``{"context": "documents",
"corpus", "documents", "mean_document_tokens"}`` (the context a tile attends over the corpus's packed documents,
`plan.documents`); absent in plans made before it (the prefix).
``layers_per_stage`` lists the decoder layers of every chunk (K·v of them, in model order) and ``virtual_stages`` is v,
the chunks per device (`schedule.partition`); a plan without them has v = 1 and N/K layers per stage. ``recompute`` then
has one entry per chunk.
``loss_chunk_tokens`` is the tokens the last stage's LM head and cross-entropy run at a time, forward and backward
(their logits never all at once: `engine.loss`), chosen by the memory plan (`plan.memory.planned_loss_chunk_tokens`;
``terapipe train --loss-chunk-tokens`` overrides it; 0: a tile's whole logits at once; absent: the runtime's default).
``order`` is the schedule order every stage walks, by name (`schedule.orders`: GPipe's, all forwards then all
backwards, when absent; 1F1B, ZB-H1, ZB-V); ``recompute``
lists, per stage, whether its tiles re-run their forward inside their backward instead of keeping activations
(absent: none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from terapipe_cli.config.bundled import bundled_names
from terapipe_cli.config.device import precision_field
from terapipe_cli.config.hardware import load_hardware
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_json_with_schema, write_json_atomic
from terapipe_cli.models import ModelConfig
from terapipe_cli.schedule.orders import DEFAULT_ORDER, order_of
from terapipe_cli.schedule.partition import PLACEMENTS, Partition, check_partition, refuses_tied
from terapipe_cli.schedule.schedule import ALL_ORDERS

PLAN_SCHEMA = "terapipe.plan/1"

Slices = list[tuple[int, list[int]]]


def normalize_slices(slices: Sequence, *, where: str = "slices") -> Slices:
    """Turn ``[[b, [l, ...]], ...]`` (JSON) or tuples into ``[(b, [l, ...]), ...]``; check types only."""
    out: Slices = []
    if not isinstance(slices, (list, tuple)) or not slices:
        raise UserError("must be a non-empty list of [batch size, [token slice lengths]]", where=where)
    for d, entry in enumerate(slices):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise UserError(f"entry {d} must be [batch size, [token slice lengths]], got {entry!r}", where=where)
        b, lengths = entry
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise UserError(f"entry {d}: batch size must be a positive integer, got {b!r}", where=where)
        if not isinstance(lengths, (list, tuple)) or not lengths:
            raise UserError(f"entry {d}: token slices must be a non-empty list, got {lengths!r}", where=where)
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise UserError(f"entry {d}: token slice lengths must be positive integers, got {n!r}", where=where)
        out.append((int(b), [int(n) for n in lengths]))
    return out


def check_slices(slices: Slices, *, seq_len: int, batch_size: int, where: str = "slices") -> None:
    """Every batch slice's token slices sum to L, and the batch slices sum to B (docs/design.md §9)."""
    for d, (_, lengths) in enumerate(slices):
        if sum(lengths) != seq_len:
            raise UserError(
                f"batch slice {d}: token slices sum to {sum(lengths)}, expected the sequence length {seq_len}",
                where=where,
            )
    total = sum(b for b, _ in slices)
    if total != batch_size:
        raise UserError(f"batch slices sum to {total} sequences, expected the batch size {batch_size}", where=where)


def short_form(slices: Sequence, *, fold: bool = False) -> str:
    """``[(1, [776, 640, 632])] * 16``; runs of equal batch slices are folded, different ones joined by +.

    With ``fold``, runs of three or more equal token slices are folded too (``[(1, [72]*24 + [64]*5)] * 2``):
    long DP schemes are mostly such runs. Either way the text is a Python expression equal to the scheme.
    """
    parts: list[str] = []
    k = 0
    while k < len(slices):
        run = 1
        while k + run < len(slices) and _same(slices[k + run], slices[k]):
            run += 1
        b, lengths = slices[k]
        lengths = [int(n) for n in lengths]
        body = f"[({b}, {_fold_runs(lengths) if fold else str(lengths)})]"
        parts.append(body if run == 1 else f"{body} * {run}")
        k += run
    return " + ".join(parts)


def _fold_runs(lengths: list[int]) -> str:
    """``[72, 72, 72, 64]`` -> ``[72]*3 + [64]``."""
    parts: list[str] = []
    singles: list[int] = []
    k = 0
    while k < len(lengths):
        n = 1
        while k + n < len(lengths) and lengths[k + n] == lengths[k]:
            n += 1
        if n >= 3:
            if singles:
                parts.append(str(singles))
                singles = []
            parts.append(f"[{lengths[k]}]*{n}")
        else:
            singles.extend(lengths[k : k + n])
        k += n
    if singles:
        parts.append(str(singles))
    return " + ".join(parts)


def _same(x, y) -> bool:
    return x[0] == y[0] and list(x[1]) == list(y[1])


@dataclass(frozen=True)
class Plan:
    """A validated plan file."""

    model: ModelConfig
    stages: int
    batch_size: int
    seq_len: int
    token_step: int
    slices: Slices
    predicted_s: float | None = None
    data_parallel: int = 1
    precision: str = "fp32"  # the profile's: the precision `terapipe train` must run at
    tensor_parallel: int = 1  # T: processes per stage, splitting heads and the MLP (the profile's)
    order: str = DEFAULT_ORDER.name  # the schedule order, one of schedule.ALL_ORDERS
    recompute: tuple[bool, ...] = ()  # per chunk: recompute its tiles' forward in the backward (empty: none)
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    path: str | None = None
    partition: Partition | None = None  # the layers of each chunk (None: N/K each, v = 1)
    # The tokens the last stage's head and loss run at a time (`engine.loss`; 0: a tile's whole logits at once; None:
    # a plan from before it, the runtime's default)
    loss_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.partition is None:
            object.__setattr__(self, "partition", Partition.even_split(self.model.layers, self.stages))

    @property
    def virtual_stages(self) -> int:
        return self.partition.virtual

    @property
    def chunks(self) -> int:
        """K·v: the pipeline's chunks (virtual stages)."""
        return self.partition.chunks

    def short_form(self) -> str:
        return short_form(self.slices)


def plan_from_dict(obj: dict, where: str) -> Plan:
    if obj.get("schema") != PLAN_SCHEMA:
        raise UserError(f"field 'schema' is {obj.get('schema')!r}, expected {PLAN_SCHEMA!r}", where=where)
    f = Fields(obj, where)
    model_obj = f.get("model")
    if not isinstance(model_obj, dict):
        raise f.fail("model", "must be an object")
    model = ModelConfig.from_dict(model_obj, where)
    stages = f.int("stages", minimum=1)
    partition = _partition(f, model, stages, where)
    batch_size = f.int("batch_size", minimum=1)
    seq_len = f.int("seq_len", minimum=1)
    token_step = f.int("token_step", minimum=1, default=1)
    if seq_len > model.seq_len:
        raise f.fail("seq_len", f"is {seq_len}, longer than the model's seq_len {model.seq_len}")
    slices = normalize_slices(f.get("slices"), where=f"{where}: field 'slices'")
    check_slices(slices, seq_len=seq_len, batch_size=batch_size, where=f"{where}: field 'slices'")
    predicted = obj.get("predicted_s")
    if predicted is not None:
        predicted = f.number("predicted_s", minimum=0)
    return Plan(
        model=model,
        stages=stages,
        batch_size=batch_size,
        seq_len=seq_len,
        token_step=token_step,
        slices=slices,
        predicted_s=predicted,
        data_parallel=f.int("data_parallel", minimum=1, default=1),
        precision=precision_field(f),
        tensor_parallel=_tensor_parallel(f, model, where),
        order=_order(f),
        recompute=_recompute(f, partition.chunks),
        raw=obj,
        path=where,
        partition=partition,
        loss_chunk_tokens=f.int("loss_chunk_tokens", minimum=0) if obj.get("loss_chunk_tokens") is not None else None,
    )


def _partition(f: Fields, model: ModelConfig, stages: int, where: str) -> Partition:
    """``layers_per_stage`` (one count per chunk) over ``virtual_stages`` (absent: 1), or the even split; placed as
    ``placement`` says (absent: the order's — the V for ZB-V — else interleaved)."""
    virtual = f.int("virtual_stages", minimum=1, default=1)
    counts = f.get("layers_per_stage", None)
    order = f.get("order", DEFAULT_ORDER.name)
    placement = f.get("placement", order_of(order).placement if order in ALL_ORDERS else "interleaved")
    if placement not in PLACEMENTS:
        raise f.fail("placement", f"must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if order in ALL_ORDERS and order_of(order).placement != placement:
        raise f.fail(
            "placement", f"order {order!r} runs on the {order_of(order).placement} placement, not {placement!r}"
        )
    if refuses_tied(placement) and model.tie_embeddings:
        raise f.fail("placement", "the V placement with tied embeddings is not supported yet (both ends on device 0)")
    if counts is None:
        if virtual == 1 and placement == "interleaved":
            return Partition.even_split(model.layers, stages, where=f"{where}: field 'stages'", name=model.name)
        counts = Partition.balanced(model.layers, stages, virtual).to_list()
    return check_partition(
        counts, layers=model.layers, devices=stages, virtual=virtual, where=f"{where}: field 'layers_per_stage'",
        placement=placement,
    )  # fmt: skip


def _tensor_parallel(f: Fields, model: ModelConfig, where: str) -> int:
    t = f.int("tensor_parallel", minimum=1, default=1)
    model.check_tensor_parallel(t, where=f"{where}: field 'tensor_parallel'")
    return t


def _order(f: Fields) -> str:
    order = f.get("order", DEFAULT_ORDER.name)
    if order not in ALL_ORDERS:
        raise f.fail("order", f"must be one of {', '.join(ALL_ORDERS)}, got {order!r}")
    return order


def _recompute(f: Fields, chunks: int) -> tuple[bool, ...]:
    """One bool per chunk: per stage with v = 1 (absent: none recompute)."""
    value = f.get("recompute", None)
    if value is None:
        return (False,) * chunks
    if not isinstance(value, list) or len(value) != chunks or not all(isinstance(v, bool) for v in value):
        raise f.fail("recompute", f"must be a list of {chunks} booleans (one per stage), got {value!r}")
    return tuple(value)


def replan_advice(plan: Plan, precision: str) -> str:
    """How to get a plan made for ``precision`` instead of ``plan`` (made for another), in words that fit how its
    profile was made: a measured one is measured again at that precision; an analytic one is estimated again from a
    hardware file that prices it (a hardware file prices one precision, its ``[training] dtype``: `terapipe profile
    --analytic --precision` cannot change it), a bundled one of the same device where there is one."""
    profile = plan.raw.get("profile") if isinstance(plan.raw.get("profile"), dict) else {}
    model = plan.model.name
    tensor = f" --tensor-parallel {plan.tensor_parallel}" if plan.tensor_parallel > 1 else ""
    if profile.get("source") != "analytic":
        return f"re-profile with `terapipe profile --precision {precision} --model {model}{tensor}` and plan again"
    hardware = _bundled_hardware(profile.get("device"), precision)
    if hardware is None:
        return (
            f"plan again on an analytic profile of a hardware file whose [training] dtype is {precision} "
            f"(`terapipe profile --analytic --hardware FILE --model {model}{tensor}`)"
        )
    return (
        f"plan again on an analytic profile in {precision}: `terapipe profile --analytic --hardware {hardware} "
        f"--model {model}{tensor}`, then `terapipe plan` on it"
    )


def _bundled_hardware(device: object, precision: str) -> str | None:
    """The first bundled hardware file of the GPU named ``device`` that prices ``precision`` (None: none does)."""
    for name in bundled_names("hardware"):
        hardware = load_hardware(name)
        if hardware.device.name == device and hardware.training.dtype == precision:
            return name
    return None


def read_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (one clear error naming the file and field)."""
    return plan_from_dict(read_json_with_schema(path, PLAN_SCHEMA, "plan"), str(path))


def write_plan(path: str | Path, obj: dict) -> Path:
    """Validate, then write atomically."""
    plan_from_dict(obj, str(path))
    return write_json_atomic(path, obj)


def make_plan_dict(
    *,
    model: ModelConfig,
    stages: int,
    batch_size: int,
    seq_len: int,
    token_step: int,
    slices: Slices,
    predicted_s: float | None = None,
    data_parallel: int = 1,
    precision: str = "fp32",
    tensor_parallel: int = 1,
    order: str = DEFAULT_ORDER.name,
    recompute: Sequence[bool] | None = None,
    partition: Partition | None = None,
    **extra,
) -> dict:
    """The plan object, for `terapipe plan` and for hand-made schemes (tests, baselines, the report's GPipe
    run); ``precision`` and ``tensor_parallel`` are the ones the plan's times are for."""
    slices = [[int(b), [int(n) for n in lengths]] for b, lengths in slices]
    obj = {
        "schema": PLAN_SCHEMA,
        "model": model.to_dict(),
        "stages": stages,
        "data_parallel": data_parallel,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "token_step": token_step,
        "slices": slices,
        "short_form": short_form(slices),
        "predicted_s": predicted_s,
        "precision": precision,
        "tensor_parallel": tensor_parallel,
        "order": order,
    }
    chunks = len(extra.get("layers_per_stage", ())) or stages if partition is None else partition.chunks
    obj["recompute"] = [bool(r) for r in recompute] if recompute is not None else [False] * chunks
    if partition is not None:
        obj["layers_per_stage"] = partition.to_list()
        obj["virtual_stages"] = partition.virtual
        if partition.placement != "interleaved":
            obj["placement"] = partition.placement
    obj.update(extra)
    return obj
