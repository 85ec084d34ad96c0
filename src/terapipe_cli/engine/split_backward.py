"""A tile's backward in two calls (docs/design.md §11b): I, the gradient of the tile's input
and of the K/V cache rows it read, now — what the previous chunk and the earlier token slices wait for — and W, the
weights' gradients, later, where a zero-bubble schedule has a gap.

The same idea as torch.distributed.pipelining's ``stage_backward_input`` / ``stage_backward_weight``, written for our
graphs (`split_graph`). A *weight chain* is a path of nodes that leads to one parameter and nothing else, each node
with one consumer (a weight's transpose, its cast to 16 bits, the embedding's lookup): only its parameter's gradient
flows through it. Every other node is the *rest*, and a node of the rest that hands gradient to a weight chain (a
matmul, a norm) is a *weight consumer*. I asks autograd for the gradient of the input and of every weight consumer's
output (``torch.autograd.grad`` with those as inputs, the graph kept): a consumer on the way to the input computes
its input's gradient only — its weight's edge is not asked for, so the weight's matmul is not done — and the K/V
hand-back (`attention._Window`) runs on the way, so an earlier token slice's I finds its K/V gradients in the cache.
W runs each consumer again for its chains alone, from the gradient I saved, then the chains down to the parameters,
accumulated into ``.grad``: each node's work is done once between I and W (the consumers' backward is two calls, as a
matmul's two products are two), so the sum of every tile's W is the whole backward's weight gradient, and nothing
walks a graph twice. Tensor parallelism's all-reduces in the backward sit on the activations' path: they run in I.

A parameter a consumer reads directly (a norm's weight, a bias, with no cast between) whose gradient node has more
than one consumer (a weight tied within the chunk) is computed in I instead: asking for it from one consumer in W
could reach it through the rest of the graph again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge

from terapipe_cli.models.attention import _Window

_WINDOW = _Window._backward_cls  # the K/V hand-back's node: always the rest (I)


@dataclass
class PendingWeights:
    """What a tile's W needs, from its I: each weight consumer's output edges with their gradients and the heads of
    its weight chains; and the gradients of parameters I computed itself (`split_graph`)."""

    consumers: list[tuple[list[GradientEdge], list[torch.Tensor], list[GradientEdge]]]
    done: list[tuple[torch.nn.Parameter | torch.Tensor, torch.Tensor]]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The gradients held from I to W (for the memory count)."""
        return [g for _, grads, _ in self.consumers for g in grads] + [g for _, g in self.done]


def _nodes(root) -> tuple[list, dict, dict]:
    """The graph below ``root`` (a grad_fn node): its nodes children first, each node's child edges, each node's
    consumers' edges into it ((parent, output number), with repeats)."""
    order: list = []
    children: dict = {}
    parents: dict = {root: []}
    seen: set = {root}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        kids = [(n, nr) for n, nr in node.next_functions if n is not None]
        children[node] = kids
        stack.append((node, True))
        for kid, nr in kids:
            parents.setdefault(kid, []).append((node, nr))
            if kid not in seen:
                seen.add(kid)
                stack.append((kid, False))
    return order, children, parents


def split_graph(root, params: set[int]) -> tuple[list[tuple[object, list[int], list]], list]:
    """The tile's graph below ``root`` cut for I and W (module docstring): each weight consumer with its used output
    numbers and its weight chains' heads (edges), and the parameter edges I computes itself. ``params``: the ids of
    the parameters."""
    order, children, parents = _nodes(root)
    chain: set = set()
    for node in order:  # children first
        variable = getattr(node, "variable", None)
        if variable is not None:
            if id(variable) in params:
                chain.add(node)
            continue
        kids = children[node]
        if len(kids) == 1 and kids[0][0] in chain and len(parents[node]) == 1 and not isinstance(node, _WINDOW):
            chain.add(node)
    consumers, in_i = [], []
    for node in order:
        if node in chain:
            continue
        heads = []
        for kid, nr in children[node]:
            if kid not in chain:
                continue
            if getattr(kid, "variable", None) is not None and len(parents[kid]) > 1:
                in_i.append((kid, nr))  # a parameter read here and elsewhere: its gradient in I
            else:
                heads.append((kid, nr))
        if heads:
            used = sorted({nr for _, nr in parents[node]}) if node is not root else [0]
            consumers.append((node, used, heads))
    return consumers, in_i


def backward_input(
    output: torch.Tensor,
    grad_output: torch.Tensor | None,
    inputs: Sequence[torch.Tensor],
    params: dict[int, torch.nn.Parameter],
) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """I: the gradients of ``inputs`` (leaves of the tile's graph) from ``output`` (with ``grad_output``; None for a
    scalar loss), the K/V hand-back on the way, and what W needs. The graph is kept for W. ``params``: the chunk's
    parameters by id."""
    consumers, in_i = split_graph(output.grad_fn, set(params))
    edges = [GradientEdge(node, nr) for node, used, _ in consumers for nr in used]
    direct = [GradientEdge(node, nr) for node, nr in in_i]
    wanted = list(inputs) + edges + direct
    grads = torch.autograd.grad(
        [output], wanted, grad_outputs=None if grad_output is None else [grad_output], retain_graph=True,
        allow_unused=True,
    )  # fmt: skip
    at = len(inputs)
    pending = PendingWeights([], [])
    for node, used, heads in consumers:
        got = [(GradientEdge(node, nr), g) for nr, g in zip(used, grads[at : at + len(used)], strict=True)]
        at += len(used)
        got = [(e, g) for e, g in got if g is not None]
        if got:
            pending.consumers.append(
                ([e for e, _ in got], [g for _, g in got], [GradientEdge(k, nr) for k, nr in heads])
            )
    for (node, _), g in zip(in_i, grads[at:], strict=True):
        if g is not None:
            pending.done.append((node.variable, g))
    return list(grads[: len(inputs)]), pending


def backward_weight(pending: PendingWeights, params: dict[int, torch.nn.Parameter]) -> None:
    """W: the weights' gradients from what I left, accumulated into ``.grad`` as a whole backward would: each
    consumer again for its weight chains' heads alone, then every chain down to its parameter at once."""
    heads, head_grads = [], []
    for outputs, grads, chain_heads in pending.consumers:
        got = torch.autograd.grad(outputs, chain_heads, grad_outputs=grads, retain_graph=True, allow_unused=True)
        for edge, g in zip(chain_heads, got, strict=True):
            if g is None:
                continue
            variable = getattr(edge.node, "variable", None)
            if variable is not None:  # the chain is the parameter itself
                _accumulate(variable, g)
            else:
                heads.append(edge)
                head_grads.append(g)
    if heads:
        reached = list(params.values())
        for p, g in zip(reached, torch.autograd.grad(heads, reached, grad_outputs=head_grads, allow_unused=True),
                        strict=True):  # fmt: skip
            if g is not None:
                _accumulate(p, g)
    for p, g in pending.done:
        _accumulate(p, g)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.detach().clone() if g.dtype == p.dtype else g.to(p.dtype)
    else:
        p.grad += g
