"""Operator tables: one device's operators timed once (`profile.operators` measures them), and any model's profile
made by summing its kernels priced from the table. Pure numpy, no torch.

A table (``terapipe.operators/1``) holds, for one device and precision:

* ``gemm``: a ``torch.nn.functional.linear`` product of an (m, k) input and an (n, k) weight, on a grid of (m, n, k);
  the backward's products (`models.spec.backward_gemms`) on the same grid in the layouts autograd runs them in;
* ``attention``: `models.attention.attend` forward and backward at batch 1, on a grid of (query heads, query heads
  per key/value head, head_dim, query length i, context length j); b sequences of h heads are b·h query heads;
* ``stream``: one element-wise kernel (a residual add) by bytes moved, which prices every element-wise pass;
* ``host_s``: the time of a tiny op, the host's cost of issuing one kernel;
* ``tile_host_s`` (optional): per model family, what one layer's tile costs through the runtime's stage code beyond
  its kernels priced from this table, timed at a shape so small its kernels take next to nothing: the host's own
  per-tile work (Python module calls, autograd's bookkeeping, the K/V cache, the K/V gradient hand-back, autocast's
  copies). Forward, backward and the split backward's I and W of a tile without context, and forward and backward
  of a tile with context (`TILE_HOST_KEYS`).

Times are read by multilinear interpolation of log(time) over log(m), log(n), log(k) (attention: log of heads, group,
head_dim and i, log(1 + j); streams: log(bytes)), so a grid point returns its own time and a point between grid
points a time between theirs. Beyond the grid the nearest edge point's time is scaled by the work (FLOPs, bytes):
up by the ratio, never down (below the grid a kernel costs what the smallest measured one did).

A tile on a CPU runs its kernels one after another, each timed with its host cost: the tile is their sum, plus
``host_s`` for each kernel the layer launches (`analytic.kernels_per_tile`) that no table entry prices (views,
casts, autograd's own), plus the family's ``tile_host_s``. On a GPU the host runs ahead, so a tile is max(GPU time,
kernels × ``host_s`` + the family's ``tile_host_s``), the analytic model's dispatch floor with the host's per-tile
work. A table without ``tile_host_s`` prices tiles from their kernels alone.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from terapipe_cli.config.device import PRECISIONS
from terapipe_cli.config.hardware import Device, Hardware, Link, Training
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_json_with_schema
from terapipe_cli.models import ModelConfig
from terapipe_cli.models.spec import Gemm
from terapipe_cli.profile import analytic

OPERATORS_SCHEMA = "terapipe.operators/1"
ATTENTION_AXES = ("heads", "group", "head_dim", "i", "j")
GEMM_LAYOUTS = ("forward", "dgrad", "wgrad")  # a product of the forward, of an input's gradient, of a weight's
# A tile's host term without context (its backward whole, and split into I and W), and with context.
TILE_HOST_KEYS = ("forward", "backward", "input", "weight", "context_forward", "context_backward")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# What a profile made from a table without --hardware records for what no operator prices: the links as free, as
# `terapipe profile --no-comm` does, and the optimizer's and the memory's bytes per parameter of plain AdamW.
FREE_LINK = Link(bytes_per_s=1e12, latency_s=0.0)
STATE_BYTES_PER_PARAM = 16  # weight, gradient, Adam's m and v, 4 bytes each (fp32 master weights under autocast)
OPTIMIZER_BYTES_PER_PARAM = 28  # one Adam step reads the gradient, reads and writes weight, m and v


@dataclass(frozen=True)
class Grid:
    """Times on a rectangular grid: ``axes`` (ascending values per dimension) and ``seconds`` of their shape."""

    axes: tuple[np.ndarray, ...]
    seconds: np.ndarray

    def at(self, coords: Sequence, work, transforms: Sequence) -> np.ndarray:
        """Seconds at ``coords`` (broadcast arrays): log-time interpolated over the transformed axes, scaled up by
        ``work(coords) / work(the nearest grid point)`` beyond the grid."""
        coords = np.broadcast_arrays(*(np.asarray(c, dtype=float) for c in coords))
        clamped = [np.clip(c, ax[0], ax[-1]) for c, ax in zip(coords, self.axes, strict=True)]
        axes = [f(ax) for f, ax in zip(transforms, self.axes, strict=True)]
        points = [f(c) for f, c in zip(transforms, clamped, strict=True)]
        seconds = np.exp(_multilinear(axes, np.log(self.seconds), points))
        return seconds * np.maximum(work(*coords) / work(*clamped), 1.0)


def _multilinear(axes: Sequence[np.ndarray], values: np.ndarray, points: Sequence[np.ndarray]) -> np.ndarray:
    """Interpolate ``values`` (on the grid ``axes``) at ``points``, each within its axis."""
    lows, fracs = [], []
    for ax, x in zip(axes, points, strict=True):
        if len(ax) == 1:
            lows.append(np.zeros(x.shape, dtype=int))
            fracs.append(np.zeros(x.shape))
            continue
        lo = np.clip(np.searchsorted(ax, x, side="right") - 1, 0, len(ax) - 2)
        lows.append(lo)
        fracs.append((x - ax[lo]) / (ax[lo + 1] - ax[lo]))
    out = np.zeros(points[0].shape)
    for corner in itertools.product((0, 1), repeat=len(axes)):
        if any(c and len(ax) == 1 for c, ax in zip(corner, axes, strict=True)):
            continue
        weight = np.ones(points[0].shape)
        for c, frac in zip(corner, fracs, strict=True):
            weight = weight * (frac if c else 1 - frac)
        out = out + weight * values[tuple(lo + c for lo, c in zip(lows, corner, strict=True))]
    return out


def _gemm_work(m, n, k):
    return m * n * k


def _attention_work(heads, group, head_dim, i, j):
    return heads * head_dim * i * (i + j)


def _bytes_work(nbytes):
    return nbytes


@dataclass(frozen=True)
class OperatorTable:
    """A validated operator table (the module docstring); ``raw``: the file's object."""

    path: str
    sha256: str
    device: dict
    precision: str
    host_s: float
    gemm: dict[str, Grid]  # by layout (`GEMM_LAYOUTS`)
    attention_forward: Grid
    attention_backward: Grid
    stream: Grid
    raw: dict
    tile_host_s: dict[str, dict[str, float]] | None = None  # by family, `TILE_HOST_KEYS`; None: not timed

    @property
    def gpu(self) -> bool:
        return self.device.get("kind") == "cuda"

    def gemm_seconds(self, m, n, k, layout: str = "forward") -> np.ndarray:
        return self.gemm[layout].at((m, n, k), _gemm_work, (np.log,) * 3)

    def attention_seconds(self, heads, group, head_dim, i, j) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds of attention for ``heads`` query heads (b sequences × their heads)."""
        coords, transforms = (heads, group, head_dim, i, j), (np.log,) * 4 + (np.log1p,)
        grids = (self.attention_forward, self.attention_backward)
        return tuple(g.at(coords, _attention_work, transforms) for g in grids)

    def stream_seconds(self, nbytes) -> np.ndarray:
        nbytes = np.asarray(nbytes, dtype=float)
        seconds = self.stream.at((np.maximum(nbytes, 1.0),), _bytes_work, (np.log,))
        return np.where(nbytes > 0, seconds, 0.0)  # a pass over nothing is not run (fused attention's scores)


def _axis(f: Fields, key: str, minimum: int = 1) -> np.ndarray:
    values = f.list(key)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
        raise f.fail(key, f"must be a non-empty list of integers of at least {minimum}")
    if any(a >= b for a, b in zip(values, values[1:], strict=False)):
        raise f.fail(key, "must be strictly ascending")
    return np.asarray(values, dtype=float)


def _seconds(f: Fields, key: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        arr = np.asarray(f.list(key), dtype=float)
    except (TypeError, ValueError):
        raise f.fail(key, "must be nested lists of numbers") from None
    if arr.shape != shape:
        raise f.fail(key, f"must have the grid's shape {list(shape)}, got {list(arr.shape)}")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise f.fail(key, "must hold finite, positive seconds")
    return arr


def _grid(f: Fields, names: Sequence[str], key: str = "seconds", zero_axes: Sequence[str] = ()) -> Grid:
    axes = tuple(_axis(f, name, 0 if name in zero_axes else 1) for name in names)
    return Grid(axes, _seconds(f, key, tuple(len(ax) for ax in axes)))


def operator_table_from_dict(obj: dict, where: str, sha256: str = "") -> OperatorTable:
    """Validate an operator table object; every error is one line naming ``where`` and the field."""
    if obj.get("schema") != OPERATORS_SCHEMA:
        raise UserError(f"field 'schema' is {obj.get('schema')!r}, expected {OPERATORS_SCHEMA!r}", where=where)
    f = Fields(obj, where)
    device = f.sub("device")
    kind = device.str("kind")
    if kind not in ("cpu", "cuda"):
        raise device.fail("kind", f"must be cpu or cuda, got {kind!r}")
    device.str("name")
    precision = f.str("precision")
    if precision not in PRECISIONS:
        raise f.fail("precision", f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    f.str("torch")
    attention = f.sub("attention")
    return OperatorTable(
        path=where,
        sha256=sha256,
        device=dict(obj["device"]),
        precision=precision,
        host_s=f.number("host_s", positive=True),
        gemm={layout: _grid(f.sub("gemm"), ("m", "n", "k"), f"{layout}_s") for layout in GEMM_LAYOUTS},
        attention_forward=_grid(attention, ATTENTION_AXES, "forward_s", zero_axes=("j",)),
        attention_backward=_grid(attention, ATTENTION_AXES, "backward_s", zero_axes=("j",)),
        stream=_grid(f.sub("stream"), ("bytes",)),
        raw=obj,
        tile_host_s=_tile_host(f) if "tile_host_s" in obj else None,
    )


def _tile_host(f: Fields) -> dict[str, dict[str, float]]:
    families = f.sub("tile_host_s")
    if not families.obj:
        raise f.fail("tile_host_s", "must name at least one model family")
    out = {}
    for family in families.obj:
        terms = families.sub(family)
        out[family] = {key: terms.number(key, minimum=0.0) for key in TILE_HOST_KEYS}
    return out


def read_operator_table(path: str | Path) -> OperatorTable:
    """Read and validate an operator table file (one line naming the file and the field on any fault)."""
    obj = read_json_with_schema(path, OPERATORS_SCHEMA, "operator table")
    return operator_table_from_dict(obj, str(path), hashlib.sha256(Path(path).read_bytes()).hexdigest())


class TablePricer:
    """Prices each kernel of a layer from an operator table, for `analytic.layer_seconds_split` and
    `analytic.ends_seconds` (the other pricer is `analytic.Roofline`). Attention is the runtime's fused kernel."""

    fused = True

    def __init__(self, table: OperatorTable) -> None:
        self.table = table

    def tile_host(self, model: ModelConfig, j) -> tuple:
        """The family's per-tile host seconds (forward, backward, I, W) at context lengths ``j``: the tile without
        context's, or with context's (which adds to I alone); zeros where the table has no term for the family."""
        terms = (self.table.tile_host_s or {}).get(model.arch)
        if terms is None:
            return 0.0, 0.0, 0.0, 0.0
        with_context = np.asarray(j) > 0
        forward = np.where(with_context, terms["context_forward"], terms["forward"])
        backward = np.where(with_context, terms["context_backward"], terms["backward"])
        context_input = max(terms["input"] + terms["context_backward"] - terms["backward"], 0.0)
        inputs = np.where(with_context, context_input, terms["input"])
        return forward, backward, inputs, np.full(np.shape(forward), terms["weight"])

    def gemm(self, gemm: Gemm) -> np.ndarray:
        name, batch, m, n, k = gemm
        kind = name.rsplit(".", 1)[-1]
        return batch * self.table.gemm_seconds(m, n, k, kind if kind in GEMM_LAYOUTS else "forward")

    def attention(self, model: ModelConfig, b, i, j, t: int) -> tuple[np.ndarray, np.ndarray]:
        heads = b * model.heads / t
        return self.table.attention_seconds(heads, model.heads / model.kv_heads, model.head_dim, i, j)

    def stream(self, nbytes) -> np.ndarray:
        return self.table.stream_seconds(nbytes)

    def hold_layer(self, model: ModelConfig, t: int, j, times: tuple, priced: tuple[int, int, int]) -> tuple:
        """(forward, backward, I, W) with the host's cost of the kernels not priced and the family's per-tile host
        term added (CPU), or held at the dispatch floor with that term (GPU); ``priced``: the kernels priced one by
        one forward, in I and in W; ``j``: the tiles' context lengths (`tile_host`)."""
        forward, backward, inputs, weight = times
        host = self.table.host_s
        fwd, bwd = analytic.kernels_per_tile(self.table.precision, t, model)
        wgt = analytic.weight_kernels_per_tile(self.table.precision, model)
        tile_f, tile_b, tile_i, tile_w = self.tile_host(model, j)
        if self.table.gpu:
            floors = (fwd * host + tile_f, bwd * host + tile_b, (bwd - wgt) * host + tile_i, wgt * host + tile_w)
            return tuple(np.maximum(x, floor) for x, floor in zip(times, floors, strict=True))
        extra_f, extra_i, extra_w = (max(n - p, 0) * host for n, p in zip((fwd, bwd - wgt, wgt), priced, strict=True))
        return (forward + extra_f + tile_f, backward + extra_i + extra_w + tile_b, inputs + extra_i + tile_i,
                weight + extra_w + tile_w)  # fmt: skip

    def hold_end(self, seconds: np.ndarray, kernels: int, priced: int) -> np.ndarray:
        host = self.table.host_s
        return np.maximum(seconds, kernels * host) if self.table.gpu else seconds + max(kernels - priced, 0) * host


def table_hardware(table: OperatorTable) -> Hardware:
    """What no operator prices, for a profile made without ``--hardware``: the table's device (its name and
    memory), free links (`FREE_LINK`) and plain AdamW's bytes per parameter. The roofline's constants are unused."""
    e = DTYPE_BYTES[table.precision]
    device = Device(
        name=str(table.device["name"]),
        memory_bytes=float(table.device.get("memory_bytes") or 0.0),
        peak_flops=1.0,
        memory_bytes_per_s=1.0,
        matmul_efficiency=1.0,
        matmul_half_dim=0.0,
        memory_efficiency=1.0,
        kernel_launch_s=table.host_s,
    )
    training = Training(
        dtype=table.precision,
        dtype_bytes=e,
        state_bytes_per_param=STATE_BYTES_PER_PARAM,
        optimizer_bytes_per_param=OPTIMIZER_BYTES_PER_PARAM,
        grad_accumulate_bytes_per_param=3 * e,
        attention="fused",
    )
    return Hardware(
        name=f"operator table {table.path}",
        gpus_per_node=int(table.device.get("gpus_visible", 1) or 1),
        device=device,
        intra_node=FREE_LINK,
        network=FREE_LINK,
        training=training,
        path=None,
    )


def operator_profile(
    model: ModelConfig,
    table: OperatorTable,
    hardware: Hardware | None = None,
    *,
    tensor_parallel: int = 1,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    token_step: int = 8,
) -> dict:
    """A ``terapipe.profile/3`` object (``"source": "operators"``) for ``model``, every kernel priced from ``table``
    (`TablePricer`), on the grid `analytic.analytic_profile` makes. Links, all-reduces, the optimizer's and the
    memory's figures from ``hardware`` (in the table's precision), else the table's device defaults
    (`table_hardware`); the note says which."""
    if hardware is not None and hardware.training.dtype != table.precision:
        raise UserError(
            f"prices {hardware.training.dtype}, but the operator table {table.path} was timed in {table.precision}",
            where=str(hardware.path),
        )
    hw = hardware if hardware is not None else table_hardware(table)
    pricer = TablePricer(table)
    prof = analytic.analytic_profile(
        model, hw, tensor_parallel=tensor_parallel, batch_sizes=batch_sizes, token_step=token_step, pricer=pricer
    )
    params = model.params_per_layer(tensor_parallel)
    rest = (
        f"links, all-reduces, optimizer and memory from hardware file {hw.path}"
        if hardware is not None
        else "links priced as free, optimizer and memory from the table's device defaults (AdamW: "
        f"{OPTIMIZER_BYTES_PER_PARAM} bytes per parameter a step, {STATE_BYTES_PER_PARAM} of state; the device's "
        "memory as the table records it); pass --hardware for others"
    )
    host = (
        f"the host's per-tile work of a {model.arch} layer as the table timed it at a tiny shape"
        if (table.tile_host_s or {}).get(model.arch) is not None
        else f"no per-tile host work (the table has no tile_host_s for {model.arch}: tiles priced from their kernels "
        "alone, short ones low on a CPU)"
    )
    device = {k: v for k, v in table.device.items() if k in ("kind", "name", "memory_bytes", "threads", "cores")}
    if hardware is not None:
        device.update(memory_bytes=hw.device.memory_bytes, hardware_file=hw.path, gpus_per_node=hw.gpus_per_node)
    prof.update(
        source="operators",
        note=(
            f"ESTIMATED from timed operators, not from timed tiles: each kernel of one decoder layer priced from the "
            f"operator table {table.path} ({table.device['kind']}, {table.device['name']}, {table.precision}, "
            f"torch {table.raw.get('torch')}), with {host}, tensor parallelism {tensor_parallel}; {rest}. Made by "
            "terapipe_cli.profile.operator_table."
        ),
        device={**device, "tensor_parallel": tensor_parallel},
        optimizer_s_per_layer=float(pricer.stream(np.asarray(params * hw.training.optimizer_bytes_per_param))),
        operator_table={"path": table.path, "sha256": table.sha256, "created": table.raw.get("created")},
    )
    prof.pop("hardware_config")
    return prof
