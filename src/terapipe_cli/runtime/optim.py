"""The optimizer step's policies, shared by the workers and the single-process reference of ``--verify``.

- ``LRSchedule``: linear warm-up, then cosine decay to a floor (nanoGPT's ``get_lr``).
- ``clip_global_norm``: gradient clipping by the norm over ALL parameters of the model. Each stage holds only
  its own layers, so each sums its squares locally, the pipeline group sums those sums, and every stage scales
  by the same factor — the result equals clipping the whole model on one device (docs/design.md §6a).
- ``make_optimizer``: AdamW as nanoGPT configures it, with the multi-tensor (``foreach``) or fused kernels
  where the device has them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from terapipe_cli.errors import UserError

DEFAULT_GRAD_CLIP = 1.0
WARMUP_FRACTION = 0.1  # the default warm-up: this share of the run's steps (at least one step)
MIN_LR_FRACTION = 0.1  # the default floor of the cosine decay: this share of the peak lr (as nanoGPT)


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate per step (1-based): ``warmup_steps`` linear steps up to ``lr``, cosine down to ``min_lr``
    at ``total_steps``, and ``min_lr`` after that (a run extended by ``--resume`` keeps the floor)."""

    lr: float
    total_steps: int
    warmup_steps: int
    min_lr: float

    @classmethod
    def default(
        cls, lr: float, total_steps: int, warmup_steps: int | None = None, min_lr: float | None = None
    ) -> LRSchedule:
        """The schedule with the defaults filled in and every value checked (one-line errors name the flag)."""
        if not (lr > 0 and math.isfinite(lr)):
            raise UserError(f"must be a positive number, got {lr}", where="--lr")
        if warmup_steps is None:
            warmup_steps = max(1, round(WARMUP_FRACTION * total_steps))
        if warmup_steps < 0:
            raise UserError(f"must be 0 or more, got {warmup_steps}", where="--warmup-steps")
        if min_lr is None:
            min_lr = MIN_LR_FRACTION * lr
        if not (0 <= min_lr <= lr and math.isfinite(min_lr)):
            raise UserError(f"must be between 0 and --lr ({lr:g}), got {min_lr:g}", where="--min-lr")
        return cls(lr=float(lr), total_steps=int(total_steps), warmup_steps=int(warmup_steps), min_lr=float(min_lr))

    def __call__(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)

    def to_dict(self) -> dict:
        return {
            "lr": self.lr,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "min_lr": self.min_lr,
        }


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_global_norm(
    params: list[nn.Parameter], max_norm: float, sum_across: Callable[[torch.Tensor], None] | None = None
) -> float:
    """Scale every gradient so that the global norm is at most ``max_norm``; returns the norm before clipping.

    ``sum_across`` sums a float64 scalar tensor in place over the stages that share the model (an all-reduce
    over the pipeline group); None for a model held whole. ``max_norm <= 0`` measures without clipping.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    squares = local.double().pow(2)
    if sum_across is not None:
        sum_across(squares)
    norm = squares.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(local.dtype))
    return float(norm)


def make_optimizer(module: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW as nanoGPT configures it: weight decay on matrices and embeddings only.

    Per-parameter groups keep the update independent of how the model is split into stages. The multi-tensor
    implementation (``foreach``) runs one kernel chain for all parameters instead of one per parameter; on
    CUDA the fused kernel goes further. Both compute the same update per parameter.
    """
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = any(p.is_cuda for p in module.parameters())
    kernel = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kernel)
