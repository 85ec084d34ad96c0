"""One pipeline stage's per-tile compute: forward a tile, later back-propagate it once (docs/design.md §6).

This is the runtime's own per-slice code path: the workers run it, and the profiler times it.

The K/V hand-back. A tile's attention reads the keys/values of the earlier token slices of the same batch
slice. Each tile stores its own per-layer (k, v) as *detached leaves* that later tiles read, so a later
tile's backward deposits the gradient for those keys/values in the leaves' ``.grad`` instead of walking
into the earlier tile's graph. When the earlier tile's turn comes (backward runs in reverse token order),
one ``torch.autograd.backward`` call feeds in the gradient of its output from stage k+1 *together with* the
accumulated gradients of its own k, v — so every graph is walked exactly once and the backward costs
O(tiles), not O(tiles²).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from terapipe_cli.config import ModelConfig
from terapipe_cli.model import GPT, KV, token_loss_sum


@dataclass
class _TileState:
    x: torch.Tensor  # the input leaf (stage > 0) whose .grad goes back to the previous stage
    out: torch.Tensor  # the output activation, or the summed token loss on the last stage
    kv: list[KV]  # this tile's own per-layer (k, v), still attached to its graph
    kv_leaves: list[KV]  # the same tensors detached: what later tiles attend over


class StageRunner:
    """Holds stage ``stage`` of ``stages`` of the model and runs tiles through it.

    ``kv_handback=False`` drops the earlier slices' K/V gradients: a test-only negative control that must
    make verification fail.
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
    ) -> None:
        self.device = torch.device(device)
        self.module = GPT(model, stage, stages, seed=seed).to(self.device)
        self.first, self.last = self.module.first, self.module.last
        self.kv_handback = kv_handback
        self.loss_scale = 1.0
        self._tiles: dict[tuple[int, int], _TileState] = {}
        self._context: dict[int, list[list[KV]]] = {}  # batch slice -> per layer: (k, v) leaves of its tiles so far
        self._next_token: dict[int, int] = {}  # batch slice -> tokens already run (the next tile's start)

    def set_loss_scale(self, scale: float) -> None:
        """1 / (predicted tokens of the whole step, all replicas): makes the gradient the single-device one."""
        self.loss_scale = float(scale)

    def forward_tile(
        self, batch_slice: int, token_slice: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one tile forward; tiles of a batch slice must come in token order.

        x: (b, i) int64 token ids on stage 0, else the (b, i, H) activation from the previous stage.
        Returns the detached (b, i, H) output to send on, or on the last stage the tile's summed token
        loss (0-d, detached; needs ``targets`` (b, i)).
        """
        key = (batch_slice, token_slice)
        if key in self._tiles:
            raise RuntimeError(f"tile {key} was already run forward")
        context = self._context.setdefault(batch_slice, [[] for _ in self.module.layer_ids])
        if len(context[0]) != token_slice:
            raise RuntimeError(f"tile {key}: token slices of a batch slice must run in order (reset between steps)")
        token_start = self._next_token.get(batch_slice, 0)
        x = x.to(self.device, non_blocking=True)
        if not self.first:
            x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out, kv = self.module(x, token_start, context if token_slice else None)
            if self.last:
                if targets is None:
                    raise ValueError("the last stage needs targets")
                out = token_loss_sum(out, targets.to(self.device, non_blocking=True))
        leaves = [(k.detach().requires_grad_(True), v.detach().requires_grad_(True)) for k, v in kv]
        for layer_context, leaf in zip(context, leaves, strict=True):
            layer_context.append(leaf)
        self._tiles[key] = _TileState(x, out, kv, leaves)
        self._next_token[batch_slice] = token_start + x.shape[1]
        return out.detach()

    def backward_tile(self, batch_slice: int, token_slice: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Back-propagate one tile, once; tiles of a batch slice must come in reverse token order.

        grad_out: gradient of this tile's output from the next stage (None on the last stage, where the
        tile's loss is scaled by the loss scale). Parameter gradients accumulate in ``.grad``. Returns the
        gradient for the previous stage (None on stage 0).
        """
        state = self._tiles.pop((batch_slice, token_slice))
        if self._context[batch_slice][0][-1][0] is not state.kv_leaves[0][0]:
            raise RuntimeError(f"tile {(batch_slice, token_slice)}: backward must run in reverse token order")
        if self.last:
            roots, grads = [state.out * self.loss_scale], [None]
        else:
            if grad_out is None:
                raise ValueError("a stage other than the last needs the gradient of its output")
            roots, grads = [state.out], [grad_out.to(self.device, non_blocking=True)]
        if self.kv_handback:
            # Gradients that later slices' attention left on this tile's keys/values (docs/design.md §6).
            for (k, v), (k_leaf, v_leaf) in zip(state.kv, state.kv_leaves, strict=True):
                if k_leaf.grad is not None:
                    roots.append(k)
                    grads.append(k_leaf.grad)
                if v_leaf.grad is not None:
                    roots.append(v)
                    grads.append(v_leaf.grad)
        torch.autograd.backward(roots, grads)
        if token_slice == 0:
            # Every later slice of this batch slice is done: its context is no longer needed.
            self._context.pop(batch_slice, None)
            self._next_token.pop(batch_slice, None)
        else:
            for layer_context in self._context[batch_slice]:
                layer_context.pop()  # this tile's leaves (checked above to be the last ones)
        return None if self.first else state.x.grad

    def reset(self) -> None:
        """Forget stored tiles and keys/values (between steps or measurements)."""
        self._tiles.clear()
        self._context.clear()
        self._next_token.clear()

    @property
    def pending_tiles(self) -> int:
        return len(self._tiles)
