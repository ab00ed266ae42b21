"""The tribunal: members' reports of faults, offences and their verdicts.

A member's word alone condemns nobody (promise 8). Every member reaches the same verdict
from the same data (the all-reduced sum, the gathered rows or digests), so a verdict counts
once most of those that saw the evidence reached it (`roster.majority`); a member kept out
on its fellows' word alone (unreachable, asking for state that does not exist) needs most
of the others (`roster.most_others`). Reports of failed collectives that nothing bears out
are held (`Hearsay`); an offender is benched, and quarantined when it offends again and
again. A verdict no repair can end halts the job (`finish.Finish.halt`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from unbroken.control.checks import Candidate, Checks, Finding, Outcome, Verdict, confirmer
from unbroken.control.finish import Finish
from unbroken.control.hearsay import LIMIT as HEARSAY_LIMIT
from unbroken.control.hearsay import PERIOD_S as HEARSAY_PERIOD_S
from unbroken.control.hearsay import Hearsay, Report
from unbroken.control.messages import REFUSALS_KEPT, Checked, Commitment, Refusal, Verify
from unbroken.control.planning import Planner
from unbroken.control.recovery import Recovery
from unbroken.control.roster import Decision, Member, Roster, majority, most_others
from unbroken.events import Kind
from unbroken.sched import nat
from unbroken.sched.balance import Role

FAULT_GRACE_S = 0.1
"""A reported collective failure waits this long for the failed member's session to drop,
so one failure makes one epoch change."""
HELD = {True: "", False: " (held: nothing bore out its last report yet)"}
"""What a report's event adds when `Hearsay` holds it back."""
OFFENCES = {
    Kind.ABSENT: "never joined the data plane",
    Kind.UNREACHABLE: "its data plane is unreachable",
    Kind.UNFOUNDED: "its reports of failed collectives are borne out by nothing",
    Kind.BAD_REQUEST: "it asked its donors for state that does not exist",
}
"""What keeps a member out of the epochs (`Membership.absent`), for the epoch's reason."""
PROBE_WAIT_S = 2.0
"""A member that says it cannot reach a peer's data plane: how long the others have to try
(`unbroken.control.messages.Probe`) before the epoch is formed again with everyone."""
BENCH_S = 30.0
"""A member whose gradient was refused does not train for this long."""
CHECKED_STEPS = 20
"""Steps gathered and checked row by row after a sum did not add up (`Suspicion`)."""
QUARANTINE_AFTER = 3
"""...and after this many refusals it is quarantined: told to stop, and out of every epoch."""
ROLLBACK_PERIODS = 2
"""A failed audit may discard at most this many audit periods of steps; past it the job halts."""
REFUSED_STEPS_KEPT = 64
"""Steps behind the newest refused one whose refusals are remembered (`Membership.halt`)."""


class Tribunal:
    """Accusations, verdicts, offences and the audits' rollbacks."""

    def __init__(self, roster: Roster, planner: Planner, recovery: Recovery, finish: Finish) -> None:
        self._roster = roster
        self._planner = planner
        self._recovery = recovery
        self._finish = finish
        self.rollback_to = -1
        """A failed audit's rollback, carried by the next epoch order (`take_rollback`)."""
        self.verdicts: list[Refusal] = []
        """The latest audit verdicts, sent in every order (`EpochOrder.refused`) and published
        with each epoch in etcd, whence a new leader takes them over (`remember_verdicts`)."""
        self._refused: set[tuple[int, str]] = set()
        self._rolled_back: dict[int, set[int]] = {}
        """A step failed audits went back to → the epochs of those audits (`_rollback_bounded`)."""
        self._refused_at: dict[int, dict[str, str]] = {}
        """Step → the members whose contribution to it was refused, with why (`offence`)."""
        self.quarantined_keys: set[str] = set()
        self._accusers: dict[tuple[int, str, str], set[str]] = {}
        """(epoch, culprit or "", kind) → the members that reported it."""
        self._hearsay = Hearsay(window_s=max(2.0, 2 * roster.lease_s))
        """Reports of failed collectives that nothing else bore out yet."""
        self._witnesses: dict[int, dict[str, str]] = {}
        """The last epochs' members, each with its zone (who could see a verdict's evidence)."""
        self._rollbacks: dict[int, dict[str, int]] = {}
        """Epoch → its members that reported an audit verdict, each with the step it went back to."""
        self.checking_from: int | None = None
        """Since this step every contribution is gathered and checked (a sum did not add up)."""
        self.checks = Checks(self._confirmer, roster.name)
        """The trainers' commitments and the findings of the members checking them."""
        self._moved: dict[str, int] = {}
        """Member → the epoch in force when it was moved behind a forwarder (`_unreachable`)."""

    # ------------------------------------------------------------------ epochs

    def epoch_formed(self, epoch: int, witnesses: dict[str, str]) -> None:
        """Epoch ``epoch`` formed of these members (each with its zone): they witness it; what
        was said of epochs before the one before is forgotten."""
        self._witnesses[epoch] = witnesses
        for e in [e for e in self._witnesses if e < epoch - 1]:
            del self._witnesses[e]
        self._accusers = {k: v for k, v in self._accusers.items() if k[0] >= epoch - 1}
        self._rollbacks = {e: r for e, r in self._rollbacks.items() if e >= epoch - 1}

    def take_rollback(self) -> int:
        """The rollback the next order carries: told once, a later epoch must not roll back again."""
        back, self.rollback_to = self.rollback_to, -1
        return back

    def trace(self, member_id: str, now: float) -> None:
        """A member failed or left: what others reported about its epochs is borne out."""
        epochs = {e for e, w in self._witnesses.items() if member_id in w}
        self._release(self._hearsay.borne_out(epochs, now, by=member_id), now)

    def _release(self, borne: list[Report], now: float) -> None:
        """Held reports that something bore out after all: the current epoch's re-forms."""
        r = self._roster
        for x in borne:
            if x.epoch == r.epoch and x.member_id in r.members:
                name = r.members[x.member_id].name
                r.want_epoch(now, urgent=True, reason=f"collective failed at {name}: {x.reason}", delay=0.0)

    def remember_verdicts(self, verdicts: Iterable[Refusal]) -> None:
        """The audits' verdicts a previous leader ordered (published with its last epoch)."""
        for x in verdicts:
            self._refuse(x.epoch, x.step)

    # ------------------------------------------------------------------ checks of work

    def committed(self, member_id: str, commitments: Sequence[Commitment], now: float) -> Decision:
        """A trainer's commitments to its slices (`Progress.commitments`, `control.checks`)."""
        r = self._roster
        if member_id not in r.members:
            return Decision()
        # Of the epoch in force or the one before (reports cross an epoch change), no other:
        # a member's word about other epochs would only fill the record.
        kept = [c for c in commitments if r.epoch - 1 <= c.epoch <= r.epoch]
        return self.check_outcomes(self.checks.committed(member_id, kept, r.step), now)

    def checked(self, member_id: str, check: Checked, now: float) -> Decision:
        """A member's recomputation of a trainer's slice (`control.checks`): compared with
        the trainer's commitment; a first finding against it has another member check it
        again (`Decision.verify`), a second member's benches it (`Kind.BAD_WORK`)."""
        m = self._roster.members.get(member_id)
        if m is None or m.quarantined or m.flags or check.trainer == member_id:
            return Decision()
        # Only a validator's finding, or one a member was asked for, counts: a trainer or a
        # standby saying so unasked is one more voice an attacker could add.
        if m.role is not Role.VALIDATOR and not check.ordered:
            return Decision()
        t = self._roster.members.get(check.trainer)
        arithmetic = t.caps.arithmetic if t is not None and t.caps.arithmetic else None
        return self.check_outcomes(self.checks.checked(Finding(member_id, check, now), arithmetic), now)

    def check_outcomes(self, outcomes: list[Outcome], now: float) -> Decision:
        r = self._roster
        d = Decision()
        for o in outcomes:
            t = r.members.get(o.trainer)
            if o.verdict is Verdict.MATCH or t is None:
                continue
            if o.verdict is Verdict.CONFIRMED:
                why = f"wrong work from {t.name}"
                d.merge(self.offence(t, r.epoch, o.reason, now, Kind.BAD_WORK, why, keep_checking=True))
                continue
            if o.confirmer is not None:
                again = f"another member found {t.name}'s work differing from its commitment: {o.reason}"
                d.verify[o.confirmer] = Verify(epoch=r.epoch, trainer=o.trainer, step=r.step, reason=again)
            d.events.append(r.event(now, Kind.CHECK, o.trainer, f"{t.name}: {o.reason}"))
        return d

    def _confirmer(self, trainer: str, accusers: Collection[str]) -> str | None:
        """Who checks ``trainer`` again (`control.checks.confirmer`), in the epoch in force."""
        r, shares = self._roster, self._planner.shares
        t = r.members.get(trainer)
        if t is None or len(shares) != len(r.epoch_members):
            return None
        candidates = [
            Candidate(mid, c.role, share, c.caps.arithmetic)
            for mid, share in zip(r.epoch_members, shares, strict=True)
            if (c := r.members.get(mid)) is not None and c.role is not None and not c.flags
        ]
        return confirmer(candidates, trainer, accusers, t.caps.arithmetic)

    # ------------------------------------------------------------------ faults

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
        """A member saw a collective fail, or refused a bad contribution (``culprit``), or a
        sum that did not add up (``Kind.SUSPECT``). Re-form the epoch unless it already
        changed. A culprit is benched, and quarantined when it offends again and again,
        once most of the members that saw the evidence named it (``zone_only``: the
        culprit's zone, a DiLoCo inner step's); their reports count for the epoch before
        the current one too (the first report already re-formed it)."""
        r = self._roster
        d = Decision()
        witnesses = self._witnesses.get(epoch)
        if witnesses is None and epoch == r.epoch:  # an epoch the members resumed with
            witnesses = {mid: "" for mid in r.epoch_members or self._recovery.resumes}
        m = r.members.get(member_id)
        if witnesses is None or member_id not in witnesses or m is None:
            return d
        if m.quarantined or m.excluded_until > now:
            return d  # kept out of the epochs: its word re-forms none
        current = epoch == r.epoch
        if current:
            self._recovery.epoch_broke(now, f"{m.name} reports: {reason}")
        back = self._rollback_reported(member_id, epoch, kind, rollback_to, witnesses)
        if back >= 0:
            # Remembered whatever the epoch now (a report may come after the next order):
            # a member away since must not bring back what the verdict refused.
            self._refuse(epoch, back, replace=True)
        if current and back >= 0:
            if (halt := self._rollback_bounded(epoch, back, reason, now)) is not None:
                return halt
            # Every copy of the audited state predates the corruption (a joiner's copy is of
            # the step it joined at, a member cut short of a verdict holds an older one), and
            # a member without it fetches it from one that holds it.
            self.rollback_to = back
        act, released = self._hearsay.reported(member_id, epoch, now, reason)
        self._release(released, now)
        c = r.members.get(culprit) if culprit is not None else None
        if kind is Kind.SUSPECT or c is not None:
            # Every member reaches the same verdict from the same data (the all-reduced sum,
            # the gathered rows or digests): a verdict counts once most of them reached it.
            seen = witnesses
            if zone_only and c is not None and kind is Kind.BAD_GRADIENT:
                seen = {mid: z for mid, z in witnesses.items() if z == witnesses.get(c.member_id)}
            if member_id not in seen:
                return d
            key = (epoch, c.member_id if c is not None else "", kind)
            accusers = self._accusers.setdefault(key, set())
            first = not accusers
            accusers.add(member_id)
            if c is not None and kind in (Kind.UNREACHABLE, Kind.BAD_REQUEST):
                return self._on_their_word(d, m, c, kind, epoch, reason, now, accusers, len(seen), first, act)
            agreed = len(accusers) >= majority(len(seen))
            if agreed and c is not None:
                what = "bad gradient" if kind is Kind.BAD_GRADIENT else "failed audit"
                return self.offence(c, epoch, reason, now, kind, f"{what} from {c.name}", step)
            if agreed and c is None and self.checking_from is None:
                # A contribution lied, and only the gathered rows can say whose: check each.
                self.checking_from = r.step
                then = (
                    "DiLoCo's exchange gathers no rows: the round is retried as it was"
                    if self._planner.policy.diloco is not None
                    else f"the next {CHECKED_STEPS} steps gather and check every member's contribution"
                )
                d.events.append(r.event(now, Kind.SUSPECT, None, f"{reason}; {then}"))
                r.want_epoch(now, urgent=True, reason="a step's sum did not add up: checking each part", delay=0.0)
                return d
            if len(accusers) > 1 or not current:
                return d
            if c is not None:
                reason = f"{reason} (names {c.name}; benched only when most of the epoch agrees)"
        if not current:
            return d
        d.events.append(r.event(now, Kind.FAULT, member_id, f"{m.name} reports: {reason}{HELD[act]}"))
        if not act:
            return d
        r.want_epoch(now, urgent=True, reason=f"collective failed at {m.name}: {reason}", delay=FAULT_GRACE_S)
        return d

    def _on_their_word(
        self,
        d: Decision,
        m: Member,
        c: Member,
        kind: Kind,
        epoch: int,
        reason: str,
        now: float,
        accusers: set[str],
        seen: int,
        first: bool,
        act: bool,
    ) -> Decision:
        """``m`` says ``c`` cannot be reached, or asked it for state that does not exist:
        only the others can say so (of ``seen`` who saw the evidence), and ``c`` is kept out
        once most of them, by `most_others`, did — or, unreachable, once ``c`` names itself
        (a member that reaches few of its peers says so, and its word about itself is enough)."""
        r = self._roster
        current = epoch == r.epoch
        others = len(accusers - {c.member_id})
        if kind is Kind.UNREACHABLE:
            if epoch <= self._moved.get(c.member_id, -1):
                return d  # said of its address before it moved behind a forwarder
            if c.member_id in accusers:  # its own outbound connections fail: no forwarder helps
                return self.absent(c.member_id, epoch, reason, now, kind=Kind.UNREACHABLE)
            # Never one alone: in an epoch of two it is one word against another.
            if others >= most_others(seen, never_alone=True):
                return self._unreachable(c, epoch, reason, now, accusers)
            if first and current:
                d.events.append(r.event(now, Kind.FAULT, m.member_id, f"{m.name} reports: {reason}{HELD[act]}"))
                if act:
                    # Most of the epoch is trying the address meanwhile (`Probe`): if
                    # they reach it, the epoch is formed again with everyone.
                    r.want_epoch(now, urgent=True, reason=f"{m.name} reports: {reason}", delay=PROBE_WAIT_S)
            return d
        # What a receiver asked of its donors is on their wires alone: most of the others
        # (one of a pair) say so, or the epoch is formed again without a verdict. (A receiver
        # that asks one donor alone escapes this; one donor's word is not enough to keep
        # anyone out, or one liar could keep out whom it liked.)
        if others >= most_others(seen, never_alone=False):
            return self.absent(c.member_id, epoch, reason, now, kind=Kind.BAD_REQUEST)
        if len(accusers) > 1 or not current:
            return d
        reason = f"{reason} (names {c.name}; kept out only when most of the others agree)"
        d.events.append(r.event(now, Kind.FAULT, m.member_id, f"{m.name} reports: {reason}{HELD[act]}"))
        if act:
            r.want_epoch(now, urgent=True, reason=f"collective failed at {m.name}: {reason}", delay=FAULT_GRACE_S)
        return d

    def _unreachable(self, c: Member, epoch: int, reason: str, now: float, accusers: set[str]) -> Decision:
        """Most of the others could not connect to ``c``: the next epoch has its peers reach
        it through a forwarder one of the epoch's members offers, or, where none does (or it
        is behind one already), it is benched (`sched.nat.unreachable`)."""
        r = self._roster
        others = [o for mid in r.epoch_members if mid != c.member_id and (o := r.members.get(mid)) is not None]
        mine = [(o.forwarding, o.no_inbound) for o in others if not o.quarantined]
        offers = nat.forwarders(mine, sorted(r.relay_forwarders.values()))
        names = sorted(r.name(mid) for mid in accusers)
        verdict = nat.unreachable(c.name, names, offers, behind=c.no_inbound)
        if verdict.forwarder is None:
            return self.absent(c.member_id, epoch, f"{verdict.reason}. {reason}", now, kind=Kind.UNREACHABLE)
        if not r.epoch - 1 <= epoch <= r.epoch or r.rank_of(c.member_id) is None:
            return Decision()  # as `absent`: said of an epoch it is no longer in
        c.no_inbound = c.moved_behind = True
        self._moved[c.member_id] = r.epoch
        d = Decision()
        d.events.append(r.event(now, Kind.FORWARDED, c.member_id, verdict.reason))
        r.want_epoch(now, urgent=True, reason=verdict.reason, delay=0.0)
        return d

    # ------------------------------------------------------------------ audits

    def _rollback_reported(
        self, member_id: str, epoch: int, kind: Kind, rollback_to: int, witnesses: dict[str, str]
    ) -> int:
        """A member's audit verdict on ``epoch`` (going back to its audited state of step
        ``rollback_to``; -1: it holds none): the step the group goes back to, -1 until it is
        known. Each member reaches the verdict from the same gathered digests: one member's
        word alone rolls nobody back. It is known once most of the epoch's members reported
        and two of them name the same step (members audited together hold the same one: the
        oldest such), or once all of them reported (the oldest named: a joiner's copy is newer
        than the last audit). A liar that reports first cannot get its step ordered before the
        others' arrive, and a member's first report is the one that counts. Until then the
        members that saw the verdict went back on their own, and the sync phase's floors take
        back those that did not."""
        if kind is not Kind.AUDIT:
            return -1
        members = set(witnesses)
        if (found := self._recovery.found()) is not None and found[0] == epoch and epoch not in self._witnesses:
            members = found[1]  # recovering: the epoch's members, not only those back so far
        if member_id not in members:
            return -1
        reports = self._rollbacks.setdefault(epoch, {})
        reports.setdefault(member_id, rollback_to)
        if len(reports) < majority(len(members)):
            return -1
        steps = [s for s in reports.values() if s >= 0]
        named_twice = [s for s in set(steps) if steps.count(s) >= 2]
        if not named_twice and len(reports) < len(members):
            return -1
        return min(named_twice or steps, default=-1)

    def _rollback_bounded(self, epoch: int, back: int, reason: str, now: float) -> Decision | None:
        """A halt instead of the rollback to ``back`` that an audit of ``epoch`` decided, when
        it is one no repair can end: the group already went back to that step after an audit
        of another epoch (repaired, it diverged again), or it would discard more than
        `ROLLBACK_PERIODS` audit periods (a job whose audits go back further and further)."""
        step = self._roster.step
        epochs = self._rolled_back.setdefault(back, set())
        epochs.add(epoch)
        if len(epochs) >= 2:
            return self._finish.halt(
                now,
                f"the replicas diverged again after the group went back to step {back} and repaired them "
                f"(the last audit: {reason}). A difference that comes back is how the members compute, not a "
                "flipped bit: state the training loop changes outside what unbroken replicates (a scheduler not "
                "given to replicate(), a learning rate or a counter the loop sets itself), code or settings that "
                "differ between nodes, nondeterministic kernels or mixed devices. Make the members compute "
                "alike, then restart from the last checkpoint",
            )
        every = self._planner.policy.audit_every
        if every and step - back > ROLLBACK_PERIODS * every:
            return self._finish.halt(
                now,
                f"a failed audit ({reason}) would take the group back {step - back} steps, from step "
                f"{step} to step {back}: more than {ROLLBACK_PERIODS} audit periods of {every} steps, so "
                "the audits before it did not pass either. Training on would redo the run, not repair it: "
                "find why the members' states differ (the audits name who), then restart from the last checkpoint",
            )
        return None

    def _refuse(self, epoch: int, step: int, replace: bool = False) -> None:
        """Record a verdict: states committed in ``epoch`` or before, above ``step`` (the
        oldest step said for the epoch, or, ``replace``, this one: the reports' step so far)."""
        for i, x in enumerate(self.verdicts):
            if x.epoch == epoch:
                self.verdicts[i] = Refusal(epoch=epoch, step=step if replace else min(step, x.step))
                return
        self.verdicts = [*self.verdicts, Refusal(epoch=epoch, step=step)][-REFUSALS_KEPT:]

    # ------------------------------------------------------------------ offences

    def absent(self, member_id: str, epoch: int, reason: str, now: float, kind: Kind = Kind.ABSENT) -> Decision:
        """The leader saw ``member_id`` never join epoch ``epoch``'s data plane (its own
        evidence: it holds the rendezvous), or most of the epoch could not connect to it
        (``Kind.UNREACHABLE``), or its reports of failed collectives were borne out by
        nothing, again and again (``Kind.UNFOUNDED``, `Hearsay`). Kept out of the epochs
        like a culprit; quarantined when it happens again and again."""
        r = self._roster
        c = r.members.get(member_id)
        # Evidence about the epoch before counts too (reports cross the next epoch's
        # forming): the member is still in the current one, doing the same.
        if c is None or not r.epoch - 1 <= epoch <= r.epoch or r.rank_of(member_id) is None:
            return Decision()
        # Out of the epochs, not only of training: a member in an epoch must build its
        # groups (this one would hold every build up again) and may report failures.
        c.excluded_until = now + BENCH_S
        r.readmit_at = min(r.readmit_at or c.excluded_until, c.excluded_until)
        return self.offence(c, epoch, reason, now, kind, f"{c.name}: {OFFENCES[kind]}")

    def offence(
        self,
        c: Member,
        epoch: int,
        reason: str,
        now: float,
        kind: Kind,
        why: str,
        step: int = -1,
        keep_checking: bool = False,
    ) -> Decision:
        """Bench ``c`` for an offence in ``epoch`` (counted once per epoch) and re-form;
        quarantine it after `QUARANTINE_AFTER`. A bad gradient at ``step`` that another
        member was refused for too is the step's samples, not a node: the job halts.
        ``keep_checking``: the offence says nothing of a sum that did not add up (wrong work,
        `checked`): the steps checked row by row since (if any) stay so."""
        r = self._roster
        d = Decision()
        if (epoch, c.member_id) in self._refused:
            return d
        self._refused.add((epoch, c.member_id))
        if kind is Kind.BAD_GRADIENT and step >= 0:
            refused = self._refused_at.setdefault(step, {})
            refused.setdefault(c.member_id, reason)
            for old in [s for s in self._refused_at if s < step - REFUSED_STEPS_KEPT]:
                del self._refused_at[old]
            if len(refused) >= 2:
                said = "; ".join(f"{r.name(mid)}: {why}" for mid, why in refused.items())
                return self._finish.halt(
                    now,
                    f"step {step} was refused for every member that computed it ({said}). Its samples give "
                    "that gradient whoever computes them: the model or the data (NaN/Inf in these samples, a "
                    "learning rate too high, no loss scaling), not a faulty node. Fix it and restart from the "
                    "last checkpoint",
                    step,
                )
        self._release(self._hearsay.borne_out({epoch}, now, by=c.member_id), now)
        if not keep_checking:
            self.checking_from = None  # found: the next epoch goes back to the job's rule
        c.flags += 1
        c.benched_until = now + BENCH_S
        d.events.append(r.event(now, kind, c.member_id, f"{c.name} (offence {c.flags}): {reason}"))
        if c.flags >= QUARANTINE_AFTER and not c.quarantined:
            c.quarantined = True
            if c.key:
                self.quarantined_keys.add(c.key)  # its node, restarted under the same key, too
            said = (
                f"{c.name} quarantined after {c.flags} offences (refused gradients, wrong work, failed audits, "
                f"absent from or unreachable on the data plane), the last: {reason}"
            )
            d.events.append(r.event(now, Kind.QUARANTINE, c.member_id, f"{said}; out of training"))
            # Told to stop. Even the last member: its sessions' peers may be reconnecting, and
            # a group with no member waits for nodes (a job whose data is at fault halts when
            # a second member is refused for the same step, above).
            d.quarantine[c.member_id] = said
        r.want_epoch(now, urgent=True, reason=why, delay=0.0)
        return d

    # ------------------------------------------------------------------ time

    def expire(self, now: float) -> Decision:
        """Commitments whose checks are overdue (`Checks.expire`)."""
        return self.check_outcomes(self.checks.expire(now), now)

    def unfounded(self, now: float) -> Decision:
        """Members whose reports of failed collectives nothing bore out, again and again."""
        d = Decision()
        for mid in self._hearsay.due(now):
            why = f"reported {HEARSAY_LIMIT} failed collectives within {HEARSAY_PERIOD_S:g} s that nothing bore out"
            d.merge(self.absent(mid, self._roster.epoch, why, now, kind=Kind.UNFOUNDED))
        return d

    def checked_enough(self, now: float) -> None:
        """Steps checked row by row since a sum did not add up: after `CHECKED_STEPS` without a
        culprit, the next epoch goes back to the job's rule."""
        if self.checking_from is not None and self._roster.step >= self.checking_from + CHECKED_STEPS:
            self.checking_from = None
            self._roster.want_epoch(now, urgent=False, reason=f"no culprit in {CHECKED_STEPS} checked steps", delay=0.0)
