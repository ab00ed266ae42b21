"""The job's end, as the membership decides it: finished once most of the epoch's members
said ``done`` with the same state, or halted with an error no repair can end.

One member's word ends nothing. A member that said done and left (its session closes
after it) is no failure once most of the epoch reached the last step too; a lease without
that, and the epoch forms again without it (`Finish.check`).
"""

from __future__ import annotations

from collections.abc import Callable

from unbroken.control.roster import Decision, Roster, majority
from unbroken.events import Kind


class Finish:
    """The members' final states and who of them left, and the job's end."""

    def __init__(self, roster: Roster, found: Callable[[], tuple[int, set[str]] | None]) -> None:
        """``found``: the epoch a recovering leader's members came back from, and its members
        (`recovery.Recovery.found`): whose done counts before any epoch formed here."""
        self._roster = roster
        self._found = found
        self.final_digests: dict[str, str] = {}
        """Members that reported the job's last step, with their state's digest."""
        self._final_metrics: dict[str, dict[str, float]] = {}
        self.final_metrics: dict[str, float] = {}
        self.final_digest: str | None = None
        """The state most of the last epoch's trainers finished with."""
        self.last_epoch: list[str] = []
        """The members of the epoch in which most members reached the job's last step."""
        self.gone: dict[str, tuple[float, str]] = {}
        """Members of the epoch that said done and left before the job finished: when, and
        their names. Theirs is no failure once most of the epoch reached the last step too;
        a lease without that, and it is one (a session saying done with a made-up digest,
        taken into an epoch it never builds, had held the group for good)."""

    def said_done(self, member_id: str) -> bool:
        return member_id in self.final_digests

    def left(self, member_id: str, name: str, now: float) -> bool:
        """A member left (its session closed, or it failed): whether it had said done. Then
        its leaving is no failure yet; of the epoch in force, it is held to `check`."""
        if member_id not in self.final_digests:
            return False
        if self._roster.rank_of(member_id) is not None:
            self.gone[member_id] = (now, name)
        return True

    def check(self, now: float) -> Decision:
        """Members that said done and left (`gone`): borne out once most of the epoch's
        members still here report the last step; a lease without that, and the epoch forms
        again without them."""
        r = self._roster
        d = Decision()
        if r.finished:
            self.gone.clear()
            return d
        # Its own word counts (an honest pair's other member may be evaluating before its
        # done), but one member here at least must have reached the last step too.
        here = sum(1 for mid in r.epoch_members if (x := r.members.get(mid)) is not None and x.step >= r.num_steps)
        gone = sum(1 for mid in self.gone if r.rank_of(mid) is not None)
        if r.num_steps and here >= 1 and here + gone >= majority(len(r.epoch_members)):
            return d
        for mid, (since, name) in list(self.gone.items()):
            if now - since < r.lease_s:
                continue
            del self.gone[mid]
            if r.rank_of(mid) is None:
                continue
            why = f"{name} said done at the last step and left, and most of the epoch never reached it"
            d.events.append(r.event(now, Kind.FAILURE, mid, why))
            r.want_epoch(now, urgent=True, reason=why, delay=0.0)
        return d

    def done(self, member_id: str, step: int, digest: str, metrics: dict[str, float], now: float) -> Decision:
        """A member that reached the job's last step (``step`` checked by the caller) said so
        with its state's ``digest``. The job is finished once most of the voters agree."""
        r = self._roster
        d = Decision()
        self.final_digests[member_id] = digest
        self._final_metrics[member_id] = metrics
        if r.finished:
            if digest == self.final_digest:
                self.final_metrics.update(metrics)
            return d
        # Only the epoch's members vote (each applied every step: whatever its role, it holds
        # the state), each once, whether or not its session is still open (a finisher's
        # closes): sessions outside the epoch, however many one token holder opens, cannot make
        # a majority, and neither can one member the plan made the only trainer.
        voters = self.voters()
        agree = [mid for mid in voters if self.final_digests.get(mid) == digest]
        if len(agree) < majority(len(voters)):
            return d
        r.finished = True
        self.final_digest = digest
        for mid in agree:
            self.final_metrics.update(self._final_metrics[mid])
        d.events.append(
            r.event(now, Kind.FINISHED, member_id, f"final step {step} reached ({len(agree)} agree on the state)")
        )
        return d

    def voters(self) -> list[str]:
        """Whose done counts: the members of the epoch in which most members reached the
        job's last step (an epoch formed after, a member having died at the end, holds only
        some of them), else of the epoch in force, else, for a leader recovering, of the epoch
        its members came back from."""
        if self.last_epoch:
            return self.last_epoch
        if self._roster.epoch_members:
            return self._roster.epoch_members
        found = self._found()
        return sorted(found[1]) if found is not None else []

    def halt(self, now: float, reason: str, step: int = -1) -> Decision:
        """Stop the job on a failure training cannot go past: no epoch forms after it, every
        member is told to stop with ``reason``, and a node that comes later is refused with it
        (a loop that retries or rolls back forever would look like training and never end).
        ``step``: the step that could not be taken (the group committed every one before it)."""
        r = self._roster
        d = Decision()
        if r.finished:
            return d
        r.step = max(r.step, step)
        r.finished = True
        r.halted = reason
        r.pending_due = None
        d.halt = reason
        d.events.append(r.event(now, Kind.HALTED, None, f"job stopped at step {r.step}: {reason}"))
        return d
