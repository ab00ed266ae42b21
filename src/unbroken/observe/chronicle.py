"""What the coordinator records: the job's events, its curves, the anomalies found in them,
and each failure's recovery (from its detection to the first step committed after it).

Recording never decides anything, and a failure to record loses the record, never the
decision (`Coordinator._deliver` sends a decision before its events are recorded). Floods
are counted rather than listed (`Quiet`), and a failure met at every tick is logged once
per interval (`Hush`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unbroken.events import Event, Kind
from unbroken.observe.anomaly import Anomaly, Detector
from unbroken.observe.eventlog import EventLog
from unbroken.observe.history import History
from unbroken.observe.quiet import Hush, Quiet, Say

if TYPE_CHECKING:
    from pathlib import Path

    from unbroken.control.membership import Membership
    from unbroken.control.messages import Progress

log = logging.getLogger(__name__)

MAX_EVENTS = 10_000


class Chronicle:
    """The coordinator's events, history, anomalies and recoveries."""

    def __init__(
        self, event_log: Path | None, membership: Callable[[], Membership], clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``membership``: the coordinator's view now (a new term replaces it), which names
        members and dates events; ``clock``: the coordinator's."""
        self._membership = membership
        self._clock = clock
        self.events = EventLog(event_log, MAX_EVENTS)
        """The job's events (``/api/events?since=`` pages by their ``seq``)."""
        self.history = History()
        self.anomalies = Detector()
        self.recoveries: list[dict[str, Any]] = []
        self._open_failures: list[dict[str, Any]] = []
        self.quiet = Quiet()
        self._hush = Hush()

    def name(self, member_id: str | None) -> str | None:
        if member_id is None:
            return None
        mem = self._membership().members.get(member_id)
        return mem.name if mem else member_id.split("#")[0]

    def record(self, ev: Event, node: str | None = None) -> None:
        """Emit ``ev`` (``node``: the name of a member gone from the membership) and act on it."""
        rec = self.events.emit(ev, self.name(ev.member) or node)
        log.info("event %s: %s", ev.kind, ev.reason)
        if ev.kind is Kind.FAILURE:
            self._open_failures.append({"cause": ev.reason, "detected_at": rec.time, "epoch": ev.epoch})
            if rec.node is not None:
                self._anomalies(self.anomalies.failure(rec.node, ev.time, ev.reason))

    def now(self, kind: Kind, member: str | None, reason: str) -> None:
        """Record an event of the epoch and step in force, now."""
        ms = self._membership()
        self.record(Event(self._clock(), kind, member, ms.epoch, ms.step, reason))

    def refusal(self, source: str, reason: str, kind: Kind = Kind.REFUSED) -> None:
        """Record a refused or dropped session, a few per source and window: a flood of
        them must not push the job's own events out of the history or fill the disk."""
        now = self._clock()
        say = self.quiet.allow(source, now)
        if say is Say.NO:
            self.events.count(kind)
            return
        if say is Say.LAST:
            reason += f" (more from {source} are counted in /metrics, not listed, for {self.quiet.window_s:g} s)"
        ms = self._membership()
        self.record(Event(now, kind, None, ms.epoch, ms.step, reason))

    def complain(self, what: str) -> None:
        """Log the exception being handled, once per ``what`` and `Hush` interval (a failure
        met at every tick once wrote tracebacks by the hundred megabytes)."""
        counted = self._hush.allow(what, self._clock())
        if counted is not None:
            log.exception("%s%s", what, f" ({counted} more times since it was last logged)" if counted else "")

    def progress(self, mid: str, msg: Progress) -> None:
        """Curves, anomalies and recoveries from a progress report."""
        if msg.first_in_epoch:
            self._close_recoveries(msg.epoch, msg.step, msg.wall_time)
        ms = self._membership()
        mem = ms.members.get(mid)
        rank = ms.rank_of(mid)
        if mem is not None and msg.compute_s > 0 and rank is not None:
            share = ms.shares[rank] if len(ms.shares) == len(ms.epoch_members) else 0
            self.history.add_node(mem.name, msg.wall_time, share / msg.compute_s)
        members = len(ms.epoch_members)
        for p in msg.recent:
            loss = p.loss if p.finite else float("nan")
            if self.history.add(p.step, p.wall_time, loss, p.samples_per_s, members, msg.epoch):
                self._anomalies(
                    self.anomalies.loss(p.step, loss) + self.anomalies.throughput(p.step, p.samples_per_s, members)
                )

    def _anomalies(self, found: list[Anomaly]) -> None:
        if not found:  # the common case: each failure asks, and a name index costs every member
            return
        ms = self._membership()
        by_name = {mem.name: mid for mid, mem in ms.members.items()}
        for a in found:
            step = ms.step if a.step is None else a.step
            ev = Event(self._clock(), a.kind, by_name.get(a.member or ""), ms.epoch, step, a.reason)
            self.record(ev, node=a.member)

    def _close_recoveries(self, epoch: int, step: int, wall_time: float) -> None:
        still_open = []
        for f in self._open_failures:
            if epoch > f["epoch"] and wall_time >= f["detected_at"]:
                self.recoveries.append(
                    f | {"first_commit_at": wall_time, "step": step, "duration_s": wall_time - f["detected_at"]}
                )
            else:
                still_open.append(f)
        self._open_failures = still_open
