"""Checking the work, the leader's part: commitments, recomputations, and who is named.

Trainers commit to each slice they contribute (`m.Commitment`, with their progress);
validators recompute some slices bit for bit and say what they found (`m.Checked`;
`unbroken.train.checks` is the members' part). The leader compares::

    finding ──(skipped; other arithmetic or micro-batches)──▶ not compared (said once a minute)
       │──(no commitment yet)──▶ waits `WAIT_S` for it, then not compared
       │──(equal)──▶ match; an ordered check that matched leaves its accusation unconfirmed
       └──(differs)──▶ accusation ──(a second member's, within `WINDOW_S`)──▶ confirmed: named
                           └──(the first)──▶ another member asked to check again (`m.Verify`)

A member's finding is its word alone (promise 8): a trainer is named only once two members
other than itself found its work differing from its commitments. A member asked to confirm
that finds the trainer's work as committed leaves the accusation unconfirmed, and a member
whose accusations go unconfirmed `UNFOUNDED_LIMIT` times in `UNFOUNDED_PERIOD_S` gets none
of them followed up by an order for a while (another member's own finding still confirms
one). Two members finding opposite things of the same slice name nobody: one of them
computes wrongly. Confirming on a later step than the first finding catches a trainer that
keeps computing wrongly (a faulty device, a loader reading the wrong samples); one wrong
once is not named (`Membership` benches a trainer named here: `Membership.checked`).

Pure: no clock, no sockets; `Membership` feeds it and turns its outcomes into events,
orders and offences.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from unbroken.control.messages import Checked, Commitment
from unbroken.specs import Role

WAIT_S = 10.0
"""A finding waits this long for the commitment it is compared with (reports cross)."""
KEPT_STEPS = 256
"""Steps behind the newest whose commitments are kept (a check lands a few steps late)."""
WINDOW_S = 300.0
"""Two members' findings against a trainer this close together name it."""
ORDER_WAIT_S = 90.0
"""An order to confirm gets no answer in this long (its member left, or the trainer never
trained where it could be checked): the accusation stays unconfirmed."""
UNFOUNDED_LIMIT = 2
UNFOUNDED_PERIOD_S = 600.0
SAID_EVERY_S = 60.0
"""A reason for not comparing, said again for the same checker and trainer no sooner."""


class Verdict(str, enum.Enum):
    MATCH = "match"
    MISMATCH = "mismatch"
    """One member's finding: another is asked, or has been, or it is not followed up."""
    CONFIRMED = "confirmed"
    UNCONFIRMED = "unconfirmed"
    DISPUTED = "disputed"
    NOT_COMPARED = "not-compared"


@dataclass(frozen=True)
class Finding:
    """One member's check of a trainer's slice, as received."""

    checker: str
    check: Checked
    at: float


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    trainer: str
    step: int
    reason: str
    """What happened, for the event (members by id: `Membership` names them)."""
    accusers: tuple[str, ...] = ()
    confirmer: str | None = None
    """The member asked to check the trainer again (MISMATCH)."""


@dataclass(frozen=True)
class Candidate:
    """A member that might confirm a finding (`confirmer`)."""

    member: str
    role: Role
    share: int
    arithmetic: str


def confirmer(candidates: Sequence[Candidate], trainer: str, accusers: Collection[str], arithmetic: str) -> str | None:
    """Who checks ``trainer`` again: a validator that computes like it, else the fastest
    trainer that does (largest share: its step waits while it recomputes), never the trainer
    itself nor a member that accused it already; the first in rank order among equals."""
    able = [c for c in candidates if c.member != trainer and c.member not in accusers and c.arithmetic == arithmetic]
    validators = [c for c in able if c.role is Role.VALIDATOR]
    if validators:
        return validators[0].member
    trainers = [c for c in able if c.role is Role.TRAINER and c.share > 0]
    return max(trainers, key=lambda c: c.share).member if trainers else None


Pick = Callable[[str, Collection[str]], "str | None"]
"""Who confirms a first finding against a trainer, not one of the accusers (`confirmer`)."""


class Checks:
    """The leader's record of commitments and findings (see the module's docstring)."""

    def __init__(self, pick: Pick, name: Callable[[str], str] = str) -> None:
        """``pick``: who confirms a finding (`confirmer` over the epoch in force); ``name``:
        a member's name for the outcomes' reasons (by id)."""
        self._pick = pick
        self._name = name
        self._commitments: dict[int, dict[tuple[int, str], Commitment]] = {}
        """Step → (epoch, trainer) → its commitment: whole steps are dropped as the group moves on."""
        self._waiting: dict[tuple[int, int, str], list[Finding]] = {}
        """(epoch, step, trainer) → the findings waiting for that commitment."""
        self._accused: dict[str, dict[str, Finding]] = {}
        """Trainer → the members whose findings against it stand, with the finding."""
        self._asked: dict[str, tuple[str, str, float]] = {}
        """Trainer → (the member asked to confirm, the accuser, since when)."""
        self._unfounded: dict[str, deque[float]] = {}
        self._results: dict[tuple[int, int, str], dict[str, bool]] = {}
        """(epoch, step, trainer) → each checker's finding of it: whether it matched."""
        self._said: dict[tuple[str, str, str], float] = {}
        self._named: dict[str, int] = {}
        """Trainer → the newest epoch of the findings that named it: later findings of that
        epoch or before are about what it was named for (it is benched since)."""
        self.compared = 0
        self.mismatches = 0

    def committed(self, member: str, commitments: Iterable[Commitment], step: int) -> list[Outcome]:
        """A trainer's commitments; the findings that waited for them are compared. ``step``:
        the group's step as the leader knows it, not as any member says: a commitment past it
        or more than `KEPT_STEPS` behind is dropped, and so are steps the group left behind
        (one trainer's claim of a far step must not prune the others', nor grow the record)."""
        floor = step - KEPT_STEPS
        for old in [s for s in self._commitments if s < floor]:
            del self._commitments[old]
        if self._results and min(k[1] for k in self._results) < floor:
            self._results = {k: v for k, v in self._results.items() if k[1] >= floor}
        out: list[Outcome] = []
        for c in commitments:
            if not floor <= c.step <= step + 1:
                continue
            self._commitments.setdefault(c.step, {})[(c.epoch, member)] = c
            for f in self._waiting.pop((c.epoch, c.step, member), []):
                out += self._compare(f, c)
        return out

    def _commitment(self, check: Checked) -> Commitment | None:
        return self._commitments.get(check.step, {}).get((check.epoch, check.trainer))

    def checked(self, finding: Finding, arithmetic: str | None) -> list[Outcome]:
        """A member's finding; ``arithmetic``: the trainer's (None: not known)."""
        f, check, n = finding, finding.check, self._name
        if check.skipped:
            out = self._not_compared(f, f"{n(f.checker)} did not check it: {check.skipped}")
            asked = self._asked.get(check.trainer)
            if check.ordered and asked is not None and asked[0] == f.checker:
                del self._asked[check.trainer]
                self._accused.get(check.trainer, {}).pop(asked[1], None)  # unconfirmed: it stands no more
                self._unfounded.setdefault(asked[1], deque(maxlen=UNFOUNDED_LIMIT)).append(f.at)
                why = f"{n(f.checker)}, asked to confirm {n(asked[1])}'s finding, could not check it"
                out.append(self._outcome(Verdict.UNCONFIRMED, f, why))
            return out
        if arithmetic is not None and arithmetic != check.arithmetic:
            why = f"it computes with {arithmetic!r}, {n(f.checker)} with {check.arithmetic!r}: not bit for bit"
            return self._not_compared(f, why)
        c = self._commitment(check)
        if c is None:
            self._waiting.setdefault((check.epoch, check.step, check.trainer), []).append(f)
            return []
        return self._compare(f, c)

    def expire(self, now: float) -> list[Outcome]:
        """Findings whose commitment never came, and orders never answered."""
        out: list[Outcome] = []
        late = [f for fs in self._waiting.values() for f in fs if now - f.at > WAIT_S]
        self._waiting = {
            k: kept for k, fs in self._waiting.items() if (kept := [f for f in fs if now - f.at <= WAIT_S])
        }
        for f in late:
            out += self._not_compared(f, f"no commitment of its slice of step {f.check.step} came", now)
        n = self._name
        for trainer, (asked, accuser, since) in list(self._asked.items()):
            if now - since > ORDER_WAIT_S:
                del self._asked[trainer]
                self._accused.get(trainer, {}).pop(accuser, None)  # unconfirmed: it stands no more
                self._unfounded.setdefault(accuser, deque(maxlen=UNFOUNDED_LIMIT)).append(now)
                reason = f"{n(asked)}, asked to confirm {n(accuser)}'s finding, did not answer in {ORDER_WAIT_S:g} s"
                out.append(Outcome(Verdict.UNCONFIRMED, trainer, -1, reason))
        for trainer, found in list(self._accused.items()):
            for who in [w for w, x in found.items() if now - x.at > WINDOW_S]:
                del found[who]
            if not found:
                del self._accused[trainer]
        self._said = {k: t for k, t in self._said.items() if now - t < SAID_EVERY_S}
        return out

    def _compare(self, f: Finding, c: Commitment) -> list[Outcome]:
        check, trainer, n = f.check, f.check.trainer, self._name
        if c.microbatch != check.microbatch:
            why = f"it computed its slice in micro-batches of {c.microbatch}, {n(f.checker)} in {check.microbatch}"
            return self._not_compared(f, f"{why}: not bit for bit")
        if check.epoch <= self._named.get(trainer, -1):
            return []
        self.compared += 1
        match = c.digest == check.digest
        seen = self._results.setdefault((check.epoch, check.step, trainer), {})
        seen[f.checker] = match
        if len(set(seen.values())) > 1:
            self._accused.get(trainer, {}).pop(f.checker, None)
            for who, ok in seen.items():
                if not ok:
                    self._accused.get(trainer, {}).pop(who, None)
            said = ", ".join(f"{n(who)} {'as committed' if ok else 'differing'}" for who, ok in sorted(seen.items()))
            why = f"members disagree on its slice of step {check.step} ({said}): one of them computes wrongly"
            return [self._outcome(Verdict.DISPUTED, f, why)]
        asked = self._asked.get(trainer)
        if match:
            if not (check.ordered and asked is not None and asked[0] == f.checker):
                return [self._outcome(Verdict.MATCH, f, "")]
            del self._asked[trainer]
            accuser = asked[1]
            self._accused.get(trainer, {}).pop(accuser, None)
            times = self._unfounded.setdefault(accuser, deque(maxlen=UNFOUNDED_LIMIT))
            times.append(f.at)
            why = f"{n(f.checker)} found its slice of step {check.step} as committed: {n(accuser)}'s finding is alone"
            return [self._outcome(Verdict.UNCONFIRMED, f, why, accusers=(accuser,))]
        self.mismatches += 1
        what = f"{n(f.checker)}'s recomputation of its slice of step {check.step} differs from its commitment"
        if self._ignored(f.checker, f.at):  # its findings went unconfirmed: it confirms nothing either
            why = f"{what}; not followed up: {UNFOUNDED_LIMIT} of {n(f.checker)}'s findings went unconfirmed lately"
            return [self._outcome(Verdict.MISMATCH, f, why)]
        found = self._accused.setdefault(trainer, {})
        found.setdefault(f.checker, f)
        accusers = tuple(sorted(found))
        if len(accusers) >= 2:
            del self._accused[trainer]
            self._asked.pop(trainer, None)
            self._named[trainer] = max(x.check.epoch for x in found.values())
            steps = ", ".join(f"{n(who)} at step {found[who].check.step}" for who in accusers)
            why = f"its slices recomputed by two members differ from its commitments ({steps})"
            return [self._outcome(Verdict.CONFIRMED, f, why, accusers=accusers)]
        if asked is not None:
            return [self._outcome(Verdict.MISMATCH, f, f"{what}; {n(asked[0])} was asked to check it again")]
        picked = self._pick(trainer, accusers)
        if picked is None:
            why = f"{what}; no other member computes like it to confirm"
            return [self._outcome(Verdict.MISMATCH, f, why)]
        self._asked[trainer] = (picked, f.checker, f.at)
        return [self._outcome(Verdict.MISMATCH, f, f"{what}; {n(picked)} checks it again", confirmer=picked)]

    def _ignored(self, checker: str, now: float) -> bool:
        times = self._unfounded.get(checker)
        return times is not None and len(times) >= UNFOUNDED_LIMIT and now - times[0] <= UNFOUNDED_PERIOD_S

    def _not_compared(self, f: Finding, why: str, now: float | None = None) -> list[Outcome]:
        now = f.at if now is None else now
        key = (f.checker, f.check.trainer, why.split(":")[0])
        if now - self._said.get(key, -SAID_EVERY_S) < SAID_EVERY_S:
            return []
        self._said[key] = now
        return [self._outcome(Verdict.NOT_COMPARED, f, why)]

    @staticmethod
    def _outcome(
        verdict: Verdict, f: Finding, reason: str, accusers: tuple[str, ...] = (), confirmer: str | None = None
    ) -> Outcome:
        return Outcome(verdict, f.check.trainer, f.check.step, reason, accusers, confirmer)
