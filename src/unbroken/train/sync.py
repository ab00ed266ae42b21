"""The sync phase decision: who is behind or different, and who sends them state."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncPlan:
    source: int
    """Rank whose state everyone must hold."""
    step: int
    """The highest committed step in the group."""
    receivers: tuple[int, ...]
    """Ranks that are behind or hold a different state at that step."""


def plan_sync(reports: Sequence[tuple[int, int]]) -> SyncPlan:
    """Decide from each rank's ``(committed step, digest)``.

    The source holds the highest committed step; among ranks at that step the most common
    digest wins (ties: the lowest rank), so a single corrupted replica cannot win a vote.
    """
    if not reports:
        raise ValueError("no reports to plan a sync from")
    top = max(step for step, _ in reports)
    at_top = [(rank, digest) for rank, (step, digest) in enumerate(reports) if step == top]
    votes = Counter(d for _, d in at_top)
    best = max(votes.values())
    winner = next(d for _, d in at_top if votes[d] == best)
    source = next(rank for rank, d in at_top if d == winner)
    receivers = tuple(r for r, (step, d) in enumerate(reports) if step != top or d != winner)
    return SyncPlan(source=source, step=top, receivers=receivers)
