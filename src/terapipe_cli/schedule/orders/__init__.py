"""The schedule orders, one module each: an `Order` builds every device's row of actions and carries the closed form
of its memory (`base.Order`). A new order is a module here and one line in `_ALL`.

``ORDERS`` names the orders the planner's searches consider (the objective prices them alike; the memory-aware search
has closed forms for them); ``--order auto`` then also tries each configuration in ``SPLIT_ORDERS`` — the same
scheme with every backward split into I and W (ZB-H1 on the configuration's own partition; ZB-V as a configuration of
its own, two chunks per device in a V) — and the simulator keeps the fastest that fits (`plan.configs`), when the
profile timed I and W apart as the runtime runs them (`plan.configs.split_timed`; from other profiles only when
asked). `order_of` finds any of them by name."""

from __future__ import annotations

from terapipe_cli.schedule.orders.base import Order
from terapipe_cli.schedule.orders.gpipe import GPIPE
from terapipe_cli.schedule.orders.one_f_one_b import ONE_F_ONE_B
from terapipe_cli.schedule.orders.zero_bubble import ZB_H1, ZB_V

_ALL: dict[str, Order] = {o.name: o for o in (GPIPE, ONE_F_ONE_B, ZB_H1, ZB_V)}
ORDERS = (GPIPE.name, ONE_F_ONE_B.name)  # the searches' orders
SPLIT_ORDERS = (ZB_H1.name, ZB_V.name)  # tried by `--order auto` on the searches' result (module docstring)
# Those that run on a configuration's own partition (ZB-V's V is a configuration of its own).
SPLIT_INTERLEAVED = tuple(o.name for o in (ZB_H1, ZB_V) if o.placement == "interleaved")
ALL_ORDERS = tuple(_ALL)
DEFAULT_ORDER = GPIPE  # a plan file's order when it names none


def order_of(name: str | Order) -> Order:
    """The order of that name (an `Order` is returned as it is); ValueError for an unknown one."""
    if isinstance(name, Order):
        return name
    if name not in _ALL:
        raise ValueError(f"order must be one of {tuple(_ALL)}, got {name!r}")
    return _ALL[name]


__all__ = ["ALL_ORDERS", "DEFAULT_ORDER", "ORDERS", "SPLIT_INTERLEAVED", "SPLIT_ORDERS", "Order", "order_of"]
