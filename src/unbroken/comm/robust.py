"""Robust aggregation: a step's gradient that a faulty node cannot drag far.

The mean is what synchronous training means (promise 3), and the guard already refuses
NaN/Inf and gradients orders of magnitude out of range. A node that is wrong by less — a
sign-flipped or ten-times-too-large gradient, step after step — passes the guard and pulls
the mean wherever it likes. Jobs that pool untrusted hardware can ask for a robust rule:

- ``clip[:C]`` (C = 2 by default): each trainer's mean gradient is scaled down to at most C
  times the median of the trainers' gradient norms, then weighted by its share as usual.
  While every node is honest almost nothing is clipped; a bad node's pull is bounded by
  C × the typical norm.
- ``trimmed[:F]`` (F = 0.25 by default): coordinate-wise, the ⌊F·n⌋ largest and smallest of
  the n trainers' mean gradients are dropped and the rest averaged; every trainer counts
  once, whatever its share (a bad node must not buy weight with a large share).

- ``checked``: the mean, from every contribution gathered and checked (the coordinator turns
  it on for a while when a step's sum does not add up: see below).

All three need each contribution, not just their sum: the step all-gathers the members' flat
tensors (each node sends (n-1)× its payload instead of the all-reduce's 2(n-1)/n×; the
cost is measured by ``bench/robust.py``) and every node combines the same rows in the same
order with element-wise operations only, so replicas stay bit-identical across machines.
The norms come from the nodes' own norm slots, not from a local reduction whose rounding
could differ between CPUs, but each row is checked against them first (`lie`): a member
whose gradient is not finite, whose declared norm is not its gradient's, or who wrote into
another member's slots is named from the gathered data itself, which every member holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from unbroken.specs import Rule


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite. A finite sum proves it (an infinity or a NaN
    anywhere makes the sum infinite or NaN) and costs a read of ``t``, where
    ``isfinite(t).all()`` writes a mask as large as ``t`` (0.25 s for 50M floats, against
    7 ms); only a sum that overflowed is looked at element by element."""
    if t.numel() == 0 or math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def trim_count(n: int, fraction: float) -> int:
    """How many values are dropped at each end among ``n`` (at least one is kept)."""
    return min(int(fraction * n), (n - 1) // 2)


def combine(rows: Sequence[torch.Tensor], weights: Sequence[float], norms: Sequence[float], rule: Rule) -> torch.Tensor:
    """The step's gradient from each member's contribution.

    ``rows[i]`` is member i's gradient already weighted by its share (``weights[i]`` = share
    / B; the mean rule's result is their plain sum), ``norms[i]`` the norm of ``rows[i]`` as
    member i computed it. Members without a share are ignored by robust rules.
    """
    if not rows:
        raise ValueError("no contributions to combine")
    trainers = [i for i, w in enumerate(weights) if w > 0]
    total = torch.zeros_like(rows[0])
    if rule.kind in ("mean", "checked") or not trainers:
        for row in rows:
            total += row
        return total
    if rule.kind == "clip":
        per_node = [norms[i] / weights[i] for i in trainers]
        bound = rule.value * _lower_median(per_node)
        for i, norm in zip(trainers, per_node, strict=True):
            scale = 1.0 if norm <= bound or norm == 0.0 else bound / norm
            total += rows[i] * scale if scale != 1.0 else rows[i]
        return total
    means = [rows[i] / weights[i] for i in trainers]
    t = trim_count(len(means), rule.value)
    ordered = (
        _sorted_network(means) if len(means) <= SORTING_NETWORK_MAX else list(torch.sort(torch.stack(means), 0).values)
    )
    kept = ordered[t : len(means) - t]
    for row in kept:
        total += row
    return total / len(kept)


NORM_TOLERANCE = 1e-3
"""A declared norm may differ from the one computed here by this fraction (float rounding,
which differs between CPUs, is far below it)."""


def lie(
    row: torch.Tensor,
    rank: int,
    gradient: int,
    votes_at: int,
    norms_at: int,
    share: int | None,
    overflow_allowed: bool = False,
) -> str | None:
    """What member ``rank``'s row (as gathered: its weighted gradient in ``row[:gradient]``,
    its vote, sample count, switch, loss and overflow from ``votes_at``, one norm slot per
    member from ``norms_at``; an overflow is believed only while ``overflow_allowed``)
    says that is not true, or None."""
    grad = row[:gradient]
    if not all_finite(row[:votes_at]):
        return "sent a gradient (or buffer update) that is not finite"
    vote, samples, overflow = row[votes_at].item(), row[votes_at + 1].item(), row[votes_at + 4].item()
    if vote != 1.0 or (share is not None and samples != float(share)):
        return f"voted {vote:g} with {samples:g} samples (its share is {share})"
    if overflow not in (0.0, 1.0) or (overflow and bool(grad.any())):
        return f"says {overflow:g} for its overflow but sent {'a' if grad.any() else 'no'} gradient"
    if overflow and not overflow_allowed:
        return "says its gradient overflowed where no overflow is believed (no loss scale, or too many in a row)"
    slots = row[norms_at:]
    declared = slots[rank].item()
    others = float(slots.abs().sum().item()) - abs(declared)
    if others != 0.0:
        return "wrote into other members' norm slots"
    if gradient == 0:  # a sharded zone's row: its gradient went out block by block, summed at once
        return None
    actual = float(torch.linalg.vector_norm(grad).item())
    if not abs(actual - declared) <= NORM_TOLERANCE * max(actual, abs(declared)) + 1e-30:
        return f"declared a gradient norm of {declared:.4g}; its gradient's is {actual:.4g}"
    return None


SORTING_NETWORK_MAX = 16
"""Up to this many trainers, coordinates are ordered by element-wise min/max passes (4x
faster than `torch.sort` along the node axis for 4 nodes, and exact)."""


def _sorted_network(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each coordinate's values in ascending order across the tensors (odd-even transposition)."""
    out = list(values)
    n = len(out)
    for rnd in range(n):
        for j in range(rnd % 2, n - 1, 2):
            out[j], out[j + 1] = torch.minimum(out[j], out[j + 1]), torch.maximum(out[j], out[j + 1])
    return out


def _lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]
