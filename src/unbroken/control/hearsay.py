"""Collective failures that one member reports and nothing else bears out.

A member's report that a collective failed re-forms the epoch at once: a real failure
must cost no more than the step in flight, and there is no time to ask around. But a
real failure leaves other traces within a lease or two: a peer's session drops or its
lease runs out, a peer leaves, or another member reports the same epoch failing (every
member of a collective sees it break). A member whose reports nothing else bears out is
re-forming the epoch on its word alone (a broken node, or a hostile one holding the
token). So while one of its reports waits to be borne out, its next ones are held (they
re-form nothing), and after `LIMIT` reports within `PERIOD_S` that nothing bore out the
leader keeps it out of the epochs (`unbroken.control.membership.Membership.fault`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

LIMIT = 2
PERIOD_S = 60.0


@dataclass
class _Report:
    member_id: str
    epoch: int
    at: float


class Hearsay:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        """How long a report waits for something else to bear it out."""
        self._open: list[_Report] = []
        self._borne_at = -float("inf")
        """When something last bore out failures (a member failed or left)."""
        self._lone: dict[str, deque[float]] = {}

    def reported(self, member_id: str, epoch: int, now: float) -> bool:
        """``member_id`` says a collective of ``epoch`` failed. False: hold it (re-form
        nothing on it), since an earlier report of this member waits to be borne out."""
        others = [r for r in self._open if r.epoch == epoch and r.member_id != member_id]
        if others or now - self._borne_at <= self.window_s:
            self._open = [r for r in self._open if r not in others]
            return True
        mine = [r for r in self._open if r.member_id == member_id]
        if not any(r.epoch == epoch for r in mine):
            self._open.append(_Report(member_id, epoch, now))
        return not any(now - r.at <= self.window_s for r in mine)

    def borne_out(self, now: float, by: str | None = None) -> None:
        """Something bears out recent reports (a failure or a leave: ``by`` None), or a
        member ``by`` reported evidence of its own (its word does not bear out its reports)."""
        recent = [r for r in self._open if now - r.at <= self.window_s and r.member_id != by]
        self._open = [r for r in self._open if r not in recent]
        if by is None:
            self._borne_at = now

    def due(self, now: float) -> list[str]:
        """Members whose reports nothing bore out `LIMIT` times within `PERIOD_S` (counted again from zero)."""
        lapsed = [r for r in self._open if now - r.at > self.window_s]
        self._open = [r for r in self._open if r not in lapsed]
        out = []
        for r in lapsed:
            times = self._lone.setdefault(r.member_id, deque())
            times.append(r.at)
            while times and now - times[0] > PERIOD_S:
                times.popleft()
            if len(times) >= LIMIT:
                del self._lone[r.member_id]
                out.append(r.member_id)
        return out
