"""The optimizer step's policies, shared by the workers and the single-process reference of ``--verify``.

- ``clip_global_norm``: gradient clipping by the norm over ALL parameters of the model. Each stage holds only
  its own layers, so each sums its squares locally, the pipeline group sums those sums, and every stage scales
  by the same factor — the result equals clipping the whole model on one device (docs/design.md §6a).
- ``LossScale``: fp16's dynamic loss scale, one for the whole pipeline.
- ``take_step``: the update itself — unscale and skip on overflow (fp16), clip, AdamW — one function for the
  workers and the reference, so both take exactly the same decisions.
- ``make_optimizer``: AdamW with the run's `OptimizerConfig` (nanoGPT's by default), with the multi-tensor
  (``foreach``) or fused kernels where the device has them.
- ``AdamW``: torch.optim.AdamW's update (its own functional kernels, the same arguments), state and state dict,
  without torch.optim.Optimizer, whose methods load torch's compiler stack (``torch._dynamo``, seconds of CPU per
  process on a small machine) the first time they run; a training worker never needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from terapipe_cli.config.optimizer import OptimizerConfig
from terapipe_cli.models.attention import branch

# The token and position embeddings and the LM head, by the names every architecture gives them (models/gpt/module.py's,
# kept by Llama and GPT-2) on every stage and tensor rank: what --no-decay-embeddings leaves undecayed. Tied, the
# head's matrix is the embedding's, listed once by `named_parameters`, under ``wte.weight``.
EMBEDDINGS_AND_HEAD = ("wte.weight", "wpe.weight", "lm_head.weight")


class AdamW:
    """AdamW over parameter groups, as ``torch.optim.AdamW(groups, lr=, betas=, eps=, foreach= | fused=)`` computes
    it: each step calls ``torch.optim.adam.adam`` with decoupled weight decay and the group's settings, as that
    optimizer's ``step`` does; ``state`` holds each parameter's ``step`` (a float32 scalar: on the CPU, or with the
    fused kernel on the parameter's device), ``exp_avg`` and ``exp_avg_sq``; `state_dict` and `load_state_dict` read
    and write torch's format (state by index in group order), so checkpoints of either load in the other."""

    def __init__(
        self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float, foreach: bool, fused: bool
    ) -> None:
        defaults = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 1e-2, "amsgrad": False, "maximize": False,
            "foreach": foreach or None, "capturable": False, "differentiable": False, "fused": fused or None,
            "decoupled_weight_decay": True,
        }  # fmt: skip
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.requires_grad_(False)
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim.adam import adam

        for group in self.param_groups:
            fused = bool(group["fused"])
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p not in self.state:
                    step = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                    self.state[p] = {
                        "step": step,
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                foreach=group["foreach"],
                capturable=False,
                differentiable=False,
                fused=group["fused"],
                grad_scale=None,
                found_inf=None,
                has_complex=any(torch.is_complex(p) for p in params),
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    def state_dict(self) -> dict:
        """torch.optim's format: ``{"state": {index: state}, "param_groups": [settings with "params": indices]}``."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [index[id(p)] for p in group["params"]]})  # fmt: skip
        state = {index[id(p)]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim's: the groups' settings from ``state_dict``; each state tensor on its parameter's device,
        its moments in the parameter's type (``step`` stays as saved, on the parameter's device with fused kernels)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(self.param_groups, saved, strict=True)):
            raise ValueError("loaded state dict has a parameter group of another size than the optimizer's")
        by_index = {}
        for group, stored in zip(self.param_groups, saved, strict=True):
            by_index.update(zip(stored["params"], group["params"], strict=True))
        pairs = zip(self.param_groups, saved, strict=True)
        fused = {id(p): bool(stored.get("fused")) for group, stored in pairs for p in group["params"]}
        self.state = {}
        for i, values in state_dict["state"].items():
            p = by_index[int(i)]
            self.state[p] = {key: _as_state(key, v, p, fused[id(p)]) for key, v in values.items()}
        self.param_groups = [{**s, "params": g["params"]} for g, s in zip(self.param_groups, saved, strict=True)]


def _as_state(key: str, value, p: torch.Tensor, fused: bool):
    """A loaded state value as torch.optim places it for parameter ``p``."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        return value.to(dtype=torch.float32, device=p.device) if fused else value
    return value.to(dtype=p.dtype, device=p.device) if p.is_floating_point() else value.to(device=p.device)


def set_lr(optimizer: AdamW, lr: float) -> None:
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
    optimizer: AdamW,
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


def make_optimizer(module: nn.Module, lr: float, config: OptimizerConfig | None = None) -> AdamW:
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
    return AdamW(groups, lr=lr, betas=config.betas, eps=config.eps, foreach=not on_cuda, fused=on_cuda)
