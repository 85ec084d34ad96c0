"""Hardware descriptions for analytic profiles: TOML files under ``configs/hardware/``, one validated dataclass.

A file describes one kind of node (e.g. an AWS p3.16xlarge) and the network between nodes. Every number
is a public figure (vendor datasheet, instance page, paper) or a modelling constant chosen from public
measurements; the file's comments give the source of each.

    [hardware]
    name = "aws-p3.16xlarge"
    gpus_per_node = 8
    constants = "estimated"        # optional (default "estimated"): where the device's constants come from:
                                   # "estimated" (datasheets and modelling assumptions, nothing measured) or
                                   # "calibrated" (fitted to measured tiles by `terapipe profile --calibrate`)

    [device]                       # one accelerator
    name = "NVIDIA V100-SXM2-16GB"
    memory_bytes = 17179869184     # usable device memory
    peak_flops = 125e12            # dense matrix-product peak in the training dtype
    memory_bytes_per_s = 900e9     # device memory bandwidth
    matmul_efficiency = 0.75       # fraction of peak a large matrix product reaches
    matmul_half_dim = 64           # a matrix dimension this small halves the efficiency (x / (x + h) per dim)
    memory_efficiency = 0.83       # fraction of memory bandwidth a streaming kernel reaches
    kernel_launch_s = 5e-6         # no kernel takes less than this on the GPU
    dispatch_s = 30e-6             # optional (default 0: no floor): host seconds per kernel eager PyTorch issues;
                                   # a tile takes at least (kernels it launches) × dispatch_s (profile/analytic.py);
                                   # 0 also prices a CUDA-graphed layer, which no host dispatches kernel by kernel
    reserved_bytes = 2147483648    # optional (default 0): what a training process cannot use of memory_bytes (the
                                   # CUDA context, NCCL's buffers): plans are held to memory_bytes − reserved_bytes

    [intra_node]                   # GPU-to-GPU inside a node (NVLink): tensor-parallel all-reduces
    bytes_per_s = 150e9
    latency_s = 5e-6

    [network]                      # node-to-node: stage-to-stage transfers, data-parallel all-reduces
    bytes_per_s = 3.125e9
    latency_s = 30e-6

    [training]                     # the numeric format of training (software, not silicon)
    dtype = "fp16"
    dtype_bytes = 2
    state_bytes_per_param = 16     # weights + gradients + optimizer state held per parameter
    optimizer_bytes_per_param = 28 # memory traffic of one optimizer update per parameter
    attention = "fused"            # optional: "dense" (the default; Megatron's scores, softmax and dropout
                                   # kernels) or "fused" (one scaled_dot_product_attention kernel, as the runtime)
    grad_accumulate_bytes_per_param = 6  # optional: memory traffic of adding one tile's weight gradients into
                                   # the step's (``.grad +=``: read both, write one; default 3 × dtype_bytes)

Files fitted to measurements by `terapipe profile --calibrate` (`profile.calibrate`) say so in ``constants``, in
their header and in the comment of every fitted constant; an analytic profile and every plan priced by it carry
that word (`plan.domain.provenance`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from terapipe_cli.config.bundled import find_config, load_toml
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields
from terapipe_cli.models import ModelConfig


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    peak_flops: float
    memory_bytes_per_s: float
    matmul_efficiency: float
    matmul_half_dim: float
    memory_efficiency: float
    kernel_launch_s: float
    # Host time per kernel issued by eager PyTorch (Python, dispatcher, autograd, launch): the floor of a tile
    # whose kernels are shorter than that (docs/design.md §12). 0, the default: no floor, the pure roofline of
    # the files written before it; 0 also prices a CUDA-graphed layer, which the host does not dispatch.
    dispatch_s: float = 0.0
    # Of memory_bytes, what a training process cannot use: the CUDA context, NCCL's buffers (`plan.memory`).
    reserved_bytes: float = 0.0


@dataclass(frozen=True)
class Link:
    """A latency + bytes/bandwidth link."""

    bytes_per_s: float
    latency_s: float


ATTENTION = ("dense", "fused")
# Where a file's device constants come from: datasheets and assumptions, or a fit to measured tiles.
CONSTANTS = ("estimated", "calibrated")


@dataclass(frozen=True)
class Training:
    dtype: str
    dtype_bytes: int
    state_bytes_per_param: float
    optimizer_bytes_per_param: float
    # Every tile's backward adds its weights' gradients into the step's gradient buffers: a memory-bound pass over all
    # of a stage's parameters, whatever the tile's length (PyTorch's AccumulateGrad, `variable_grad += new_grad`, in
    # terapipe's runtime; `w.grad += grad_w` in the published TeraPipe runs' runner). Bytes per parameter: read the
    # sum and the new gradient, write the sum — 3 × dtype_bytes for gradients in the training type (the file's
    # default). A step's first tile writes without reading; the model prices every tile alike.
    grad_accumulate_bytes_per_param: float
    # "dense" (the default, Megatron-LM of the published runs): scores Q·Kᵀ over the whole i × (i + j) rectangle
    # are written to memory, then softmax and dropout kernels read them. "fused" (the runtime's
    # scaled_dot_product_attention, FlashAttention-style): one kernel keeps the scores on chip, skips the blocks
    # the causal mask hides, and its backward recomputes them.
    attention: str = "dense"


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    device: Device
    intra_node: Link
    network: Link
    training: Training
    path: str | None = None
    constants: str = "estimated"  # CONSTANTS

    def check_tensor_parallel(self, model: ModelConfig, tensor_parallel: int) -> None:
        """Tensor parallelism splits heads and the MLP across GPUs of one node (docs/design.md §7)."""
        model.check_tensor_parallel(tensor_parallel)
        if tensor_parallel > self.gpus_per_node:
            raise UserError(
                f"is {tensor_parallel}, more than the {self.gpus_per_node} GPUs of a node of '{self.name}' "
                "(tensor parallelism stays inside a node)",
                where="tensor_parallel",
            )


def _check_keys(f: Fields, obj: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise f.fail(unknown[0], "is not a known setting here (known: " + ", ".join(known) + ")")


def _fraction(f: Fields, key: str) -> float:
    value = f.number(key, positive=True)
    if value > 1:
        raise f.fail(key, f"is a fraction and must be at most 1, got {value}")
    return value


def _table(f: Fields, obj: dict, key: str) -> tuple[Fields, dict]:
    sub = f.sub(key)
    return sub, obj[key]


def _link(f: Fields, obj: dict, key: str) -> Link:
    sub, table = _table(f, obj, key)
    _check_keys(sub, table, ("bytes_per_s", "latency_s"))
    return Link(bytes_per_s=sub.number("bytes_per_s", positive=True), latency_s=sub.number("latency_s", minimum=0))


def hardware_from_dict(obj: dict, where: str) -> Hardware:
    """Validate a parsed hardware TOML; every error names ``where`` and the field."""
    top = Fields(obj, where)
    _check_keys(top, obj, ("hardware", "device", "intra_node", "network", "training"))

    hw, hw_obj = _table(top, obj, "hardware")
    _check_keys(hw, hw_obj, ("name", "gpus_per_node", "constants"))
    constants = hw.str("constants", default="estimated")
    if constants not in CONSTANTS:
        raise hw.fail("constants", f"must be {' or '.join(map(repr, CONSTANTS))}, got {constants!r}")

    dev, dev_obj = _table(top, obj, "device")
    device_keys = (
        "name",
        "memory_bytes",
        "peak_flops",
        "memory_bytes_per_s",
        "matmul_efficiency",
        "matmul_half_dim",
        "memory_efficiency",
        "kernel_launch_s",
        "dispatch_s",
        "reserved_bytes",
    )
    _check_keys(dev, dev_obj, device_keys)
    device = Device(
        name=dev.str("name"),
        memory_bytes=dev.number("memory_bytes", positive=True),
        peak_flops=dev.number("peak_flops", positive=True),
        memory_bytes_per_s=dev.number("memory_bytes_per_s", positive=True),
        matmul_efficiency=_fraction(dev, "matmul_efficiency"),
        matmul_half_dim=dev.number("matmul_half_dim", minimum=0),
        memory_efficiency=_fraction(dev, "memory_efficiency"),
        kernel_launch_s=dev.number("kernel_launch_s", minimum=0),
        dispatch_s=dev.number("dispatch_s", minimum=0, default=0.0),
        reserved_bytes=dev.number("reserved_bytes", minimum=0, default=0.0),
    )

    tr, tr_obj = _table(top, obj, "training")
    known = ("dtype", "dtype_bytes", "state_bytes_per_param", "optimizer_bytes_per_param", "attention",
             "grad_accumulate_bytes_per_param")  # fmt: skip
    _check_keys(tr, tr_obj, known)
    attention = tr.str("attention", default="dense")
    if attention not in ATTENTION:
        raise tr.fail("attention", f"must be {' or '.join(ATTENTION)}, got {attention!r}")
    dtype_bytes = tr.int("dtype_bytes", minimum=1)
    training = Training(
        dtype=tr.str("dtype"),
        dtype_bytes=dtype_bytes,
        state_bytes_per_param=tr.number("state_bytes_per_param", minimum=0),
        optimizer_bytes_per_param=tr.number("optimizer_bytes_per_param", minimum=0),
        attention=attention,
        grad_accumulate_bytes_per_param=tr.number(
            "grad_accumulate_bytes_per_param", minimum=0, default=3 * dtype_bytes
        ),
    )
    return Hardware(
        name=hw.str("name"),
        gpus_per_node=hw.int("gpus_per_node", minimum=1),
        device=device,
        intra_node=_link(top, obj, "intra_node"),
        network=_link(top, obj, "network"),
        training=training,
        path=where,
        constants=constants,
    )


def hardware_to_dict(hardware: Hardware) -> dict:
    """The tables of a hardware file, as `hardware_from_dict` reads them back: what an analytic profile keeps of the
    file it was estimated from, so that `terapipe plan` can price it again at other batch sizes."""
    return {
        "hardware": {"name": hardware.name, "gpus_per_node": hardware.gpus_per_node, "constants": hardware.constants},
        # reserved_bytes only where a file sets it: the profiles of every other file stay as they were
        "device": {k: v for k, v in asdict(hardware.device).items() if k != "reserved_bytes" or v},
        "intra_node": asdict(hardware.intra_node),
        "network": asdict(hardware.network),
        "training": asdict(hardware.training),
    }


def load_hardware(path: str | Path) -> Hardware:
    """Load and validate a hardware TOML, or a bundled one by name (``v100``, ``a100``, ``h100``; one-line
    `UserError` naming the file and field)."""
    path = find_config(path, "hardware", "--hardware")
    return hardware_from_dict(load_toml(path, "hardware"), str(path))
