"""The last chunk's LM head and cross-entropy over chunks of tokens: the logits of a whole tile never exist at once.

A tile of n = b·i tokens and a vocabulary of V rows makes n × V logits; with a long tile and a large vocabulary they
are the largest tensor of the step (L = 8,192 tokens of a 128K vocabulary: 4 GiB in fp32), and the loss's backward
needs them again as softmax − onehot. `head_loss_sum` instead walks the tile ``chunk`` tokens at a time (Liger
Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy do the same in fused kernels; this is the plain
PyTorch form of it):

* forward: per chunk, its logits → the per-token log-sum-exp and the target's logit → the loss sum. The forward keeps
  only the head's input, the targets and one log-sum-exp per token (fp32), nothing of size V;
* backward: over blocks of the vocabulary's rows with as many logits as a forward chunk, the block's logits of the
  whole tile made again, softmax − onehot (times the incoming gradient) in fp32, then its part of the input's
  gradient and its rows of the head's weight gradient — each row once per tile, in one product over the tile.

So the head holds O(chunk × V) logits for a moment, never O(n × V). Exact: each chunk's loss and each block's gradients
are those of the whole tile's, so the sums equal the unchunked computation up to the order of additions (tests compare
them).

Precision. As ``F.linear`` then ``F.cross_entropy`` run under autocast: the product in the compute type (the weight's
16-bit copy, one per step: `compute_weight`), the softmax and the loss in fp32, the logits' gradient cast back to the
compute type for the two products of the backward. The input's gradient is summed over the vocabulary's blocks in
fp32; each row of the weight's gradient is one product over the tile, added into the fp32 gradient.

The head's weight gradient is accumulated into ``weight.grad`` by the backward itself (Megatron-LM's gradient
accumulation fusion does the same), not handed to autograd: it needs each chunk's logits' gradient, which exists only
inside the backward's loop, and handing back a whole (V, H) per tile would be the unchunked path's transient. So the
split backward's I (engine/split_backward.py) does the head's whole backward — the weight's gradient included — and
its W has nothing of the head left to do: making every chunk's logits again in W would repeat the head's largest
product. The graph has no edge to the weight, so the split finds no weight consumer here.

With the vocabulary split over tensor ranks (engine/tensor.py) each rank makes its own rows' logits of the chunk; the
max and the two sums are all-reduced per chunk (Megatron's vocab-parallel cross-entropy, chunk by chunk); the
backward, over this rank's rows, needs no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_weight(module: nn.Module, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``weight`` in the compute type ``dtype`` (None: as it is), detached. A 16-bit copy is made once per version of
    the weight (an optimizer step bumps it) and kept on ``module`` until `drop_compute_weights`: the one copy per step
    autocast would keep for ``F.linear``, shared by every tile's forward and backward."""
    if dtype is None or weight.dtype == dtype:
        return weight.detach()
    held = getattr(module, "_compute_weight", None)
    if held is not None and held[0] is weight and held[1] == weight._version and held[2] == dtype:
        return held[3]
    copy = weight.detach().to(dtype)
    module._compute_weight = (weight, weight._version, dtype, copy)
    return copy


def drop_compute_weights(module: nn.Module) -> None:
    """Forget the 16-bit copies of `compute_weight` held by ``module``'s submodules (the end of a step)."""
    for m in module.modules():
        m.__dict__.pop("_compute_weight", None)


def chunk_ranges(n: int, chunk: int) -> list[range]:
    """The rows [0, n) in consecutive pieces of at most ``chunk``."""
    return [range(s, min(s + chunk, n)) for s in range(0, n, chunk)]


class _ChunkedHeadLoss(torch.autograd.Function):
    """The summed cross-entropy of ``x @ wc.T`` (this rank's rows [lo, hi) of the vocabulary) over chunks of rows
    (the module docstring). ``held_weight`` holds the parameter ``wc`` computes with (in a tuple: not an autograd
    input, its gradient goes to ``.grad`` directly); ``tp`` the tensor group when the vocabulary is split (None:
    whole)."""

    @staticmethod
    def forward(ctx, x, targets, wc, held_weight, chunk, tp, lo, hi):
        n = x.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for r in chunk_ranges(n, chunk):
                logits = _logits(x[r.start : r.stop], wc)
                t = targets[r.start : r.stop]
                if tp is None:
                    lse[r.start : r.stop] = torch.logsumexp(logits, dim=-1)
                    target = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1)
                else:
                    lse[r.start : r.stop], target = _vocab_parallel_lse(logits, t, tp, lo, hi)
                total += (lse[r.start : r.stop] - target).sum()
        ctx.save_for_backward(x, targets, wc, lse)
        (ctx.weight,) = held_weight
        ctx.chunk, ctx.lo, ctx.hi = chunk, lo, hi
        return total

    @staticmethod
    def backward(ctx, grad):
        x, targets, wc, lse = ctx.saved_tensors
        weight = ctx.weight if ctx.weight.requires_grad else None
        with torch.autocast(x.device.type, enabled=False):
            grad_x = _backward_by_rows(x, targets, wc, lse, grad, ctx.chunk, ctx.lo, ctx.hi, ctx.needs_input_grad[0],
                                       weight)  # fmt: skip
        return grad_x, None, None, None, None, None, None, None


def _logits(x: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
    """A chunk's logits in fp32, from the product in the compute type (as ``F.linear`` under autocast, then
    ``F.cross_entropy``'s cast to fp32)."""
    return F.linear(x.to(wc.dtype), wc).float()


def _vocab_parallel_lse(logits, t, tp, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-sum-exp over the whole vocabulary and its target's logit, from this rank's rows [lo, hi)."""
    top = logits.amax(dim=-1)
    if not tp.skip_vocab_allreduce:
        tp.all_reduce(top, op="max")  # the shift that keeps the exponentials finite, the same on every rank
    shifted = logits - top.unsqueeze(-1)
    held = (t >= lo) & (t < hi)
    local = (t - lo).masked_fill(~held, 0)
    target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~held, 0.0)
    sums = torch.stack([target, shifted.exp_().sum(-1)])
    if not tp.skip_vocab_allreduce:
        tp.all_reduce(sums)  # the target's logit from the rank holding it; the exponentials of every rank
    target, total = sums
    return top + total.log(), top + target


def vocab_block_rows(n: int, rows: int, chunk: int) -> int:
    """The vocabulary rows the backward takes at a time for a tile of ``n`` tokens over ``rows`` rows: as many logits
    as a forward chunk of ``chunk`` tokens makes (``chunk · rows``), so the backward's transient is the forward's."""
    return max(1, min(rows, chunk * rows // max(n, 1)))


def _backward_by_rows(x, targets, wc, lse, grad, chunk: int, lo: int, hi: int, input_grad: bool, weight):
    """The backward over blocks of the vocabulary's rows (`vocab_block_rows`): per block, the tile's logits of those
    rows made again, softmax − onehot times ``grad`` (fp32), the block's rows of the weight's gradient in one product
    over all the tile's tokens (added into ``weight.grad`` in fp32 once per tile, as the unchunked backward does: a
    split over tokens would add a whole (V, H) gradient per chunk, on a GPU the slowest part of the head), and its
    part of the input's gradient summed in fp32. Returns the input's gradient (None unless ``input_grad``)."""
    n, rows = x.shape[0], wc.shape[0]
    step = vocab_block_rows(n, rows, chunk)
    xc = x.to(wc.dtype)
    held = (targets >= lo) & (targets < hi)
    local = (targets - lo).masked_fill(~held, -1)  # -1: the target is another rank's row
    grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if input_grad else None
    if weight is not None and weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    for v0 in range(0, rows, step):
        _block_backward(xc, local, lse, grad, wc, v0, min(v0 + step, rows), grad_x, weight)
    return None if grad_x is None else grad_x.to(x.dtype)


def _block_backward(xc, local, lse, grad, wc, v0: int, v1: int, grad_x, weight) -> None:
    """Rows [v0, v1) of the vocabulary in `_backward_by_rows`: ``xc`` the tile's input in the compute type, ``local``
    each token's target row on this rank (-1: another rank's)."""
    w = wc[v0:v1]
    probs = F.linear(xc, w).float().sub_(lse.unsqueeze(-1)).exp_()
    mine = (local >= v0) & (local < v1)
    probs.scatter_add_(-1, (local - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1), -mine.unsqueeze(-1).to(probs.dtype))
    g = probs.mul_(grad).to(wc.dtype)
    if grad_x is not None:
        grad_x.add_(g @ w)
    if weight is not None:
        if g.dtype == weight.grad.dtype:
            weight.grad[v0:v1].addmm_(g.t(), xc)
        else:  # a 16-bit product over the whole tile, added in fp32
            weight.grad[v0:v1] += (g.t() @ xc).to(weight.grad.dtype)


def chunked_loss_sum(
    x: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    wc: torch.Tensor,
    chunk: int,
    tp=None,
    lo: int = 0,
    hi: int | None = None,
) -> torch.Tensor:
    """The summed cross-entropy of the head ``weight`` (computing with ``wc``, its copy in the compute type) on
    ``x`` (..., H) against ``targets`` (...), ``chunk`` tokens at a time; with ``tp``, over the whole vocabulary from
    this rank's rows [lo, hi) (a collective per chunk)."""
    x2 = x.reshape(-1, x.shape[-1])
    hi = wc.shape[0] if hi is None else hi
    # The weight in a tuple: no autograd input (its gradient goes to .grad directly, the module docstring says why).
    return _ChunkedHeadLoss.apply(x2, targets.reshape(-1), wc, (weight,), max(1, int(chunk)), tp, lo, hi)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy: the step divides by all predicted tokens of the step (docs/design.md §6)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
