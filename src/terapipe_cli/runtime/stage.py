"""One pipeline stage's per-tile compute: forward a tile, later back-propagate it once (docs/design.md §6).

This is the runtime's own per-slice code path: the workers run it, and the profiler times it.

Keys and values. Each batch slice has one `KVCache` per layer of the stage: its token slices write their
keys/values into it in order and attend over everything written so far, so no slice copies the earlier ones'
K/V again. The K/V gradient hand-back lives in the cache: a later slice's backward leaves the gradients of the
earlier rows there, and the earlier slice's own backward (reverse token order) picks them up — every tile's
graph is walked exactly once.

Recomputation. With ``recompute=True`` a tile keeps only its input (and, in the K/V caches, its keys and values,
which later slices read anyway): its forward runs inside ``torch.utils.checkpoint`` (non-reentrant), which drops
what the forward would save and re-runs it when the tile's backward needs it. The re-run writes the same keys and
values into the same cache rows, and the K/V hand-back happens in the one backward, so the result is exactly
the same; the cost is one more forward per tile, inside its backward.

Precision. ``precision="bf16"`` or ``"fp16"`` runs each tile's forward under autocast (the backward follows the
forward's types); parameters, their gradients and the activations sent between stages stay fp32.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from terapipe_cli.config import ModelConfig
from terapipe_cli.model import GPT, KVCache, token_loss_sum
from terapipe_cli.runtime.tensor import TensorGroup, shard_module

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _TileState:
    x: torch.Tensor  # the input leaf (stage > 0) whose .grad goes back to the previous stage
    out: torch.Tensor  # the output activation, or the summed token loss on the last stage


@dataclass
class _BatchSlice:
    """What one batch slice holds between its first forward and its last backward."""

    caches: list[KVCache]  # one per layer of the stage
    next_token: int = 0  # tokens already run: the next tile's start
    open_tiles: list[int] = field(default_factory=list)  # token slices run forward and not yet backward


class StageRunner:
    """Holds stage ``stage`` of ``stages`` of the model and runs tiles through it.

    ``kv_handback=False`` drops the earlier slices' K/V gradients: a test-only negative control that must
    make verification fail. With ``tensor`` (T > 1), the stage keeps only its tensor rank's heads and MLP
    columns (`tensor.shard_module`); a tile's input and output are still the whole (b, i, H) activation.
    """

    def __init__(
        self,
        model: ModelConfig,
        stage: int,
        stages: int,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        kv_handback: bool = True,
        precision: str = "fp32",
        tensor: TensorGroup | None = None,
        recompute: bool = False,
    ) -> None:
        if precision not in AUTOCAST_DTYPES:
            raise ValueError(f"precision must be one of {sorted(AUTOCAST_DTYPES)}, got {precision!r}")
        self.device = torch.device(device)
        self.module = GPT(model, stage, stages, seed=seed)
        if tensor is not None:
            shard_module(self.module, tensor)
        self.module.to(self.device)
        self.tensor = tensor
        self.recompute = recompute
        self.first, self.last = self.module.first, self.module.last
        self.seq_len = model.seq_len
        self.kv_handback = kv_handback
        self.precision = precision
        self.loss_scale = 1.0
        self._tiles: dict[tuple[int, int], _TileState] = {}
        self._slices: dict[int, _BatchSlice] = {}

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
        graph would keep a copy of its own (measured: +64% saved bytes for 8 slices of the tiny model in bf16).
        """
        return self.autocast()

    def forward_tile(
        self,
        batch_slice: int,
        token_slice: int,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        grad: bool = True,
    ) -> torch.Tensor:
        """Run one tile forward; tiles of a batch slice must come in token order.

        x: (b, i) int64 token ids on stage 0, else the (b, i, H) activation from the previous stage.
        Returns the detached (b, i, H) output to send on, or on the last stage the tile's summed token
        loss (0-d, detached; needs ``targets`` (b, i)). ``grad=False``: an evaluation, no graph kept (no
        backward follows; `reset` afterwards).
        """
        key = (batch_slice, token_slice)
        if key in self._tiles:
            raise RuntimeError(f"tile {key} was already run forward")
        state = self._slices.get(batch_slice)
        if state is None:
            caches = [KVCache(self.seq_len, handback=self.kv_handback) for _ in self.module.layer_ids]
            state = self._slices[batch_slice] = _BatchSlice(caches)
        if token_slice != len(state.open_tiles):
            raise RuntimeError(f"tile {key}: token slices of a batch slice must run in order (reset between steps)")
        x = x.to(self.device, non_blocking=True)
        if not self.first:
            x = x.detach().requires_grad_(grad)
        if self.last:
            if targets is None:
                raise ValueError("the last stage needs targets")
            targets = targets.to(self.device, non_blocking=True)
        with torch.enable_grad() if grad else torch.no_grad(), self.autocast():
            if grad and self.recompute:
                out = checkpoint(self._forward, x, state.next_token, state.caches, targets, use_reentrant=False)
            else:
                out = self._forward(x, state.next_token, state.caches, targets)
        self._tiles[key] = _TileState(x, out)
        state.open_tiles.append(token_slice)
        state.next_token += x.shape[1]
        return out.detach()

    def _forward(
        self, x: torch.Tensor, start: int, caches: list[KVCache], targets: torch.Tensor | None
    ) -> torch.Tensor:
        """The stage's layers on one tile, and on the last stage its summed token loss."""
        out = self.module(x, start, caches)
        return token_loss_sum(out, targets) if self.last else out

    def backward_tile(self, batch_slice: int, token_slice: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Back-propagate one tile, once; tiles of a batch slice must come in reverse token order.

        grad_out: gradient of this tile's output from the next stage (None on the last stage, where the
        tile's loss is scaled by the loss scale). Parameter gradients accumulate in ``.grad``. Returns the
        gradient for the previous stage (None on stage 0).
        """
        key = (batch_slice, token_slice)
        state = self._slices.get(batch_slice)
        if key not in self._tiles or state is None or state.open_tiles[-1] != token_slice:
            raise RuntimeError(f"tile {key}: backward must run once per tile, in reverse token order")
        tile = self._tiles.pop(key)
        if self.last:
            torch.autograd.backward(tile.out * self.loss_scale)
        else:
            if grad_out is None:
                raise ValueError("a stage other than the last needs the gradient of its output")
            torch.autograd.backward(tile.out, grad_out.to(self.device, non_blocking=True))
        state.open_tiles.pop()
        if not state.open_tiles:
            # Every slice of this batch slice is done: its keys/values are no longer needed.
            del self._slices[batch_slice]
        return None if self.first else tile.x.grad

    def reset(self) -> None:
        """Forget stored tiles and keys/values (between steps or measurements)."""
        self._tiles.clear()
        self._slices.clear()

    @property
    def pending_tiles(self) -> int:
        return len(self._tiles)
