"""The cost model t(b, i, j) of docs/design.md §3, built from a ``terapipe.profile/3`` (or ``/2``, ``/1``) file.
Imports no torch.

    t(b, i, j) = ℓ · [ t_nc(b, i) + t_ctx(b, i, j) ] + comm(b, i)

* ``t_nc(b, i)``: per-layer forward + backward time with no context, measured on a grid of batch sizes
  and token lengths and interpolated piecewise-linearly between grid points (linearly extrapolated above
  the grid, held at the smallest measured point below it).
* ``t_ctx(b, i, j) = a0 + a1·b·i + a2·b·j + a3·b·i·j`` for j > 0 (zero for j = 0), forward and backward
  fitted separately; clipped at zero because context never makes a layer faster.
  With packed documents masked (``terapipe plan --data CORPUS``: `Profile.attended`, `plan.documents`), j is the
  context a tile is expected to attend instead of its whole prefix.
* ``comm(b, i)``: the activation sent forward and its gradient sent back, each ``latency + bytes/bandwidth``
  with ``bytes = b·i·hidden·dtype_bytes``; zero when there is one stage.

The profile format (every field is checked by `read_profile`):

    {
      "schema": "terapipe.profile/3",                 or "terapipe.profile/2": the same without "memory";
                                                       "terapipe.profile/1": also without the two
                                                       backward_*_s grids below
      "source": "measured" | "analytic" | "operators" | "example",   how the numbers were obtained
      "note": "...",                                   free text (e.g. how an example was made)
      "created": "2026-11-21T20:00:00Z",
      "device": {"kind": "cpu" | "cuda", "name": "...", "tensor_parallel": T, ...},
                                                       T (optional, absent: 1): the tensor-parallel degree
                                                       the times are for; every number below is then
                                                       per device, one of the T ranks of a stage
      "model": {"name", "layers", "hidden", "heads", "vocab", "seq_len"},
      "precision": "fp32" | "bf16" | "fp16",          optional (absent: fp32): the compute precision timed
      "dtype_bytes": 4,                                bytes per element of what is sent between devices
      "token_step": 8,                                 the grid step the times were taken on
      "batch_sizes": [1, 2, 4],                        ascending
      "token_lengths": [8, 16, ...],                   ascending
      "forward_s":  [[per-layer seconds per token length] per batch size],
      "backward_s": [[...] per batch size],
      "backward_input_s":  [[...] per batch size],    schema /2: a tile's backward as the runtime's split runs it
      "backward_weight_s": [[...] per batch size],    (docs/design.md §11b): I (the input's and the K/V cache's
                                                       gradients) and W (the weights'), per layer, no context; the
                                                       split's two calls can cost more than backward_s together.
                                                       A tile's context adds to its I alone (the context term of
                                                       "backward": attention's backward and the K/V hand-back; W's
                                                       products run over the tile's own rows). A /1 profile's
                                                       backward is split by the architecture's analytic I : W
                                                       ratio (`Profile.split_grids`)
      "context": {"forward":  {"coef": [a0, a1, a2, a3], "heldout_rel_err_mean": e, "heldout_rel_err_max": e},
                  "backward": {...}},
      "comm": {"latency_s": s, "bytes_per_s": x},
      "optimizer_s_per_layer": s,                      optional: one optimizer step of one layer's weights
      "activation_bytes_per_token_per_layer": n,       optional
      "step_overhead_s": s,                            optional: any other fixed time per training step
      "params_per_layer": n,                           optional: parameters of one decoder layer (per device:
                                                       one tensor rank's share)
      "vocab_parallel": true,                          optional (absent: false): the token embedding and the LM
                                                       head are split over the T tensor ranks by vocabulary rows
                                                       (Megatron's split, engine/tensor.py), as the runtime runs
                                                       them; the memory estimate then counts each device's share
                                                       of their parameters and of the logits (`plan.memory`).
                                                       Absent in profiles made before the runtime split them,
                                                       which keep the whole-vocabulary estimate
      "data_parallel_link": {"latency_s": s, "bytes_per_s": x}
                                                       optional: one step of the ring all-reduce the
                                                       data-parallel replicas run (measured by `terapipe
                                                       profile`, or estimated from a hardware file)
      "hardware_config": {...}                         analytic profiles: the hardware file's tables as estimated
                                                       from (`config.hardware.hardware_to_dict`), so that `terapipe
                                                       plan` can price it again at other batch sizes; device.
                                                       ``hardware_file`` and ``constants`` ("estimated" or
                                                       "calibrated") say where it came from (`plan.domain`)
      "memory": {...}                                  schema /3, optional: what a stage keeps and the peaks of
                                                       its actions, traced from the runtime's code on fake tensors
                                                       (`terapipe profile --memory-trace`; the format: `plan.traced`);
                                                       without it the memory estimate uses `plan.memory`'s formulas
      "extended": {"from_batch_sizes": [...], "added": [...]}
                                                       only in memory: a profile priced again beyond its file's
                                                       grid (`profile.analytic.extended_for_batch`)
    }

The grid is the profile's domain: the planner prices no batch slice outside ``batch_sizes`` (`plan.domain`).

With ``data_parallel = D > 1`` the per-step constant also holds the ring all-reduce of a stage's gradients:
``2(D−1)·latency + 2(D−1)/D · bytes / bandwidth`` with ``bytes = ℓ · params_per_layer · dtype_bytes``. A
profile without ``params_per_layer`` or ``data_parallel_link`` still plans with D > 1: the all-reduce is then
left out of the price (zero), and `CostModel.allreduce_unpriced` says why, for the plan to record it.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from terapipe_cli.config.device import precision_field
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_json_with_schema
from terapipe_cli.models import ModelConfig, backward_input_share, vocab_share
from terapipe_cli.plan.documents import AttendedContext
from terapipe_cli.plan.traced import TracedMemory, traced_from_dict
from terapipe_cli.schedule import memo
from terapipe_cli.schedule.partition import Partition

PROFILE_SCHEMA = "terapipe.profile/3"  # what `terapipe profile` writes
# What the reader takes: /1 has no I and W grids, /2 no traced memory (``memory``, which /3 may hold).
PROFILE_SCHEMAS = ("terapipe.profile/1", "terapipe.profile/2", PROFILE_SCHEMA)
# The LM head's share of its backward in I: all of it. The chunked head (engine/loss.py) makes each chunk's logits
# again and computes its input's and its weight's gradient from them in the same pass, in I; its W has nothing left
# (making the logits again in W would repeat the head's largest product). The ends are timed whole in every schema.
HEAD_INPUT_SHARE = 1.0
# Of each end's backward, the share in each part of `Profile.only` (embedding, head).
_END_BACKWARDS = {
    "forward": (0.0, 0.0),
    "backward": (1.0, 1.0),
    "input": (0.0, HEAD_INPUT_SHARE),
    "weight": (1.0, 1.0 - HEAD_INPUT_SHARE),
}
PROFILE_SOURCES = ("measured", "analytic", "operators", "example")


def context_terms(b, i, j) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four terms the context coefficients multiply: 1, b·i, b·j, b·i·j (the fit's feature columns)."""
    b, i, j = (np.asarray(x, dtype=float) for x in (b, i, j))
    bi = b * i
    return np.ones_like(bi), bi, b * j, bi * j


def context_seconds(coef: tuple[float, float, float, float], b, i, j) -> np.ndarray:
    """t_ctx = a0 + a1·b·i + a2·b·j + a3·b·i·j for j > 0, zero for j = 0, never negative.

    Clipped at zero because context never makes a layer faster.
    """
    a0, a1, a2, a3 = coef
    _, bi, bj, bij = context_terms(b, i, j)
    t = a0 + a1 * bi + a2 * bj + a3 * bij
    return np.where(np.asarray(j) > 0, np.maximum(t, 0.0), 0.0)


def ring_allreduce_seconds(nbytes, ranks: int, *, latency_s: float, bytes_per_s: float) -> np.ndarray:
    """Ring all-reduce of ``nbytes`` over ``ranks`` peers: 2(r−1) steps, each moving nbytes/r.

    ``2(r−1)·latency + 2(r−1)/r · bytes / bandwidth``; zero for a single rank.
    """
    nbytes = np.asarray(nbytes, dtype=float)
    if ranks <= 1:
        return np.zeros_like(nbytes)
    steps = 2 * (ranks - 1)
    return steps * latency_s + steps / ranks * nbytes / bytes_per_s


def ring_link_from_allreduce(latency_s: float, bytes_per_s: float, ranks: int) -> tuple[float, float]:
    """The per-step link (latency, bandwidth) for which `ring_allreduce_seconds` over ``ranks`` peers takes
    ``latency_s + bytes / bytes_per_s``, the time of a whole all-reduce as measured: the latency divided by
    the 2(r−1) steps, the bandwidth multiplied by 2(r−1)/r."""
    if ranks < 2:
        raise ValueError(f"ring_link_from_allreduce: needs at least 2 ranks, got {ranks}")
    steps = 2 * (ranks - 1)
    return latency_s / steps, bytes_per_s * steps / ranks


@dataclass(frozen=True)
class ContextFit:
    """t_ctx = a0 + a1·b·i + a2·b·j + a3·b·i·j (seconds, per layer)."""

    coef: tuple[float, float, float, float]
    heldout_rel_err_mean: float | None = None
    heldout_rel_err_max: float | None = None

    def __call__(self, b: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return context_seconds(self.coef, b, i, j)


@dataclass(frozen=True)
class Profile:
    """A validated ``terapipe.profile/3`` (or ``/2``, ``/1``)."""

    model: ModelConfig
    source: str
    device: dict
    dtype_bytes: int
    token_step: int
    batch_sizes: tuple[int, ...]
    token_lengths: tuple[int, ...]
    forward_s: np.ndarray  # (len(batch_sizes), len(token_lengths)) seconds per layer
    backward_s: np.ndarray
    context_forward: ContextFit
    context_backward: ContextFit
    latency_s: float
    bytes_per_s: float
    optimizer_s_per_layer: float = 0.0
    activation_bytes_per_token_per_layer: float | None = None
    step_overhead_s: float = 0.0
    params_per_layer: float | None = None
    dp_latency_s: float | None = None
    dp_bytes_per_s: float | None = None
    precision: str = "fp32"  # the compute precision the times are for (docs/design.md §6a)
    tensor_parallel: int = 1  # device.tensor_parallel: the T the times are for, per device of a stage's T
    vocab_parallel: bool = False  # the embedding and the head split over the T ranks by vocabulary rows
    ends: Ends | None = None  # the embedding and the head (None: a profile from before they were timed)
    # Schema /2: I's and W's seconds per layer, no context (None: a /1 profile, split by `split_grids`' ratio).
    backward_input_s: np.ndarray | None = None
    backward_weight_s: np.ndarray | None = None
    # Schema /3: the memory traced from the runtime's code (`plan.traced`; None: the hand formulas of `plan.memory`).
    memory: TracedMemory | None = field(default=None, repr=False)
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    path: str | None = None
    sha256: str | None = None
    # In memory only: attention priced by the context a tile attends over a corpus's packed documents (block-causal
    # masking, `plan.documents`) instead of the whole prefix; None: the whole prefix (full causal attention).
    attended: AttendedContext | None = field(default=None, repr=False, compare=False)

    @property
    def model_argument(self) -> str:
        """What to give ``terapipe profile --model`` to profile this model again: the file or folder the profile was
        made from (its ``model_source``), else (a profile from before that was recorded) the model's name."""
        return shlex.quote(str(self.raw.get("model_source") or self.model.name))

    @property
    def split_source(self) -> str:
        """How a tile's backward splits into I and W: "measured", "analytic" or "example" (schema /2: I and W as the
        profile's source has them), or "ratio" (schema /1, timed whole: by the architecture's analytic I : W ratio)."""
        return "ratio" if self.backward_input_s is None else self.source

    def split_grids(self) -> tuple[np.ndarray, np.ndarray]:
        """I's and W's seconds per layer on the grid, for tiles without context: the profile's own (schema /2), or
        its backward split by the architecture's analytic I : W ratio (/1, `models.backward_input_share`)."""
        if self.backward_input_s is not None and self.backward_weight_s is not None:
            return self.backward_input_s, self.backward_weight_s
        b, i = np.meshgrid(self.batch_sizes, self.token_lengths, indexing="ij")
        share = backward_input_share(self.model, b, i, 0, self.tensor_parallel)
        return share * self.backward_s, (1.0 - share) * self.backward_s

    def only(self, part: str) -> Profile:
        """This profile with every time but ``part``'s zero — "forward", "backward" (whole), or a split backward's
        "input" (I) or "weight" (W) — so that a `CostModel` of it prices that part alone, with the cost model's own
        interpolation (`simulate.cost_model_parts`). A tile's context adds to its forward and to its I, never to its
        W (the module docstring). The ends: the embedding's backward is W's (the first chunk's input is token ids,
        with no gradient), the head's is split by `HEAD_INPUT_SHARE`."""
        if part not in _END_BACKWARDS:
            raise ValueError(f"part must be one of {', '.join(_END_BACKWARDS)}, got {part!r}")
        zeros, none = np.zeros_like(self.forward_s), ContextFit((0.0, 0.0, 0.0, 0.0))
        if part == "forward":
            return replace(self, backward_s=zeros, context_backward=none, ends=self._ends_only(1.0, 0.0, 0.0))
        backward = self.backward_s if part == "backward" else self.split_grids()[part == "weight"]
        return replace(
            self,
            forward_s=zeros,
            context_forward=none,
            backward_s=backward,
            context_backward=none if part == "weight" else self.context_backward,
            ends=self._ends_only(0.0, *_END_BACKWARDS[part]),
        )

    def _ends_only(self, forward: float, embed_backward: float, head_backward: float) -> Ends | None:
        """The ends with their forwards and backwards scaled (by 0 or 1, or the head's backward by its share)."""
        e = self.ends
        if e is None:
            return None
        return replace(
            e,
            embed_forward_s=forward * e.embed_forward_s,
            head_forward_s=forward * e.head_forward_s,
            embed_backward_s=embed_backward * e.embed_backward_s,
            head_backward_s=head_backward * e.head_backward_s,
        )


@dataclass(frozen=True)
class Ends:
    """The work of the pipeline's ends, per (b, i) on the profile's grid (seconds; no context term: neither
    attends): the first chunk's token and position embedding, and the last chunk's final norm, LM head and
    cross-entropy. ``embed_params`` and ``head_params`` are their parameters on one device (split under T where the
    runtime splits them)."""

    embed_forward_s: np.ndarray
    embed_backward_s: np.ndarray
    head_forward_s: np.ndarray
    head_backward_s: np.ndarray
    embed_params: float
    head_params: float


ENDS_KEYS = ("embed_forward_s", "embed_backward_s", "head_forward_s", "head_backward_s")


def _ends(f: Fields, rows: int, cols: int) -> Ends | None:
    if "ends" not in f.obj:
        return None
    sub = f.sub("ends")
    grids = [_grid(sub, key, rows, cols) for key in ENDS_KEYS]
    return Ends(*grids, sub.number("embed_params", minimum=0), sub.number("head_params", minimum=0))


def _context_fit(f: Fields, key: str) -> ContextFit:
    sub = f.sub(key)
    coef = sub.list("coef")
    if len(coef) != 4 or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in coef):
        raise sub.fail("coef", "must be a list of four numbers [a0, a1, a2, a3]")
    err_mean = sub.get("heldout_rel_err_mean", None)
    err_max = sub.get("heldout_rel_err_max", None)
    return ContextFit(tuple(float(c) for c in coef), err_mean, err_max)


def _grid(f: Fields, key: str, rows: int, cols: int) -> np.ndarray:
    value = f.list(key)
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise f.fail(key, "must be a table of numbers (one row per batch size)") from None
    if arr.shape != (rows, cols):
        raise f.fail(key, f"must have shape [batch_sizes={rows}][token_lengths={cols}], got {list(arr.shape)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise f.fail(key, "must hold finite, non-negative seconds")
    return arr


def _ascending_ints(f: Fields, key: str) -> tuple[int, ...]:
    values = f.list(key)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise f.fail(key, "must be a non-empty list of positive integers")
    if any(a >= b for a, b in zip(values, values[1:], strict=False)):
        raise f.fail(key, "must be strictly ascending")
    return tuple(values)


def profile_from_dict(obj: dict, where: str) -> Profile:
    """Validate a profile object (schema /3, or /2, /1: `PROFILE_SCHEMAS`); every error names ``where`` and the
    field."""
    if obj.get("schema") not in PROFILE_SCHEMAS:
        raise UserError(
            f"field 'schema' is {obj.get('schema')!r}, expected {PROFILE_SCHEMA!r} (or the older "
            f"{PROFILE_SCHEMAS[1]!r} or {PROFILE_SCHEMAS[0]!r})",
            where=where,
        )
    f = Fields(obj, where)
    source = f.str("source")
    if source not in PROFILE_SOURCES:
        raise f.fail("source", f"must be one of {', '.join(PROFILE_SOURCES)}, got {source!r}")
    model_obj = f.get("model")
    if not isinstance(model_obj, dict):
        raise f.fail("model", "must be an object")
    model = ModelConfig.from_dict(model_obj, where)
    batch_sizes = _ascending_ints(f, "batch_sizes")
    token_lengths = _ascending_ints(f, "token_lengths")
    forward = _grid(f, "forward_s", len(batch_sizes), len(token_lengths))
    backward = _grid(f, "backward_s", len(batch_sizes), len(token_lengths))
    split = None
    if obj["schema"] != PROFILE_SCHEMAS[0]:  # /2: the backward timed as I and W too
        rows, cols = len(batch_sizes), len(token_lengths)
        split = [_grid(f, key, rows, cols) for key in ("backward_input_s", "backward_weight_s")]
    ctx = f.sub("context")
    comm = f.sub("comm")
    device = f.get("device", {})
    if not isinstance(device, dict):
        raise f.fail("device", "must be an object")
    tensor_parallel = Fields(device, where, "device.").int("tensor_parallel", minimum=1, default=1)
    model.check_tensor_parallel(tensor_parallel, where=f"{where}: field 'device.tensor_parallel'")
    act = f.get("activation_bytes_per_token_per_layer", None)
    if act is not None:
        act = f.number("activation_bytes_per_token_per_layer", minimum=0)
    params = f.get("params_per_layer", None)
    if params is not None:
        params = f.number("params_per_layer", minimum=0)
    vocab_parallel = f.get("vocab_parallel", False)
    if not isinstance(vocab_parallel, bool):
        raise f.fail("vocab_parallel", f"must be true or false, got {vocab_parallel!r}")
    dp_latency = dp_bandwidth = None
    if "data_parallel_link" in obj:
        link = f.sub("data_parallel_link")
        dp_latency = link.number("latency_s", minimum=0)
        dp_bandwidth = link.number("bytes_per_s", positive=True)
    return Profile(
        model=model,
        source=source,
        device=device,
        dtype_bytes=f.int("dtype_bytes", minimum=1),
        token_step=f.int("token_step", minimum=1),
        batch_sizes=batch_sizes,
        token_lengths=token_lengths,
        forward_s=forward,
        backward_s=backward,
        context_forward=_context_fit(ctx, "forward"),
        context_backward=_context_fit(ctx, "backward"),
        latency_s=comm.number("latency_s", minimum=0),
        bytes_per_s=comm.number("bytes_per_s", positive=True),
        optimizer_s_per_layer=f.number("optimizer_s_per_layer", minimum=0, default=0.0),
        activation_bytes_per_token_per_layer=act,
        step_overhead_s=f.number("step_overhead_s", minimum=0, default=0.0),
        params_per_layer=params,
        dp_latency_s=dp_latency,
        dp_bytes_per_s=dp_bandwidth,
        precision=precision_field(f),
        tensor_parallel=tensor_parallel,
        vocab_parallel=vocab_parallel,
        ends=_ends(f, len(batch_sizes), len(token_lengths)),
        backward_input_s=None if split is None else split[0],
        backward_weight_s=None if split is None else split[1],
        memory=traced_from_dict(obj["memory"], where) if "memory" in obj and obj["schema"] == PROFILE_SCHEMA else None,
        raw=obj,
    )


def read_profile(path: str | Path) -> Profile:
    """Read and validate a profile file (one clear error naming the file and field)."""
    prof = profile_from_dict(read_json_with_schema(path, PROFILE_SCHEMA, "profile"), str(path))
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return replace(prof, path=str(path), sha256=digest)


def _interp_linear(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear in x; linear extrapolation above the grid, held at ys[0] below it."""
    x = np.asarray(x, dtype=float)
    if len(xs) == 1:
        # One grid point: time proportional to size above it, held below it.
        return ys[0] * np.maximum(x / xs[0], 1.0)
    inside = np.interp(x, xs, ys)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    above = ys[-1] + slope * (x - xs[-1])
    return np.where(x > xs[-1], above, inside)


def _add_into(t, x):
    """t + x, into t where t is an array of the sum's shape."""
    if isinstance(t, np.ndarray) and t.shape == np.broadcast_shapes(t.shape, np.shape(x)):
        return np.add(t, x, out=t)
    return t + x


@dataclass(frozen=True)
class GridKinds:
    """The time of every kind of device of one partition (and of chunk, ``chunks``; None with one chunk per device) on
    a grid of tiles, one row per batch slice of ``span`` (`CostModel.grid_kinds`), keyed by kind: (layers, runs the
    embedding, runs the head, hops). The partition's ``cost`` there is the slowest of its ``devices``' times, its
    ``bubble`` the slowest of its ``chunks``'. ``nonnegative``: every part of a time is finite and ≥ 0, so that a kind
    no greater in each of the four (`below`) takes no longer on any tile. ``key``: the parts' (the kinds of models
    of equal keys are comparable)."""

    span: np.ndarray
    devices: dict
    chunks: dict | None
    nonnegative: bool
    key: tuple

    def below(self, kind: tuple, other: tuple) -> bool:
        """Whether ``kind`` takes no longer than ``other`` on every tile, by their makings alone (`nonnegative`):
        rounding is monotone, so fewer layers and hops, and ends only where ``other`` has them, never cost more."""
        return self.nonnegative and all(a <= b for a, b in zip(kind, other, strict=True))

    @staticmethod
    def slowest(times: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """The slowest of ``times`` per tile (into ``out``, or a new array)."""
        if len(times) == 1:
            out = np.empty_like(times[0]) if out is None else out
            np.copyto(out, times[0])
            return out
        out = np.maximum(times[0], times[1], out=out)
        for more in times[2:]:
            np.maximum(out, more, out=out)
        return out


class CostModel:
    """``cost(b, i, j)``: seconds for one tile (docs/design.md §3), vectorised, as the objective adds it up.

    ``b``, ``i``, ``j`` are broadcastable integer arrays: sequences in the batch slice, new tokens, context
    tokens. The pipeline is ``partition`` (`schedule.partition`: K devices, K·v chunks, the layers of each; default the
    most even split of the layers over ``stages``): chunk c's time for a tile is

        t_c(b, i, j) = ℓ_c · [ t_nc(b, i) + t_ctx(b, i, j) ] + ends_c(b, i) + comm(b, i)

    with ``ends_c`` the embedding on chunk 0 and the final norm, head and loss on the last chunk (a profile that
    timed them, `Ends`; zero for one that did not), and ``comm`` the activation sent on and its gradient back when
    there are several devices. A device runs the tile once per chunk it holds: u_k = Σ over its chunks of t_c.
    ``cost(b, i, j)`` is the slowest device's u_k (what the objective sums: the pipeline runs at its slowest stage's
    pace) and ``bubble(b, i, j)`` the slowest chunk's t_c (what it multiplies by K − 1: the fill and drain pass one
    chunk per device); with v = 1 they are the same and ``bubble`` is None. ``step_s`` is the per-step constant
    (the optimizer update of the fullest device's parameters, any fixed overhead, the data-parallel all-reduce). With
    ``recompute`` every tile's forward runs twice (once more inside its backward, engine/stage.py), so its forward
    time, context term included, counts twice.

    With ``within_profile`` a tile of a batch slice outside the profile's batch sizes (fewer sequences than the
    smallest, more than the largest) costs +inf instead of an extrapolated time: the planner's searches and
    baselines then never use it (`plan.domain`), and ``max_batch_slice`` tells `search.solve` to lay out no DP rows
    for larger batch slices. Without it (the default, for pricing a given scheme) such tiles are extrapolated.
    """

    def __init__(
        self,
        profile: Profile,
        stages: int,
        data_parallel: int = 1,
        *,
        recompute: bool = False,
        within_profile: bool = False,
        partition: Partition | None = None,
    ) -> None:
        if stages < 1:
            raise UserError(f"must be at least 1, got {stages}", where="stages")
        model = profile.model
        if partition is None:
            if stages > model.layers:
                raise UserError(
                    f"{stages} stages are more than the {model.layers} layers of {model.name}", where="stages"
                )
            partition = Partition.balanced(model.layers, stages)
        if partition.devices != stages or partition.total_layers != model.layers:
            raise ValueError(f"the partition {partition.layers} is not one of {model.layers} layers on {stages} stages")
        self.profile = profile
        self.stages = stages
        self.partition = partition
        self.data_parallel = data_parallel
        self.recompute = recompute
        self.within_profile = within_profile
        self.min_batch_slice = min(profile.batch_sizes) if within_profile else None
        self.max_batch_slice = max(profile.batch_sizes) if within_profile else None
        self._bs = np.asarray(profile.batch_sizes, dtype=float)
        self._ts = np.asarray(profile.token_lengths, dtype=float)
        self._forwards = 2.0 if recompute else 1.0
        self._nc = self._forwards * profile.forward_s + profile.backward_s
        ends = profile.ends
        self._embed = None if ends is None else self._forwards * ends.embed_forward_s + ends.embed_backward_s
        self._head = None if ends is None else self._forwards * ends.head_forward_s + ends.head_backward_s
        bytes_per_token = model.hidden * profile.dtype_bytes
        self._comm_latency = 2.0 * profile.latency_s if stages > 1 else 0.0
        self._comm_per_token = 2.0 * bytes_per_token / profile.bytes_per_s if stages > 1 else 0.0
        # What sets a tile's price: per device (layers, runs the embedding, runs the head, chunks), per chunk the same
        # with one chunk each; only the distinct ones are evaluated.
        last = partition.chunks - 1
        self._devices = sorted(
            {
                (partition.device_layers(k), 0 in chunks, last in chunks, len(chunks))
                for k in range(stages)
                for chunks in [partition.chunks_on(k)]
            }
        )
        self._chunks = sorted({(n, c == 0, c == last, 1) for c, n in enumerate(partition.layers)})
        self.virtual = partition.virtual
        self.bubble = None if partition.virtual == 1 else self._bubble
        # The per-step constant: the fullest device's update (and its replicas' all-reduce), plus fixed overhead.
        self.device_params = [self._device_params(k) for k in range(stages)]
        self.step_s = max(self._update_s(k) for k in range(stages)) + profile.step_overhead_s
        # Why the gradient all-reduce of D > 1 replicas is not in the price (None when it is, or D = 1).
        self.allreduce_unpriced = self._unpriced(data_parallel)
        self.allreduce_s = self._allreduce_s(data_parallel) if self.allreduce_unpriced is None else 0.0
        self.step_s += self.allreduce_s
        self.tied_allreduce_s = self._tied_allreduce_s()
        self.step_s += self.tied_allreduce_s

    @property
    def layers_per_stage(self) -> int:
        """The most layers any device holds (all of them with an even split, v = 1)."""
        return max(self.partition.device_layers(k) for k in range(self.stages))

    def _device_params(self, k: int) -> float | None:
        """Parameters device k holds (per tensor rank): its layers', and the ends' where the profile timed them (a
        profile without `Ends` prices the layers alone, as before)."""
        p, part = self.profile, self.partition
        if p.params_per_layer is None:
            return None
        params = part.device_layers(k) * p.params_per_layer
        if p.ends is not None:
            chunks = part.chunks_on(k)
            params += p.ends.embed_params * (0 in chunks) + p.ends.head_params * (part.chunks - 1 in chunks)
            params += self._tied_rows_params() * (part.chunks - 1 in chunks)  # a tied matrix's copy (§6a)
        return params

    def _tied_rows_params(self) -> float:
        """Parameters of the tied embedding matrix's copy on the last device (tied embeddings whose ends are on two
        devices, Megatron-LM's embedding group; 0 otherwise): the fullest tensor rank's rows of it."""
        model, T = self.profile.model, self.profile.tensor_parallel
        if not model.tie_embeddings or self.partition.devices == 1:
            return 0.0
        return float(vocab_share(model.vocab, T) * model.hidden)

    def _tied_allreduce_s(self) -> float:
        """The two copies' gradient sum every step (fp32 gradients between the first and the last device, over the
        stage-to-stage link): 0 when the model does not tie its embeddings across devices."""
        tied = self._tied_rows_params()
        if not tied:
            return 0.0
        p = self.profile
        return float(ring_allreduce_seconds(4.0 * tied, 2, latency_s=p.latency_s, bytes_per_s=p.bytes_per_s))

    def _update_s(self, k: int) -> float:
        """Device k's optimizer update: per layer as profiled, the ends' parameters at the same rate per parameter."""
        p = self.profile
        layers = self.partition.device_layers(k)
        if p.ends is None or not p.params_per_layer:
            return layers * p.optimizer_s_per_layer
        return self.device_params[k] / p.params_per_layer * p.optimizer_s_per_layer

    def _unpriced(self, replicas: int) -> str | None:
        if replicas < 1:
            raise UserError(f"must be at least 1, got {replicas}", where="data_parallel")
        p = self.profile
        missing = [
            key
            for key, value in (("params_per_layer", p.params_per_layer), ("data_parallel_link", p.dp_latency_s))
            if value is None
        ]
        if replicas == 1 or not missing:
            return None
        return f"{p.path or 'the profile'} has no {' or '.join(repr(k) for k in missing)}"

    def _allreduce_s(self, replicas: int) -> float:
        """The replicas' gradient all-reduce of the fullest device (every device reduces at once)."""
        if replicas == 1:
            return 0.0
        p = self.profile
        grad_bytes = max(self.device_params) * p.dtype_bytes
        return float(
            ring_allreduce_seconds(grad_bytes, replicas, latency_s=p.dp_latency_s, bytes_per_s=p.dp_bytes_per_s)
        )

    @classmethod
    def from_profile(
        cls, path: str | Path, stages: int, data_parallel: int = 1, *, recompute: bool = False
    ) -> CostModel:
        return cls(read_profile(path), stages, data_parallel, recompute=recompute)

    def no_context(self, b: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Per-layer forward + backward seconds of b × i tokens with no context."""
        return self._gather(self._nc, b, i)

    def _gather(self, grid: np.ndarray | None, b, i) -> np.ndarray:
        """A profile ``grid`` at every (b, i) (zero for no grid). The planner asks for every pair of a large broadcast
        grid, but the inputs hold few distinct values: interpolate once per distinct pair, then gather."""
        b, i = np.asarray(b, dtype=float), np.asarray(i, dtype=float)
        if grid is None:
            return np.zeros(np.broadcast(b, i).shape)
        ub, b_idx = np.unique(b, return_inverse=True)
        ui, i_idx = np.unique(i, return_inverse=True)
        return self._interpolate(grid, ub, ui)[b_idx.reshape(b.shape), i_idx.reshape(i.shape)]

    def _interpolate(self, grid: np.ndarray, b: np.ndarray, i: np.ndarray) -> np.ndarray:
        """A profile ``grid`` for every b (rows) and i (columns): first along tokens, then along the batch size."""
        rows = np.stack([_interp_linear(i, self._ts, row) for row in grid])  # (grid batch sizes, len(i))
        if len(self._bs) == 1:
            return rows[0][None, :] * np.maximum(b / self._bs[0], 1.0)[:, None]
        k = np.clip(np.searchsorted(self._bs, b, side="right") - 1, 0, len(self._bs) - 2)
        b0, b1 = self._bs[k], self._bs[k + 1]
        w = (np.maximum(b - b0, 0.0) / (b1 - b0))[:, None]  # held at the smallest batch size below the grid
        return rows[k] + w * (rows[k + 1] - rows[k])

    def context(self, b: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Per-layer extra forward + backward seconds caused by j context tokens (over packed documents: by the
        context the tile is expected to attend, `Profile.attended`)."""
        b, i, j = (np.asarray(x, dtype=float) for x in (b, i, j))
        if self.profile.attended is not None:
            j = self.profile.attended(b, j)
        return self._forwards * self.profile.context_forward(b, i, j) + self.profile.context_backward(b, i, j)

    def comm(self, b: np.ndarray, i: np.ndarray) -> np.ndarray:
        """One chunk's transfers of a tile: its activation on and its gradient back (zero on one device)."""
        return self._comm_latency + self._comm_per_token * (np.asarray(b, dtype=float) * np.asarray(i, dtype=float))

    def embedding(self, b, i) -> np.ndarray:
        """The first chunk's embedding of a tile, forward + backward (zero without `Ends`)."""
        return self._gather(self._embed, b, i)

    def head(self, b, i) -> np.ndarray:
        """The last chunk's final norm, LM head and loss of a tile, forward + backward (zero without `Ends`)."""
        return self._gather(self._head, b, i)

    def chunk_time(self, chunk: int, b, i, j) -> np.ndarray:
        """t_c: chunk ``chunk``'s forward + backward of a tile, its transfers included (the class docstring)."""
        last = self.partition.chunks - 1
        return self._time((self.partition.layers[chunk], chunk == 0, chunk == last, 1), b, i, j)

    def _time(self, kind: tuple[int, bool, bool, int], b, i, j, layer=None) -> np.ndarray:
        parts = self.parts(b, i, j) if layer is None else {"layer": layer, "b": b, "i": i}
        return self._combine(kind, parts)

    def parts(self, b, i, j) -> dict:
        """What every tile price here is made of, for tiles (b, i, j): one layer's time, and ``b``, ``i`` (the ends
        and transfers are read from them lazily)."""
        return {"layer": self.no_context(b, i) + self.context(b, i, j), "b": b, "i": i}

    @property
    def price_key(self) -> tuple:
        """What this model's tile prices depend on besides the tiles: its profile (by identity, `memo.identity`), the
        forwards a tile runs, the transfers, the batch slices it prices and the kinds of its devices and chunks. Two
        cost models with one key price every tile alike (`search._Tables` shares their tables)."""
        kinds = (tuple(self._devices), None if self.bubble is None else tuple(self._chunks))
        limits = (self.min_batch_slice, self.max_batch_slice)
        return (memo.identity(self.profile), self._forwards, self._comm_latency, self._comm_per_token, limits, kinds)

    def grid_prices(self, sizes, i, j, grid: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``cost`` and ``bubble`` (``cost`` again with one chunk per device) of the tiles (b, i, j) for b in
        ``sizes`` (a row each) and the tiles of the rows ``i``, ``j``, which ``grid`` names (`search._Tables`' key of
        them): the arrays ``cost(sizes[:, None], i, j)`` gives, from `grid_kinds` — the slowest of the partition's
        kinds, a row outside the profile's +inf."""
        sizes = np.asarray(sizes).reshape(-1)
        kinds = self.grid_kinds(sizes, i, j, grid)

        def slowest(times: dict) -> np.ndarray:
            t = kinds.slowest(list(times.values()))
            if len(kinds.span) == len(sizes) and np.array_equal(kinds.span, sizes):
                return t
            out = np.full((len(sizes), t.shape[1]), np.inf)
            rows = np.isin(sizes, kinds.span)
            if rows.any():
                out[rows] = t[sizes[rows] - kinds.span[0]]
            return out

        total = slowest(kinds.devices)
        return total, (total if kinds.chunks is None else slowest(kinds.chunks))

    def grid_kinds(self, sizes, i, j, grid: tuple) -> GridKinds:
        """The time of each kind of device (and, with v > 1, of chunk) of this partition — its layers, ends and
        hops (`_combine`) — on the tiles of `grid_prices`, for the batch slices from the least to the largest of
        ``sizes`` the profile prices. Within `memo.sharing` the parts of one profile's tiles are priced once per grid,
        and each kind once: the planner prices many partitions (`plan.configs`)."""
        sizes = np.asarray(sizes).reshape(-1)
        span = sizes
        if self.within_profile:
            inside = sizes[(sizes >= self.min_batch_slice) & (sizes <= self.max_batch_slice)]
            span = np.arange(inside.min(), inside.max() + 1) if len(inside) else inside
        b = span[:, None]
        common = (memo.identity(self.profile), grid, tuple(int(s) for s in span), *self._priced_by)
        parts = memo.remembered(("parts", *common), lambda: self._all_parts(b, i, j))

        def times(kinds) -> dict:
            return {k: memo.remembered(("kind", *common, k), lambda k=k: self._combine(k, parts)) for k in kinds}

        chunks = None if self.bubble is None else times(self._chunks)
        return GridKinds(span, times(self._devices), chunks, parts["nonnegative"], common)

    @property
    def _priced_by(self) -> tuple:
        """What the parts of a tile's price depend on besides the profile: the forwards it runs, its transfers."""
        return (self._forwards, self._comm_latency, self._comm_per_token)

    def _all_parts(self, b, i, j) -> dict:
        """`parts` with the transfers and the ends priced too (shared parts are never added to), and whether every
        part is finite and non-negative (`GridKinds.nonnegative`)."""
        parts = self.parts(b, i, j)
        parts.update(comm=self.comm(b, i), embedding=self.embedding(b, i), head=self.head(b, i))
        arrays = [parts[k] for k in ("layer", "comm", "embedding", "head")]
        parts["nonnegative"] = all(bool(np.all(np.isfinite(x)) and np.all(x >= 0)) for x in arrays)
        return parts

    def _combine(self, kind: tuple[int, bool, bool, int], parts: dict) -> np.ndarray:
        layers, embeds, heads, hops = kind
        b, i = parts["b"], parts["i"]
        if "comm" not in parts:
            parts["comm"] = self.comm(b, i)
        # layers·ℓ + hops·comm + the ends, summed in this order (in place: the same sums, fewer arrays).
        t = _add_into(layers * parts["layer"], parts["comm"] if hops == 1 else hops * parts["comm"])
        for flag, name, price in ((embeds, "embedding", self.embedding), (heads, "head", self.head)):
            if flag:
                if name not in parts:
                    parts[name] = price(b, i)
                t = _add_into(t, parts[name])
        return t

    def _slowest_of(self, kinds, parts: dict) -> np.ndarray:
        return self._slowest([self._combine(kind, parts) for kind in kinds], parts["b"])

    def _slowest(self, times: list[np.ndarray], b) -> np.ndarray:
        """The slowest of ``times`` per tile (a new array), +inf outside the profile's batch sizes (with
        ``within_profile``)."""
        t = np.max(np.stack(np.broadcast_arrays(*times)), axis=0)
        if not self.within_profile:
            return t
        b = np.asarray(b)
        return np.where((b >= self.min_batch_slice) & (b <= self.max_batch_slice), t, np.inf)

    def __call__(self, b, i, j) -> np.ndarray:
        return self._slowest_of(self._devices, self.parts(b, i, j))

    def _bubble(self, b, i, j) -> np.ndarray:
        return self._slowest_of(self._chunks, self.parts(b, i, j))
