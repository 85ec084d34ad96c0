"""Analytic profiles: the cost model of docs/design.md §3 estimated for hardware we do not have. Pure numpy, no torch.

One decoder layer (Megatron-style: pre-norm attention and MLP blocks, tensor parallelism over heads and the
MLP's inner dimension, two all-reduces forward and two backward) is written down kernel by kernel, and each
kernel is timed with a roofline:

* a matrix product ``batch × (m × k)·(k × n)`` takes ``max(flops / (peak · eff), bytes / memory bandwidth,
  launch)`` where ``eff = matmul_efficiency · s(m)·s(n)·s(k)``, ``s(x) = x / (x + matmul_half_dim)``: a short
  slice (small m) leaves the device under-used, exactly the effect that makes very fine slicing slow. The
  FLOP counts are exact (2·m·n·k per product; forward and backward are listed product by product);
* an element-wise kernel (layer norm, softmax, GeLU, dropout, residual) moves its bytes over the memory
  bandwidth, and no kernel beats the launch floor;
* a tensor-parallel all-reduce is a ring over the intra-node link: ``2(t−1)·latency + 2(t−1)/t · bytes/bw``;
* the dispatch floor (hardware files with ``dispatch_s``): eager PyTorch issues the layer's kernels one by one
  from the host, so a tile's forward (backward) takes at least the kernels it launches × ``dispatch_s``
  (`dispatch_floor_seconds`). That floor, not FLOPs, prices short slices on a fast GPU.

Placement assumed: consecutive stages of one pipeline fill a node (tensor-parallel groups inside a node),
so at least one stage boundary per node crosses the network, which sets the pipeline's pace; every
stage-to-stage transfer is therefore priced on the inter-node network. All GPUs of a node reduce their
gradients across replicas at the same time, so the data-parallel all-reduce of one GPU gets 1/gpus_per_node
of the node's network bandwidth.

The context term t_ctx(b, i, j) is fitted to the analytic times with the same relative least squares as a
measured profile (`terapipe_cli.profile.fit.fit_context`) and checked on held-out points.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from terapipe_cli.config.device import PRECISIONS
from terapipe_cli.config.experiment import Experiment
from terapipe_cli.config.hardware import Device, Hardware, hardware_from_dict, hardware_to_dict
from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig, arch_spec, vocab_share
from terapipe_cli.models.spec import Gemm, backward_gemms, is_weight_gradient
from terapipe_cli.models.spec import layer_gemms as forward_gemms
from terapipe_cli.plan.costmodel import PROFILE_SCHEMA, Profile, profile_from_dict, ring_allreduce_seconds
from terapipe_cli.profile.fit import fit_context
from terapipe_cli.units import utc_timestamp


def gemm_flops(gemms: Iterable[Gemm]) -> np.ndarray:
    return sum(2.0 * batch * m * n * k for _, batch, m, n, k in gemms)


def layer_flops(model: ModelConfig, b, i, j, tensor_parallel: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Exact forward and backward FLOPs of one layer on one device for a tile (b, i, j)."""
    fwd = forward_gemms(model, b, i, j, tensor_parallel)
    return gemm_flops(fwd), gemm_flops(backward_gemms(fwd))


def _gemm_seconds(dev: Device, dtype_bytes: int, gemm: Gemm) -> np.ndarray:
    _, batch, m, n, k = gemm
    h = dev.matmul_half_dim
    efficiency = dev.matmul_efficiency * (m / (m + h)) * (n / (n + h)) * (k / (k + h))
    compute = 2.0 * batch * m * n * k / (dev.peak_flops * efficiency)
    memory = dtype_bytes * batch * (m * k + k * n + m * n) / (dev.memory_bytes_per_s * dev.memory_efficiency)
    return np.maximum(np.maximum(compute, memory), dev.kernel_launch_s)


def _fused_attention_seconds(
    dev: Device, dtype_bytes: int, model: ModelConfig, b: np.ndarray, i: np.ndarray, j: np.ndarray, t: int
) -> tuple[np.ndarray, np.ndarray]:
    """Fused attention (``[training] attention = "fused"``): one kernel forward, one backward, each priced like a
    matrix product (FlashAttention, Dao et al. 2022).

    The scores never leave the chip, so memory moves only q, k, v and the output (and their gradients); the causal
    mask lets the kernel skip the key blocks above the diagonal, so a query meets j + i/2 keys on average; the
    backward recomputes the scores and runs five products against the forward's two (2.5× its FLOPs).
    """
    heads, d, h = model.heads / t, float(model.head_dim), dev.matmul_half_dim
    keys = j + i / 2
    flops = 4.0 * b * heads * i * keys * d
    efficiency = dev.matmul_efficiency * (i / (i + h)) * (keys / (keys + h)) * (d / (d + h))
    rows = dtype_bytes * b * heads * d  # bytes of one query (or output) row across the heads
    kv_rows = rows * model.kv_heads / model.heads  # of one key or value row: kv_heads heads (grouped-query)
    bw = dev.memory_bytes_per_s * dev.memory_efficiency
    forward = np.maximum(flops / (dev.peak_flops * efficiency), (rows * 2 * i + kv_rows * 2 * (i + j)) / bw)
    backward = np.maximum(2.5 * flops / (dev.peak_flops * efficiency), (rows * 4 * i + kv_rows * 4 * (i + j)) / bw)
    return np.maximum(forward, dev.kernel_launch_s), np.maximum(backward, dev.kernel_launch_s)


def _stream_seconds(dev: Device, nbytes: np.ndarray) -> np.ndarray:
    return np.maximum(nbytes / (dev.memory_bytes_per_s * dev.memory_efficiency), dev.kernel_launch_s)


class Pricer(Protocol):
    """How `layer_seconds_split` and `ends_seconds` price each kernel they list: `Roofline` (a hardware file) or
    `profile.operator_table.TablePricer` (timed operators). ``fused``: attention runs as one kernel, priced by
    ``attention``, rather than as its two products and its score passes."""

    fused: bool

    def gemm(self, gemm: Gemm) -> np.ndarray: ...

    def attention(self, model: ModelConfig, b, i, j, t: int) -> tuple[np.ndarray, np.ndarray]: ...

    def stream(self, nbytes) -> np.ndarray: ...

    def hold_layer(self, model: ModelConfig, t: int, j, times: tuple, priced: tuple[int, int, int]) -> tuple: ...

    def hold_end(self, seconds: np.ndarray, kernels: int, priced: int) -> np.ndarray: ...


class Roofline:
    """Prices each kernel of a layer by the hardware file's roofline (the module docstring), and holds a tile at the
    file's dispatch floor: the pricer of `layer_seconds_split` and `ends_seconds` for an analytic profile (the other
    is `profile.operator_table.TablePricer`, from timed operators)."""

    def __init__(self, hardware: Hardware) -> None:
        self.hardware, self.dev, self.dtype_bytes = hardware, hardware.device, hardware.training.dtype_bytes
        self.fused = hardware.training.attention == "fused"

    def gemm(self, gemm: Gemm) -> np.ndarray:
        return _gemm_seconds(self.dev, self.dtype_bytes, gemm)

    def attention(self, model: ModelConfig, b, i, j, t: int) -> tuple[np.ndarray, np.ndarray]:
        return _fused_attention_seconds(self.dev, self.dtype_bytes, model, b, i, j, t)

    def stream(self, nbytes) -> np.ndarray:
        return _stream_seconds(self.dev, nbytes)

    def hold_layer(self, model: ModelConfig, t: int, j, times: tuple, priced: tuple[int, int, int]) -> tuple:
        """(forward, backward, I, W) held at the dispatch floor (`dispatch_floor_seconds`), where the file has one;
        ``j``: the tiles' context lengths; ``priced``: the kernels priced one by one forward, in I and in W (the
        roofline needs neither)."""
        forward, backward, inputs, weight = times
        dev, hardware = self.dev, self.hardware
        if dev.dispatch_s:
            floor_fwd, floor_bwd = dispatch_floor_seconds(hardware, t, model)
            floor_w = weight_kernels_per_tile(hardware.training.dtype, model) * dev.dispatch_s
            forward, backward = np.maximum(forward, floor_fwd), np.maximum(backward, floor_bwd)
            inputs, weight = np.maximum(inputs, floor_bwd - floor_w), np.maximum(weight, floor_w)
        return forward, backward, inputs, weight

    def hold_end(self, seconds: np.ndarray, kernels: int, priced: int) -> np.ndarray:
        """One end's forward or backward of ``kernels`` kernels (``priced`` of them priced one by one), held at the
        dispatch floor."""
        return np.maximum(seconds, kernels * self.dev.dispatch_s) if self.dev.dispatch_s else seconds


def layer_seconds(
    model: ModelConfig, hardware: Hardware, b, i, j, tensor_parallel: int = 1, pricer: Pricer | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds of one layer on one device for tiles (b, i, j) (broadcast arrays)."""
    forward, backward, _, _ = layer_seconds_split(model, hardware, b, i, j, tensor_parallel, pricer)
    return forward, backward


def layer_seconds_split(
    model: ModelConfig, hardware: Hardware, b, i, j, tensor_parallel: int = 1, pricer: Pricer | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Forward, backward, and the backward split into I and W (docs/design.md §11b): seconds of one layer on one
    device for tiles (b, i, j) (broadcast arrays), each kernel priced by ``pricer`` (None: the hardware file's
    `Roofline`; `profile.operator_table.TablePricer`: timed operators).

    I holds every product's input gradient (``dgrad``), both of attention's backward products (the gradients of the
    queries and of the keys and values, the context's too: `models.spec.ACTIVATION_PRODUCTS`), the fused attention's
    backward, every element-wise kernel (the norms', the activation's, the softmax's, the residuals') and the
    tensor-parallel all-reduces, which sit on the activations' path; W the weights' gradient products (``wgrad``).
    Each is held at its own dispatch floor (its kernels: `weight_kernels_per_tile`), so where the floor binds,
    I + W is more than the whole backward, as the split's two calls launch their kernels in two runs."""
    pricer = Roofline(hardware) if pricer is None else pricer
    e = hardware.training.dtype_bytes
    b, i, j = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (b, i, j)))
    t = tensor_parallel
    H = float(model.hidden)
    act = b * i * H * e  # bytes of one b × i × H activation
    inner = act * model.ffn_hidden / H / t
    scores = b * (model.heads / t) * i * (i + j) * e  # bytes of one attention score matrix

    fwd_gemms = forward_gemms(model, b, i, j, t)
    fused = pricer.fused
    if fused:  # the attention products run inside one kernel, priced on their own
        fwd_gemms = [g for g in fwd_gemms if g[0] not in ("scores", "values")]
        scores = 0.0 * scores  # never written to memory
    forward = sum(pricer.gemm(g) for g in fwd_gemms)
    bwd_gemms = backward_gemms(fwd_gemms)
    backward = sum(pricer.gemm(g) for g in bwd_gemms)
    weight = sum(pricer.gemm(g) for g in bwd_gemms if is_weight_gradient(g))
    inputs = sum(pricer.gemm(g) for g in bwd_gemms if not is_weight_gradient(g))
    if fused:
        attention_fwd, attention_bwd = pricer.attention(model, b, i, j, t)
        forward, backward, inputs = forward + attention_fwd, backward + attention_bwd, inputs + attention_bwd

    # Element-wise kernels, bytes moved (read + write): the architecture's (`terapipe_cli.models`' ``streams``).
    fwd_stream, bwd_stream = model.spec.streams(model, act, inner, scores, t, e)
    forward = forward + sum(pricer.stream(x) for x in fwd_stream)
    bwd_streams = sum(pricer.stream(x) for x in bwd_stream)
    backward, inputs = backward + bwd_streams, inputs + bwd_streams

    # Megatron's f/g operators: two all-reduces of the activation forward, two of its gradient backward.
    link = hardware.intra_node
    allreduce = ring_allreduce_seconds(act, t, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s)
    forward, backward, inputs = forward + 2 * allreduce, backward + 2 * allreduce, inputs + 2 * allreduce
    # The tile's weight gradients added into the step's (`config.hardware.Training.grad_accumulate_bytes_per_param`):
    # a pass over the layer's parameters whatever the tile's length, in W where the backward is split. GPU work like
    # the rest, so under the dispatch floor below where the host sets the pace.
    accumulate = _accumulate_seconds(hardware, model.params_per_layer(t), pricer)
    backward, weight = backward + accumulate, weight + accumulate
    wgrads = sum(1 for g in bwd_gemms if is_weight_gradient(g)) + 1  # and the accumulation
    attention_ops = 1 if fused else 0
    streams_run = [sum(1 for x in side if np.any(x)) for side in (fwd_stream, bwd_stream)]  # fused: no score passes
    priced = (
        len(fwd_gemms) + attention_ops + streams_run[0],
        len(bwd_gemms) + 1 - wgrads + attention_ops + streams_run[1],
        wgrads,
    )
    return pricer.hold_layer(model, t, j, (forward, backward, inputs, weight), priced)


def _accumulate_seconds(hardware: Hardware, params: float, pricer: Pricer) -> float:
    """One tile's weight gradients of ``params`` parameters added into the step's gradient buffers."""
    nbytes = hardware.training.grad_accumulate_bytes_per_param * params
    return float(pricer.stream(np.asarray(nbytes))) if nbytes else 0.0


def ends_seconds(
    model: ModelConfig,
    hardware: Hardware,
    b,
    i,
    tensor_parallel: int = 1,
    *,
    vocab_parallel: bool = False,
    pricer: Pricer | None = None,
) -> dict[str, np.ndarray]:
    """Forward and backward seconds of the pipeline's ends on one device for tiles (b, i) (docs/design.md §3):
    ``embed_forward``/``embed_backward`` (the first chunk: token and position embedding) and ``head_forward``/
    ``head_backward`` (the last chunk: final layer norm, LM head, cross-entropy). With ``vocab_parallel`` each of
    the T tensor ranks holds its rows of the embedding and of the head (Megatron's split, engine/tensor.py; priced
    for the fullest rank, ⌈V/T⌉ rows, `models.vocab_share`): its products and its logits' kernels shrink by
    T, the embedding's output is all-reduced over the ranks, the loss's per-token max and then its sum of
    exponentials with the target's logit (one all-reduce of both), and the head input's gradient in the backward;
    otherwise every rank runs the whole of both.

    Embedding: a gather of b·i rows of H (memory-bound: read and write b·i·H) plus the position rows and their sum;
    its backward scatters the gradient into the table (read b·i·H, read and write the rows touched). Head: the norm
    (2·b·i·H), the product (b·i) × H × V forward and again in the backward (the chunked head makes its logits again)
    with its two products, and the cross-entropy's
    log-softmax over b·i × V (the logits read and written twice forward, three times backward, fp32).
    Each backward also adds its tables' gradients into the step's (as a layer does, `layer_seconds_split`). Each
    kernel priced by ``pricer``, as a layer's.
    """
    pricer = Roofline(hardware) if pricer is None else pricer
    e = hardware.training.dtype_bytes
    b, i = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (b, i)))
    H, t = float(model.hidden), (tensor_parallel if vocab_parallel else 1)
    V = float(vocab_share(model.vocab, t))
    rows = b * i
    act = rows * H * e
    one = np.ones_like(rows)
    stream, gemm = pricer.stream, pricer.gemm
    embed_fwd, embed_bwd = stream(2 * act), stream(3 * act)  # gather; scatter-add
    if model.spec.learned_positions:  # + positions (rotary ones turn inside attention); their rows' gradient
        embed_fwd, embed_bwd = embed_fwd + stream(3 * act), embed_bwd + stream(act)
    head = ("head", one, rows, one * V, one * H)
    logits = rows * V * 4.0  # the loss works in fp32
    head_fwd = stream(2 * act) + gemm(head) + 2 * stream(2 * logits)
    # The backward makes each chunk's logits again (the chunked head, engine/loss.py): the forward's product, its two.
    head_bwd = stream(3 * act) + sum(gemm(g) for g in [head, *backward_gemms([head])])
    head_bwd = head_bwd + 3 * stream(2 * logits)
    if t > 1:  # the embedding's partial rows summed, the loss's per-token max and sum of exponentials
        link = hardware.intra_node
        embed_fwd = embed_fwd + ring_allreduce_seconds(act, t, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s)
        top, sums = (
            ring_allreduce_seconds(rows * n, t, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s) for n in (4, 8)
        )
        head_fwd = head_fwd + top + sums
        head_bwd = head_bwd + ring_allreduce_seconds(act, t, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s)
    # Each tile's gradients of the tables added into the step's, as a layer's (`layer_seconds_split`).
    embed_params, head_params = ends_params(model, tensor_parallel, vocab_parallel=vocab_parallel)
    embed_bwd = embed_bwd + _accumulate_seconds(hardware, embed_params, pricer)
    head_bwd = head_bwd + _accumulate_seconds(hardware, head_params, pricer)
    # A handful of kernels each way (gather/add; norm, product, loss), of which the priced ones above (with the
    # positions' and the accumulation): no tile is shorter than their dispatch.
    positions = 1 if model.spec.learned_positions else 0
    return {
        "embed_forward": pricer.hold_end(embed_fwd, 3, 1 + positions),
        "embed_backward": pricer.hold_end(embed_bwd, 4, 2 + positions),
        "head_forward": pricer.hold_end(head_fwd, 6, 4),
        "head_backward": pricer.hold_end(head_bwd, 10, 8),
    }


def ends_params(model: ModelConfig, tensor_parallel: int = 1, *, vocab_parallel: bool = False) -> tuple[int, int]:
    """Parameters of the embedding (token and position tables) and of the head (final norm and LM head) on one
    device: the fullest tensor rank's share of the vocabulary rows with ``vocab_parallel`` (`models.vocab_share`), the
    whole vocabulary otherwise (`models.ModelConfig.end_params`)."""
    return model.end_params(vocab_share(model.vocab, tensor_parallel if vocab_parallel else 1))


# Tensor parallelism: two all-reduces forward and two backward, each a clone and the collective (engine/tensor.py).
TENSOR_PARALLEL_KERNELS = (4, 4)


def kernels_per_tile(dtype: str, tensor_parallel: int = 1, model: ModelConfig | None = None) -> tuple[int, int]:
    """The kernels one tile of one layer of ``model`` launches (None: the ``gpt`` layer's), forward and backward,
    in ``dtype`` on T tensor ranks.

    Counted from the runtime's layer (each architecture's tables, `terapipe_cli.models`) for the PyTorch 2.x CUDA
    kernels; a version that fuses or splits a kernel differently moves the count by one or two of about 15 forward
    and 35 backward, which the calibrated ``dispatch_s`` absorbs (it is fitted against the ``gpt`` counts).
    """
    spec = arch_spec("gpt") if model is None else model.spec
    fwd, bwd = (sum(n for _, n in kernels) for kernels in spec.kernels(model))
    if dtype in ("bf16", "fp16"):
        extra = spec.autocast_kernels
        fwd, bwd = fwd + extra[0], bwd + extra[1]
    if tensor_parallel > 1:
        fwd, bwd = fwd + TENSOR_PARALLEL_KERNELS[0], bwd + TENSOR_PARALLEL_KERNELS[1]
    return fwd, bwd


def weight_kernels_per_tile(dtype: str, model: ModelConfig | None = None) -> int:
    """Of `kernels_per_tile`'s backward kernels, those a split backward's W launches (each architecture's
    ``weight_kernels``: the weights' gradient products, their ``.grad +=`` and, under autocast, their casts)."""
    spec = arch_spec("gpt") if model is None else model.spec
    plain, autocast = spec.weight_kernels
    return plain + (autocast if dtype in ("bf16", "fp16") else 0)


def dispatch_floor_seconds(
    hardware: Hardware, tensor_parallel: int = 1, model: ModelConfig | None = None
) -> tuple[float, float]:
    """The least time the host needs to issue one tile's forward and backward kernels.

    Eager PyTorch launches kernels asynchronously: the host walks the layer op by op (Python, the dispatcher,
    autograd's bookkeeping, the launch) while the GPU works through its queue. When the kernels are longer than
    their dispatch the host runs ahead and the GPU sets the pace; when they are shorter, the GPU waits for each
    next kernel and the host sets it. So a tile takes max(GPU time, kernels × dispatch_s) — the two bounds of
    that queue. The max is exact wherever one side dominates, which is everywhere but near the crossover, where
    it is low by at most half (a GPU that idles on a few short kernels while long ones queue up); the measured
    tile times showed a flat floor and then a straight GPU line, with no wide bend to model.
    """
    fwd, bwd = kernels_per_tile(hardware.training.dtype, tensor_parallel, model)
    return fwd * hardware.device.dispatch_s, bwd * hardware.device.dispatch_s


def activation_bytes_per_token(model: ModelConfig, dtype_bytes: int, tensor_parallel: int = 1) -> float:
    """Activation bytes one layer keeps for the backward per token: the architecture's count (`terapipe_cli.models`'
    ``activation_bytes_per_token``: Korthikanti et al.'s for ``gpt`` and ``gpt2``, llama's from its ops)."""
    return model.spec.activation_bytes_per_token(model, dtype_bytes, tensor_parallel)


def _context_points(
    batch_sizes: Sequence[int], seq_len: int, token_step: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tiles (b, i, j > 0) spread geometrically over the slice and context lengths a plan can use."""
    lengths = np.unique(np.geomspace(token_step, seq_len, 12).round() // token_step * token_step).astype(int)
    lengths = lengths[lengths >= 1]
    pts = [(b, i, j) for b in batch_sizes for i in lengths for j in lengths if i + j <= seq_len]
    if len(pts) < 8:  # very short sequences: use every pair
        grid = range(1, seq_len + 1)
        pts = [(b, i, j) for b in batch_sizes for i in grid for j in grid if i + j <= seq_len]
    b, i, j = (np.array(x, dtype=float) for x in zip(*pts, strict=True))
    return b, i, j


def token_grid(seq_len: int, token_step: int) -> list[int]:
    """Every multiple of the token step up to L, and L itself."""
    grid = list(range(token_step, seq_len + 1, token_step))
    if not grid or grid[-1] != seq_len:
        grid.append(seq_len)
    return grid


def analytic_profile(
    model: ModelConfig,
    hardware: Hardware,
    *,
    tensor_parallel: int = 1,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    token_step: int = 8,
    vocab_parallel: bool = True,
    pricer: Pricer | None = None,
) -> dict:
    """A ``terapipe.profile/3`` object (``"source": "analytic"``) for ``model`` on ``hardware``.

    Times are per layer on one device of a tensor-parallel group of ``tensor_parallel`` GPUs, on the grid
    (``batch_sizes``) × (every multiple of ``token_step`` up to the model's seq_len). The profile's precision is
    the hardware file's ``[training] dtype``, the precision its ``peak_flops`` is for. The embedding and the head
    are priced split over the tensor ranks by vocabulary rows, as the runtime runs them (``vocab_parallel``;
    False only to price a profile again as it was made before the split, `extended_for_batch`). ``pricer``: how each
    kernel is priced (None: `Roofline`; `profile.operator_table.operator_profile` passes its table's).
    """
    sizes = _check_grid(model, hardware, tensor_parallel, batch_sizes, token_step)
    if hardware.training.dtype not in PRECISIONS:
        raise UserError(
            "[training] dtype must be fp32, bf16 or fp16 (the precision of peak_flops), "
            f"got {hardware.training.dtype!r}",
            where=str(hardware.path),
        )
    t, e = tensor_parallel, hardware.training.dtype_bytes
    lengths = token_grid(model.seq_len, token_step)
    bb, ii = np.meshgrid(np.array(sizes, dtype=float), np.array(lengths, dtype=float), indexing="ij")
    fwd, bwd, bwd_input, bwd_weight = layer_seconds_split(model, hardware, bb, ii, 0.0, t, pricer)
    ends = ends_seconds(model, hardware, bb, ii, t, vocab_parallel=vocab_parallel, pricer=pricer)
    embed_params, head_params = ends_params(model, t, vocab_parallel=vocab_parallel)
    params = model.params_per_layer(t)
    net = hardware.network
    return {
        "schema": PROFILE_SCHEMA,
        "source": "analytic",
        "note": (
            f"ESTIMATED, not measured: roofline model of one decoder layer on {hardware.device.name} "
            f"({hardware.name}, hardware file {hardware.path}), {hardware.training.dtype} training "
            f"({e}-byte activations), tensor parallelism {t} inside a node"
            f"{' (the embedding and the head split by vocabulary rows)' if vocab_parallel and t > 1 else ''}; "
            "stage-to-stage transfers over the inter-node network. Made by terapipe_cli.profile.analytic."
        ),
        "created": utc_timestamp(),
        "device": _device_entry(hardware, t),
        "model": model.to_dict(),
        "precision": hardware.training.dtype,
        "dtype": hardware.training.dtype,
        "dtype_bytes": e,
        "token_step": token_step,
        "batch_sizes": sizes,
        "token_lengths": lengths,
        "forward_s": fwd.tolist(),
        "backward_s": bwd.tolist(),
        # I and W from the kernel tables (`layer_seconds_split`); a tile's context adds to I alone (the costmodel).
        "backward_input_s": bwd_input.tolist(),
        "backward_weight_s": bwd_weight.tolist(),
        "context": _fit_context_term(model, hardware, t, sizes, token_step, pricer),
        "ends": {
            **{f"{name}_s": value.tolist() for name, value in ends.items()},
            "embed_params": embed_params,
            "head_params": head_params,
        },
        "comm": {"latency_s": net.latency_s, "bytes_per_s": net.bytes_per_s},
        "optimizer_s_per_layer": _optimizer_seconds(hardware, params),
        "params_per_layer": params,
        "vocab_parallel": vocab_parallel,
        "data_parallel_link": {
            "latency_s": net.latency_s,
            "bytes_per_s": net.bytes_per_s / hardware.gpus_per_node,
        },
        "activation_bytes_per_token_per_layer": activation_bytes_per_token(model, e, t),
        "state_bytes_per_param": hardware.training.state_bytes_per_param,
        # The hardware as estimated from, so that `terapipe plan` can price this profile again at batch sizes
        # beyond its grid (`extended_for_batch`) and name where its constants come from (`plan.domain`).
        "hardware_config": hardware_to_dict(hardware),
    }


def _check_grid(
    model: ModelConfig, hardware: Hardware, tensor_parallel: int, batch_sizes: Sequence[int], token_step: int
) -> list[int]:
    """The batch sizes of the grid, sorted and deduplicated, once every argument is checked."""
    hardware.check_tensor_parallel(model, tensor_parallel)
    if isinstance(token_step, bool) or not isinstance(token_step, int) or token_step < 1:
        raise UserError(f"must be a positive integer, got {token_step!r}", where="token_step")
    sizes = sorted(set(batch_sizes))
    if not sizes or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in sizes):
        raise UserError(f"must be positive integers, got {list(batch_sizes)!r}", where="batch_sizes")
    return sizes


def _fit_context_term(
    model: ModelConfig,
    hardware: Hardware,
    tensor_parallel: int,
    sizes: Sequence[int],
    token_step: int,
    pricer: Pricer | None = None,
) -> dict:
    """The profile's ``context`` entry: t_ctx fitted on two thirds of the points, its relative tile-time error
    reported on the rest."""
    t = tensor_parallel
    b, i, j = _context_points(sizes, model.seq_len, token_step)
    f_ctx, b_ctx = layer_seconds(model, hardware, b, i, j, t, pricer)
    f_nc, b_nc = layer_seconds(model, hardware, b, i, 0.0, t, pricer)
    held = np.random.default_rng(0).permutation(b.size) % 3 == 0
    context = {}
    for name, nc, full in (("forward", f_nc, f_ctx), ("backward", b_nc, b_ctx)):
        fit = fit_context(b[~held], i[~held], j[~held], nc[~held], full[~held])
        err = fit.errors(b[held], i[held], j[held], nc[held], full[held])
        context[name] = {
            "coef": list(fit.coef),
            "heldout_rel_err_mean": err.mean,
            "heldout_rel_err_max": err.max,
            "heldout_points": err.count,
            "fit_rel_err_max": fit.fit_err.max,
        }
    return context


def _optimizer_seconds(hardware: Hardware, params: int) -> float:
    """One optimizer update of a layer's weights: memory-bound, no faster than one kernel launch."""
    dev = hardware.device
    return max(
        params * hardware.training.optimizer_bytes_per_param / (dev.memory_bytes_per_s * dev.memory_efficiency),
        dev.kernel_launch_s,
    )


def _device_entry(hardware: Hardware, tensor_parallel: int) -> dict:
    dev = hardware.device
    return {
        "kind": "cuda",
        "name": dev.name,
        "hardware": hardware.name,
        "hardware_file": hardware.path,
        "constants": hardware.constants,
        "memory_bytes": dev.memory_bytes,
        **({"reserved_bytes": dev.reserved_bytes} if dev.reserved_bytes else {}),
        "gpus_per_node": hardware.gpus_per_node,
        "tensor_parallel": tensor_parallel,
    }


def experiment_profile(exp: Experiment, *, batch_size: int, tensor_parallel: int, token_step: int) -> dict:
    """The analytic profile (docs/design.md §12) of the experiment's model on its hardware at ``tensor_parallel``,
    for planning pipelines of ``batch_size`` sequences: every batch-slice size the planner may choose, 1 to
    ``batch_size``, is on the grid (analytic times cost nothing to compute, and it spares the interpolation in b)."""
    try:
        exp.hardware.check_tensor_parallel(exp.model, tensor_parallel)
    except UserError as e:
        raise UserError(f"{e.message} (experiment {exp.name})", where="--tensor-parallel") from None
    return analytic_profile(
        exp.model,
        exp.hardware,
        tensor_parallel=tensor_parallel,
        batch_sizes=range(1, batch_size + 1),
        token_step=token_step,
    )


def extended_batch_sizes(grid: Sequence[int], batch_size: int) -> list[int]:
    """The grid's batch sizes, every power of two up to ``batch_size``, and ``batch_size`` itself."""
    powers = {1 << k for k in range(batch_size.bit_length()) if 1 << k <= batch_size}
    return sorted(set(grid) | powers | {batch_size})


def extended_for_batch(profile: Profile, batch_size: int) -> Profile | None:
    """An analytic profile priced again by its own model for a plan of ``batch_size`` sequences per replica, when
    its grid stops short of that (docs/design.md §3a): on `extended_batch_sizes`, so that no batch slice the plan
    may choose is extrapolated (between grid sizes the cost model interpolates, as on a grid made with
    ``--batch-sizes`` so). The result keeps the file's path and checksum and records the sizes it added under
    ``"extended"``. None when the grid already reaches ``batch_size``, or the profile is not analytic or keeps no
    ``hardware_config`` (made before profiles kept it): the planner then stays within the grid."""
    grid = profile.batch_sizes
    config = profile.raw.get("hardware_config")
    if profile.source != "analytic" or batch_size <= max(grid) or not isinstance(config, dict):
        return None
    where = f"{profile.path or 'the profile'}: field 'hardware_config'"
    hardware = hardware_from_dict(config, where)
    named = profile.device.get("hardware_file")
    if isinstance(named, str):
        hardware = replace(hardware, path=named)
    sizes = extended_batch_sizes(grid, batch_size)
    obj = analytic_profile(
        profile.model,
        hardware,
        tensor_parallel=profile.tensor_parallel,
        batch_sizes=sizes,
        token_step=profile.token_step,
        vocab_parallel=profile.vocab_parallel,
    )
    obj["extended"] = {"from_batch_sizes": list(grid), "added": sorted(set(sizes) - set(grid))}
    extended = profile_from_dict(obj, where)
    return replace(extended, path=profile.path, sha256=profile.sha256)
