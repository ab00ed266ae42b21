"""What the coordinator keeps as reports come instead of walking every member at each read
(`roster.EpochSteps`, `roster.Leases`): the same answers as that walk, on random sequences
of joins, reports, failures, leaves, reconnections, pauses and epoch changes."""

from __future__ import annotations

import random

import pytest

from unbroken.config import MembershipConfig
from unbroken.control.membership import Membership
from unbroken.control.relaying import heard_steps
from unbroken.control.roster import Roster

from .test_membership import hello


def lapsed_by_scan(r: Roster, now: float) -> list[str]:
    """What the lease check found before: a walk over every member."""
    return sorted(mid for mid, m in r.members.items() if now - m.last_seen > r.lease_s)


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


@pytest.mark.parametrize("seed", range(12))
def test_the_lease_heap_finds_what_a_walk_over_the_members_finds(seed: int) -> None:
    rng = random.Random(seed)
    ms = Membership(MembershipConfig(lease_s=1.0), now=0.0)
    r = ms.roster
    names = [f"n{i}" for i in range(rng.randint(3, 30))]
    now, found = 0.0, 0
    for _ in range(800):
        now += rng.choice((0.01, 0.1, 0.4))
        mid = rng.choice(names)
        roll = rng.random()
        if mid not in ms.members:
            ms.admit(hello(mid), now)
        elif roll < 0.6:
            ms.heartbeat(mid, 0, now)
        elif roll < 0.65:
            ms.fail(mid, now, "cut off")
        elif roll < 0.7:
            ms.session_closed(mid, now)
        elif roll < 0.72:
            ms.pause(rng.choice((0.2, 1.5)))
        elif roll < 0.75:
            ms.admit(hello(mid), now)  # a reconnection: the same member, heard now
        else:
            expected = lapsed_by_scan(r, now)
            assert sorted(r.leases.lapsed(r.members, now, r.lease_s)) == expected, f"seed {seed} at {now:.2f}"
            found += len(expected)
    assert found > 0, "some leases lapsed, so the heap's answers were compared"


@pytest.mark.parametrize("seed", range(8))
def test_a_relays_steps_in_one_pass_leave_what_a_heartbeat_each_would(seed: int) -> None:
    """`relaying.heard_steps` (a relay's batch of members and their steps, `Roster.heard_steps`)
    against `Membership.heartbeat` for every one: two memberships fed the same sequence."""
    rng = random.Random(seed)
    fast, slow = (Membership(MembershipConfig(lease_s=1.0), now=0.0) for _ in range(2))
    both = (fast, slow)
    names = [f"n{i}" for i in range(rng.randint(3, 12))]
    now, batched = 0.0, 0
    for mid in names:
        h = hello(mid, steps=rng.choice((0, 12)))
        for ms in both:
            ms.admit(h, now)
    for _ in range(500):
        now += rng.choice((0.01, 0.05, 0.3))
        mid = rng.choice(names)
        roll = rng.random()
        if mid not in slow.members or roll < 0.05:
            h = hello(mid, step=rng.randint(0, 14), steps=rng.choice((0, 12)))
            for ms in both:
                ms.admit(h, now)
        elif roll < 0.1:
            for ms in both:
                ms.fail(mid, now, "cut off")
        elif roll < 0.2:
            for ms in both:
                for other in list(ms.members):
                    ms.heartbeat(other, ms.members[other].step, now)
                ms.tick(now)
        else:
            said = []
            for who in rng.sample(names, rng.randint(1, len(names))):
                if who in slow.members:
                    step = max(0, slow.members[who].step - rng.choice((0, 0, 1, 5)) + rng.choice((0, 0, 0, 1, 3)))
                    said.append((who, step))
                    slow.heartbeat(who, step, now)
            heard_steps(fast, said, now)
            batched += len(said)
        r, s = fast.roster, slow.roster
        assert (r.epoch, r.step, fast.reported_step()) == (s.epoch, s.step, slow.reported_step()), f"seed {seed}"
        assert {k: (m.step, m.last_seen) for k, m in r.members.items()} == {
            k: (m.step, m.last_seen) for k, m in s.members.items()
        }
        assert fast.finish.last_epoch == slow.finish.last_epoch
        assert r._quorum._at == s._quorum._at and r._quorum.floor == s._quorum.floor
    assert batched > 500, "the relays' batches named members"
