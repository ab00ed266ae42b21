"""When every holder of the group's newest state is gone: the newest checkpoint the members
can read, against the best state a member holds.

A job down to one trainer (the others expelled, benched, or joining later with older
states) loses that trainer: the next epoch forms from members whose states are older than
the group's last committed step. The leader says so in the order (``group_step``: that
step, as it heard it), and the members compare their best state with the checkpoints they
can read (`plan_catch_up`, the same on every member): the newest checkpoint above the best
state, not above the group's step (a newer one is another run's: the group never moves to
a step it did not commit), wins; the members that read it whole restore it, and the others
take it from them in the sync phase. Where none is newer, the committed steps above the
best state are lost and trained again, and the decision says how many.

What a member says of its checkpoint is its claim only: it claims a step after reading the
file's description itself (its pickle: a training state of this job, of that step), reads
the chosen file whole, and only it restores from that file (promise 8). With a
--checkpoint-dir per node, two members may hold that step from different histories: the
claimants compare the digests of what they read, and only those that agree with the first
restore it (`agreed`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from unbroken.events import BACK_TO_CHECKPOINT, GOES_ON_FROM
from unbroken.state.sync import abandoned


@dataclass(frozen=True)
class CatchUp:
    """What the members of an epoch that starts behind the group do (`plan_catch_up`)."""

    live: int
    """The best step a member holds (of the newest history: `state.sync.abandoned`)."""
    checkpoint: int = -1
    """The checkpoint step to go back to (-1: none is newer than ``live``)."""
    readers: tuple[int, ...] = ()
    """The ranks that claim it; once they read it whole (`agreed`), those that restore it,
    each from its own file."""
    lost: tuple[int, int] | None = None
    """The committed steps lost (first, last): those after the state the group goes on from
    (None: none, the group's step as the leader heard it is held)."""

    @property
    def reason(self) -> str:
        """What the job's log says of it (empty where the group goes on as it is)."""
        if self.checkpoint < 0 and self.lost is None:
            return ""
        held = f"the best state here is step {self.live}"
        if self.lost is None:
            # The leader's step lags the group's: steps its lone holder committed after its
            # last report are gone with it, unknown here.
            return (
                f"{held}: {BACK_TO_CHECKPOINT} {self.checkpoint}, the group's last committed step as last "
                f"reported; steps {self.checkpoint + 1}.. committed since, if any, are lost and trained again"
            )
        first, last = self.lost
        gone = f"every member holding step {last} is gone"
        count = f"{last - first + 1} committed, or more: as last reported"
        steps = f"steps {first}..{last} ({count}) are lost and trained again"
        if self.checkpoint >= 0:
            return f"{gone} and {held}: {BACK_TO_CHECKPOINT} {self.checkpoint}, newer; {steps}"
        return f"{gone}, {held} and no member can read a newer checkpoint: {GOES_ON_FROM} {self.live}; {steps}"


def plan_catch_up(
    steps: Sequence[int], lineages: Sequence[int], claims: Sequence[int], group_step: int, cap: int | None = None
) -> CatchUp:
    """Decide from each rank's committed step, its state's history (``lineages``,
    `TrainState.lineage`) and the checkpoint step it read whole (``claims``, -1: none),
    where the group last committed ``group_step`` (as the leader heard it).

    A claim above ``group_step`` is passed over (another run's checkpoint), or above ``cap``
    (a step no claimant read whole in an earlier round); so is one not above the best state
    (it would throw committed steps away)."""
    if not steps or not len(steps) == len(lineages) == len(claims):
        raise ValueError(f"one step, lineage and claim per rank: {len(steps)}, {len(lineages)}, {len(claims)}")
    live = max(abandoned(steps, lineages))
    newer = [c for c in claims if live < c <= (group_step if cap is None else min(cap, group_step))]
    if not newer:
        return CatchUp(live, lost=(live + 1, group_step) if group_step > live else None)
    back = max(newer)
    readers = tuple(r for r, c in enumerate(claims) if c == back)
    return CatchUp(live, back, readers, (back + 1, group_step) if group_step > back else None)


def agreed(plan: CatchUp, digests: Sequence[int]) -> CatchUp:
    """``plan`` with its readers cut to the claimants that read the chosen checkpoint whole
    and hold the state most of them hold (ties: the one the lowest rank holds); where
    several read it and no two agree, none (``digests``: each rank's digest prefix of what
    it read, -1: it did not read it whole). A lone claimant's word is taken as any donor's
    in a sync phase; against others, one rank that says another state is outvoted, not
    followed. No readers left: none read it (or agreed on it)."""
    read = [r for r in plan.readers if digests[r] >= 0]
    if not read:
        return replace(plan, readers=())
    held = Counter(digests[r] for r in read)
    best = max(held.values())
    if len(read) > 1 and best < 2:
        return replace(plan, readers=())
    chosen = next(digests[r] for r in read if held[digests[r]] == best)
    return replace(plan, readers=tuple(r for r in read if digests[r] == chosen))


LINEAGES = 2**62
"""A state's history (`TrainState.lineage`) is below this: the group's next one (one more)
still fits the int64 of a sync exchange."""


def misreported(
    num_steps: int, steps: Sequence[int], lineages: Sequence[int], claims: Sequence[int] = ()
) -> tuple[int, str] | None:
    """The first rank whose report no honest member makes (a step beyond the job's
    ``num_steps`` or below 0, a history outside ``[0, LINEAGES)``, a checkpoint claim outside
    ``[-1, num_steps]``), with what it said; None where every report is in range."""
    for r, (step, lineage) in enumerate(zip(steps, lineages, strict=True)):
        if not 0 <= step <= num_steps:
            return r, f"rank {r} said it holds step {step}, outside the job's 0..{num_steps}"
        if not 0 <= lineage < LINEAGES:
            return r, f"rank {r} said its state's history is {lineage}, outside 0..{LINEAGES - 1}"
    for r, claim in enumerate(claims):
        if not -1 <= claim <= num_steps:
            return r, f"rank {r} claimed a checkpoint of step {claim}, outside the job's -1..{num_steps}"
    return None
