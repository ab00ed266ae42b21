"""The roster: who is in, which epoch, which step — the state every part of `Membership`
shares (`unbroken.control.membership`), with the one majority rule they all count by.

The parts (`tribunal`, `recovery`, `planning`, `finish`) each own their own state and read
and write this one; none of them keeps a copy of it. An epoch any part wants is asked for
here (`Roster.want_epoch`) and formed by the facade when due, with every reason given.
"""

from __future__ import annotations

import collections
import enum
import heapq
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from unbroken.control.messages import Capabilities, EpochOrder, Verify
from unbroken.events import Event, Kind
from unbroken.sched.balance import Preference, Profile, Role

JOIN_SETTLE_S = 0.25
"""Joins that arrive this close together share one epoch change (`Roster.join_settle_s`)."""
SETTLE_MEMBERS = 5000
"""Past this many members, joins wait longer for each other in proportion: an epoch's
formation costs the leader tens of microseconds a member, and a fleet arriving a few
hundred a second would otherwise have it form one every `JOIN_SETTLE_S`, each longer than
the last (at 100,000 members: seconds each, the leader doing nothing else). In proportion,
a stream of joins keeps forming epochs at most a bounded share of its time."""
REASONS_SHOWN = 8
"""An epoch's reason names this many causes, then counts the rest."""
WINDOW = 8
"""Recent step times kept per member for straggler detection."""
SETTLED_AFTER = 3
"""Steps or probes a node must have measured before the plan moves it out of training."""
WANDER_REVIEWS = 120
"""A member's speeds noted at this many plan reviews (half a minute for a small group) say
how far its speed strays by itself: a machine's processes sharing its cores make identical
nodes look 2-3 times apart for a second or more, each in turn, and shares that follow that
only move back and forth. Its spread (robust: a lasting change of level moves it only once it
fills half the window) counts as noise of its speed when a rebalance is judged (not in the
plan itself: truly unequal nodes keep shares by their speeds)."""
WANDER_KNOWN_AFTER = 8
"""Reviews before a member's wander counts (none until then: a node that is slow from the
start is moved at once)."""
WANDER_EVERY = 4
"""Its wander is computed again every this many reviews (a spread of 120 values moves little)."""


def majority(n: int) -> int:
    """Most of ``n`` voters: more than half. Every vote of the membership counts by it."""
    return n // 2 + 1


def most_others(group: int, *, never_alone: bool) -> int:
    """How many of a member's fellows in a group of ``group`` (it included) must say so
    before their word about it counts: most of the others and, ``never_alone``, never one
    alone (in a group of two, one word against another). The one rule by which members are
    kept out on their fellows' word (`tribunal.Tribunal.fault`, `recovery.Recovery.vanished`)."""
    need = majority(group - 1)
    return max(2, need) if never_alone else need


class MemberState(str, enum.Enum):
    JOINING = "joining"
    ACTIVE = "active"
    LEAVING = "leaving"


class StepQuorum:
    """The highest step most of an epoch's members reported reaching: the group's step rises
    with it, so one member's word (an insider standing by at 199,999 of 200,000) moves it no
    more. A report costs the distinct steps reported above the group's (a handful), not the
    members: thousands of members report every step."""

    def __init__(self, size: int, floor: int) -> None:
        self.need = majority(size)
        self.floor = floor
        self._at: dict[str, int] = {}
        """Each member's step, where above ``floor``."""
        self._count: collections.Counter[int] = collections.Counter()

    def report(self, member_id: str, step: int) -> int:
        """A member of the epoch reached ``step``: the step most of them reached now."""
        old = self._at.get(member_id)
        if step <= self.floor or (old is not None and step <= old):
            return self.floor
        if old is not None:
            self._count[old] -= 1
        self._at[member_id] = step
        self._count[step] += 1
        if len(self._at) < self.need:
            return self.floor
        reached = 0
        for s in sorted((s for s, n in self._count.items() if n > 0), reverse=True):
            reached += self._count[s]
            if reached >= self.need:
                self.floor = s
                break
        self._at = {mid: s for mid, s in self._at.items() if s > self.floor}
        self._count = collections.Counter(self._at.values())
        return self.floor


class EpochSteps:
    """The steps the epoch's present members reported, as a multiset: the second highest of
    them is read at every hello (`Membership.reported_step`), and a fleet's admission is
    thousands of hellos, so it is kept as reports come rather than sorted from the members
    at each read. A report moves a count (constant time); the distinct steps, a handful
    while a group trains, are kept sorted (O(log N) when one appears or goes)."""

    def __init__(self) -> None:
        self._at: dict[str, int] = {}
        self._count: collections.Counter[int] = collections.Counter()
        self._distinct: SortedList[int] = SortedList()

    def set(self, member_id: str, step: int) -> None:
        old = self._at.get(member_id)
        if old == step:
            return
        if old is not None:
            self._uncount(old)
        self._at[member_id] = step
        if self._count[step] == 0:
            self._distinct.add(step)
        self._count[step] += 1

    def drop(self, member_id: str) -> None:
        if (old := self._at.pop(member_id, None)) is not None:
            self._uncount(old)

    def _uncount(self, step: int) -> None:
        self._count[step] -= 1
        if self._count[step] == 0:
            del self._count[step]
            self._distinct.remove(step)

    def second_highest(self) -> int:
        """The second highest step (the highest where one member reported; 0: none did)."""
        if not self._distinct:
            return 0
        top = int(self._distinct[-1])
        if self._count[top] > 1 or len(self._distinct) == 1:
            return top
        return int(self._distinct[-2])


def _never(member_id: str) -> float:
    return -math.inf


class Leases:
    """When each member was last heard, as a heap that the lease check reads from its oldest
    end: a check costs the members whose entry is over a lease old, not every member (at
    100,000 members a scan of them all, ten times a lease, was a core's work). An entry
    holds a time at or before any ``last_seen`` the member will have (a heartbeat sets it
    to the clock's now); one found older than the member's is put back with that time."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._queued: dict[str, float] = {}
        """Each member's live entry (others in the heap are stale: dropped when reached)."""
        self.vouched: Callable[[str], float] = _never
        """When the member's relay last vouched that it was heard (`relaying.Relays.vouched`):
        a relayed member's lease is renewed by its relay's summaries, read here only when its
        entry comes due (once a lease), not on each of the relay's ten batches a lease."""

    def add(self, member_id: str, seen: float) -> None:
        self._queued[member_id] = seen
        heapq.heappush(self._heap, (seen, member_id))

    def heard_at(self, member: Member, now: float) -> float:
        """When the member was last heard, its relay's newest summary included (what the
        dashboard shows: ``last_seen`` of a relayed member is brought up only when due)."""
        return max(member.last_seen, min(self.vouched(member.member_id), now))

    def lapsed(self, members: dict[str, Member], now: float, lease_s: float) -> list[str]:
        """The members not heard from for more than ``lease_s``, the longest silent first."""
        out, back, heap = [], [], self._heap
        while heap and now - heap[0][0] > lease_s:
            seen, mid = heapq.heappop(heap)
            if self._queued.get(mid) != seen:
                continue
            if (m := members.get(mid)) is None:
                del self._queued[mid]
                continue
            if now - m.last_seen > lease_s:
                m.last_seen = self.heard_at(m, now)
            if now - m.last_seen > lease_s:
                out.append(mid)
            back.append(mid)  # one kept past its lease (it said it is done) is checked again
        for mid in back:
            # Not after now: a pause moves ``last_seen`` ahead, and the next heartbeat back to now.
            self.add(mid, min(members[mid].last_seen, now))
        return out


@dataclass
class Member:
    member_id: str
    name: str
    weight: float
    joined_at: float
    last_seen: float
    host: str = ""
    pid: int = 0
    key: str = ""
    """The public key its member id is bound to (`unbroken.control.identity`)."""
    source: str = ""
    """Where its session came from (the peer's address, or its relay)."""
    trained: bool = False
    """The group committed a step in an epoch it belonged to, as another member reported:
    its exit is no churn (`unbroken.control.admissions`)."""
    state: MemberState = MemberState.JOINING
    step: int = 0
    loss: float | None = None
    samples_per_s: float = 0.0
    caps: Capabilities = field(default_factory=Capabilities)
    preference: Preference = Preference.AUTO
    evaluates: bool = False
    role: Role | None = None
    compute_times: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    validation: dict[str, float] | None = None
    checkpoint_error: str | None = None
    """Why its last checkpoint failed (None: it did not, or it writes none)."""
    zone: str = ""
    no_inbound: bool = False
    """It accepts no connection (behind NAT): never a zone's leader where another can be (`sched.nat`)."""
    forwarding: str = ""
    """Where it forwards for members behind NAT (HOST:PORT; empty: it does not)."""
    moved_behind: bool = False
    """Most of the others could not connect to it: orders name it among the members their
    peers reach through a forwarder (`EpochOrder.behind`, `sched.nat.unreachable`)."""
    flags: int = 0
    """Its offences (`tribunal.Tribunal.offence`): gradients refused, work found wrong..."""
    benched_until: float = 0.0
    excluded_until: float = 0.0
    """Out of every epoch until then (it never joined an epoch's data plane)."""
    quarantined: bool = False
    bytes_intra: int = 0
    bytes_inter: int = 0
    levels: deque[float] = field(default_factory=lambda: deque(maxlen=WANDER_REVIEWS))
    """Its predicted time for an even share at each recent plan review, as a logarithm."""
    reviews: int = 0
    wander: float = 0.0
    """How far its speed strays from its usual level (relative; see `WANDER_REVIEWS`)."""
    typical_wander: float = 0.0
    """The median of its fellow trainers' wander at the last review."""

    def profile(self, now: float = 0.0) -> Profile:
        c = self.caps
        return Profile(
            self.name,
            c.per_sample_s,
            c.overhead_s,
            c.max_microbatch,
            self.weight,
            self.preference,
            self.evaluates,
            benched=now < self.benched_until,
            settled=c.measurements >= SETTLED_AFTER,
            noise=c.noise,
        )

    def review(self, even_share: float) -> None:
        """Note its speed at a plan review; its wander is the spread of those it noted."""
        t = self.profile().time_for(max(1, round(even_share)))
        if t <= 0:
            return
        self.levels.append(math.log(t))
        self.reviews += 1
        if len(self.levels) < WANDER_KNOWN_AFTER or self.reviews % WANDER_EVERY:
            return
        centre = statistics.median(self.levels)
        self.wander = 1.4826 * statistics.median(abs(v - centre) for v in self.levels)


@dataclass
class Decision:
    """What the service must do after a call: orders to deliver and sessions to close."""

    orders: dict[str, EpochOrder] = field(default_factory=dict)
    expel: dict[str, str] = field(default_factory=dict)
    refuse: str | None = None
    events: list[Event] = field(default_factory=list)
    quarantine: dict[str, str] = field(default_factory=dict)
    """Members told not to come back (their sessions closed), with why."""
    halt: str | None = None
    """The job stops here with this error (`finish.Finish.halt`): every member is told."""
    verify: dict[str, Verify] = field(default_factory=dict)
    """Members asked to check a trainer's work (`Membership.checked`)."""

    def merge(self, other: Decision) -> Decision:
        self.orders.update(other.orders)
        self.verify.update(other.verify)
        self.expel.update(other.expel)
        self.events.extend(other.events)
        self.quarantine.update(other.quarantine)
        self.halt = self.halt or other.halt
        return self


class Members(dict[str, "Member"]):
    """The members by id, keeping `Leases` and `EpochSteps` as members of the epoch in force come and
    go (its only writers are these three; `Roster.reached` follows a member's step)."""

    def __init__(self, roster: Roster) -> None:
        super().__init__()
        self._roster = roster

    def __setitem__(self, member_id: str, member: Member) -> None:
        super().__setitem__(member_id, member)
        self._roster.leases.add(member_id, member.last_seen)
        if member_id in self._roster.ranks:
            self._roster.steps.set(member_id, member.step)

    def __delitem__(self, member_id: str) -> None:
        super().__delitem__(member_id)
        self._roster.steps.drop(member_id)

    def pop(self, member_id: str, *default: Member | None) -> Member | None:  # type: ignore[override]
        self._roster.steps.drop(member_id)
        return super().pop(member_id, *default)


class Roster:
    """The members, the epoch in force and its ranks, the group's step, and the epoch
    wanted next with its reasons."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.term = 0
        """The leader's term, carried by every epoch order (0 without etcd)."""
        self.ranks: dict[str, int] = {}
        """Each member of the epoch in force by its rank (set with `epoch_members`; read on
        every report, so a dictionary, not a call)."""
        self.steps = EpochSteps()
        """The steps of the epoch's members here (`Membership.reported_step`)."""
        self.leases = Leases()
        self.members: dict[str, Member] = Members(self)
        self.epoch = 0
        self.epoch_floor = 0
        """Nodes have heard of epochs up to this one (from before a restart): number above it."""
        self.started = False
        """An epoch was formed here, or a member came from a job that trained."""
        self.step = 0
        self.num_steps = 0
        """The job's last step, as its first member said (0: not said)."""
        self.batch_size: int | None = None
        self.finished = False
        self.halted: str | None = None
        """Why the job was stopped without finishing (`finish.Finish.halt`): ``finished`` is True too."""
        self.readmit_at: float | None = None
        """When a member kept out of the epochs may come back (an epoch forms then)."""
        self.relay_forwarders: dict[str, str] = {}
        """Relay → where it forwards for members behind NAT (HOST:PORT), while it is linked."""
        self._epoch_members: list[str] = []
        self._quorum = StepQuorum(0, 0)
        self.committers: set[str] = set()
        """Members of the epoch in force that reported a commit in it (two at most: a
        member's own report never proves that it trained)."""
        self.pending_due: float | None = None
        self.pending_urgent = False
        self.pending_reasons: dict[str, None] = {}
        self.lost_step = 0
        """The group's step where the epoch in force started behind it (`behind`; 0: it did not)."""
        self._went_back: tuple[int, dict[str, int]] = (0, {})
        """The epoch in force and the step each of its members said it went back to (`went_back`)."""

    @property
    def epoch_members(self) -> list[str]:
        """The members of the epoch in force; rank = position."""
        return self._epoch_members

    @epoch_members.setter
    def epoch_members(self, members: list[str]) -> None:
        for mid in self._epoch_members:
            if (m := self.members.get(mid)) is not None and self.committers - {mid}:
                m.trained = True
        self.committers = set()
        self._epoch_members = list(members)
        self.ranks = {mid: rank for rank, mid in enumerate(self._epoch_members)}
        self._quorum = StepQuorum(len(self._epoch_members), self.step)
        self.steps = EpochSteps()
        for mid in self._epoch_members:  # what the new epoch's members said before it
            if (x := self.members.get(mid)) is not None:
                self.step = max(self.step, self._quorum.report(mid, x.step))
                self.steps.set(mid, x.step)

    def rank_of(self, member_id: str) -> int | None:
        """The member's rank in the epoch in force (None: not in it), in constant time."""
        return self.ranks.get(member_id)

    def alone(self, member_id: str) -> bool:
        """Whether ``member_id`` is the only member of the epoch in force still here: it alone
        holds the group's newest state."""
        return self.rank_of(member_id) is not None and not any(
            mid != member_id and mid in self.members for mid in self._epoch_members
        )

    def kept(self, reason: str) -> str:
        """Why the epoch's last member (`alone`) asking to leave for ``reason`` stays."""
        return f"{reason}; it alone holds step {self.step}, so it stays until a member takes it"

    def gone_with(self, last: bool) -> str:
        """What a leave says where the leaver went ``last``: with the group's newest state."""
        return f"; nobody took step {self.step}, which leaves with it" if last else ""

    def behind(self, now: float, order: list[str], kept: list[str]) -> list[Event]:
        """What says so where the epoch in force (just formed, of ``order``) starts behind
        the group's step: no member is ``kept`` from the epoch before (those hold its state),
        every member that held it is gone (left, failed), and the best state here is older.
        Its order carries the group's step (`lost_step`) wherever no member said it holds
        it, kept or not (one kept from an epoch that failed before its sync phase holds what
        it held before): the members compare the states they hold and the checkpoints they
        can read, and say what they went on from."""
        top = max((self.members[mid].step for mid in order if mid in self.members), default=0)
        self.lost_step = self.step if top < self.step else 0
        if kept or top >= self.step:
            return []
        why = (
            f"epoch {self.epoch} starts behind the group: it committed step {self.step} (as last reported) or "
            f"later, nobody holding it is here, and the best state here is step {top} (as last reported); its "
            "members look for a newer checkpoint"
        )
        return [Event(time=now, kind=Kind.ROLLBACK, member=None, epoch=self.epoch, step=self.step, reason=why)]

    def reached(self, member_id: str, step: int) -> None:
        """A member of the epoch in force reported ``step``: the group's step follows most of them."""
        self.step = max(self.step, self._quorum.report(member_id, step))
        if member_id in self.members:
            self.steps.set(member_id, step)

    def heard_steps(self, said: list[tuple[str, int]], now: float) -> list[tuple[str, int]]:
        """Members heard at ``now`` saying their steps (a relay's batch names each member whose
        step changed), in one pass: what `Membership.heartbeat` does for a member of the epoch
        in force, with the group's step counted once at the end rather than per member. At
        100,000 members that is 200,000 a second, a core at the facade's per-call cost.
        Returns what it leaves to `Membership.heartbeat`: members of no epoch (their claims
        are judged there), or all of them when there is no epoch or the job is finishing."""
        if not self.ranks or (self.num_steps and self.step >= self.num_steps):
            return said
        members, ranks, quorum, steps = self.members, self.ranks, self._quorum, self.steps
        top, rest = self.step, []
        for mid, step in said:
            if (m := members.get(mid)) is None:
                continue
            if mid not in ranks:
                rest.append((mid, step))
                continue
            m.last_seen = now
            if step > m.step:
                m.step = step
                top = max(top, quorum.report(mid, step))
                steps.set(mid, step)
        self.step = top
        return rest

    def went_back(self, member_id: str, step: int) -> bool:
        """A member of the epoch in force went back to a checkpoint of ``step``, in process (a
        sharded job's fall-back, `unbroken.train.shard_fallback`), or to the best state of an
        epoch that started behind the group (`unbroken.train.catchup`): once every member of the
        epoch said the same step, the group's step and the members' go back to it (steps
        only grow otherwise: the epochs after would all be urgent, the finish and the checks
        would read steps the group left). One member's word moves nothing (promise 8).
        True for the first member to say it: the event is logged once."""
        epoch, said = self._went_back
        if epoch != self.epoch:
            said = {}
            self._went_back = (self.epoch, said)
        if member_id not in self.ranks or member_id in said:
            return False
        first = step not in said.values()
        said[member_id] = step
        if len(said) == len(self._epoch_members) and set(said.values()) == {step} and step < self.step:
            self.step = step
            for m in self.members.values():
                m.step = min(m.step, step)
            self._quorum = StepQuorum(len(self._epoch_members), step)
        return first

    def name(self, member_id: str) -> str:
        member = self.members.get(member_id)
        return member.name if member is not None else member_id

    def event(self, now: float, kind: Kind, member: str | None, reason: str) -> Event:
        return Event(time=now, kind=kind, member=member, epoch=self.epoch, step=self.step, reason=reason)

    def join_settle_s(self) -> float:
        """How long a join waits for others to share its epoch change (`SETTLE_MEMBERS`)."""
        return JOIN_SETTLE_S * max(1.0, len(self.members) / SETTLE_MEMBERS)

    def want_epoch(self, now: float, urgent: bool, reason: str, delay: float, replacing: str | None = None) -> None:
        """Form an epoch ``delay`` from ``now`` (or sooner if one is pending) for ``reason``,
        which replaces the pending reasons that start with ``replacing``."""
        due = now + delay
        if self.pending_due is None:
            self.pending_due = due
            self.pending_reasons = {reason: None}
        else:
            self.pending_due = min(self.pending_due, due)
            if replacing is not None:
                self.pending_reasons = {r: None for r in self.pending_reasons if not r.startswith(replacing)}
            self.pending_reasons[reason] = None
        self.pending_urgent = self.pending_urgent or urgent

    def unwant(self, reason: str) -> None:
        """The pending epoch no longer forms for ``reason``; nor at all, if that was its only one."""
        if reason in self.pending_reasons:
            del self.pending_reasons[reason]
            if not self.pending_reasons:
                self.pending_due, self.pending_urgent = None, False

    def pending_reason(self) -> str:
        """Why the pending epoch forms: every reason when few, else the first few and a count
        (a thousand joins make one epoch, not a reason of a thousand parts)."""
        reasons = list(self.pending_reasons)
        if len(reasons) <= REASONS_SHOWN:
            return "; ".join(reasons)
        return "; ".join(reasons[:REASONS_SHOWN]) + f"; and {len(reasons) - REASONS_SHOWN} more"

    def clear_pending(self) -> None:
        """An epoch is being formed: nothing is pending any more."""
        self.pending_due, self.pending_urgent, self.pending_reasons = None, False, {}
