"""Membership, leases and epochs: the coordinator's decisions, as a pure state machine.

No sockets and no clock of its own: every call takes ``now`` and returns the orders to send.

Member life::

    joining ──(epoch formed)──▶ active ──(leave: graceful epoch)──▶ gone
       │                          │
       └──(session drop / lease)──┴──(urgent epoch without it)────▶ gone

`Membership` is a thin facade over small parts that share one `Roster` (who is in, which
epoch, which step, the epoch wanted next): joins, leaves, leases and the forming of epochs
are decided here; what a hello must match in `gate`; faults, offences and verdicts in
`tribunal`; a restarted coordinator's wait for the group in `recovery`; shares, roles,
zones and reviews in `planning`; the job's end in `finish`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar, overload

from unbroken.config import MembershipConfig
from unbroken.control.admissions import Admissions
from unbroken.control.checks import Checks
from unbroken.control.finish import Finish
from unbroken.control.gate import Gate, first_mismatch, job_differences
from unbroken.control.messages import (
    OUTAGE_TRUST_LEASES,
    Capabilities,
    Checked,
    Commitment,
    Hello,
    Refusal,
    TensorSpec,
)
from unbroken.control.planning import (
    PLAN_DWELL_S,
    PLAN_DWELL_STEPS,
    REBALANCE_EVERY_S,
    STRAGGLER_PERSIST_S,
    Planner,
)
from unbroken.control.recovery import FRESH_JOB_GRACE_S, OUTAGE_MARGIN_S, Awaited, Recovery
from unbroken.control.roster import JOIN_SETTLE_S, Decision, Member, MemberState, Roster, StepQuorum
from unbroken.control.tribunal import (
    BENCH_S,
    CHECKED_STEPS,
    FAULT_GRACE_S,
    PROBE_WAIT_S,
    QUARANTINE_AFTER,
    ROLLBACK_PERIODS,
    Tribunal,
)
from unbroken.events import Event, Kind
from unbroken.sched.balance import Plan, Preference, Role
from unbroken.sched.links import Links
from unbroken.sched.nat import reachable_first
from unbroken.specs import Policy

__all__ = [
    "BENCH_S",
    "CHECKED_STEPS",
    "FAULT_GRACE_S",
    "FRESH_JOB_GRACE_S",
    "JOIN_SETTLE_S",
    "OUTAGE_MARGIN_S",
    "OUTAGE_TRUST_LEASES",
    "PLAN_DWELL_S",
    "PLAN_DWELL_STEPS",
    "PROBE_WAIT_S",
    "QUARANTINE_AFTER",
    "REBALANCE_EVERY_S",
    "ROLLBACK_PERIODS",
    "STRAGGLER_PERSIST_S",
    "Awaited",
    "Decision",
    "Event",
    "Member",
    "MemberState",
    "Membership",
    "StepQuorum",
    "first_mismatch",
    "job_differences",
]

T = TypeVar("T")


class _Owned(Generic[T]):
    """An attribute of `Membership` that one of its parts owns: read and written there, so
    that the parts never hold copies of each other's state."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self._part, self._name = part, name or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = self._name or name

    @overload
    def __get__(self, obj: None, owner: type) -> _Owned[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> T | _Owned[T]:
        if obj is None:
            return self
        value: T = getattr(getattr(obj, self._part), self._name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self._part), self._name, value)


class Membership:
    """The coordinator's view: who is in, which epoch, which plan."""

    # The parts' state, read and written where it lives (the service and tests use these names).
    term = _Owned[int]("roster")
    lease_s = _Owned[float]("roster")
    members = _Owned[dict[str, Member]]("roster")
    epoch = _Owned[int]("roster")
    epoch_members = _Owned[list[str]]("roster")
    step = _Owned[int]("roster")
    num_steps = _Owned[int]("roster")
    batch_size = _Owned[int | None]("roster")
    finished = _Owned[bool]("roster")
    halted = _Owned[str | None]("roster")
    policy = _Owned[Policy]("planner")
    balance = _Owned[bool]("planner")
    plan = _Owned[Plan | None]("planner")
    shares = _Owned[list[int]]("planner")
    links = _Owned[Links]("planner")
    recovering_until = _Owned[float | None]("recovery", "until")
    checks = _Owned[Checks]("tribunal")
    final_digests = _Owned[dict[str, str]]("finish")
    final_digest = _Owned[str | None]("finish")
    final_metrics = _Owned[dict[str, float]]("finish")
    job = _Owned[str | None]("gate")
    job_identity = _Owned[str | None]("gate")
    job_spec = _Owned[str]("gate")
    fingerprint = _Owned[list[TensorSpec] | None]("gate")

    def __init__(
        self,
        config: MembershipConfig | None = None,
        *,
        now: float,
        recovering: bool = False,
        policy: Policy | None = None,
    ) -> None:
        """``recovering``: a coordinator (re)started while a group may be training: wait up to
        ``config.recovery_window_s`` for the last epoch's members before forming one."""
        config = config or MembershipConfig()
        self.roster = Roster(config.lease_s)
        self.planner = Planner(self.roster, policy or Policy(), balance=config.balance, now=now)
        self.recovery = Recovery(self.roster, now=now, window_s=config.recovery_window_s, recovering=recovering)
        self.finish = Finish(self.roster, self.recovery.found)
        self.tribunal = Tribunal(self.roster, self.planner, self.recovery, self.finish)
        self.gate = Gate(self.roster, self.recovery, self.tribunal.quarantined_keys)
        self.min_nodes = config.min_nodes
        self.admissions = Admissions()
        """Strikes against keys and addresses whose members left before training, which
        make their next joins wait (`unbroken.control.admissions`)."""
        self._next_expiry_scan = now

    def rank_of(self, member_id: str) -> int | None:
        """The member's rank in the epoch in force (None: not in it), in constant time."""
        return self.roster.rank_of(member_id)

    zones_of = staticmethod(Planner.zones_of)

    # ----------------------------------------------------------------- joins and leaves

    def unbound(self, member_id: str, key: str, one_per_key: bool = False) -> str | None:
        return self.gate.unbound(member_id, key, one_per_key)

    unbound.__doc__ = Gate.unbound.__doc__

    def admit(self, hello: Hello, now: float, reconnect: bool = False, key: str = "", source: str = "") -> Decision:
        """Check a hello; on success the node becomes a joining member. ``reconnect``: the
        member's previous session was still open and has been replaced (it stays as it was).
        ``key`` and ``source``: its node key and where its session came from; a join under
        those that churned lately waits before an epoch takes it (`admissions`)."""
        r = self.roster
        d = Decision()
        if (why := self.gate.refusal(hello, reconnect)) is not None:
            d.refuse = why
            return d
        if hello.member_id in r.members:  # reconnected
            self.heartbeat(hello.member_id, hello.step, now)
            self._left_epoch(hello, now)
            return d
        # A group in training never takes a newcomer's word that it is ahead (a checkpoint of
        # another run): its step counts from the group's; the node drops that state itself.
        running = bool(r.epoch_members) and self.recovering_until is None and hello.resume is None
        step = min(hello.step, r.step) if running else hello.step
        self.gate.let_in(hello)
        r.members[hello.member_id] = Member(
            member_id=hello.member_id,
            name=hello.name,
            weight=hello.weight,
            joined_at=now,
            last_seen=now,
            host=hello.host,
            pid=hello.pid,
            key=key,
            source=source,
            trained=hello.resume is not None,  # back from an epoch that trained (a leader changed)
            step=step,
            caps=hello.capabilities,
            preference=Preference(hello.role),
            evaluates=hello.evaluates,
            zone=hello.zone,
            no_inbound=hello.no_inbound,
            forwarding=hello.forwarding,
        )
        if self.recovering_until is None or hello.resume is not None:  # a newcomer's word moves no recovery
            r.step = max(r.step, step)
        r.epoch_floor = max(r.epoch_floor, hello.last_epoch, hello.restored_epoch or 0)
        live = hello.resume is not None or hello.last_epoch > 0 or (hello.step > 0 and hello.restored_epoch is None)
        r.started = r.started or live
        d.events.append(r.event(now, Kind.JOIN, hello.member_id, f"{hello.name} connected"))
        if self.recovery.joined(hello, now):
            return d
        wait = self.admissions.wait(key, source, now)
        if wait is not None:
            # Kept out of the epochs until then, as a benched member is: not refused (an honest
            # node behind a churner's address only waits), and its join re-forms nothing now.
            member = r.members[hello.member_id]
            member.excluded_until = wait.until
            r.readmit_at = min(r.readmit_at or wait.until, wait.until)
            d.events.append(r.event(now, Kind.CHURN, hello.member_id, f"{hello.name}: {wait.reason}"))
            return d
        r.want_epoch(now, urgent=False, reason=f"{hello.name} joined", delay=r.join_settle_s())
        return d

    def _churned(self, m: Member, now: float) -> None:
        """``m`` is leaving: a strike against its key and address unless it trained (the group
        committed a step in an epoch it belonged to). A join it made that no epoch took yet
        re-forms nothing any more."""
        r = self.roster
        if m.trained or (r.rank_of(m.member_id) is not None and r.committers - {m.member_id}):
            return
        self.admissions.churned(m.key, m.source, now)
        joined = f"{m.name} joined"
        if r.rank_of(m.member_id) is None and joined in r.pending_reasons:
            joining = (o for o in r.members.values() if o is not m and o.state is MemberState.JOINING)
            if not any(o.name == m.name for o in joining):
                r.unwant(joined)

    def _left_epoch(self, hello: Hello, now: float) -> None:
        """A session replaced (or a relay's member back) says it abandoned its epoch (its
        fence refuses the step in flight): the epoch cannot go on without it."""
        x, mid = hello.resume, hello.member_id
        if x is None or not x.abandoned:
            return
        if self.recovering_until is not None:
            self.recovery.abandoned(mid, x, now)
            return
        if x.epoch == self.epoch and self.rank_of(mid) is not None:
            self.tribunal.trace(mid, now)  # its leaving bears out what the others report of the epoch
            why = f"{self.members[mid].name} left epoch {x.epoch} (its session lapsed)"
            self.roster.want_epoch(now, urgent=True, reason=why, delay=0.0)

    def revoke(self, keys: Callable[[str], bool], now: float) -> Decision:
        """Members whose key ``keys`` no longer admits (taken off the allowed keys) are
        expelled, as for a lapsed lease: the job goes on without them, and their rejoin is
        refused."""
        d = Decision()
        for mid, m in list(self.members.items()):
            if m.key and not keys(m.key):
                d.expel[mid] = "its key was taken off the job's allowed keys"
                d.merge(self.fail(mid, now, "its key was taken off the job's allowed keys"))
        return d

    def leave(self, member_id: str, now: float, reason: str, last: bool = False) -> Decision:
        """``last``: the leaver alone holds the group's state and nobody came to take it (`train.leaving`)."""
        r, d = self.roster, Decision()
        if (m := r.members.get(member_id)) is None:
            return d
        if r.alone(member_id) and not last:  # it alone holds the state: it stays until a member takes it
            return Decision(events=[r.event(now, Kind.LEAVE, member_id, f"{m.name} asks to leave: {r.kept(reason)}")])
        d.events.append(r.event(now, Kind.LEAVE, member_id, f"{m.name} leaves: {reason}{r.gone_with(last)}"))
        self.tribunal.trace(member_id, now)
        self._churned(m, now)
        self.planner.left += m.role is Role.TRAINER
        if r.rank_of(member_id) is not None:
            m.state = MemberState.LEAVING
            # A failure already pending keeps its urgency: its step in flight must be abandoned.
            d.merge(self._form_epoch(now, urgent=r.pending_urgent, reason=f"{m.name} left"))
        del r.members[member_id]
        return d

    def fail(self, member_id: str, now: float, cause: str) -> Decision:
        """A member is gone (session dropped, lease expired, malformed message)."""
        r, d = self.roster, Decision()
        if (m := r.members.get(member_id)) is None:
            return d
        self._churned(m, now)
        del r.members[member_id]
        d.events.append(r.event(now, Kind.FAILURE, member_id, f"{m.name}: {cause}"))
        self.tribunal.trace(member_id, now)
        self.planner.vacated += m.role is Role.TRAINER
        if r.rank_of(member_id) is not None and not r.finished and not self.finish.left(member_id, m.name, now):
            r.want_epoch(now, urgent=True, reason=f"{m.name} failed ({cause})", delay=0.0)
        self.recovery.failed(member_id, now, f"{m.name} failed ({cause})")
        return d

    def session_closed(self, member_id: str, now: float) -> Decision:
        """The member's session ended; after ``done``, ``leave`` or the job's end that is no failure."""
        m = self.members.get(member_id)
        if self.finished or m is None:
            self.members.pop(member_id, None)
            return Decision()
        if self.finish.left(member_id, m.name, now):
            del self.members[member_id]
            return Decision()
        return self.fail(member_id, now, "control connection dropped")

    def number_above(self, epoch: int) -> None:
        """Epochs formed from now on are numbered above ``epoch`` (one published before)."""
        self.roster.epoch_floor = max(self.roster.epoch_floor, epoch)

    def listening(self, now: float) -> None:
        self.recovery.listening(now)

    listening.__doc__ = Recovery.listening.__doc__

    def awaited(self, now: float) -> Awaited | None:
        return self.recovery.awaited(now)

    awaited.__doc__ = Recovery.awaited.__doc__

    def vanished(self, reporter: str, epoch: int, members: Iterable[str], now: float) -> Decision:
        return self.recovery.vanished(reporter, epoch, members, now)

    vanished.__doc__ = Recovery.vanished.__doc__

    def remember_verdicts(self, verdicts: Iterable[Refusal]) -> None:
        self.tribunal.remember_verdicts(verdicts)

    remember_verdicts.__doc__ = Tribunal.remember_verdicts.__doc__

    def extend(self, member_ids: Iterable[str], until: float) -> None:
        """These members' leases run at least until ``until`` (their relay went silent: they
        need time to reconnect elsewhere before their lease may lapse)."""
        for mid in member_ids:
            m = self.members.get(mid)
            if m is not None:
                m.last_seen = max(m.last_seen, until - self.lease_s)

    def pause(self, seconds: float) -> None:
        """The service was not listening for ``seconds``: that time counts against no lease."""
        for m in self.members.values():
            m.last_seen += seconds

    # ---------------------------------------------------------------- reports

    def heartbeat(self, member_id: str, step: int, now: float) -> None:
        r = self.roster
        m = r.members.get(member_id)
        if m is not None:
            m.last_seen = now
            m.step = max(m.step, step)
            if not r.ranks:  # no epoch yet (a start, a recovery): the claims are all there is
                if self.recovery.until is None or member_id in self.recovery.resumes:
                    r.step = max(r.step, m.step)
            elif member_id in r.ranks:  # a newcomer's claim moves nothing, one member's alone neither
                r.reached(member_id, m.step)
                if r.num_steps and r.step >= r.num_steps and not self.finish.last_epoch:
                    self.finish.last_epoch = list(r.epoch_members)

    def progress(
        self,
        member_id: str,
        step: int,
        loss: float,
        sps: float,
        now: float,
        *,
        epoch: int | None = None,
        compute_s: float = 0.0,
        caps: Capabilities | None = None,
        wire: tuple[int, int] | None = None,
    ) -> None:
        r = self.roster
        self.heartbeat(member_id, step, now)
        m = r.members.get(member_id)
        if m is None:
            return
        m.loss = loss
        m.samples_per_s = sps
        if caps is not None:
            m.caps = caps
        if wire is not None:
            m.bytes_intra, m.bytes_inter = wire
        if epoch == r.epoch and m.role is Role.TRAINER and compute_s > 0:
            m.compute_times.append(compute_s)
        if epoch == r.epoch and len(r.committers) < 2 and member_id in r.ranks:
            r.committers.add(member_id)

    def links_measured(self, member_id: str, epoch: int, rates: dict[str, float], now: float) -> Decision:
        return self.planner.links_measured(member_id, epoch, rates, now)

    links_measured.__doc__ = Planner.links_measured.__doc__

    def validation(self, member_id: str, step: int, metrics: dict[str, float], seconds: float, now: float) -> Decision:
        d = Decision()
        m = self.members.get(member_id)
        if m is None:
            return d
        m.validation = {"step": float(step), **metrics}
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        said = f"{m.name} evaluated step {step}: {shown} ({seconds:.2f} s)"
        d.events.append(self.roster.event(now, Kind.VALIDATION, member_id, said))
        return d

    def committed(self, member_id: str, commitments: Sequence[Commitment], now: float) -> Decision:
        return self.tribunal.committed(member_id, commitments, now)

    committed.__doc__ = Tribunal.committed.__doc__

    def checked(self, member_id: str, check: Checked, now: float) -> Decision:
        return self.tribunal.checked(member_id, check, now)

    checked.__doc__ = Tribunal.checked.__doc__

    def fault(
        self,
        member_id: str,
        epoch: int,
        reason: str,
        now: float,
        culprit: str | None = None,
        kind: Kind = Kind.BAD_GRADIENT,
        rollback_to: int = -1,
        zone_only: bool = False,
        step: int = -1,
    ) -> Decision:
        return self.tribunal.fault(member_id, epoch, reason, now, culprit, kind, rollback_to, zone_only, step)

    fault.__doc__ = Tribunal.fault.__doc__

    def absent(self, member_id: str, epoch: int, reason: str, now: float, kind: Kind = Kind.ABSENT) -> Decision:
        return self.tribunal.absent(member_id, epoch, reason, now, kind)

    absent.__doc__ = Tribunal.absent.__doc__

    def halt(self, now: float, reason: str, step: int = -1) -> Decision:
        return self.finish.halt(now, reason, step)

    halt.__doc__ = Finish.halt.__doc__

    def done(self, member_id: str, step: int, digest: str, metrics: dict[str, float], now: float) -> Decision:
        """A member reached the job's last step. The job is finished once most of the
        epoch's trainers said so with the same state: one member's word ends nothing."""
        r = self.roster
        d = Decision()
        m = r.members.get(member_id)
        if m is None:
            return d
        if r.num_steps and step != r.num_steps:
            d.events.append(
                r.event(now, Kind.REFUSED, member_id, f"{m.name} reports done at step {step}, not the job's "
                        f"last step {r.num_steps}: ignored")
            )  # fmt: skip
            return d
        if r.epoch_members and r.rank_of(member_id) is None and member_id not in self.finish.last_epoch:
            d.events.append(
                r.event(now, Kind.REFUSED, member_id, f"{m.name} reports done but is no member of the epoch "
                        f"that trains: ignored")
            )  # fmt: skip
            return d
        self.heartbeat(member_id, step, now)
        return self.finish.done(member_id, step, digest, metrics, now)

    def reported_step(self) -> int:
        """The second highest step the epoch's members reported (the highest where it has one
        member): what a joiner's checkpoint is held against. The group's step (`StepQuorum`)
        trails it by a report, and a checkpoint of the newest step must not look ahead of
        the group; one member's word alone still moves it nothing."""
        r = self.roster
        return max(r.step, r.steps.second_highest())

    def beyond(self, step: int) -> str | None:
        return self.gate.beyond(step)

    beyond.__doc__ = Gate.beyond.__doc__

    # ---------------------------------------------------------------- time

    def tick(self, now: float, expire: bool = True) -> Decision:
        """Expire leases, end a recovery window, and form a pending epoch when due."""
        r = self.roster
        d = Decision()
        # Leases are checked a tenth of a lease apart, not on every tick: with thousands of
        # members a scan costs milliseconds, and a tenth of a lease late is soon enough.
        scan = expire and now >= self._next_expiry_scan
        if scan:
            self._next_expiry_scan = now + r.lease_s / 10
        for mid in r.leases.lapsed(r.members, now, r.lease_s) if scan else []:
            if (m := r.members.get(mid)) is not None and not (r.finished and self.finish.said_done(mid)):
                d.expel[mid] = f"no heartbeat for {now - m.last_seen:.2f} s (lease {r.lease_s} s)"
                d.merge(self.fail(mid, now, f"lease expired after {now - m.last_seen:.2f} s"))
        if self.recovery.until is not None:
            d.merge(self.recovery.recover(now, self.planner))
            if self.recovery.until is not None:
                return d
        if not r.started and len(r.members) < self.min_nodes:
            return d  # the job has not started: wait for enough nodes
        if not r.started and all(m.preference is Preference.VALIDATOR for m in r.members.values()):
            return d  # ...and for one that may train: a validator never does (`--role validator`)
        d.merge(self.tribunal.expire(now))
        if self.finish.gone:
            d.merge(self.finish.check(now))
        d.merge(self.tribunal.unfounded(now))
        if r.readmit_at is not None and now >= r.readmit_at:
            later = [m.excluded_until for m in r.members.values() if m.excluded_until > now]
            r.readmit_at = min(later) if later else None
            back = [m for m in r.members.values() if 0 < m.excluded_until <= now and r.rank_of(m.member_id) is None]
            for m in back:
                if m.quarantined:
                    continue
                # A join that waited (`admissions`) is a join; anyone else was kept out for an offence.
                joined = m.state is MemberState.JOINING
                why = f"{m.name} joined" if joined else "a member kept out of the data plane may try again"
                r.want_epoch(now, urgent=False, reason=why, delay=0)
        self.tribunal.checked_enough(now)
        if r.pending_due is not None and now >= r.pending_due and not r.finished:
            d.merge(self._form_epoch(now, r.pending_urgent, r.pending_reason()))
        elif r.pending_due is None and not r.finished:
            d.merge(self.planner.review(now))
        return d

    def _form_epoch(self, now: float, urgent: bool, reason: str) -> Decision:
        r = self.roster
        d = Decision()
        r.clear_pending()
        if not urgent and r.epoch_members and r.step <= self.planner.formed_at_step:
            # Nothing of the epoch in force has committed (that the leader heard of): some
            # members may be in its first step while others still sync, and the ones syncing
            # would leave for the new order while the others wait in that step for them. A
            # graceful switch needs a step all of them reach: this one switches at once.
            urgent = True

        def eligible(m: Member) -> bool:
            # A member that said done trains no more: an epoch holding it would wait for it.
            return not m.quarantined and m.excluded_until <= now and not self.finish.said_done(m.member_id)

        keep = [
            m
            for m in r.epoch_members
            if m in r.members and r.members[m].state != MemberState.LEAVING and eligible(r.members[m])
        ]
        # A benched member goes behind the others (a stable sort): it never leads its zone,
        # whose DiLoCo pseudo-gradient is its leader's word alone.
        keep.sort(key=lambda mid: r.members[mid].benched_until > now)
        kept = set(keep)
        new = sorted(
            (
                m
                for m in r.members.values()
                if m.member_id not in kept
                and (m.state == MemberState.JOINING or (m.state == MemberState.ACTIVE and m.excluded_until))
                and eligible(m)
            ),
            key=lambda m: (m.joined_at, m.member_id),
        )
        order = reachable_first(keep + [m.member_id for m in new], lambda mid: r.members[mid].no_inbound)
        if not order:
            return d
        old = list(r.epoch_members)
        r.epoch = max(r.epoch, r.epoch_floor) + 1
        d.events.extend(r.behind(now, order, keep))
        r.started = True
        r.epoch_members = order
        self.planner.formed_at_step = r.step  # after the members: their earlier reports may raise it
        members = [r.members[m] for m in order]
        d.events.extend(self.planner.make_plan(members, now))
        zones = self.zones_of(members)
        self.tribunal.epoch_formed(r.epoch, dict(zip(order, zones, strict=True)))
        for m in members:
            m.state = MemberState.ACTIVE
        msg = self.planner.order(
            members,
            zones,
            now,
            urgent=urgent,
            reason=reason,
            checking=self.tribunal.checking_from is not None,
            rollback_to=self.tribunal.take_rollback(),
            refused=self.tribunal.verdicts,
        )
        # Everyone of the old epoch hears of it (a leaver learns it may go), and everyone of the new.
        for mid in dict.fromkeys(old + order):
            if mid in r.members or mid in old:
                d.orders[mid] = msg
        d.events.append(r.event(now, Kind.EPOCH, None, f"epoch {r.epoch} with {len(order)} members: {reason}"))
        return d
