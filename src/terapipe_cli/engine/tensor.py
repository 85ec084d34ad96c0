"""Tensor parallelism inside a stage: Megatron-LM's split of each decoder layer over T processes (docs/design.md §6b).

Each of a stage's T tensor ranks holds the query/key/value projections of its own heads and the matching
columns of the MLP's first linear (column-parallel), and the matching input columns of the attention's output
projection and of the MLP's second linear (row-parallel). A row-parallel linear gives a partial sum: it is
all-reduced over the T ranks in the forward (`_SumOverRanks`). A column-parallel linear's input is the same on
every rank, so its gradient is the sum of every rank's part: all-reduced in the backward (`_CopyToRanks`).
Two all-reduces forward and two backward per layer and tile. Each rank's K/V cache holds only its own heads' keys
and values.

The vocabulary is split too (Megatron's vocab-parallel embedding and cross-entropy): each rank holds the rows
[r·V//T, (r+1)·V//T) of the token embedding and of the LM head (`models.vocab_rows`; V need not divide by
T). The embedding looks up the tokens it holds, zeros the others' rows and sums over the ranks
(`VocabParallelEmbedding`); the head is column-parallel over the vocabulary (`VocabParallelHead`), and the loss is
the exact cross-entropy over the whole vocabulary from each rank's share of the logits
(`vocab_parallel_loss_sum`: the max and the sums all-reduced in the forward, nothing in the backward; the runtime
runs it chunk by chunk, `engine.loss`, never holding the whole logits). The layer norms and the position embedding
are replicated: every rank computes them on the same inputs, so their gradients agree on every rank without a
collective.

Why not ``torch.distributed.tensor.parallel`` (``ColwiseParallel``/``RowwiseParallel`` via
``parallelize_module``): it turns the parameters into DTensors, and the rest of this runtime needs plain
tensors — the data-parallel gradient all-reduce over one flat buffer, the global-norm clipping over the
pipeline, the fused/foreach AdamW, checkpoints that hold the whole stage (`Trainer.full_state`) and, on a shared GPU,
collectives staged through host memory on gloo (`comm.host_all_reduce`), which DTensor's own collectives do not
do. The split itself is two autograd functions and a weight slice per linear, written out below.

A linear layer's bias (GPT-2's) goes with its output features: a column-parallel layer's is cut with its weight, a
row-parallel layer's is whole on every rank and added once, after the sum over the ranks (every rank then computes
the same output and the same bias gradient, as for the layer norms).

Parameter names stay the single-device model's; a sharded parameter is a slice of the full one along one
dimension (`SPLITS`: every architecture's splits, each declared by its arch spec in `terapipe_cli.models`).
`shard_tensor` cuts the full tensor into this rank's slice, `gather_tensor` puts the full one back together (an
all-gather over the tensor group), so checkpoints, ``--verify`` and ``terapipe export`` see whole tensors whatever T
was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from terapipe_cli.engine.comm import Group
from terapipe_cli.engine.loss import chunked_loss_sum, compute_weight, token_loss_sum
from terapipe_cli.models import Split, all_splits, vocab_rows

if TYPE_CHECKING:
    from terapipe_cli.engine.optim import AdamW


@dataclass(frozen=True)
class TensorGroup:
    """This process's place in its stage's tensor-parallel group.

    ``skip_allreduce`` drops the backward all-reduce of the column-parallel inputs, ``skip_vocab_allreduce`` the
    all-reduces of the vocab-parallel loss (each rank's loss then covers its own rows only): test-only negative
    controls that must make verification fail."""

    rank: int
    size: int
    group: Group | None = None  # the collectives of the stage's T ranks (`comm.DistGroup`, or threads in tests)
    skip_allreduce: bool = False
    skip_vocab_allreduce: bool = False

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The reduction (``op``: sum or max) over the group's ranks, in place; returns ``tensor``."""
        self.group.all_reduce(tensor, op=op, what="a tensor-parallel all-reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, in rank order (``sizes``: each rank's length along
        ``dim`` when they differ)."""
        return self.group.all_gather(tensor, dim, sizes)


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
    """A linear holding this rank's slice ``weight`` of the whole one (under the whole one's name), and its
    ``bias`` (None: none) as `ColumnParallelLinear` or `RowParallelLinear` holds it."""

    def __init__(self, weight: torch.Tensor, tp: TensorGroup, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.tp = tp


class ColumnParallelLinear(_ShardedLinear):
    """``y_r = x · W_rᵀ + b_r``: this rank's output columns of a linear (and of its bias); the input's gradient is
    summed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToRanks.apply(x, self.tp), self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """``y = Σ_r x_r · W_rᵀ + b``: this rank's input columns of a linear; the output is summed, and the whole bias
    added once, after the sum (in the output's precision, as the unsplit linear adds it under autocast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _SumOverRanks.apply(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """The token embedding's rows ``rows`` of the vocabulary, under the whole table's name (``wte.weight``).

    A token this rank does not hold looks up a valid row (its first) whose output is then zeroed; the ranks'
    outputs summed (`_SumOverRanks`) are the whole embedding, exactly (one rank adds the row, the others zeros).
    The sum's backward is the identity, so every rank receives the whole output gradient and its rows' gradient
    is the whole table's gradient at those rows."""

    def __init__(self, weight: torch.Tensor, tp: TensorGroup, rows: range) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.tp, self.lo, self.hi = tp, rows.start, rows.stop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        elsewhere = (tokens < self.lo) | (tokens >= self.hi)
        rows = F.embedding((tokens - self.lo).masked_fill(elsewhere, 0), self.weight)
        return _SumOverRanks.apply(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.tp)


class VocabParallelHead(ColumnParallelLinear):
    """The LM head's rows ``rows`` of the vocabulary (column-parallel over it): this rank's logits (b, i, V_r).
    The input's gradient is summed over the ranks (`_CopyToRanks`); the loss is `vocab_parallel_loss_sum`."""

    def __init__(self, weight: torch.Tensor, tp: TensorGroup, rows: range) -> None:
        super().__init__(weight, tp)
        self.lo, self.hi = rows.start, rows.stop


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy over the whole vocabulary from each rank's share of the logits (Megatron's).

    Forward, in fp32 as ``F.cross_entropy`` works under autocast: the per-token max over all ranks (all-reduced,
    a shift that keeps the exponentials finite), then one all-reduce of the per-token sum of exponentials and of
    the target's shifted logit (only the rank holding the target adds it, the others zero): loss = Σ log(sum) −
    target. Backward needs no collective: the gradient of a rank's logits is softmax − onehot over its own rows,
    with the softmax kept from the forward (fp32, b·i·V_r, as ``F.cross_entropy`` keeps its log-probabilities)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp: TensorGroup, lo: int, hi: int):
        with torch.autocast(logits.device.type, enabled=False):
            shifted = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit logits: fp32
            top = shifted.amax(dim=-1)
            if not tp.skip_vocab_allreduce:
                tp.all_reduce(top, op="max")
            shifted = shifted - top.unsqueeze(-1)
            held = (targets >= lo) & (targets < hi)
            local = (targets - lo).masked_fill(~held, 0)
            target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~held, 0.0)
            sums = torch.stack([target, shifted.exp_().sum(-1)])
            if not tp.skip_vocab_allreduce:
                tp.all_reduce(sums)  # the target's logit from the rank holding it; the exponentials of every rank
            target, total = sums
            softmax = shifted.div_(total.unsqueeze(-1))  # the exponentials, normalised in place
        ctx.save_for_backward(softmax, local, held)
        ctx.dtype = logits.dtype
        return (total.log() - target).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, held = ctx.saved_tensors
        # In place: the saved softmax is needed once (a tile's graph is walked once, engine/stage.py).
        softmax.scatter_add_(-1, local.unsqueeze(-1), -held.unsqueeze(-1).to(softmax.dtype))
        return softmax.mul_(grad).to(ctx.dtype), None, None, None, None


def vocab_parallel_loss_sum(
    logits_local: torch.Tensor, targets: torch.Tensor, tp: TensorGroup, lo: int, hi: int
) -> torch.Tensor:
    """The summed (not averaged) cross-entropy over the whole vocabulary, from this rank's logits (b, i, hi − lo) of
    the vocabulary's rows [lo, hi): the same on every rank of the group (a collective: all ranks call it), equal to
    ``loss.token_loss_sum`` of the whole logits."""
    return _VocabParallelCrossEntropy.apply(logits_local, targets, tp, lo, hi)


def head_loss_sum(module: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """The last chunk's summed token loss of ``module`` (a `models.decoder.Decoder`) from its final norm's output
    ``h``: the LM head and the cross-entropy ``chunk`` tokens at a time (`engine.loss`; 0: the whole logits at once),
    over the whole vocabulary from this rank's rows when the head is vocab-parallel (`shard_module`)."""
    head = module.lm_head
    split = isinstance(head, VocabParallelHead)
    if chunk <= 0:
        logits = head(h)
        if split:
            return vocab_parallel_loss_sum(logits, targets, head.tp, head.lo, head.hi)
        return token_loss_sum(logits, targets)
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    wc = compute_weight(head, head.weight, dtype)
    if not split:
        return chunked_loss_sum(h, targets, head.weight, wc, chunk)
    # The input's gradient is summed over the ranks, as the column-parallel head's (`_CopyToRanks`).
    x = _CopyToRanks.apply(h, head.tp)
    return chunked_loss_sum(x, targets, head.weight, wc, chunk, head.tp, head.lo, head.hi)


# How each sharded parameter is cut, by the end of its name: every arch spec's (`terapipe_cli.models`).
SPLITS: dict[str, Split] = all_splits()


def split_of(name: str) -> Split | None:
    """How a sharded parameter is cut; None for a replicated one."""
    return next((split for suffix, split in SPLITS.items() if name.endswith(suffix)), None)


def shard_ranges(name: str, full_shape: Sequence[int], size: int, rank: int) -> tuple[int, list[range]] | None:
    """Where tensor rank ``rank`` of ``size`` finds its share of the full tensor of parameter ``name`` (shape
    ``full_shape``): (the dimension, the index ranges along it, concatenated in order: one per stacked part, as the
    fused q, k, v); None when it holds the whole tensor. A reader of a file takes just these (`train.init_from`)."""
    split = split_of(name)
    if split is None or size == 1:
        return None
    dim, parts, vocab = split
    if vocab:
        return dim, [vocab_rows(full_shape[dim], size, rank)]
    block = full_shape[dim] // parts
    piece = block // size
    return dim, [range(p * block + rank * piece, p * block + (rank + 1) * piece) for p in range(parts)]


def shard_tensor(name: str, full: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """This rank's slice of the full tensor of parameter ``name`` (the tensor itself when replicated)."""
    where = shard_ranges(name, full.shape, tp.size, tp.rank)
    if where is None:
        return full
    dim, ranges = where
    return torch.cat([full.narrow(dim, r.start, len(r)) for r in ranges], dim=dim).contiguous()


def gather_tensor(name: str, local: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """The full tensor of parameter ``name`` from every rank's slice (a collective: all ranks call it)."""
    split = split_of(name)
    if split is None or tp.size == 1:
        return local
    dim, parts, vocab = split
    if vocab:
        # The ranks' shares of the vocabulary may differ by a row: each one's length first (a one-number gather).
        sizes = tp.all_gather(local.new_tensor([local.shape[dim]], dtype=torch.long), 0).tolist()
        return tp.all_gather(local, dim, sizes)
    return tp.all_gather(local.unflatten(dim, (parts, -1)), dim + 1).flatten(dim, dim + 1)


def shard_module(module: nn.Module, tp: TensorGroup) -> None:
    """Keep only this rank's part of every decoder layer of ``module`` (a `models.decoder.Decoder`), and of the
    vocabulary's rows of its token embedding (chunk 0) and LM head (the last chunk), in place."""
    if tp.size == 1:
        return
    module.cfg.check_tensor_parallel(tp.size)  # T splits the heads and the MLP's width
    rows = vocab_rows(module.cfg.vocab, tp.size, tp.rank)
    if module.first:
        weight = module.wte.weight
        module.wte = VocabParallelEmbedding(shard_tensor("wte.weight", weight, tp), tp, rows).to(weight.device)
    if module.last:
        weight = module.lm_head.weight
        module.lm_head = VocabParallelHead(shard_tensor("lm_head.weight", weight, tp), tp, rows).to(weight.device)
        if module.cfg.tie_embeddings and module.first:  # tied on this stage: the one matrix's rows again
            module.lm_head.weight = module.wte.weight
    for n, block in module.blocks.items():
        for path, linear in list(block.named_modules()):
            split = split_of(f"{path}.weight") if isinstance(linear, nn.Linear) else None
            if split is None:
                continue
            # Cut along the output features: column-parallel, its bias cut alike; along the input features:
            # row-parallel, its bias whole.
            kind = ColumnParallelLinear if split.dim == 0 else RowParallelLinear
            weight = shard_tensor(f"blocks.{n}.{path}.weight", linear.weight, tp)
            bias = linear.bias
            if bias is not None and kind is ColumnParallelLinear:
                if split_of(f"{path}.bias") is None:
                    raise ValueError(f"the bias of column-parallel {path} has no split (its arch spec's splits)")
                bias = shard_tensor(f"blocks.{n}.{path}.bias", bias, tp)
            sharded = kind(weight, tp, bias).to(linear.weight.device)
            owner, attr = path.rsplit(".", 1)
            setattr(block.get_submodule(owner), attr, sharded)
        block.attn.split_heads(tp.size)


def parameter_names(module: nn.Module, optimizer: AdamW) -> list[str]:
    """The names of the optimizer's parameters in its state dict's order (its groups' order)."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def local_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, model: dict, optim: dict, tp: TensorGroup
) -> tuple[dict, dict]:
    """This rank's part of a whole stage's (model state, optimizer state) as a terapipe.checkpoint/1 file holds them
    (the optimizer state by index; `Trainer.full_state` now saves it by name)."""
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
