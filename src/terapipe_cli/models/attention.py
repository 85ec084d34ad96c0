"""Attention over a token slice's context, shared by every architecture: the K/V cache of one batch slice at one
layer (`KVCache`, with the K/V gradient hand-back) and `attend`, causal attention of a slice's queries over the
earlier slices' keys/values and its own (docs/design.md §6).

Which kernels run depends on the device: on the CPU a slice with context applies an additive mask (PyTorch's CPU
kernels skip masked blocks only for the top-left causal flag), on CUDA the fused kernels take the bottom-right
causal alignment (``causal_lower_right``) without a mask, and grouped-query keys/values are expanded for fp32 CUDA.
The choice is `branch`'s, by the tensor's device, and `forced_branch("cuda")` makes the CPU take the CUDA branch:
the CUDA code's arithmetic is then tested on the CPU against the CPU's own (tests/engine/test_cuda_branches.py),
so a GPU run has only kernels and speed left to check.

Packed documents (`DocumentMask`, docs/design.md §6): a token attends only to earlier tokens of its own document,
in its slice and in the cache alike, and a slice reads the cache only from the earliest document start of its
queries.
Both branches then take one explicit boolean mask of (i, start + i − lo) per tile, shared by the tile's layers: on
the CPU PyTorch's flash kernel takes it, on CUDA the memory-efficient kernel (the flash kernel takes no mask).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_FORCED: str | None = None  # the device type whose code path every tensor takes (None: its own device's)


def branch(t: torch.Tensor) -> str:
    """The device type whose code path a computation on ``t`` takes: ``t``'s own, unless `forced_branch` says."""
    return _FORCED or t.device.type


@contextmanager
def forced_branch(device_type: str) -> Iterator[None]:
    """Within: every `branch` is ``device_type``'s ("cuda" runs the CUDA branches' arithmetic on the CPU).

    Process-wide (every thread of an in-process run takes it); for tests and the GPU bring-up's dry run."""
    global _FORCED
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device type must be cpu or cuda, got {device_type!r}")
    before, _FORCED = _FORCED, device_type
    try:
        yield
    finally:
        _FORCED = before


@dataclass(frozen=True)
class DocumentMask:
    """Block-causal attention of one tile over packed documents (docs/design.md §6): which keys its queries may see.

    ``doc_starts[r, t]`` is where the document of query t of row r begins, in the sequence's positions (0 for a
    document that began before the window). Query t sees key s iff doc_starts[t] ≤ s ≤ t, so the tile reads the
    K/V cache only from ``lo``, the earliest of its queries' document starts (a tile whose every row begins a
    document there reads no cache). ``positions``: each token's place in its own document (learned positions and
    RoPE restart at each document). ``mask``: (b, 1, i, start + i − lo) boolean, built once for all the tile's
    layers (1 byte per (query, key) pair, kept for the backward) — or None when every query's document begins at
    ``lo`` (no boundary inside the rows it reads): attention is then plain causal over rows [lo, start + i), on the
    kernels and masks of the causal path (an explicit mask over a long prefix costs a visible share of a CPU step)."""

    start: int
    lo: int
    positions: torch.Tensor  # (b, i) int64
    mask: torch.Tensor | None  # (b, 1, i, start + i - lo) bool, True where the query sees the key; None: causal

    @classmethod
    def of(
        cls, doc_starts: torch.Tensor, start: int, device: torch.device | str = "cpu", unmasked: bool = False
    ) -> DocumentMask:
        """The tile of the tokens [start, start + i) whose queries' document starts are ``doc_starts`` (b, i),
        given on the CPU (``lo`` is read without waiting for a device); the tensors are made on ``device``.
        ``unmasked``: the tile's queries see every cached row of earlier slices, whatever document it belongs to
        (the mask kept inside the tile's own rows) — a test-only negative control (`config.controls.Controls`)."""
        doc_starts = doc_starts.to(torch.int64)
        i = doc_starts.shape[1]
        lo = 0 if unmasked else int(doc_starts[:, 0].min())
        one_document = bool((doc_starts == lo).all())
        doc_starts = doc_starts.to(device)
        queries = torch.arange(start, start + i, device=device)
        if one_document:
            return cls(start, lo, queries[None, :] - doc_starts, None)
        keys = torch.arange(lo, start + i, device=device)
        seen = keys[None, None, :] >= doc_starts[:, :, None]
        if unmasked:
            seen = seen | (keys < start)[None, None, :]
        mask = seen & (keys[None, None, :] <= queries[None, :, None])
        return cls(start, lo, queries[None, :] - doc_starts, mask[:, None])


class KVCache:
    """The keys and values of one batch slice at one layer, for the whole sequence; its slices fill it in order.

    A slice of ``i`` tokens starting at ``start`` writes its own k, v into rows ``[start, start + i)`` and attends
    over rows ``[0, start + i)`` — the earlier slices' keys/values are never copied again (docs/design.md §6).

    The K/V gradient hand-back: a slice's backward produces gradients for every row it read. Rows of earlier
    slices go into ``grad`` (summed over the later slices); the slice's own rows, plus what later slices left
    there, flow into its own graph. Backward runs in reverse token order, so when an earlier slice's turn comes
    every later slice has already handed its share back: each slice's graph is walked once, O(slices).
    ``handback=False`` drops the earlier rows' gradients: a test-only negative control.
    """

    def __init__(self, rows: int, *, handback: bool = True) -> None:
        self.rows = rows
        self.handback = handback
        self.keys: torch.Tensor | None = None  # (b, heads, rows, head_dim), allocated by the first slice
        self.values: torch.Tensor | None = None
        self.grad: tuple[torch.Tensor, torch.Tensor] | None = None  # gradients handed back to earlier rows

    def window(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this slice's (k, v) at ``start``; return rows [0, start + i) of keys and values, differentiable."""
        return _Window.apply(k, v, self, start)

    def _write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if self.keys is None:
            shape = (*k.shape[:2], max(self.rows, end), k.shape[3])
            self.keys, self.values = k.new_empty(shape), v.new_empty(shape)
        elif end > self.keys.shape[2] or k.shape[:2] != self.keys.shape[:2] or k.dtype != self.keys.dtype:
            raise RuntimeError(f"a slice of shape {tuple(k.shape)} at {start} does not fit this K/V cache")
        with torch.no_grad():
            self.keys[:, :, start:end].copy_(k)
            self.values[:, :, start:end].copy_(v)
        # Tensors of their own over the cache's storage: later slices' writes to rows past `end` must not bump
        # the version counter of what attention saved for its backward (those rows are not part of it).
        return _rows(self.keys, end), _rows(self.values, end)

    def _hand_back(self, grad_k: torch.Tensor, grad_v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of this slice's own k, v: its rows of the window's gradient plus what later slices left."""
        end = grad_k.shape[2]
        own = [grad_k[:, :, start:end], grad_v[:, :, start:end]]
        if self.grad is not None and self.grad[0].shape[2] >= end:
            own = [g + acc[:, :, start:end] for g, acc in zip(own, self.grad, strict=True)]
        if start and self.handback:
            if self.grad is None:
                self.grad = (
                    grad_k.new_zeros(grad_k.shape[:2] + (start, grad_k.shape[3])),
                    grad_v.new_zeros(grad_v.shape[:2] + (start, grad_v.shape[3])),
                )
            self.grad[0][:, :, :start] += grad_k[:, :, :start]
            self.grad[1][:, :, :start] += grad_v[:, :, :start]
        return own[0], own[1]


def _rows(cache: torch.Tensor, end: int) -> torch.Tensor:
    """Rows [0, end) of a (b, heads, rows, d) cache as a new tensor on the same storage (its own version counter)."""
    return cache.new_empty(0).set_(
        cache.untyped_storage(), cache.storage_offset(), (*cache.shape[:2], end, cache.shape[3]), cache.stride()
    )


class _Window(torch.autograd.Function):
    """Autograd for `KVCache.window`: forward writes into the cache, backward hands gradients back (above)."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, cache: KVCache, start: int):
        ctx.cache, ctx.start = cache, start
        return cache._write(k, v, start)

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor, grad_v: torch.Tensor):
        gk, gv = ctx.cache._hand_back(grad_k, grad_v, ctx.start)
        return gk, gv, None, None


def reversed_causal_mask(i: int, start: int, dtype: torch.dtype) -> torch.Tensor:
    """The CPU's additive mask for a slice of ``i`` queries after ``start`` context keys, the queries reversed.

    PyTorch's CPU attention needs an explicit mask for the bottom-right causal alignment and keeps it for the
    backward: a full (i, start + i) mask would hold 4 bytes per (query, key) pair for every tile until its
    backward, more than the tile's activations at long context. With the queries in reverse order, row r'
    (query i − 1 − r') blocks key c exactly when r' + c > start + i − 1: a function of r' + c, so the mask is a
    stride-(1, 1) view of one vector of start + 2i − 1 values, O(L) memory.
    """
    line = torch.zeros(start + 2 * i - 1, dtype=dtype)
    line[start + i :] = float("-inf")
    return line.as_strided((i, start + i), (1, 1))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache | None,
    start: int,
    *,
    gqa: bool = False,
    docs: DocumentMask | None = None,
) -> torch.Tensor:
    """Causal attention of a slice's queries q (b, heads, i, d) over the keys/values of [0, start + i): its own
    k, v (b, kv_heads, i, d) and, in ``cache``, the earlier slices' (None: the whole sequence, no cache).

    ``gqa``: fewer key/value heads than query heads (grouped-query attention); the kernels read each key/value head
    for its group of query heads (``enable_gqa``) without expanding the cache, and sum the group's gradients.
    ``docs``: packed documents, block-causal (`DocumentMask`): the cache's rows [docs.lo, start + i) only."""
    if docs is not None:
        keys, values = (k, v) if cache is None else cache.window(k, v, start)
        # Rows before the earliest document start are never read: their share of the hand-back is zero.
        keys, values = keys[:, :, docs.lo :], values[:, :, docs.lo :]
        if docs.mask is None:  # one document over every row read: causal over them
            return _causal(q, keys, values, start - docs.lo, gqa)
        keys, values, gqa = expand_for_kernel(q, keys, values, gqa)
        return F.scaled_dot_product_attention(q.contiguous(), keys, values, attn_mask=docs.mask, enable_gqa=gqa)
    if cache is None:
        k, v, gqa = expand_for_kernel(q, k, v, gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # q on its own storage (a copy), so the projection's output (q, k, v together) is not kept for the
    # backward: attention saves q and the cache's rows, no more than the whole-sequence path keeps.
    keys, values = cache.window(k, v, start)
    return _causal(q, keys, values, start, gqa)


def _causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, gqa: bool) -> torch.Tensor:
    """Causal attention of q (b, heads, i, d) over ``keys``/``values`` (b, kv_heads, start + i, d), aligned to the
    bottom-right corner: the first query sees the ``start`` keys before its own."""
    i = q.shape[2]
    on_cpu = branch(q) == "cpu"
    if not on_cpu:
        keys, values, gqa = expand_for_kernel(q, keys, values, gqa)
    if not start:
        return F.scaled_dot_product_attention(q.contiguous(), keys, values, is_causal=True, enable_gqa=gqa)
    if on_cpu:
        # Queries reversed, output back in order: the same forward; the key and value gradients sum the
        # queries' shares in another order (rounding-level differences).
        mask = reversed_causal_mask(i, start, q.dtype)
        return F.scaled_dot_product_attention(q.flip(2), keys, values, attn_mask=mask, enable_gqa=gqa).flip(2)
    # Causal aligned to the bottom-right corner: the slice's first query sees all `start` earlier keys;
    # the fused kernels apply it without building a mask. Imported here: its module loads torch._dynamo, seconds of
    # start-up for every process that imports this one, and only the CUDA branch needs it.
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(i, start + i)
    return F.scaled_dot_product_attention(q.contiguous(), keys, values, attn_mask=mask, enable_gqa=gqa)


def expand_for_kernel(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Grouped-query keys/values as the fused kernels can take them: as they are, except on CUDA in fp32, where
    the flash kernel does not run and the memory-efficient one has no grouped-query mode (PyTorch would fall back
    to the unfused kernel, which builds every score matrix). There each key/value head is repeated for its group of
    query heads (``repeat_interleave``, as ``transformers``' ``repeat_kv``; its backward sums the group's gradients):
    a copy of the slice's window per tile, still far smaller than the scores."""
    if gqa and branch(q) == "cuda" and q.dtype == torch.float32:
        group = q.shape[1] // keys.shape[1]
        return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1), False
    return keys, values, gqa
