"""A (re)started coordinator's recovery: it waits for the members of the epoch they come
back with before it forms one, so that a stable group trains on through its outage.

Coordinator life::

    fresh ──first join──▶ running
    recovering ──(all members of the newest reported epoch back: adopt it)──▶ running
               └─(window over: urgent epoch of whoever is back)─────────────▶ running

A recovering coordinator leaves out a member of the newest reported epoch that is not back
no sooner than `OUTAGE_TRUST_LEASES` (and a margin) after it started: that member may be
training on in an outage, which it trusts as long past its last evidence that no
coordinator had started (`unbroken.control.client`). Unless it is gone: once that wait is
all that holds the coordinator, the members back try the addresses the missing ones had in
the epoch (`m.Check`), and one that most of them, two at least, find nothing listening at
is not waited for (`Recovery.vanished`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from unbroken.control.messages import OUTAGE_TRUST_LEASES, Hello, Resume
from unbroken.control.planning import Planner
from unbroken.control.roster import JOIN_SETTLE_S, Decision, MemberState, Roster, most_others
from unbroken.events import Kind
from unbroken.sched.balance import Role, adopt

FRESH_JOB_GRACE_S = 1.0
"""After a restart, how long a first hello without a resume waits for members to come back."""
BROKEN_SETTLE_S = 0.3
"""After a restart, once a member says the newest epoch is broken (it abandoned it), how
long to wait for the rest of the group to reconnect before forming the next epoch."""
OUTAGE_MARGIN_S = 0.1
"""Beyond a node's outage trust, how long a recovering coordinator waits before leaving out
a member of the epoch it found (the clocks' rates, the evidence's way to the node)."""


@dataclass(frozen=True)
class Awaited:
    """What a recovering coordinator waits for once only its outage fence holds it
    (`Recovery.awaited`)."""

    epoch: int
    """The epoch it found."""
    missing: list[str]
    """Its members that are not back."""
    back: list[str]
    """Its members that are back (asked to try the missing ones' addresses)."""


class Recovery:
    """The epoch members come back with, who is back, and how long it is waited for."""

    def __init__(self, roster: Roster, *, now: float, window_s: float, recovering: bool) -> None:
        """``recovering``: a coordinator (re)started while a group may be training: wait up to
        ``window_s`` for the last epoch's members before forming one."""
        self._roster = roster
        self.until = now + window_s if recovering else None
        """While set, the coordinator is recovering (`Membership.recovering_until`)."""
        self.outage_fence = now + self.wait_s if recovering else now
        """Until when a recovering coordinator leaves no member of the epoch it found out (but
        one found gone: `vanished`)."""
        self.came_back: set[str] = set()
        """Members that resumed here: one that fails after is gone as in a running epoch."""
        self._vanished: dict[tuple[int, str], set[str]] = {}
        """(epoch found, a member of it not back) → the members back from that epoch that found
        nothing listening at its data-plane address there (`vanished`)."""
        self.resumes: dict[str, Resume] = {}

    @property
    def wait_s(self) -> float:
        """How long a member not back may still trust an outage (`OUTAGE_TRUST_LEASES`)."""
        return self._roster.lease_s * OUTAGE_TRUST_LEASES + OUTAGE_MARGIN_S

    def listening(self, now: float) -> None:
        """The coordinator began to listen: a recovering one's wait for members of the epoch it
        finds counts from now (until then its address refused connections, which a node in
        an outage takes for evidence that no coordinator runs there)."""
        if self.until is not None:
            self.outage_fence = max(self.outage_fence, now + self.wait_s)

    def joined(self, hello: Hello, now: float) -> bool:
        """A node joined while recovering: whether it is a member back from its epoch (its
        join asks for no epoch: the recovery forms or adopts one)."""
        if self.until is None:
            return False
        r = hello.resume
        if r is None:
            if not self.resumes:
                # Perhaps a fresh job; perhaps a restarted coordinator whose members have not
                # reconnected yet while a new node got here first. Forming a group of new nodes
                # now would start a second job from step 0 beside the live one: wait a little.
                self.until = min(self.until, now + max(FRESH_JOB_GRACE_S, 2 * self._roster.lease_s))
            return False
        if not self.resumes:
            # Live members retry every 0.1 s: one silent for a lease after the first is back
            # would be failed by its lease anyway. Waiting longer only stalls the group.
            self.until = min(self.until, now + self._roster.lease_s + JOIN_SETTLE_S)
        self.resumes[hello.member_id] = r
        self.came_back.add(hello.member_id)
        self._roster.epoch = max(self._roster.epoch, r.epoch)
        if r.abandoned and r.epoch >= self._roster.epoch:  # the roster's epoch: the newest resumed so far
            # The newest epoch cannot go on: form the next as soon as the others are back.
            self.until = min(self.until, now + BROKEN_SETTLE_S)
        return True

    def abandoned(self, member_id: str, resume: Resume, now: float) -> None:
        """A member back from its epoch says it abandoned it (its session was replaced)."""
        if self.until is not None and member_id in self.resumes:
            self.resumes[member_id] = resume
            if resume.epoch >= self._roster.epoch:
                self.until = min(self.until, now + BROKEN_SETTLE_S)

    def failed(self, member_id: str, now: float, reason: str) -> None:
        """A member is gone: if it came back from its epoch, that epoch cannot go on."""
        if self.resumes.pop(member_id, None) is not None:
            self.epoch_broke(now, reason)

    def epoch_broke(self, now: float, reason: str) -> None:
        """During a recovery, the epoch the members came back with cannot go on: stop
        waiting for the rest of them (the others are back within a settle)."""
        if self.until is not None:
            self.until = min(self.until, now + BROKEN_SETTLE_S)
            self._roster.want_epoch(now, urgent=True, reason=reason, delay=BROKEN_SETTLE_S)

    def awaited(self, now: float) -> Awaited | None:
        """What a recovering coordinator still waits for once only the outage fence holds it:
        members of the epoch it found that are not back (one may be cut off and committing
        there), and the members back from that epoch, whom it asks to try their addresses
        (`m.Check`). None while it waits for anything else, or for nothing."""
        if self.until is None or now < self.until or now >= self.outage_fence:
            return None
        found = self.found()
        if found is None:
            return None
        epoch, group = found
        missing = sorted(group - set(self._roster.members) - self.came_back - self._dead(epoch, group))
        if not missing:
            return None
        back = sorted(mid for mid, r in self.resumes.items() if r.epoch == epoch and mid in self._roster.members)
        return Awaited(epoch, missing, back)

    def found(self) -> tuple[int, set[str]] | None:
        """The newest epoch members came back from, and its members (as they reported them)."""
        if not self.resumes:
            return None
        newest = max(r.epoch for r in self.resumes.values())
        return newest, {mid for r in self.resumes.values() if r.epoch == newest for mid in r.members}

    def vanished(self, reporter: str, epoch: int, members: Iterable[str], now: float) -> Decision:
        """A member back from ``epoch`` found nothing listening at these members' data-plane
        addresses there (`m.Vanished`). A dead process commits nothing more: once most of the
        epoch's other members, and never one alone, say so of one, the new epoch need not
        wait for it."""
        d = Decision()
        r, found = self.resumes.get(reporter), self.found()
        if self.until is None or r is None or found is None or not r.epoch == found[0] == epoch:
            return d
        group = found[1]
        for mid in members:
            if mid in group and mid != reporter and mid not in self._roster.members:
                seen = self._vanished.setdefault((epoch, mid), set())
                seen.add(reporter)
                if len(seen) == most_others(len(group), never_alone=True):  # reached now (each counts once)
                    why = f"{mid}: nothing listens at its data-plane address of epoch {epoch} ({len(seen)} found)"
                    d.events.append(self._roster.event(now, Kind.FAILURE, mid, f"{why}: not waited for"))
        return d

    def _dead(self, epoch: int, group: set[str]) -> set[str]:
        """Members of ``group`` (epoch ``epoch``, found) that most of the others found gone."""
        need = most_others(len(group), never_alone=True)
        return {mid for (e, mid), seen in self._vanished.items() if e == epoch and len(seen & group) >= need}

    def recover(self, now: float, planner: Planner) -> Decision:
        """Adopt the epoch the members came back with once all of them are back; at the end
        of the window (and of the outage fence) form one of whoever is back."""
        r = self._roster
        assert self.until is not None
        d = Decision()
        if self.resumes:
            newest = max(x.epoch for x in self.resumes.values())
            first = next(x for x in self.resumes.values() if x.epoch == newest)
            group = first.members
            back = {mid for mid, x in self.resumes.items() if x.epoch == newest and x.members == group}
            intact = not any(x.abandoned for x in self.resumes.values() if x.epoch == newest)
            if intact and set(group) <= back and set(group) <= set(r.members):
                self.until = None
                r.epoch = newest
                r.epoch_members = list(group)
                members = [r.members[m] for m in group]
                planner.make_plan(members, now)
                if len(first.shares) == len(group) and len(first.roles) == len(group):
                    # The plan in force is the one the nodes carry, not one made from new reports.
                    roles = [Role(x) for x in first.roles]
                    planner.plan = adopt([m.profile() for m in members], first.shares, roles)
                    planner.shares = list(first.shares)
                    planner.planned_times = planner.times(members, planner.shares)
                    for mem, role in zip(members, roles, strict=True):
                        mem.role = role
                for mid in group:
                    r.members[mid].state = MemberState.ACTIVE
                d.events.append(r.event(now, Kind.ADOPT, None, f"rebuilt epoch {newest} from {len(group)} members"))
                if len(r.members) > len(group):
                    r.want_epoch(now, urgent=False, reason="nodes joined during recovery", delay=0.0)
                return d
        if now >= self.until:
            if now < self.outage_fence and (found := self.found()) is not None:
                epoch, found_members = found
                if not found_members <= set(r.members) | self.came_back | self._dead(epoch, found_members):
                    return d  # one not back may still commit in that epoch
            self.until = None
            if r.members and r.pending_due is not None:
                r.pending_due, r.pending_urgent = now, True  # a failure during recovery said why
            elif r.members:
                why = (
                    "a member abandoned the last epoch while no coordinator led"
                    if any(x.abandoned for x in self.resumes.values())
                    else "members of the last epoch did not return after restart"
                    if self.resumes
                    else "nodes connected to a coordinator that had just started"
                )
                r.want_epoch(now, urgent=True, reason=why, delay=0.0)
        return d
