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

Both need each contribution, not just their sum: the step all-gathers the members' flat
tensors (each node sends (n-1)× its payload instead of the all-reduce's 2(n-1)/n×; the
cost is measured by ``bench/robust.py``) and every node combines the same rows in the same
order with element-wise operations only, so replicas stay bit-identical across machines.
The norms come from the nodes' own norm slots, not from a local reduction whose rounding
could differ between CPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from unbroken.errors import ConfigError

RULES = {"mean": 0.0, "clip": 2.0, "trimmed": 0.25}
"""Each rule with its default parameter."""


@dataclass(frozen=True)
class Rule:
    kind: str
    """``mean``, ``clip`` or ``trimmed``."""
    value: float = 0.0
    """``clip``: the norm bound as a multiple of the median norm; ``trimmed``: the fraction cut at each end."""

    @property
    def robust(self) -> bool:
        return self.kind != "mean"

    def __str__(self) -> str:
        return self.kind if not self.robust else f"{self.kind}:{self.value:g}"


def parse_rule(spec: str) -> Rule:
    """``mean``, ``clip[:C]`` (C ≥ 1) or ``trimmed[:F]`` (0 < F < 0.5)."""
    kind, _, value = spec.strip().partition(":")
    if kind not in RULES or (kind == "mean" and value):
        raise ConfigError(f"aggregation {spec!r} is not one of mean, clip[:C], trimmed[:F] (e.g. clip:2, trimmed:0.25)")
    try:
        v = float(value) if value else RULES[kind]
    except ValueError:
        raise ConfigError(f"aggregation {spec!r}: {value!r} is not a number") from None
    if kind == "clip" and not v >= 1.0:
        raise ConfigError(f"aggregation {spec!r}: the clip bound must be at least 1 (times the median norm)")
    if kind == "trimmed" and not 0.0 < v < 0.5:
        raise ConfigError(f"aggregation {spec!r}: the trimmed fraction must be between 0 and 0.5")
    return Rule(kind, v)


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
    if rule.kind == "mean" or not trainers:
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
