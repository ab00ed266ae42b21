"""When a member asked to leave (SIGTERM, Ctrl-C, `request_leave`) may go: a pure decision.

A graceful leave hands the state on by a step the others commit with the leaver: it
announces its leave, the group switches epochs after the next step, and whoever stays holds
what the leaver held. So a leaver announces only where that is so::

    asked ──(others in the epoch, a step committed with them)──────▶ announce
      │                                                               (the group switches)
      ├──(others, nothing committed with them yet: they may still sync)──▶ stay
      ├──(alone: the only holder of the group's newest state)────────▶ stay, train on,
      │                                                               wait for a joiner
      └──(alone for LONE_GRACE_S, or others and nothing committed for as long)──▶ go

A lone member that went at once let a stale member rejoining a moment later become the
group, which then trained the committed steps again from its older state (a step committed
twice; the replicas' results differ). Waiting, the joiner's epoch takes the leaver in, syncs
from it, and the leave goes on as with others present. Nobody coming, the leaver goes with
the group's newest state saved (`Records.save_last`) and says so (``last``: the coordinator
then records that the group's state left with it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

LONE_GRACE_S = 10.0
"""How long a leaver waits for a member to take the state it alone holds (or, with others,
for a step committed with them): a node stopped past it is usually given 30 s before
SIGKILL (Kubernetes, Slurm), and a stale member's rejoin takes about a second."""


class Leaving(enum.Enum):
    STAY = "stay"
    """Train on: not asked, asked already, or waiting for the state to be handed on."""
    ANNOUNCE = "announce"
    """Tell the coordinator; the group switches to an epoch without this node after this step."""
    GO = "go"
    """Stop here, the leave announced as the last holder's (nobody took the state in time)."""


@dataclass(frozen=True)
class LeaveDecision:
    action: Leaving
    reason: str


def leave_now(
    *, requested: bool, announced: bool, members: int, committed_here: bool, waited_s: float, step: int
) -> LeaveDecision:
    """What a member asked to leave does before its next step. ``announced``: it told the
    coordinator already (in an epoch with others); ``members``: its epoch's size;
    ``committed_here``: the epoch committed a step since this node began it (after the sync:
    every member holds that step); ``waited_s``: since it was first asked in this epoch;
    ``step``: the step it holds."""
    if not requested or announced:
        return LeaveDecision(Leaving.STAY, "")
    if members > 1 and committed_here:
        return LeaveDecision(Leaving.ANNOUNCE, f"the others hold step {step} too")
    if waited_s >= LONE_GRACE_S:
        if members > 1:
            why = f"no step committed with the others in {LONE_GRACE_S:g} s; they sync from the epoch's holders"
            return LeaveDecision(Leaving.ANNOUNCE, why)
        why = f"nobody joined in {LONE_GRACE_S:g} s to take step {step}, which this node alone holds"
        return LeaveDecision(Leaving.GO, why)
    if members > 1:
        return LeaveDecision(Leaving.STAY, f"waiting for a step committed with the others to hand step {step} on")
    return LeaveDecision(
        Leaving.STAY,
        f"the only member, holding step {step}: training on for up to {LONE_GRACE_S:g} s for a member to take it",
    )
