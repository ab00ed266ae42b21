"""The epoch's reported steps kept as reports come (`roster.EpochSteps`): the same answer as
sorting the members' steps at each read, on random sequences of joins, reports, failures,
leaves, reconnections and epoch changes."""

from __future__ import annotations

import random

import pytest

from unbroken.config import MembershipConfig
from unbroken.control.membership import Membership
from unbroken.control.roster import Roster

from .test_membership import hello


def sorted_each_time(r: Roster) -> int:
    """What `Membership.reported_step` computed before: a sort of the epoch at every read."""
    steps = sorted((x.step for mid in r.epoch_members if (x := r.members.get(mid))), reverse=True)
    return max(r.step, steps[min(1, len(steps) - 1)] if steps else 0)


@pytest.mark.parametrize("seed", range(12))
def test_the_kept_steps_give_what_a_sort_of_the_epoch_gives(seed: int) -> None:
    rng = random.Random(seed)
    ms = Membership(MembershipConfig(lease_s=1.0), now=0.0)
    names = [f"n{i}" for i in range(rng.randint(3, 12))]
    now, checked = 0.0, 0
    for _ in range(600):
        now += rng.choice((0.01, 0.05, 0.3))
        mid = rng.choice(names)
        roll = rng.random()
        if mid not in ms.members or roll < 0.1:
            # A join, or a reconnection (with a step of its own: a checkpoint, or none).
            ms.admit(hello(mid, step=rng.choice((0, rng.randint(0, 60)))), now)
        elif roll < 0.7:
            ms.heartbeat(mid, rng.randint(0, 60), now)
        elif roll < 0.8:
            ms.fail(mid, now, "cut off")
        elif roll < 0.85:
            ms.leave(mid, now, "done here")
        elif roll < 0.9:
            ms.session_closed(mid, now)
        else:
            for other in list(ms.members):  # leases kept, so that epochs form
                ms.heartbeat(other, 0, now)
            ms.tick(now)
        assert ms.reported_step() == sorted_each_time(ms.roster), f"seed {seed}, after {checked} checks"
        checked += ms.roster.epoch > 0
    assert checked > 100, "epochs formed, so the epoch's steps were compared"
