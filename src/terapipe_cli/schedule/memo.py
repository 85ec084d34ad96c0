"""Work shared within one plan. Choosing a partition and v compares many cost models of one profile on one
grid of tiles, and each is bounded, searched and searched again within the memory limit: the tile prices and the
search's tables would be computed again every time. Inside `sharing()` they are computed once — `remembered(key,
make)` — and kept while the plan is made, at most `BUDGET_BYTES` of arrays, the least recently used dropped first.
Outside it nothing is kept and every call computes afresh, so a result never depends on whether it was shared.
Inside it the garbage collector also looks at young objects less often (`YOUNG_COLLECTION_EVERY`). Imports no torch.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# What one plan keeps at most (bytes of arrays): Llama 3 70B at L = 8192, g = 8, B = 16 (16 rows of 524,800 tiles)
# prices a kind in 67 MB and a partition's tables in 200-340 MB.
BUDGET_BYTES = 2 * 2**30
# Allocations between two collections of the youngest generation while a plan is made (Python's default: 700). A plan
# makes hundreds of thousands of small objects that last (tiles, rows, schemes) and few cycles: at the default the
# collector ran over a thousand times in a plan of a published setting and took a fifth of its CPU time
# (docs/results.md, "The garbage collector while planning").
YOUNG_COLLECTION_EVERY = 20_000


class _Store:
    """Values by key, least recently used first, and the objects whose ids are in the keys (kept alive, so that an id
    is never another object's while the store lives)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget, self.used = budget_bytes, 0
        self.values: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self.pinned: dict[int, object] = {}

    def get(self, key: tuple, make: Callable[[], T]) -> T:
        if key in self.values:
            self.values.move_to_end(key)
            return self.values[key][0]
        value = make()
        size = nbytes(value)
        while self.values and self.used + size > self.budget:
            _, (_, dropped) = self.values.popitem(last=False)
            self.used -= dropped
        if size <= self.budget:
            self.values[key] = (value, size)
            self.used += size
        return value


_current: ContextVar[_Store | None] = ContextVar("terapipe_plan_memo", default=None)


@contextmanager
def sharing(budget_bytes: int = BUDGET_BYTES) -> Iterator[None]:
    """Share tile prices and tables among the searches inside (module docstring); nested, the outer one's."""
    if _current.get() is not None:
        yield
        return
    token = _current.set(_Store(budget_bytes))
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], YOUNG_COLLECTION_EVERY), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        _current.reset(token)


def remembered(key: tuple, make: Callable[[], T]) -> T:
    """``make()``, once per ``key`` inside `sharing()`; every time outside it."""
    store = _current.get()
    return make() if store is None else store.get(key, make)


def identity(obj: object) -> int:
    """A key for ``obj`` itself (its id), valid while the store lives: inside `sharing()` the object is kept alive."""
    store = _current.get()
    if store is not None:
        store.pinned.setdefault(id(obj), obj)
    return id(obj)


def nbytes(value: object) -> int:
    """The bytes of the arrays in ``value`` (an array, a tuple or dict of them, or an object that says ``nbytes``)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    return int(getattr(value, "nbytes", 0))
