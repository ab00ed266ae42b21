"""Planning: each epoch's shares, roles, zones and leaders' ring, and the reviews that
replace a plan when measurements say a better one exists (`sched.balance`), or report a
straggler (`sched.stragglers`).

The decisions themselves are the pure functions of `unbroken.sched`; this part feeds them
the members' measurements and keeps what the plan in force predicted, to judge it by.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from unbroken.control.messages import EpochOrder, PolicyMsg, Refusal
from unbroken.control.roster import Decision, Member, Roster
from unbroken.events import Event, Kind
from unbroken.sched.balance import Plan, Preference, Role, plan, rebalance
from unbroken.sched.links import RING_MIN_ZONES, Links, bottleneck
from unbroken.sched.nat import forwarders
from unbroken.sched.stragglers import find_stragglers
from unbroken.sched.zones import AUTO, Zones, group_by_rtt
from unbroken.specs import Policy, Rule

PLAN_DWELL_S = 1.0
"""A plan stays at least this long before a rebalance may replace it."""
PLAN_DWELL_STEPS = 3
"""...and until every trainer has reported this many step times under it."""
REBALANCE_EVERY_S = 0.25
"""How often the coordinator reconsiders the plan (the cost model is not free)."""
REVIEW_MEMBERS = 500
"""Groups larger than this are reviewed proportionally less often."""
REBALANCE_PERSIST_S = 0.5
"""A better plan must stay better for this long before it replaces the current one."""
STRAGGLER_PERSIST_S = 2.0
"""A trainer must stand out in every review for this long to be called a straggler (on a
shared machine the one descheduled for a few steps changes from moment to moment)."""
RING_REASON = "leaders' ring "
"""How a pending epoch's reason names the ring it reorders to (one, the newest)."""


class Planner:
    """The plan in force, what it predicted, and the measurements that review it."""

    def __init__(self, roster: Roster, policy: Policy, *, balance: bool, now: float) -> None:
        self._roster = roster
        self.policy = policy
        """How the group trains: every epoch order carries it (`policy_for` may tighten its rule)."""
        self._policy_msg = PolicyMsg.of(policy)
        self.balance = balance
        """Shares and roles follow measured throughput (else: the operators' weights)."""
        self.plan: Plan | None = None
        self.shares: list[int] = []
        self.zones_in_force: list[str] = []
        """The zones of the epoch in force (empty: one zone)."""
        self.formed_at_step = -1
        """The group's step when the epoch in force was formed."""
        self.links = Links()
        """What zone leaders measured between zones (`sched.links`)."""
        self.ring: list[str] = []
        """The leaders' ring of the epoch in force (zone names; empty: fewer than 4 zones)."""
        self._planned_at = now
        self.planned_times: dict[str, float] = {}
        self._next_review = now
        self.vacated = 0
        """Trainers failed and not yet replaced: as many spares are wanted in every plan until filled."""
        self.left = 0
        """Trainers that left since the last plan: as many spares are wanted in the next one only
        (a trainer removed for good does not make a standby added days later train)."""
        self._stragglers: set[str] = set()
        """Members reported as stragglers under the plan in force."""
        self._straggling: dict[str, tuple[float, str]] = {}
        """Members standing out in the latest review: since when, and why."""
        self._better_since: float | None = None

    @staticmethod
    def zones_of(members: Sequence[Member]) -> list[str]:
        """Each member's zone: its own, or for ``--zone auto`` one grouped by round-trip time."""
        auto = group_by_rtt({m.member_id: m.caps.rtt_s for m in members if m.zone == AUTO})
        return [auto.get(m.member_id, m.zone) for m in members]

    def policy_for(self, members: Sequence[Member], checking: bool) -> PolicyMsg:
        """The job's policy, with its rule tightened to ``checked`` (every contribution gathered
        and checked) while a sum recently did not add up (``checking``) or a member that
        offended before is in the epoch: a benched member still sends a row, and only gathered
        rows say what each member sent."""
        watched = checking or any(m.flags for m in members)
        if watched and self.policy.aggregate.kind == "mean":
            return PolicyMsg.of(dataclasses.replace(self.policy, aggregate=Rule("checked")))
        return self._policy_msg

    @staticmethod
    def times(members: Sequence[Member], shares: Sequence[int]) -> dict[str, float]:
        """Each member's predicted compute time for its share (what stragglers are judged against)."""
        return {m.member_id: m.profile().time_for(s) for m, s in zip(members, shares, strict=True)}

    @staticmethod
    def _comm_s(trainers: Sequence[Member]) -> float:
        """Time a step spends outside compute: the all-reduce as the slowest trainer sees it
        (it waits for nobody), i.e. the smallest reported."""
        reported = [m.caps.comm_s for m in trainers if m.caps.comm_s > 0]
        return min(reported, default=0.0)

    def make_plan(self, members: Sequence[Member], now: float) -> list[Event]:
        """Plan shares and roles for the new epoch's members; events for changed roles."""
        events: list[Event] = []
        batch_size = self._roster.batch_size
        if batch_size is None:
            self.plan, self.shares = None, [0] * len(members)
            return events
        profiles = [m.profile(now) for m in members]
        p = plan(
            batch_size,
            profiles,
            balance=self.balance,
            spares_wanted=self.vacated + self.left,
            overhead_s=self._comm_s([m for m in members if m.role is Role.TRAINER]),
        )
        self.plan, self.shares = p, list(p.shares)
        self._planned_at = now
        self._better_since = None
        self.planned_times = {m.member_id: pr.time_for(s) for m, pr, s in zip(members, profiles, p.shares, strict=True)}
        # A place no spare could take (none was warm yet) stays open until a member that did
        # not train does: a spare that arrives later, or a newcomer. Else a job that lost a
        # trainer while its spare was still starting would keep one trainer fewer for good.
        filled = sum(
            1 for m, role in zip(members, p.roles, strict=True) if role is Role.TRAINER and m.role is not Role.TRAINER
        )
        self.vacated = max(0, self.vacated - max(0, filled - self.left))
        self.left = 0
        self._stragglers.clear()
        self._straggling.clear()
        for m, role, why in zip(members, p.roles, p.reasons, strict=True):
            m.compute_times.clear()
            if m.preference is Preference.STANDBY and role is Role.TRAINER:
                m.preference = Preference.AUTO  # a promoted spare stays a regular member
            if role is not m.role and (m.role is not None or role is not Role.TRAINER):
                was = m.role.value if m.role is not None else "new"
                said = f"{m.name}: {was} -> {role.value}: {why}"
                events.append(self._roster.event(now, Kind.ROLE, m.member_id, said))
            m.role = role
        return events

    def order(
        self,
        members: Sequence[Member],
        zones: list[str],
        now: float,
        *,
        urgent: bool,
        reason: str,
        checking: bool,
        rollback_to: int,
        refused: list[Refusal],
    ) -> EpochOrder:
        """The order of the epoch just formed of ``members`` (planned by `make_plan`) in
        ``zones`` (`zones_of`), with its leaders' ring."""
        r = self._roster
        self.zones_in_force = zones if len(set(zones)) > 1 else []
        names = list(dict.fromkeys(self.zones_in_force))
        self.ring = self.links.ring(names, self.ring, now) if len(names) >= RING_MIN_ZONES else []
        return EpochOrder(
            epoch=r.epoch,
            term=r.term,
            members=[m.member_id for m in members],
            shares=self.shares,
            urgent=urgent,
            reason=reason,
            roles=list(self.plan.roles) if self.plan else [],
            microbatches=list(self.plan.microbatches) if self.plan else [],
            zones=self.zones_in_force,
            ring=self.ring,
            probe_links=bool(self.ring) and not self.links.complete(self.ring, now),
            policy=self.policy_for(members, checking),
            rollback_to=rollback_to,
            group_step=r.lost_step,
            refused=refused,
            forwarders=forwarders([(m.forwarding, m.no_inbound) for m in members], sorted(r.relay_forwarders.values())),
            behind=[m.member_id for m in members if m.moved_behind],
        )

    def links_measured(self, member_id: str, epoch: int, rates: dict[str, float], now: float) -> Decision:
        """A zone leader's rates from the other zones (an order's ``probe_links``). Only the
        epoch's leaders are heard, and only of that epoch's zones: a member may lie, and its
        word moves nothing but the ring's order. Once every pair is known, a ring whose
        slowest link is `sched.links.GAIN` times faster forms a new epoch at a step boundary."""
        r = self._roster
        d = Decision()
        if epoch != r.epoch or member_id not in r.epoch_members or not self.ring:
            return d
        zones = Zones(tuple(self.zones_in_force), tuple(self.ring))
        rank = r.epoch_members.index(member_id)
        if rank not in zones.leaders:
            return d
        mine = zones.of_rank[rank]
        heard = {z: rate for z, rate in rates.items() if z in zones.names and z != mine}
        self.links.report(mine, heard, now)
        shown = ", ".join(f"{z} {rate:.0f}" for z, rate in sorted(heard.items()))
        d.events.append(r.event(now, Kind.LINKS, member_id, f"zone {mine} received (MB/s): {shown}"))
        ring = self.links.ring(zones.names, self.ring, now)
        if ring != self.ring:
            rate = self.links.rates(now)
            before, after = bottleneck(self.ring, rate), bottleneck(ring, rate)
            why = f"{RING_REASON}{' > '.join(ring)}: slowest link {before:.0f} -> {after:.0f} MB/s"
            # Newer reports may choose another ring before the epoch forms: it forms with that one.
            r.want_epoch(now, urgent=False, reason=why, delay=0.0, replacing=RING_REASON)
        return d

    def review(self, now: float) -> Decision:
        """Review the plan in force when a review is due."""
        if now < self._next_review:
            return Decision()
        # A large group is reviewed less often (a review costs about 10 µs a member):
        # it stays a few percent of the loop at any size.
        self._next_review = now + REBALANCE_EVERY_S * max(1.0, len(self._roster.epoch_members) / REVIEW_MEMBERS)
        return self._review(now)

    def _review(self, now: float) -> Decision:
        """Report stragglers; replace the plan when the measurements say a better one exists."""
        r = self._roster
        d = Decision()
        if self.plan is None or r.batch_size is None or not r.epoch_members:
            return d
        members = [r.members.get(mid) for mid in r.epoch_members]
        if any(m is None for m in members):
            return d
        live = [m for m in members if m is not None]
        trainers = [m for m in live if m.role is Role.TRAINER]
        times = {m.member_id: list(m.compute_times) for m in trainers}
        planned = len(self.shares) == len(r.epoch_members)
        shares = dict(zip(r.epoch_members, self.shares, strict=True)) if planned else None
        found = find_stragglers(times, self.planned_times, self._comm_s(trainers), shares)
        self._straggling = {mid: (self._straggling.get(mid, (now, ""))[0], why) for mid, why in found.items()}
        for mid, (since, why) in self._straggling.items():
            if mid not in self._stragglers and now - since >= STRAGGLER_PERSIST_S:
                d.events.extend(self._straggler(now, mid, why))
        if now - self._planned_at < PLAN_DWELL_S:
            return d
        if any(m.zone == AUTO for m in live):
            zones = self.zones_of(live)
            if (zones if len(set(zones)) > 1 else []) != self.zones_in_force:
                groups = ", ".join(f"{m.name} {z}" for m, z in zip(live, zones, strict=True) if m.zone == AUTO)
                r.want_epoch(now, urgent=False, reason=f"zones regrouped by round-trip time: {groups}", delay=0.0)
                return d
        if not self.balance:
            return d
        if any(len(m.compute_times) < PLAN_DWELL_STEPS for m in trainers):
            return d
        for m in trainers:
            m.review(r.batch_size / len(trainers))
        # What makes a speed stray (processes sharing cores, other jobs) is mostly the site's,
        # and a difference between two members strays with both: a member whose own record
        # happened to be calm is judged with the group's typical wander at least.
        typical = statistics.median(m.wander for m in trainers) if trainers else 0.0
        for m in trainers:
            m.typical_wander = typical
        better = rebalance(
            r.batch_size,
            self.shares,
            [m.profile(now) for m in live],
            overhead_s=self._comm_s(trainers),
            wander=[max(m.wander, m.typical_wander) for m in live],
        )
        if better is None:
            self._better_since = None
        elif self._better_since is None:
            self._better_since = now  # a passing disturbance (a process starting) must not move shares
        elif now - self._better_since >= REBALANCE_PERSIST_S:
            self._better_since = None
            # Whoever stands out now moved the shares: it was slow long enough to matter.
            for mid, (_, why) in self._straggling.items():
                if mid not in self._stragglers:
                    d.events.extend(self._straggler(now, mid, why))
            r.want_epoch(now, urgent=False, reason=better[1], delay=0.0)
        return d

    def _straggler(self, now: float, mid: str, why: str) -> list[Event]:
        self._stragglers.add(mid)
        return [self._roster.event(now, Kind.STRAGGLER, mid, f"{self._roster.members[mid].name}: {why}")]
