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


def diverged(reports: Sequence[tuple[int, int]], epochs: Sequence[int]) -> tuple[int, str] | None:
    """The sync phase's own audit. Members that committed the same step in the same epoch
    (``epochs``: where each one committed the step it holds, -1 for a state that came from
    elsewhere: a peer, a copy, a checkpoint) applied the same sums to the same state, so
    their states must be equal; one that differs from the others there was corrupted, and
    its contributions are suspect as an audit's culprit's are. States committed in different
    epochs may differ (other members, other sums) and are only repaired. The highest step
    is judged first. The rank to blame (-1 where no state has a strict majority of its
    step's and epoch's and nobody can be), with why; None when nothing convicts anyone."""
    if max(step for step, _ in reports) < 0:
        return None  # every state set aside: none is compared (the tie rule settles it)
    groups: dict[tuple[int, int], list[int]] = {}
    for r, (step, _) in enumerate(reports):
        if step >= 0 and epochs[r] >= 0:
            groups.setdefault((step, epochs[r]), []).append(r)
    for (step, epoch), ranks in sorted(groups.items(), key=lambda g: (-g[0][0], g[0][1])):
        votes = Counter(reports[r][1] for r in ranks)
        if len(votes) == 1:
            continue
        winner, count = votes.most_common(1)[0]
        where = f"step {step} as committed in epoch {epoch}"
        if 2 * count <= len(ranks):
            return -1, f"the {len(ranks)} members holding {where} hold {len(votes)} different states, none a majority"
        culprit = next(r for r in ranks if reports[r][1] != winner)
        return culprit, f"state at {where} differs from the others' ({count} of {len(ranks)} agree)"
    return None


@dataclass(frozen=True)
class Standing:
    """What a member says of its state in the sync phase, beyond its step and digest, where
    audits are on (`unbroken.train.audits`)."""

    behind: bool = False
    """Its state is not one to go on from (refused, or no copy of the state ordered back to)."""
    committed_epoch: int = -1
    """The epoch in which it committed the step it holds (-1: the state came from elsewhere)."""
    floor: int = -1
    """The step it went back to at a verdict since its last completed sync phase (-1: none)."""
    floor_epoch: int = -1
    """The epoch of that verdict."""
    synced_epoch: int = -1
    """The epoch of its last completed sync phase."""


def floored(steps: Sequence[int], standings: Sequence[Standing]) -> list[int]:
    """The steps to plan a sync from after a verdict some members did not see (their wait
    was cut short by an order, and the leader's `rollback_to` with it may have been dropped):
    a member above the lowest floor holds a state the verdict refused, and reports no step
    (-1), as one put behind does. A floor counts until any member completed a sync phase
    after its verdict (the group settled since: a member back from a long absence with an
    old floor moves nothing), and only where a member holds that step."""
    settled = max(s.synced_epoch for s in standings)
    held = [f.floor for s, f in zip(steps, standings, strict=True) if s >= 0 <= f.floor and f.floor_epoch >= settled]
    if not held or min(held) not in steps:
        return list(steps)
    floor = min(held)
    return [-1 if s > floor else s for s in steps]


def abandoned(steps: Sequence[int], lineages: Sequence[int]) -> list[int]:
    """The steps to plan a sync from where members hold states of different histories
    (``lineages``: `TrainState.lineage`, bumped by every in-process fall-back to a
    checkpoint): a member of an older history holds a state the group went back from, and
    reports no step (-1), as one put behind does, whatever its step (one expelled before the
    fall-back, back with a step the group has not reached again, must not be its source)."""
    newest = max(lineages, default=0)
    return [-1 if lin < newest else s for s, lin in zip(steps, lineages, strict=True)]


def audit(reports: Sequence[tuple[int, int]]) -> tuple[int, str] | None:
    """The consistency audit's verdict from each rank's ``(committed step, digest)``: the
    first rank whose digest differs from a strict majority's, with why; -1 where no digest
    has a majority (nobody can be blamed, and no state passed); None when all agree."""
    if not reports:
        return None
    votes = Counter(reports)
    ((winner, count),) = votes.most_common(1)
    if count == len(reports):
        return None
    if 2 * count <= len(reports):
        return -1, f"no state has a majority of the {len(reports)} members"
    rank = next(r for r, rep in enumerate(reports) if rep != winner)
    step, _ = reports[rank]
    if step != winner[0]:
        return rank, f"is at step {step}, the majority ({count} of {len(reports)}) at {winner[0]}"
    return rank, f"digest differs from the majority's ({count} of {len(reports)} agree)"
