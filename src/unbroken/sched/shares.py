"""How the global batch B is split among the trainers of an epoch."""

from __future__ import annotations

from collections.abc import Sequence


def split_batch(batch_size: int, weights: Sequence[float]) -> list[int]:
    """Split ``batch_size`` samples in proportion to ``weights``, summing to it exactly.

    Largest-remainder rounding; ties go to the lower index so every caller computes the
    same split. A weight of zero gets nothing; if all weights are zero the split is equal.
    """
    if batch_size < 0:
        raise ValueError(f"batch_size = {batch_size} must be non-negative")
    if not weights:
        raise ValueError("cannot split a batch among zero trainers")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative, got {list(weights)}")
    total = float(sum(weights))
    norm = [1.0 / len(weights)] * len(weights) if total == 0 else [w / total for w in weights]
    exact = [batch_size * w for w in norm]
    shares = [int(x) for x in exact]
    missing = batch_size - sum(shares)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[:missing]:
        shares[i] += 1
    return shares


def offsets(shares: Sequence[int]) -> list[int]:
    """Start position of each trainer's slice within the step's batch."""
    out, acc = [], 0
    for s in shares:
        out.append(acc)
        acc += s
    return out
