"""One pipeline stage's per-tile compute: forward a tile, later back-propagate it once (docs/design.md §6).

This is the runtime's own per-slice code path: the workers run it, and the profiler times it.

Keys and values. Each batch slice has one `KVCache` per layer of the stage: its token slices write their
keys/values into it in order and attend over everything written so far, so no slice copies the earlier ones'
K/V again. The K/V gradient hand-back lives in the cache: a later slice's backward leaves the gradients of the
earlier rows there, and the earlier slice's own backward (reverse token order) picks them up — every tile's
graph is walked exactly once.

Recomputation. With ``recompute=True`` a tile keeps only its input (and, in the K/V caches, its keys and values,
which later slices read anyway): its forward runs without autograd, and its backward runs the forward again,
this time keeping what autograd saves, and back-propagates through it at once. The re-run writes the same keys
and values into the same cache rows, and the K/V hand-back happens in the one backward, so the result is exactly
the same; the cost is one more forward per tile, inside its backward.

Memory. `SavedBytes` counts, exactly, what the stage keeps for its backward (docs/design.md §10): every storage
autograd saves (``torch.autograd.graph.saved_tensors_hooks``), the tiles' inputs and outputs and the K/V caches,
each storage once, from when it is first kept until the backward that releases it; its peak is the measured side
of the memory estimate.

Precision. ``precision="bf16"`` or ``"fp16"`` runs each tile's forward under autocast (the backward follows the
forward's types); parameters, their gradients and the activations sent between stages stay fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from terapipe_cli.config.controls import Controls
from terapipe_cli.engine import split_backward
from terapipe_cli.engine.loss import drop_compute_weights
from terapipe_cli.engine.tensor import TensorGroup, head_loss_sum, shard_module
from terapipe_cli.models import ModelConfig, build_model, vocab_share
from terapipe_cli.models.attention import DocumentMask, KVCache
from terapipe_cli.plan.memory import loss_chunk_tokens as default_loss_chunk_tokens
from terapipe_cli.schedule.partition import Partition

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _TileState:
    x: torch.Tensor  # the input leaf (stage > 0) whose .grad goes back to the previous stage
    out: torch.Tensor | None  # the output activation, or the summed token loss on the last stage (None: recompute)
    start: int = 0  # the tile's first token
    targets: torch.Tensor | None = None  # the last stage's targets, kept for the re-run of a recomputed tile
    docs: DocumentMask | None = None  # packed documents: the tile's block-causal mask, kept for the re-run


class SavedBytes:
    """The bytes a stage keeps for its backward, counted exactly, and their peak (docs/design.md §10).

    Holders (a tile, a batch slice's K/V caches, a recomputed tile's re-run) keep storages; a storage counts once,
    with its full size, while any holder keeps it. Parameters are not counted: they are the stage's state.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._held: dict[object, set[int]] = {}
        self._storages: dict[int, list[int]] = {}  # data pointer -> [bytes, holders]
        self.alive = 0
        self.peak = 0

    def keep(self, holder: object, tensor: torch.Tensor | None) -> None:
        """``holder`` keeps ``tensor``'s storage until `release`."""
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        held = self._held.setdefault(holder, set())
        if ptr in self._params or ptr in held or storage.nbytes() == 0:
            return
        held.add(ptr)
        entry = self._storages.setdefault(ptr, [storage.nbytes(), 0])
        entry[1] += 1
        if entry[1] == 1:
            self.alive += entry[0]
            self.peak = max(self.peak, self.alive)

    def release(self, holder: object) -> None:
        for ptr in self._held.pop(holder, ()):
            entry = self._storages[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                self.alive -= entry[0]
                del self._storages[ptr]

    @contextmanager
    def saving(self, holder: object):
        """Within: every tensor autograd saves is kept by ``holder``."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.keep(holder, t)
            # Detached: a saved output returned as itself would hold its own grad_fn, a cycle through autograd's
            # C++ graph that Python's collector cannot see — a tile run forward and never backward (dropped by
            # `StageRunner.reset`) then leaked its graph. Autograd re-attaches the unpacked data itself.
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def take_peak(self) -> int:
        """The peak since the last call (or the start); the next peak counts from what is alive now."""
        peak, self.peak = self.peak, self.alive
        return peak

    def clear(self) -> None:
        """Forget every holder; the peak starts again from zero."""
        self._held.clear()
        self._storages.clear()
        self.alive = self.peak = 0


@dataclass
class _BatchSlice:
    """What one batch slice holds between its first forward and its last backward."""

    caches: list[KVCache]  # one per layer of the stage
    next_token: int = 0  # tokens already run: the next tile's start
    open_tiles: list[int] = field(default_factory=list)  # token slices run forward and not yet backward (B or I)
    weights_due: int = 0  # tiles whose I ran and whose W has not


class StageRunner:
    """Holds stage ``stage`` of ``stages`` of the model and runs tiles through it — with a ``partition``
    (`schedule.partition`), chunk ``stage`` of its chunks, or the ``chunks`` one device runs (interleaved: every tile
    method then takes the ``chunk`` it is for; each chunk keeps its own K/V caches and tiles).

    ``controls``: the test-only switches (`config.controls.Controls`: the K/V hand-back dropped, rotary positions
    slice-local, the document mask dropped over the cache), negative controls that must make verification fail. With
    ``tensor`` (T > 1), the stage keeps only its tensor rank's heads and MLP columns (`tensor.shard_module`); a
    tile's input and output are still the whole (b, i, H) activation.
    ``recompute``: every chunk, or per chunk (a mapping). ``loss_chunk_tokens``: the last chunk's head and loss run
    that many tokens at a time (`engine.loss`; 0: the whole tile's logits at once; None: the default of
    `plan.memory.loss_chunk_tokens` for the device's memory, a CUDA device's or a CPU's fixed budget).
    """

    def __init__(
        self,
        model: ModelConfig,
        stage: int,
        stages: int,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        controls: Controls | None = None,
        precision: str = "fp32",
        tensor: TensorGroup | None = None,
        recompute: bool | Mapping[int, bool] = False,
        partition: Partition | None = None,
        chunks: tuple[int, ...] | None = None,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        if precision not in AUTOCAST_DTYPES:
            raise ValueError(f"precision must be one of {sorted(AUTOCAST_DTYPES)}, got {precision!r}")
        self.device = torch.device(device)
        self.module = build_model(model, stage, stages, seed=seed, partition=partition, chunks=chunks)
        if tensor is not None:
            shard_module(self.module, tensor)
        self.module.to(self.device)
        self.tensor = tensor
        self.chunks = self.module.chunks
        self.last_chunk = self.module.stages - 1
        self.recompute = {c: bool(recompute[c] if isinstance(recompute, Mapping) else recompute) for c in self.chunks}
        self.first, self.last = self.module.first, self.module.last
        self.seq_len = model.seq_len
        self.controls = controls if controls is not None else Controls()
        if not self.controls.rope_absolute:
            for m in self.module.modules():
                if hasattr(m, "rope_local"):  # `llama.LlamaAttention`
                    m.rope_local = True
        self.precision = precision
        if loss_chunk_tokens is None:
            rows = vocab_share(model.vocab, tensor.size if tensor is not None else 1)
            memory = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
            loss_chunk_tokens = default_loss_chunk_tokens(rows, memory)
        self.loss_chunk_tokens = int(loss_chunk_tokens)
        self.loss_scale = 1.0
        self._tiles: dict[tuple[int, int, int], _TileState] = {}  # (chunk, batch slice, token slice)
        self._slices: dict[tuple[int, int], _BatchSlice] = {}  # (chunk, batch slice)
        self._weights: dict[tuple[int, int, int], tuple] = {}  # tiles between their I and their W
        self.saved = SavedBytes(self.module)

    def _chunk(self, chunk: int | None) -> int:
        if chunk is None:
            if len(self.chunks) > 1:
                raise ValueError(f"this runner holds chunks {self.chunks}: name the chunk")
            return self.chunks[0]
        if chunk not in self.recompute:
            raise ValueError(f"chunk {chunk} is not one of this runner's {self.chunks}")
        return chunk

    def set_loss_scale(self, scale: float) -> None:
        """1 / (predicted tokens of the whole step, all replicas): makes the gradient the single-device one.

        With fp16 the trainer folds its loss scale in here too (the last stage's loss is multiplied by it)."""
        self.loss_scale = float(scale)

    def autocast(self):
        """The forward's autocast context for this stage's precision (none in fp32)."""
        dtype = AUTOCAST_DTYPES[self.precision]
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def step(self):
        """Context for one step's tiles (forwards and backwards); leave it before the optimizer step.

        Autocast keeps the low-precision copy of each weight until its outermost context ends. Entered once
        per step, every tile shares one copy per weight, as the whole sequence would; tile by tile, each tile's
        graph would keep a copy of its own (far more saved bytes with many slices, docs/design.md §10). The
        chunked head keeps its own copy of its weight (`loss.compute_weight`), dropped here at the end too.
        """
        return self._step()

    @contextmanager
    def _step(self):
        try:
            with self.autocast():
                yield
        finally:
            drop_compute_weights(self.module)

    def forward_tile(
        self,
        batch_slice: int,
        token_slice: int,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        grad: bool = True,
        chunk: int | None = None,
        doc_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one tile forward; tiles of a batch slice must come in token order (per chunk).

        x: (b, i) int64 token ids on chunk 0, else the (b, i, H) activation from the previous chunk.
        Returns the detached (b, i, H) output to send on, or on the last chunk the tile's summed token
        loss (0-d, detached; needs ``targets`` (b, i)). ``grad=False``: an evaluation, no graph kept (no
        backward follows; `reset` afterwards). ``doc_starts`` (b, i), on the CPU: packed documents, where each
        token's document begins in its sequence (`attention.DocumentMask`; None: causal over the whole sequence).
        """
        c = self._chunk(chunk)
        key = (c, batch_slice, token_slice)
        if key in self._tiles:
            raise RuntimeError(f"tile {key[1:]} was already run forward")
        state = self._slices.get((c, batch_slice))
        if state is None:
            caches = [KVCache(self.seq_len, handback=self.controls.kv_handback) for _ in self.module.chunk_layers[c]]
            state = self._slices[(c, batch_slice)] = _BatchSlice(caches)
        if token_slice != len(state.open_tiles):
            raise RuntimeError(f"tile {key[1:]}: token slices of a batch slice must run in order (reset between steps)")
        x = x.to(self.device, non_blocking=True)
        if c != 0:
            x = x.detach().requires_grad_(grad)
        if c == self.last_chunk:
            if targets is None:
                raise ValueError("the last stage needs targets")
            targets = targets.to(self.device, non_blocking=True)
        unmasked = not self.controls.cache_masked
        docs = None if doc_starts is None else DocumentMask.of(doc_starts, state.next_token, self.device, unmasked)
        if grad and not self.recompute[c]:
            with torch.enable_grad(), self.autocast(), self.saved.saving(key):
                out = self._forward(c, x, state.next_token, state.caches, targets, docs)
            self._tiles[key] = _TileState(x, out)
            self.saved.keep(key, out)
        else:  # an evaluation, or a recomputed tile: only the input is kept, the backward runs the forward again
            with torch.no_grad(), self.autocast():
                out = self._forward(c, x, state.next_token, state.caches, targets, docs)
            self._tiles[key] = _TileState(x, None, state.next_token, targets, docs)
        if grad:  # an evaluation keeps nothing for a backward
            self.saved.keep(key, x)
            for cache in state.caches if token_slice == 0 else ():
                self.saved.keep(("kv", c, batch_slice), cache.keys)
                self.saved.keep(("kv", c, batch_slice), cache.values)
        state.open_tiles.append(token_slice)
        state.next_token += x.shape[1]
        return out.detach()

    def _forward(
        self,
        chunk: int,
        x: torch.Tensor,
        start: int,
        caches: list[KVCache],
        targets: torch.Tensor | None,
        docs: DocumentMask | None = None,
    ) -> torch.Tensor:
        """The chunk's layers on one tile, and on the last chunk its summed token loss."""
        if chunk != self.last_chunk:
            return self.module(x, start, caches, chunk, docs)
        h = self.module(x, start, caches, chunk, docs, logits=False)
        return head_loss_sum(self.module, h, targets, self.loss_chunk_tokens)

    def backward_tile(
        self, batch_slice: int, token_slice: int, grad_out: torch.Tensor | None, *, chunk: int | None = None
    ) -> torch.Tensor | None:
        """Back-propagate one tile, once (B: its I and W at once); tiles of a batch slice must come in reverse token
        order (per chunk).

        grad_out: gradient of this tile's output from the next chunk (None on the last chunk, where the
        tile's loss is scaled by the loss scale). Parameter gradients accumulate in ``.grad``. Returns the
        gradient for the previous chunk (None on chunk 0).
        """
        c = self._chunk(chunk)
        key, state, tile, out = self._backward_begin(c, batch_slice, token_slice)
        if c == self.last_chunk:
            torch.autograd.backward(out * self.loss_scale)
        else:
            torch.autograd.backward(out, self._grad_in(grad_out))
        self._backward_end(key, state)
        return None if c == 0 else tile.x.grad

    def backward_input(
        self, batch_slice: int, token_slice: int, grad_out: torch.Tensor | None, *, chunk: int | None = None
    ) -> torch.Tensor | None:
        """I of one tile (`engine.split_backward`): the gradient for the previous chunk (returned; None on chunk 0)
        and the K/V gradients handed back to the earlier token slices, as `backward_tile`; the weights' gradients
        wait for `backward_weight`, and the tile's graph (a recomputed tile's re-run too) stays until then."""
        c = self._chunk(chunk)
        key, state, tile, out = self._backward_begin(c, batch_slice, token_slice)
        last = c == self.last_chunk
        root = out * self.loss_scale if last else out
        inputs = [] if c == 0 else [tile.x]
        grads, pending = split_backward.backward_input(
            root, None if last else self._grad_in(grad_out), inputs, self._params()
        )
        self._weights[key] = (pending, root)  # the root keeps the tile's graph alive for W
        for g in pending.tensors:  # the consumers' output gradients W starts from
            self.saved.keep(key, g)
        state.open_tiles.pop()
        state.weights_due += 1
        return None if c == 0 else grads[0]

    def backward_weight(self, batch_slice: int, token_slice: int, *, chunk: int | None = None) -> None:
        """W of one tile, after its I: the weights' gradients, accumulated into ``.grad``; then the tile's graph
        goes."""
        c = self._chunk(chunk)
        key = (c, batch_slice, token_slice)
        if key not in self._weights:
            raise RuntimeError(f"tile {key[1:]}: W must follow the tile's I, once")
        pending, _ = self._weights.pop(key)
        split_backward.backward_weight(pending, self._params())
        state = self._slices[(c, batch_slice)]
        state.weights_due -= 1
        self._backward_end(key, state, popped=True)

    def _backward_begin(self, c: int, batch_slice: int, token_slice: int):
        """The tile's key, batch slice, state and output (a recomputed tile's forward run again, with autograd)."""
        key = (c, batch_slice, token_slice)
        state = self._slices.get((c, batch_slice))
        if key not in self._tiles or state is None or state.open_tiles[-1] != token_slice:
            raise RuntimeError(f"tile {key[1:]}: backward must run once per tile, in reverse token order")
        tile = self._tiles.pop(key)
        out = tile.out
        if out is None:  # recomputed: the forward again, with autograd, then straight back through it
            with torch.enable_grad(), self.autocast(), self.saved.saving((key, "re-run")):
                out = self._forward(c, tile.x, tile.start, state.caches, tile.targets, tile.docs)
        return key, state, tile, out

    def _grad_in(self, grad_out: torch.Tensor | None) -> torch.Tensor:
        if grad_out is None:
            raise ValueError("a stage other than the last needs the gradient of its output")
        return grad_out.to(self.device, non_blocking=True)

    def _backward_end(self, key: tuple[int, int, int], state: _BatchSlice, *, popped: bool = False) -> None:
        """Release what the tile kept; after the batch slice's last backward, its keys/values too."""
        c, batch_slice, _ = key
        self.saved.release((key, "re-run"))
        self.saved.release(key)
        if not popped:
            state.open_tiles.pop()
        if not state.open_tiles and not state.weights_due:
            # Every slice of this batch slice is done: its keys/values are no longer needed.
            del self._slices[(c, batch_slice)]
            self.saved.release(("kv", c, batch_slice))

    def _params(self) -> dict[int, torch.nn.Parameter]:
        return {id(p): p for p in self.module.parameters() if p.requires_grad}

    def reset(self) -> None:
        """Forget stored tiles and keys/values (between steps or measurements)."""
        self._tiles.clear()
        self._slices.clear()
        self._weights.clear()
        self.saved.clear()

    @property
    def pending_tiles(self) -> int:
        return len(self._tiles) + len(self._weights)
