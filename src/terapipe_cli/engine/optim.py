"""The optimizer step's policies, shared by the workers and the single-process reference of ``--verify``.

- ``clip_global_norm``: gradient clipping by the norm over ALL parameters of the model. Each stage holds only
  its own layers, so each sums its squares locally, the pipeline group sums those sums, and every stage scales
  by the same factor — the result equals clipping the whole model on one device (docs/design.md §6a).
- ``LossScale``: fp16's dynamic loss scale, one for the whole pipeline.
- ``take_step``: the update itself — unscale and skip on overflow (fp16), clip, AdamW — one function for the
  workers and the reference, so both take exactly the same decisions.
- ``make_optimizer``: AdamW with the run's `OptimizerConfig` (nanoGPT's by default), with the multi-tensor
  (``foreach``) or fused kernels where the device has them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from terapipe_cli.config.optimizer import OptimizerConfig
from terapipe_cli.engine.attention import branch

# The token and position embeddings and the LM head, by the names every architecture gives them (engine/model.py's,
# kept by Llama and GPT-2) on every stage and tensor rank: what --no-decay-embeddings leaves undecayed. Tied, the
# head's matrix is the embedding's, listed once by `named_parameters`, under ``wte.weight``.
EMBEDDINGS_AND_HEAD = ("wte.weight", "wpe.weight", "lm_head.weight")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_global_norm(
    params: list[nn.Parameter],
    max_norm: float,
    sum_across: Callable[[torch.Tensor], None] | None = None,
    counted: list[nn.Parameter] | None = None,
) -> float:
    """Scale every gradient so that the global norm is at most ``max_norm``; returns the norm before clipping.

    ``sum_across`` sums a float64 scalar tensor in place over the processes that share the model (an
    all-reduce over the stages and tensor ranks of one replica); None for a model held whole. ``counted``: the
    parameters whose squares this process adds (None: all of ``params``) — with tensor parallelism a parameter
    every tensor rank holds whole is counted by one of them only. ``max_norm <= 0`` measures without clipping.
    """
    grads = [p.grad for p in (params if counted is None else counted) if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=params[0].device)
    squares = local.double().pow(2)
    if sum_across is not None:
        sum_across(squares)
    norm = squares.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(local.dtype))
    return float(norm)


@dataclass
class LossScale:
    """fp16's dynamic loss scale, ONE for the whole pipeline (docs/design.md §6a), with the constants of
    ``torch.amp.GradScaler``: start at 2**16, halve on a step with an inf/nan gradient (the step is skipped),
    double after 2000 steps in a row without one.

    Every rank holds its own copy and updates it from the same all-reduced overflow flag, so the copies never
    differ; the checkpoint keeps it (`state_dict`), so a resumed run goes on with the same scale."""

    scale: float = 2.0**16
    clean_steps: int = 0  # steps since the last overflow or growth
    growth_interval: int = field(default=2000, repr=False)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= 0.5
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def unscale_grads(params: list[nn.Parameter], scale: float) -> bool:
    """Divide every gradient by the loss scale; True when any of them holds an inf or nan (this process's)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return False
    torch._foreach_mul_(grads, 1.0 / scale)
    return not bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


@dataclass(frozen=True)
class StepOutcome:
    """What `take_step` did: the global gradient norm before clipping (None on a skipped step), whether the
    step was skipped for an fp16 overflow, and the loss scale for the next step (None without fp16)."""

    grad_norm: float | None
    skipped: bool
    loss_scale: float | None


def take_step(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    *,
    max_norm: float,
    loss_scale: LossScale | None = None,
    sum_across: Callable[[torch.Tensor], None] | None = None,
    overflow_anywhere: Callable[[bool], bool] | None = None,
    counted: list[nn.Parameter] | None = None,
) -> StepOutcome:
    """The update from the step's complete gradients, the same in every stage and in the reference.

    With a ``loss_scale`` (fp16): unscale the gradients, ask ``overflow_anywhere`` (all ranks; None: only this
    process) and, on an overflow, skip the step and lower the scale. Then clip by the global norm
    (`clip_global_norm` with ``sum_across`` and ``counted``) and step. The gradients stay in ``.grad``
    unscaled and clipped.
    """
    if loss_scale is not None:
        overflow = unscale_grads(params, loss_scale.scale)
        if overflow_anywhere is not None:
            overflow = overflow_anywhere(overflow)
        loss_scale.update(overflow)
        if overflow:
            return StepOutcome(grad_norm=None, skipped=True, loss_scale=loss_scale.scale)
    norm = clip_global_norm(params, max_norm, sum_across, counted)
    optimizer.step()
    return StepOutcome(norm, skipped=False, loss_scale=loss_scale.scale if loss_scale is not None else None)


def make_optimizer(module: nn.Module, lr: float, config: OptimizerConfig | None = None) -> torch.optim.AdamW:
    """AdamW with ``config``'s betas and eps, in two groups: ``config.weight_decay`` on the matrices (nanoGPT's
    rule; the embeddings and the head among them unless ``config.decay_embeddings`` is False), none on norms and
    biases. None: the defaults (`OptimizerConfig()`).

    The groups are per parameter, so the update does not depend on how the model is split into stages. The
    multi-tensor implementation (``foreach``) runs one kernel chain for all parameters instead of one per
    parameter; on CUDA the fused kernel goes further. Both compute the same update per parameter.
    """
    config = config if config is not None else OptimizerConfig()
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        embedding = any(name == e or name.endswith("." + e) for e in EMBEDDINGS_AND_HEAD)
        decays = p.dim() >= 2 and (config.decay_embeddings or not embedding)
        (decay if decays else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = any(branch(p) == "cuda" for p in module.parameters())  # `attention.forced_branch` tests it on CPU
    kernel = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=config.betas, eps=config.eps, **kernel)
