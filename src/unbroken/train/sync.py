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
    digest: int = 0
    """The winning digest (prefix) at that step: what every receiver must end up holding."""
    donors: tuple[int, ...] = ()
    """Every rank holding it (the source first): they share the sending."""


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
    donors = tuple(rank for rank, d in at_top if d == winner)
    return SyncPlan(source=source, step=top, receivers=receivers, digest=winner, donors=donors)


def diverged(reports: Sequence[tuple[int, int]], trained: Sequence[bool]) -> tuple[int, str] | None:
    """The sync phase's own audit: members at the highest step whose states differ, where one
    that differs from the majority there (``trained``: it committed steps since its state was
    last compared) took part in the group's steps with a corrupted replica. Its contributions
    are suspect as an audit's culprit's are: the rank to blame (-1 when no state has a
    strict majority there and nobody can be), with why; None when the states there agree, or
    when the ones that differ never trained with the group (a node starting from its own
    state: the sync phase just repairs it)."""
    top = max(step for step, _ in reports)
    at_top = [r for r, (step, _) in enumerate(reports) if step == top]
    votes = Counter(reports[r][1] for r in at_top)
    if len(votes) == 1:
        return None
    winner, count = votes.most_common(1)[0]
    if 2 * count <= len(at_top):
        if not any(trained[r] for r in at_top):
            return None
        return -1, f"the {len(at_top)} members at step {top} hold {len(votes)} different states, none a majority"
    culprit = next((r for r in at_top if reports[r][1] != winner and trained[r]), None)
    if culprit is None:
        return None
    return culprit, f"digest at step {top} differs from the majority's ({count} of {len(at_top)} agree)"


def audit(reports: Sequence[tuple[int, int]]) -> tuple[int, str] | None:
    """The consistency audit's verdict from each rank's ``(committed step, digest)``: the
    first rank whose digest differs from a strict majority's, with why; None when all agree
    (or when no digest has a majority: then nobody can be blamed, and the next sync phase
    settles it)."""
    if not reports:
        return None
    votes = Counter(reports)
    ((winner, count),) = votes.most_common(1)
    if count == len(reports):
        return None
    if 2 * count <= len(reports):
        return None
    rank = next(r for r, rep in enumerate(reports) if rep != winner)
    step, _ = reports[rank]
    if step != winner[0]:
        return rank, f"is at step {step}, the majority ({count} of {len(reports)}) at {winner[0]}"
    return rank, f"digest differs from the majority's ({count} of {len(reports)} agree)"
