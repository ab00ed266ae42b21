"""Reports that a collective failed (or named a culprit) which nothing else bears out.

A member's report re-forms the epoch at once: a real failure must cost no more than the
step in flight, and there is no time to ask around. But a real failure leaves other
traces within a lease or two: another member of the epoch reports it too (every member of
a collective sees it break, and every member judges the same gathered data), or a member
of that epoch fails or leaves, or the leader reaches a verdict about it. A member whose
reports nothing bears out is re-forming the epoch on its word alone (a broken node, or a
hostile one holding the token). So while one of its reports waits to be borne out, its
next ones are held (they re-form nothing until something bears them out), and after
`LIMIT` reports within `PERIOD_S` that nothing bore out the leader keeps it out of the
epochs (`unbroken.control.membership.Membership.fault`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

LIMIT = 2
PERIOD_S = 60.0
EPOCHS_KEPT = 4
"""Epochs whose reporters are remembered (a report may arrive after the next epoch formed)."""


@dataclass
class Report:
    member_id: str
    epoch: int
    at: float
    held: bool
    """Held back: it re-forms the epoch only once something bears it out."""
    reason: str


class Hearsay:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        """How long a report waits to be borne out."""
        self._open: list[Report] = []
        self._said: dict[int, set[str]] = {}
        """Epoch → the members that reported it."""
        self._traces: dict[int, tuple[float, str]] = {}
        """Epoch → when, and by whom, it last left a trace (a member of it failed or left)."""
        self._lone: dict[str, deque[float]] = {}

    def reported(self, member_id: str, epoch: int, now: float, reason: str = "") -> tuple[bool, list[Report]]:
        """``member_id``, a member of ``epoch``, says a collective of it failed. Returns
        whether the report may act (False: held), and the held reports it bears out."""
        said = self._said.setdefault(epoch, set())
        others = said - {member_id}
        said.add(member_id)
        for old in sorted(self._said)[:-EPOCHS_KEPT]:
            del self._said[old]
        if others:
            return True, self._close(lambda r: r.epoch == epoch)
        trace = self._traces.get(epoch)
        if trace is not None and now - trace[0] <= self.window_s and trace[1] != member_id:
            return True, []
        held = any(r.member_id == member_id and now - r.at <= self.window_s for r in self._open)
        if not any(r.member_id == member_id and r.epoch == epoch for r in self._open):
            self._open.append(Report(member_id, epoch, now, held, reason))
        return not held, []

    def borne_out(self, epochs: set[int], now: float, by: str) -> list[Report]:
        """A member of ``epochs`` (``by``) failed or left, or was found at fault: their
        reports are borne out, except ``by``'s own. Returns the held ones."""
        for epoch in epochs:
            self._traces[epoch] = (now, by)
        for old in sorted(self._traces)[:-EPOCHS_KEPT]:
            del self._traces[old]
        return self._close(lambda r: r.epoch in epochs and r.member_id != by and now - r.at <= self.window_s)

    def _close(self, match: object) -> list[Report]:
        closed = [r for r in self._open if match(r)]  # type: ignore[operator]
        self._open = [r for r in self._open if r not in closed]
        return [r for r in closed if r.held]

    def due(self, now: float) -> list[str]:
        """Members whose reports nothing bore out `LIMIT` times within `PERIOD_S` (counted again from zero)."""
        lapsed = [r for r in self._open if now - r.at > self.window_s]
        self._open = [r for r in self._open if r not in lapsed]
        out = []
        for r in lapsed:
            times = self._lone.setdefault(r.member_id, deque(maxlen=LIMIT))
            times.append(r.at)
            if len(times) >= LIMIT and times[-1] - times[-LIMIT] <= PERIOD_S:
                del self._lone[r.member_id]
                out.append(r.member_id)
        for mid in [mid for mid, times in self._lone.items() if now - times[-1] > PERIOD_S]:
            del self._lone[mid]
        return out
