"""Epoch orders as sent: small whatever the group's size.

A full order lists every member and, per rank, its share, micro-batch, role and zone: at
ten thousand members a few hundred kilobytes, sent to every member at every epoch change.
On the wire it is compacted twice:

* per-rank lists go as runs (value, count): a thousand equal shares are one pair;
* to a member that holds the previous epoch's order, members go as a change against it
  (``base``): the ranks removed and the members appended (an epoch keeps its members'
  order and appends the new ones, `membership.Membership._form_epoch`).

`compact` makes the order to send, `complete` rebuilds the full order on the node; the
round trip is exact, and a delta whose base is not the order the node holds is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from unbroken.control.messages import EpochOrder
from unbroken.errors import ProtocolError

T = TypeVar("T")

_LISTS = ("shares", "microbatches", "roles", "zones")


def runs(values: Sequence[T]) -> tuple[list[T], list[int]]:
    """``values`` as runs: distinct consecutive values and how many times each repeats."""
    out: list[T] = []
    counts: list[int] = []
    for v in values:
        if out and out[-1] == v:
            counts[-1] += 1
        else:
            out.append(v)
            counts.append(1)
    return out, counts


def expand(values: Sequence[T], counts: Sequence[int]) -> list[T]:
    if len(values) != len(counts):
        raise ProtocolError(f"an order's runs do not match: {len(values)} values, {len(counts)} counts")
    out: list[T] = []
    for v, c in zip(values, counts, strict=True):
        out.extend([v] * c)
    return out


def compact(order: EpochOrder, base: EpochOrder | None = None) -> EpochOrder:
    """The order to send: lists as runs, and members as a change against ``base`` when it
    is the previous order and this one keeps its members' order."""
    update: dict[str, Any] = {}
    for name in _LISTS:
        full = getattr(order, name)
        values, counts = runs(full)
        if len(values) == len(full):
            continue  # nothing repeats: the list as it is
        update[name], update[f"{name}_runs"] = values, counts
    if base is not None and base.epoch < order.epoch and not base.base:
        new = set(order.members)
        removed = [i for i, mid in enumerate(base.members) if mid not in new]
        kept = len(base.members) - len(removed)
        if order.members[:kept] == [mid for mid in base.members if mid in new]:
            update |= {"base": base.epoch, "removed": removed, "added": order.members[kept:], "members": []}
    return order.model_copy(update=update) if update else order


def complete(order: EpochOrder, held: EpochOrder | None) -> EpochOrder:
    """The full order from one as sent; ``held`` is the last full order this node has."""
    update: dict[str, Any] = {}
    if order.base:
        if held is None or held.epoch != order.base:
            have = held.epoch if held is not None else "none"
            raise ProtocolError(f"epoch {order.epoch} was sent as a change to epoch {order.base}; this node has {have}")
        gone = set(order.removed)
        if any(i >= len(held.members) for i in gone):
            raise ProtocolError(f"epoch {order.epoch} removes a rank that epoch {order.base} does not have")
        update |= {
            "members": [mid for i, mid in enumerate(held.members) if i not in gone] + list(order.added),
            "base": 0,
            "removed": [],
            "added": [],
        }
    for name in _LISTS:
        counts = getattr(order, f"{name}_runs")
        if counts:
            update[name], update[f"{name}_runs"] = expand(getattr(order, name), counts), []
    full = order.model_copy(update=update) if update else order
    size = len(full.members)
    for name in _LISTS:
        if getattr(full, name) and len(getattr(full, name)) != size:
            raise ProtocolError(f"epoch {full.epoch} has {size} members but {len(getattr(full, name))} {name}")
    if len(full.shares) != size:
        raise ProtocolError(f"epoch {full.epoch} has {size} members but {len(full.shares)} shares")
    return full
