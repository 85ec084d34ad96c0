"""The memory estimate (docs/design.md §10): what each stage keeps for its backward, walked along its schedule.

No torch, no I/O. The sizes come from a profile (`stage_sizes`); `stage_memory` walks one stage's actions the way
the runtime keeps and releases tensors (`engine.stage.StageRunner`, whose `SavedBytes` counts the same things
on the measured side):

* a batch slice's K/V caches (ℓ layers × keys and values of the whole sequence, this tensor rank's heads, in the
  compute precision) are allocated by its first forward and freed after its last backward;
* without recomputation a tile keeps everything its forward saved, from its forward to its backward;
* with recomputation a tile keeps only its input; its backward runs the forward again, and while it does, the
  tile's saved tensors are back on top of everything still kept;
* a split backward (I, then W; docs/design.md §11b) keeps all of that until the tile's W, and from its I the weight
  consumers' output gradients W starts from (`StageSizes.weight_grads`); the K/V caches go after the last W.

For the planner the same walk has a closed form for any batch grouping. When batch slice d (b_d sequences) runs
its backward on stage k, the batch slices still open there hold W_kd sequences in all, d's own included: in GPipe
order (backwards from the last batch slice) those of batch slices 0 … d; in 1F1B order those of d and the next
K − k − 1 batch slices (stage k runs at most K − k ahead). Per token (``cache`` the K/V caches, ``tile`` what a
tile keeps, ``kept`` a recomputed tile's input, ``rerun`` what its re-run saves besides):

    no recomputation:  peak_k = max over d of  W_kd·L·(cache + tile)
    recomputation:     peak_k = max over d and d's tiles (i, j) of
                                W_kd·L·cache + (W_kd − b_d)·L·kept + b_d·(j + i)·kept + b_d·i·rerun

(`in_flight`, `plain_bytes`, `recomputed_bytes`; plus the stage's state, weight copies and the head's transient). The
planner searches batch groupings with it (`plan.groupings`); for D equal batch slices of b (`EqualSlices`) the largest
W is D·b in GPipe order and min(K − k, D)·b in 1F1B. The tests check the closed form against the walk.

`check_memory` holds the estimate against a limit (`MemoryCheck`): ``--memory-limit`` or a GPU's memory per device,
a CPU's memory shared by the workers on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from terapipe_cli.config.device import machine_memory_bytes
from terapipe_cli.models import vocab_share
from terapipe_cli.plan.traced import TracedStage
from terapipe_cli.schedule.actions import Action, Phase, Tile, plan_tiles
from terapipe_cli.schedule.orders import order_of
from terapipe_cli.schedule.partition import Partition
from terapipe_cli.schedule.schedule import Schedule, scheme_shape
from terapipe_cli.units import format_bytes

_INDEX_BYTES = 8  # an int64 token id or position, per token

# The chunked head and loss (engine/loss.py): while a chunk of the last stage's tile runs its head, its logits live for
# a moment, at most two fp32 arrays of them at once (the logits and the log-sum-exp's or the softmax's temporary).
LOSS_BYTES_PER_LOGIT = 8.0
# The chunk is the largest power of two (at least MIN, at most MAX tokens) whose logits' transient fits this share of
# the device's memory — or, on a device that records none (a CPU), this many bytes. Fewer, larger chunks run the head's
# products at full speed and add each chunk's 16-bit weight gradient into the fp32 one fewer times.
LOSS_CHUNK_SHARE = 1 / 32
LOSS_CHUNK_BUDGET_BYTES = 2**29
MIN_LOSS_CHUNK_TOKENS, MAX_LOSS_CHUNK_TOKENS = 128, 2**16


def loss_chunk_tokens(vocab_rows: int, limit_bytes: float | None = None) -> int:
    """The tokens the last stage's head and loss run at a time (`engine.loss`) for ``vocab_rows`` rows of the
    vocabulary on a device of ``limit_bytes`` (None: unknown): see `LOSS_CHUNK_SHARE`."""
    budget = LOSS_CHUNK_SHARE * limit_bytes if limit_bytes else LOSS_CHUNK_BUDGET_BYTES
    chunk = MIN_LOSS_CHUNK_TOKENS
    while chunk < MAX_LOSS_CHUNK_TOKENS and 2 * chunk * vocab_rows * LOSS_BYTES_PER_LOGIT <= budget:
        chunk *= 2
    return chunk


def planned_loss_chunk_tokens(profile) -> int:
    """`loss_chunk_tokens` for a profile's fullest tensor rank's rows and its device's memory (a GPU's; a CPU profile
    records none): what a plan records and the estimate prices."""
    device = getattr(profile, "device", None) or {}
    vocab_parallel = bool(getattr(profile, "vocab_parallel", False))
    return device_loss_chunk_tokens(profile.model, profile.tensor_parallel, vocab_parallel, device.get("memory_bytes"))


def device_loss_chunk_tokens(model, tensor_parallel: int, vocab_parallel: bool, memory_bytes) -> int:
    """`loss_chunk_tokens` of ``model`` on T = ``tensor_parallel`` ranks (the fullest rank's rows when the vocabulary
    is split) of a device of ``memory_bytes`` (None or not a number: unknown)."""
    split = vocab_parallel and tensor_parallel > 1
    rows = vocab_share(model.vocab, tensor_parallel) if split else model.vocab
    memory = float(memory_bytes) if isinstance(memory_bytes, (int, float)) else None
    return loss_chunk_tokens(rows, memory)


@dataclass(frozen=True)
class StageSizes:
    """Bytes per token that stage k keeps, from the profile (docs/design.md §10)."""

    state: float  # weights, gradients and optimizer state of the stage's parameters (not per token)
    cache: float  # K/V caches, per token of a batch slice's sequence: ℓ · 2 · kv_heads·d/T · compute bytes
    tile: float  # what a tile keeps without recomputation, per token of the tile (its caches' rows apart)
    kept: float  # what a recomputed tile keeps: its input (token ids on stage 0, the fp32 activation elsewhere)
    rerun: float  # what the re-run of a recomputed tile saves on top of ``kept``
    copies: float = 0.0  # a 16-bit compute type's copies of the weight matrices, one per step (not per token)
    # For a moment, not per token: the chunked head's logits of one chunk (and a 16-bit weight gradient), last stage
    transient: float = 0.0
    # A split backward (I then W): the weight consumers' output gradients held from a tile's I to its W, per token
    weight_grads: float = 0.0
    # A traced profile (`plan.traced`): the chunk's sizes as functions of the tile, with its actions' transients. The
    # walk then reads them (its peak holds the transients); the closed forms read the per-token fields above, taken
    # at a tile of one whole sequence, and ``transient``, the largest action's peak there.
    traced: TracedStage | None = None


@dataclass(frozen=True)
class StageMemory:
    """Estimated peak memory of one stage (bytes)."""

    stage: int
    state_bytes: float  # weights, gradients and optimizer state of the stage's parameters
    activation_bytes: float  # the most kept for the backward at once, walking the stage's actions
    tiles_in_flight: int  # tiles run forward and not yet backward at that moment
    transient_bytes: float = 0.0  # for a moment on top: the chunked head's logits of one chunk (`StageSizes.transient`)

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes + self.transient_bytes


def stage_sizes(profile, stages: int, partition: Partition | None = None) -> list[StageSizes] | None:
    """Per chunk (per stage when v = 1), the sizes the estimate walks with; None when the profile lacks them.
    ``partition`` gives each chunk's layers (default: the most even split over ``stages``).

    ``activation_bytes_per_token_per_layer`` (a) is what `terapipe profile` measured for one layer: the tensors it
    saves (its input among them) and its own rows of the K/V cache. Over ℓ layers each layer's input is the output
    of the one before, so a tile keeps ℓ·(a − kv) per token besides the caches, plus the stage's output (4H, fp32)
    — except on the last stage, which keeps its final norm's input and output, one log-sum-exp per token (fp32) and
    its targets instead: the chunked head (engine/loss.py) keeps no logits for the backward, it makes each chunk's
    again, so its logits are a ``transient`` of one chunk (`planned_loss_chunk_tokens`). Stage 0 also keeps the
    token ids and positions its embeddings index. The layers' numbers are the profile's, already per tensor rank.
    With a 16-bit compute type the step also keeps one 16-bit copy of each weight matrix (the layers' and the head's;
    `StageRunner.step`) while tiles are in flight.

    The token embedding and the head: a profile that says ``vocab_parallel`` (the runtime's Megatron split,
    engine/tensor.py) counts the fullest tensor rank's share of their rows, ⌈V/T⌉ (`models.vocab_share`),
    in their parameters, their 16-bit copy and the logits' transient, plus what the split keeps besides: the local
    token ids and the mask of the tokens another rank holds (stage 0). A profile without it (made before the split)
    counts them whole on every tensor rank, as before.
    """
    raw = getattr(profile, "raw", {}) or {}
    per_layer = profile.activation_bytes_per_token_per_layer
    params = profile.params_per_layer
    traced = getattr(profile, "memory", None)
    if params is None or (per_layer is None and traced is None):
        return None
    if per_layer is None:
        per_layer = 0.0  # unused: the traced sizes replace the formulas
    model = profile.model
    H, T = model.hidden, profile.tensor_parallel
    split = bool(getattr(profile, "vocab_parallel", False)) and T > 1
    V = vocab_share(model.vocab, T) if split else model.vocab  # the fullest rank's rows of the embedding and head
    mask = 1.0 if split else 0.0  # a bool per token: which tokens (targets) another rank holds
    partition = partition or Partition.balanced(model.layers, stages)
    compute = 4 if profile.precision == "fp32" else 2
    # Keys and values of this rank's kv_heads·d/T features per token (H/T with one K/V head per query head): a
    # grouped-query model's caches are kv_heads/heads of the multi-head model's.
    kv = 2.0 * (model.kv_width / T) * compute
    embed_params = model.end_params(V)[0]
    state_per_param = float(raw.get("state_bytes_per_param", 16.0))
    gemm_out = sum(float(g[3]) for g in model.spec.forward_gemms(model, 1.0, 1.0, T, []))  # outputs per token
    chunk = planned_loss_chunk_tokens(profile)
    out = []
    for k, layers in enumerate(partition.layers):
        first, last = k == 0, k == partition.chunks - 1
        stage_params = layers * params
        tile = layers * (per_layer - kv) + (0.0 if last else 4.0 * H)
        if first:
            stage_params += embed_params
            tile += 2 * _INDEX_BYTES + (_INDEX_BYTES + mask if split else 0.0)  # + the split's local ids and mask
        transient = 0.0
        if last:
            # Tied: the embedding's table when both ends are on one device (K = 1), else a copy of it (§6a).
            stage_params += 0 if model.tie_embeddings and partition.devices == 1 else V * H
            # What the head keeps now (a reader of a traced estimate beside this: the hand formula's last stage):
            # the final norm's input and output (fp32), one log-sum-exp per token (fp32) and the targets; nothing of
            # size V. The logits live one chunk at a time, in the forward and again in the backward, with a 16-bit
            # compute type also the chunk's 16-bit weight gradient before it joins the fp32 one (engine/loss.py).
            tile += 2 * 4.0 * H + 4.0 + _INDEX_BYTES
            # A chunk is at most a tile: counted up to one sequence (a tile of b sequences may hold more, rarely).
            transient = min(chunk, model.seq_len) * V * LOSS_BYTES_PER_LOGIT + (compute * V * H if compute == 2 else 0)
        kept = _INDEX_BYTES if first else 4.0 * H
        # The re-run keeps nothing of its own output (the backward starts from it at once).
        rerun = max(tile - kept - (0.0 if last else 4.0 * H), 0.0)
        copies = 0.0 if compute == 4 else compute * (layers * params + (V * H if last else 0.0))
        # Between I and W (engine/split_backward.py): the gradient of each weight consumer's output — the layers'
        # matrix products (compute type) and their two norms (fp32), the embeddings' sum, the final norm (the head's
        # weight gradient is I's: engine/loss.py).
        grads = layers * (gemm_out * compute + 2 * 4.0 * H) + (4.0 * H if first else 0.0)
        grads += 4.0 * H if last else 0.0
        state = stage_params * state_per_param
        if traced is not None:  # the trace replaces the formulas above (kept as the fallback)
            out.append(_traced_sizes(traced.stage(layers, first, last), state, model.seq_len))
            continue
        sizes = StageSizes(state, layers * kv, tile, kept, rerun, copies, weight_grads=grads)
        out.append(replace(sizes, transient=transient))
    return out


TRANSIENTS = ("forward", "backward", "input", "weight")


def _traced_sizes(ts: TracedStage, state: float, seq_len: int) -> StageSizes:
    """A chunk's sizes from its traces (`plan.traced`); per token at a tile of one whole sequence for the closed
    forms, with the largest of its actions' transients there."""
    per_token = lambda f: max(float(f(1, seq_len, 0)), 0.0) / seq_len  # noqa: E731
    transient = max(max(float(ts.transient(q, 1, seq_len, 0)) for q in TRANSIENTS), 0.0)
    return StageSizes(
        state, ts.cache, per_token(ts.tile), per_token(ts.kept), per_token(ts.rerun), ts.copies,
        transient=transient, weight_grads=per_token(ts.weight_grads), traced=ts,
    )  # fmt: skip


def walk_peak(
    actions: Sequence[Action], sizes: Sequence[StageSizes], seq_len: int, recompute: Sequence[bool]
) -> tuple[float, int]:
    """The most one device keeps at once along its actions, and how many tiles are in flight then; ``sizes`` and
    ``recompute`` are per chunk (an action's ``stage``), each chunk keeping its own K/V caches."""
    return _walk_peak([(a.phase, a.stage, a.tile) for a in actions], sizes, seq_len, recompute)


def _walk_peak(
    actions: Sequence[tuple[Phase, int, Tile]], sizes: Sequence[StageSizes], seq_len: int, recompute: Sequence[bool]
) -> tuple[float, int]:
    """`walk_peak` of actions given as (kind, chunk, tile): a `Layout`'s need no `Action` made (`scheme_memory`)."""
    alive = peak = 0.0
    count = peak_count = 0
    open_tiles: dict[tuple[int, int], int] = {}  # (chunk, batch slice) -> its tiles run forward, not yet backward
    if actions:
        alive = peak = sum(sizes[c].copies for c in {c for _, c, _ in actions})
    for phase, stage, t in actions:
        s, rerun = sizes[stage], recompute[stage]
        if s.traced is not None:
            alive, at = _traced_step(phase, stage, t, s.traced, rerun, open_tiles, alive, seq_len)
            count += 1 if phase is Phase.F else -1 if phase.frees else 0
            if at > peak:
                peak, peak_count = at, count + (1 if phase.frees else 0)
            continue
        key = (stage, t.batch_slice)
        tokens = t.batch_size * t.tokens
        if phase is Phase.F:
            if not open_tiles.get(key):
                alive += t.batch_size * seq_len * s.cache
            open_tiles[key] = open_tiles.get(key, 0) + 1
            alive += tokens * (s.kept if rerun else s.tile)
            count += 1
            if alive > peak:
                peak, peak_count = alive, count
            continue
        if not phase.frees:  # I: the tile stays until its W
            # A split backward keeps the tile's graph (and a re-run's) until its W: the weights' gradients need it,
            # and the gradients of the weight consumers' outputs W starts from.
            alive += tokens * ((s.rerun if rerun else 0.0) + s.weight_grads)
            if alive > peak:
                peak, peak_count = alive, count
            continue
        if phase is Phase.B and rerun and alive + tokens * s.rerun > peak:
            peak, peak_count = alive + tokens * s.rerun, count
        alive -= tokens * (s.kept + (s.rerun if phase is Phase.W else 0.0) if rerun else s.tile)
        alive -= tokens * s.weight_grads if phase is Phase.W else 0.0
        count -= 1
        open_tiles[key] -= 1
        if not open_tiles[key]:
            alive -= t.batch_size * seq_len * s.cache
    return peak, peak_count


def _traced_step(
    phase: Phase, stage: int, t: Tile, ts: TracedStage, rerun: bool, open_tiles: dict, alive: float, seq_len: int
) -> tuple[float, float]:
    """One action (``phase`` of tile ``t`` on chunk ``stage``) of a traced chunk: what is live after it, and the most
    live during it (what is kept, plus the action's own transient: `plan.traced`). ``open_tiles`` also keeps, per
    batch slice, the K/V gradients its last backward handed back to its earlier tiles (under ``("handback", key)``)."""
    b, i, j = t.batch_size, t.tokens, t.token_start
    key = (stage, t.batch_slice)
    kept = float(ts.kept(b, i, j)) if rerun else float(ts.tile(b, i, j))
    if phase is Phase.F:
        if not open_tiles.get(key):
            alive += b * seq_len * ts.cache
        open_tiles[key] = open_tiles.get(key, 0) + 1
        alive += kept
        return alive, alive + max(float(ts.transient("forward", b, i, j)), 0.0)
    # A recomputed tile's re-run holds its saved tensors again (on top of its input) until its B, or its W.
    held = float(ts.tile(b, i, j)) - kept if rerun else 0.0
    if phase is Phase.W:  # the earlier hand-back goes at this W, this tile's stays until the next W
        handback = float(ts.handback(b, i, j, split=True))
        at = alive + max(float(ts.transient("weight", b, i, j)), 0.0)
        alive -= kept + held + float(ts.weight_grads(b, i, j)) - handback + open_tiles.pop(("handback", key), 0.0)
        open_tiles[("handback", key)] = handback
    else:  # B or I: a B consumes the later tile's hand-back while it runs and leaves its own for the earlier ones
        during = ts.rerun(b, i, j) if rerun else ts.transient("input" if phase is Phase.I else "backward", b, i, j)
        at = alive + max(float(during), 0.0)
        if phase is Phase.I:  # the tile stays until its W, with the gradients W starts from
            return alive + held + float(ts.weight_grads(b, i, j)), at
        handback = float(ts.handback(b, i, j))
        alive += handback - open_tiles.pop(("handback", key), 0.0) - kept
        open_tiles[("handback", key)] = handback
    open_tiles[key] -= 1
    if not open_tiles[key]:
        alive -= b * seq_len * ts.cache + open_tiles.pop(("handback", key), 0.0)
    return alive, at


def stage_memory(schedule: Schedule, profile) -> list[StageMemory] | None:
    """Peak memory per device of a schedule, walking each device's actions (`walk_peak`) over the chunks it holds,
    recomputing where the schedule says. None when the profile lacks the sizes."""
    rows = [[(a.phase, a.stage, a.tile) for a in row] for row in schedule.actions]
    return _stage_memory(rows, schedule.slices, schedule.stages, schedule.recompute, schedule.partition, profile)


def scheme_memory(
    profile,
    slices: Sequence,
    stages: int,
    order: str,
    recompute: Sequence[bool] | None = None,
    partition: Partition | None = None,
) -> list[StageMemory] | None:
    """`stage_memory` of ``Schedule.build(slices, stages, order, recompute, partition)``, the same numbers, walked
    along the order's `Layout` (shared within a plan) without building the schedule's actions."""
    shape = scheme_shape(slices, stages, order, recompute, partition)
    if len(shape.recompute) != shape.chunks:  # refused as `Schedule.build` refuses it
        return stage_memory(Schedule.build(slices, stages, order, recompute, partition), profile)
    tiles = plan_tiles(slices)
    rows = [[(p, c, tiles[n]) for p, c, n in row] for row in shape.layout.rows]
    return _stage_memory(rows, slices, stages, shape.recompute, shape.partition, profile)


def _stage_memory(
    rows: Sequence[Sequence[tuple[Phase, int, Tile]]],
    slices: Sequence,
    stages: int,
    recompute: Sequence[bool],
    partition: Partition | None,
    profile,
) -> list[StageMemory] | None:
    """`stage_memory` of each device's actions as (kind, chunk, tile)."""
    sizes = stage_sizes(profile, stages, partition)
    if sizes is None:
        return None
    chunks = stages if partition is None else partition.chunks
    if len(sizes) != chunks:
        raise ValueError(f"sizes for {len(sizes)} chunks, the schedule has {chunks}")
    device = (lambda c: c % stages) if partition is None else partition.device
    seq_len = sum(slices[0][1])
    out = []
    for k in range(stages):
        peak, count = _walk_peak(rows[k], sizes, seq_len, recompute)
        own = [c for c in range(chunks) if device(c) == k]
        state = sum(sizes[c].state for c in own)
        transient = sum(sizes[c].transient for c in own if sizes[c].traced is None)  # a traced walk's peak holds it
        out.append(StageMemory(k, state, peak, count, transient))
    return out


def in_flight(batch_sizes: Sequence[int], order: str, stages: int) -> list[list[int]]:
    """``W[k][d]``: the sequences of the batch slices open on stage k while batch slice d runs its backward (the
    order's closed form, `orders.Order.in_flight`)."""
    return order_of(order).in_flight(batch_sizes, stages)


def plain_bytes(s: StageSizes, open_sequences, seq_len: int):
    """A stage's peak without recomputation while batch slices of ``open_sequences`` sequences are open."""
    return s.state + s.copies + s.transient + np.asarray(open_sequences, dtype=float) * seq_len * (s.cache + s.tile)


def recomputed_bytes(s: StageSizes, open_sequences, b, seq_len: int, i, j):
    """A stage's peak with recomputation at the backward of a tile of i tokens after j of a batch slice of b
    sequences, while batch slices of ``open_sequences`` sequences (b's among them) are open."""
    W, b = np.asarray(open_sequences, dtype=float), np.asarray(b, dtype=float)
    i, j = np.asarray(i, dtype=float), np.asarray(j, dtype=float)
    return (
        s.state
        + s.copies
        + s.transient
        + W * seq_len * s.cache
        + (W - b) * seq_len * s.kept
        + b * ((j + i) * s.kept + i * s.rerun)
    )


def tile_fits(sizes: Sequence[StageSizes], key: tuple, seq_len: int, limit: float):
    b, opened = key

    def fits(i, j) -> np.ndarray:
        ok = np.ones(np.broadcast(np.asarray(i), np.asarray(j)).shape, dtype=bool)
        for s, w in zip(sizes, opened, strict=True):
            ok &= recomputed_bytes(s, w, b, seq_len, i, j) <= limit
        return ok

    return fits


def grouping_peaks(
    batch_sizes: Sequence[int], worst: Sequence[tuple[int, int]] | None, sizes: Sequence[StageSizes], seq_len: int,
    order: str, recompute: Sequence[bool],
) -> list[float]:  # fmt: skip
    """Each stage's peak by the closed form, for batch slices of ``batch_sizes`` whose tiles (i, j) maximising
    ``(j + i)·kept + i·rerun`` are ``worst[d]`` (needed on recomputing stages only)."""
    W = in_flight(batch_sizes, order, len(sizes))
    out = []
    for k, s in enumerate(sizes):
        if recompute[k]:
            out.append(
                max(float(recomputed_bytes(s, W[k][d], b, seq_len, *worst[d])) for d, b in enumerate(batch_sizes))
            )
        else:
            out.append(float(plain_bytes(s, max(W[k]), seq_len)))
    return out


@dataclass(frozen=True)
class EqualSlices:
    """The closed form of the walk for D equal batch slices of b sequences, one token slicing (module docstring).

    ``limit`` is the bytes per stage (device); ``order`` the schedule order.
    """

    sizes: list[StageSizes]
    batch_slice: int  # b
    slices: int  # D
    seq_len: int  # L
    order: str
    limit: float

    def in_flight(self, k: int) -> int:
        return order_of(self.order).open_slices(k, len(self.sizes), self.slices)

    def plain_bytes(self, k: int) -> float:
        """Stage k's peak without recomputation, for any token slicing."""
        return float(plain_bytes(self.sizes[k], self.in_flight(k) * self.batch_slice, self.seq_len))

    def fits_plain(self) -> list[bool]:
        return [self.plain_bytes(k) <= self.limit for k in range(len(self.sizes))]

    def recomputed_bytes(self, k: int, i, j) -> np.ndarray:
        """Stage k's peak with recomputation, if a tile of i tokens after j were the largest: see the module."""
        b = self.batch_slice
        return recomputed_bytes(self.sizes[k], self.in_flight(k) * b, b, self.seq_len, i, j)

    def tile_fits(self, i, j, *, stages: Sequence[bool] | None = None) -> np.ndarray:
        """Whether a tile (i, j) fits every recomputing stage: ``stages[k]`` (default: those that do not fit
        without)."""
        on = [not p for p in self.fits_plain()] if stages is None else stages
        ks = [k for k, recomputing in enumerate(on) if recomputing]
        b = self.batch_slice
        opened = tuple(self.in_flight(k) * b for k in ks)
        return tile_fits([self.sizes[k] for k in ks], (b, opened), self.seq_len, self.limit)(i, j)


@dataclass(frozen=True)
class MemoryCheck:
    """The estimated peak memory of every stage and the limit it is checked against (docs/design.md §10)."""

    per_stage: list[StageMemory]
    limit_bytes: float | None
    limit_source: str | None  # completes "more than the 16.0 GiB ...": where the limit came from
    # On a CPU every worker of the machine shares its memory: the limit is then for all of them together, the
    # pipeline's stages times ``copies`` (D replicas x T tensor ranks); 0 for a limit per device.
    copies: int = 0
    # The limit constrains the plan: a limit per device (`--memory-limit`, or a GPU profile's device memory). A CPU's
    # memory, shared by all the workers on the machine, only warns.
    enforced: bool = False

    @property
    def peak_bytes(self) -> float:
        return max(m.total_bytes for m in self.per_stage)

    @property
    def fullest_stage(self) -> int:
        return [m.total_bytes for m in self.per_stage].index(self.peak_bytes)

    @property
    def needed_bytes(self) -> float:
        """What must fit under the limit: the fullest stage's peak, or on shared memory every worker's."""
        if self.copies:
            return self.copies * sum(m.total_bytes for m in self.per_stage)
        return self.peak_bytes

    @property
    def exceeded(self) -> bool:
        return bool(self.limit_bytes) and self.needed_bytes > self.limit_bytes

    def summary(self) -> str:
        text = f"estimated peak memory per stage: {format_bytes(self.peak_bytes)} (largest)"
        if self.copies:
            workers = self.copies * len(self.per_stage)
            text += f"; all {workers} workers on one machine: {format_bytes(self.needed_bytes)}"
        return text + (f", limit {format_bytes(self.limit_bytes)}" if self.limit_bytes else "")

    def warning(self) -> str | None:
        """One line for a plan whose fullest stage does not fit, with what to change; None when it fits."""
        if not self.exceeded:
            return None
        if self.copies:
            workers = self.copies * len(self.per_stage)
            return (
                f"the {workers} workers need about {format_bytes(self.needed_bytes)} together (stage "
                f"{self.fullest_stage}: {format_bytes(self.peak_bytes)}), more than the "
                f"{format_bytes(self.limit_bytes)} {self.limit_source}; use a smaller batch or more machines"
            )
        return (
            f"stage {self.fullest_stage} needs about {format_bytes(self.peak_bytes)}, more than the "
            f"{format_bytes(self.limit_bytes)} {self.limit_source}; use more stages, a smaller batch, or tensor "
            "parallelism"
        )

    def to_dict(self) -> dict:
        out = {
            "per_stage_bytes": [m.total_bytes for m in self.per_stage],
            "state_bytes": [m.state_bytes for m in self.per_stage],
            "activation_bytes": [m.activation_bytes for m in self.per_stage],
        }
        if self.limit_bytes is not None:
            out.update(limit_bytes=self.limit_bytes, limit_source=self.limit_source)
        return out


def check_memory(
    per_stage: list[StageMemory] | None, device: dict, limit_gib: float | None, copies: int = 1
) -> MemoryCheck | None:
    """The limit is ``--memory-limit`` (per device) when given, else the profile's device memory when it records
    one, else, for a CPU profile, this machine's memory. A CPU's memory is shared by all the workers on it
    (``copies`` x the stages: D x T x K, as on one machine), a GPU's is one worker's. Enforced (the plan must fit):
    a limit per device, and a CPU's memory that one worker alone would exceed; a CPU's memory shared by all the
    workers only warns."""
    if per_stage is None:
        return None
    if limit_gib is not None:
        return MemoryCheck(per_stage, limit_gib * 2**30, "of --memory-limit", enforced=True)
    shared = copies if device.get("kind") == "cpu" else 0
    if isinstance(device.get("memory_bytes"), (int, float)):
        limit, source = float(device["memory_bytes"]), f"of the profile's device ({device.get('name', '?')})"
        reserved = device.get("reserved_bytes")
        if isinstance(reserved, (int, float)) and reserved > 0:  # the CUDA context's and NCCL's, never usable
            limit -= float(reserved)
            name = device.get("name", "?")
            source = f"a process can use of the profile's device ({name}: its memory less {format_bytes(reserved)})"
    elif device.get("kind") == "cpu" and machine_memory_bytes():
        limit, source = float(machine_memory_bytes()), "of this machine's memory"
    else:
        return MemoryCheck(per_stage, None, None)
    if not shared:
        return MemoryCheck(per_stage, limit, source, enforced=True)
    # A CPU's memory is shared by the workers on it, who may also be spread over several machines: all of them
    # together over it only warn; one worker alone over it binds (no machine of this kind could run that stage).
    if max(m.total_bytes for m in per_stage) > limit:
        return MemoryCheck(per_stage, limit, source + " (for one worker alone)", enforced=True)
    return MemoryCheck(per_stage, limit, source, shared)
