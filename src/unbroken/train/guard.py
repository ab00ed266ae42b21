"""Refusing bad gradients before they are applied.

Every member writes the norm of its own contribution into its own slot of the step's
all-reduce (the others write zero there), so after the sum every member sees every
member's norm and reaches the same verdict: a non-finite norm (NaN/Inf anywhere in that
gradient), a gradient from a member without a share, or a trainer whose norm (normalised
by the square root of its share) is far above the others' is refused. The step is then not
applied by anyone; the coordinator re-forms the group with the culprit out of training and
the step is retried with the same samples.

The verdict is pure: it depends only on the all-reduced vector, identical on every member.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

OUTLIER_RATIO = 1000.0
"""A trainer's share-normalised gradient norm this many times the largest of the others' is refused.

The largest, not the median: late in training most slices of a batch are fitted and their
gradients nearly vanish while one slice holding a hard example keeps a large one (seen: norms
0.00015, 0.025, 0.00012 and 0.46 for four honest slices; 3000x their median), and a slice of
one sample right after a rebalance was seen at 136x the largest other. A faulty device's
gradient is orders of magnitude off every honest one (a flipped exponent bit: 2^64)."""
MIN_PEERS = 2
"""Outliers are judged only against at least this many other trainers."""


def judge(norms: Sequence[float], shares: Sequence[int], batch_size: int) -> tuple[int, str] | None:
    """The first refused member (rank) with the reason, or None if every contribution is acceptable."""
    for rank, norm in enumerate(norms):
        if not math.isfinite(norm):
            return rank, f"its gradient is not finite (norm {norm})"
        if shares[rank] == 0 and norm != 0.0:
            return rank, f"it sent a gradient (norm {norm:.3g}) without a share of the batch"
    # Normalised by the square root of the share: the sum of s per-sample gradients that do
    # not agree (late in training) grows like sqrt(s), of ones that agree like s; dividing by
    # s would make a one-sample share look like an outlier whenever the mean gradient is small.
    per_sample = {r: norms[r] * batch_size / math.sqrt(shares[r]) for r in range(len(norms)) if shares[r] > 0}
    worst: tuple[float, int] | None = None
    for rank, value in per_sample.items():
        others = [v for r, v in per_sample.items() if r != rank]
        if len(others) < MIN_PEERS:
            continue
        typical = max(others)
        if typical > 0 and value > OUTLIER_RATIO * typical and (worst is None or value / typical > worst[0]):
            worst = (value / typical, rank)
    if worst is not None:
        ratio, rank = worst
        return rank, f"its gradient norm is {ratio:.0f}x the largest of the other trainers' (share-normalised)"
    return None
