"""Tensor parallelism inside a stage: Megatron-LM's split of each decoder layer over T processes (docs/design.md §6b).

Each of a stage's T tensor ranks holds the query/key/value projections of its own heads and the matching
columns of the MLP's first linear (column-parallel), and the matching input columns of the attention's output
projection and of the MLP's second linear (row-parallel). A row-parallel linear gives a partial sum: it is
all-reduced over the T ranks in the forward (`_SumOverRanks`). A column-parallel linear's input is the same on
every rank, so its gradient is the sum of every rank's part: all-reduced in the backward (`_CopyToRanks`).
Two all-reduces forward and two backward per layer and tile; nothing else is exchanged. The layer norms,
embeddings and LM head are replicated: every rank computes them on the same inputs, so their gradients agree
on every rank without a collective. Each rank's K/V cache holds only its own heads' keys and values.

Why not ``torch.distributed.tensor.parallel`` (``ColwiseParallel``/``RowwiseParallel`` via
``parallelize_module``): it turns the parameters into DTensors, and the rest of this runtime needs plain
tensors — the data-parallel gradient all-reduce over one flat buffer, the global-norm clipping over the
pipeline, the fused/foreach AdamW, checkpoints that hold the whole stage (`full_state`) and, on a shared GPU,
collectives staged through host memory on gloo (`comm.host_all_reduce`), which DTensor's own collectives do not
do. The split itself is two autograd functions and a weight slice per linear, written out below.

Parameter names stay the single-device model's; a sharded parameter is a slice of the full one along one
dimension (`SPLITS`). `shard_tensor` cuts the full tensor into this rank's slice, `gather_tensor` puts the
full one back together (an all-gather over the tensor group), so checkpoints, ``--verify`` and ``terapipe
export`` see whole tensors whatever T was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from terapipe_cli.engine.comm import Group


@dataclass(frozen=True)
class TensorGroup:
    """This process's place in its stage's tensor-parallel group.

    ``skip_allreduce`` drops the backward all-reduce of the column-parallel inputs: a test-only negative
    control that must make verification fail."""

    rank: int
    size: int
    group: Group | None = None  # the collectives of the stage's T ranks (`comm.DistGroup`, or threads in tests)
    skip_allreduce: bool = False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks, in place; returns ``tensor``."""
        self.group.all_reduce(tensor, what="a tensor-parallel all-reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, in rank order."""
        return self.group.all_gather(tensor, dim)


class _CopyToRanks(torch.autograd.Function):
    """Megatron's "f": the identity forward; the backward sums the input gradient over the tensor ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.tp.skip_allreduce:
            return grad, None
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _SumOverRanks(torch.autograd.Function):
    """Megatron's "g": the forward sums the partial outputs over the tensor ranks; the identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ShardedLinear(nn.Module):
    """A bias-free linear holding this rank's slice ``weight`` of the whole one (under the whole one's name)."""

    def __init__(self, weight: torch.Tensor, tp: TensorGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.tp = tp


class ColumnParallelLinear(_ShardedLinear):
    """``y_r = x · W_rᵀ``: this rank's output columns of a bias-free linear; the input's gradient is summed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToRanks.apply(x, self.tp), self.weight)


class RowParallelLinear(_ShardedLinear):
    """``y = Σ_r x_r · W_rᵀ``: this rank's input columns of a bias-free linear; the output is summed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(F.linear(x, self.weight), self.tp)


# How each sharded parameter is cut, by the end of its name: (dimension, parts). The fused q/k/v weight is three
# matrices stacked along dim 0 (parts = 3): each rank keeps its heads' rows of each of them.
SPLITS: dict[str, tuple[int, int]] = {
    "attn.qkv.weight": (0, 3),
    "attn.proj.weight": (1, 1),
    "mlp.fc.weight": (0, 1),
    "mlp.proj.weight": (1, 1),
}


def split_of(name: str) -> tuple[int, int] | None:
    """(dimension, parts) of a sharded parameter; None for a replicated one."""
    return next((split for suffix, split in SPLITS.items() if name.endswith(suffix)), None)


def shard_tensor(name: str, full: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """This rank's slice of the full tensor of parameter ``name`` (the tensor itself when replicated)."""
    split = split_of(name)
    if split is None or tp.size == 1:
        return full
    dim, parts = split
    blocks = full.unflatten(dim, (parts, -1))
    return blocks.chunk(tp.size, dim=dim + 1)[tp.rank].flatten(dim, dim + 1).contiguous()


def gather_tensor(name: str, local: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """The full tensor of parameter ``name`` from every rank's slice (a collective: all ranks call it)."""
    split = split_of(name)
    if split is None or tp.size == 1:
        return local
    dim, parts = split
    return tp.all_gather(local.unflatten(dim, (parts, -1)), dim + 1).flatten(dim, dim + 1)


def shard_module(module: nn.Module, tp: TensorGroup) -> None:
    """Keep only this rank's part of every decoder layer of ``module`` (a `model.GPT`), in place."""
    if tp.size == 1:
        return
    module.cfg.check_tensor_parallel(tp.size)  # T splits the heads and the MLP's width
    for n, block in module.blocks.items():
        for path, kind in (
            ("attn.qkv", ColumnParallelLinear),
            ("attn.proj", RowParallelLinear),
            ("mlp.fc", ColumnParallelLinear),
            ("mlp.proj", RowParallelLinear),
        ):
            owner, attr = path.split(".")
            weight = getattr(getattr(block, owner), attr).weight
            sharded = kind(shard_tensor(f"blocks.{n}.{path}.weight", weight, tp), tp).to(weight.device)
            setattr(getattr(block, owner), attr, sharded)
        block.attn.heads //= tp.size
        block.attn.hidden //= tp.size


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its state dict's order (its groups' order)."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer, tp: TensorGroup) -> tuple[dict, dict]:
    """(model state, optimizer state) of the whole stage, gathered from the tensor ranks (a collective)."""
    model = {name: gather_tensor(name, t, tp) for name, t in module.state_dict().items()}
    return model, _map_optimizer_state(module, optimizer, optimizer.state_dict(), lambda n, t: gather_tensor(n, t, tp))


def local_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, model: dict, optim: dict, tp: TensorGroup
) -> tuple[dict, dict]:
    """This rank's part of a whole stage's (model state, optimizer state), as `full_state` made them."""
    local_model = {name: shard_tensor(name, t, tp) for name, t in model.items()}
    return local_model, _map_optimizer_state(module, optimizer, optim, lambda n, t: shard_tensor(n, t, tp))


def _map_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict, fn) -> dict:
    """``state`` with ``fn(name, tensor)`` applied to every per-parameter tensor of its parameter's shape
    (Adam's moments; not the step counts)."""
    names = parameter_names(module, optimizer)
    out = dict(state)
    out["state"] = {
        index: {
            key: fn(names[index], value) if torch.is_tensor(value) and value.dim() > 0 else value
            for key, value in per_param.items()
        }
        for index, per_param in state["state"].items()
    }
    return out
