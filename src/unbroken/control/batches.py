"""What a relay sends up to the leader: its members' liveness and words, batched.

The relay's I/O (`unbroken.control.relay`) feeds this and sends what it returns; the
batching itself holds no socket and no clock of its own, so the control-plane simulator
(`unbroken.testing.simulate`) drives the same code::

    heard ──▶ alive (the newest step), unacked seq          ┐
          ──▶ routine progress: the newest kept, sent up     ├──▶ take(now) ──▶ Up, Up, ...
              every `REPORT_EVERY_S` (or as the leader says) │      (a tenth of a lease, or
          ──▶ anything else: said, in order (urgent)         │       at once when urgent)
    ended ──▶ gone                                           ┘
    acked(seq) ──▶ the members' seqs that batch carried: their heartbeats are acknowledged

Each batch sums its members' liveness up (DESIGN.md §2, "the leader sees zones"): every
member whose session the relay holds was heard within ``heard_within`` seconds (the oldest
such age, at most ``HEARD_WITHIN`` leases), except those it lists with how long ago each was
heard, and only the members whose step changed are named with it. The leader renews a
member's lease from its relay's newest summary when that lease comes due (`roster.Leases`),
so a batch costs it the changes it carries, not one entry per member; a member named unheard
is counted heard exactly when the relay last heard it, so its lease lapses no earlier than a
directly connected member's would.
"""

from __future__ import annotations

from collections.abc import Collection

from unbroken.control import messages as m

REPORT_EVERY_S = 1.0
"""Members' routine progress reports go up this often (the newest of each); a report that
opens an epoch or carries the loss curve goes up with the next batch."""
HEARD_WITHIN = 0.35
"""A batch vouches for the members heard within this many leases (members heartbeat every
fifth of a lease); older ones it names with their ages."""
BATCH_BYTES = 256 << 10
"""A batch is sent early once what it carries reaches this size (the leader caps messages)."""


def chunks(said: list[tuple[m.Said, int]], limit: int) -> list[list[m.Said]]:
    """What members said, in order, in parts of at most ``limit`` bytes (or one message)."""
    out: list[list[m.Said]] = [[]]
    size = 0
    for one, n in said:
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(one)
        size += n
    return out


class Batches:
    """One relay's batches to the leader, between two links' worth of state (`clear`)."""

    def __init__(self) -> None:
        self.seq = 0
        self.unacked: dict[str, int] = {}
        """Per member, the newest heartbeat or report seq heard and not yet sent up."""
        self._alive: dict[str, int] = {}
        self._said: list[tuple[m.Said, int]] = []
        """What members said since the last batch, each with its size on the wire."""
        self._said_bytes = 0
        self._latest: dict[str, tuple[m.Progress, int]] = {}
        """Each member's newest routine progress report, sent up every `REPORT_EVERY_S`."""
        self._reported_at = 0.0
        self.report_s = REPORT_EVERY_S
        self._routine_at = 0.0
        """How often routine reports go up: what the leader's last acknowledgement said."""
        self._gone: list[m.Gone] = []
        self._sent: dict[int, dict[str, int]] = {}
        """Per batch sent up and not yet acknowledged: the members' seqs it carried."""
        self._heard_at: dict[str, float] = {}
        """Per member, when it was last heard (or first seen held, before it spoke)."""
        self._said_steps: dict[str, int] = {}
        """Per member, the step the leader was last told (a batch names only changes)."""

    def heard(self, member_id: str, msg: m.NodeMessage, size: int, now: float) -> bool:
        """A member's message (``size`` bytes on the wire), heard at ``now``; True: send a
        batch now."""
        if isinstance(msg, (m.Heartbeat, m.Progress)):
            self._alive[member_id] = msg.step
            self._heard_at[member_id] = now
            if msg.seq:
                self.unacked[member_id] = msg.seq
        if isinstance(msg, m.Progress):
            msg = msg.model_copy(update={"seq": 0})  # its liveness goes up in the batch's list
            if msg.first_in_epoch or msg.recent:
                return self.tell(member_id, msg, size, urgent=False)  # recoveries, curves
            # The latest stands for those before, carrying their commitments too.
            self._latest[member_id] = self._coalesced(member_id, msg, size)
            return False
        if isinstance(msg, m.Heartbeat):
            return False
        return self.tell(member_id, msg, size, urgent=True)

    def last_heard(self, member_id: str) -> float | None:
        """When the member's liveness was last heard here (None: not since its session began)."""
        return self._heard_at.get(member_id)

    def tell(self, member_id: str, msg: m.NodeMessage, size: int, urgent: bool) -> bool:
        """Carry ``msg`` in the next batch; True: send a batch now."""
        self._said.append((m.Said(member=member_id, msg=msg), size))
        self._said_bytes += size
        return urgent or self._said_bytes >= BATCH_BYTES

    def ended(self, member_id: str, reason: str) -> None:
        """A member's session with the relay ended: the leader hears it with the next batch."""
        self.unacked.pop(member_id, None)
        self._latest.pop(member_id, None)  # kept up to the leader's period: not for a next session
        self._heard_at.pop(member_id, None)
        self._said_steps.pop(member_id, None)
        self._gone.append(m.Gone(member=member_id, reason=reason))

    def take(self, now: float, members: Collection[str], lease_s: float) -> list[m.Up]:
        """The batches to send now (``members``: whose sessions the relay holds; ``lease_s``:
        the leader's lease)."""
        if now - self._reported_at >= REPORT_EVERY_S:
            self._reported_at = now
            # A report that carries commitments goes up within `REPORT_EVERY_S` whatever the
            # leader's period: they are checked against, and a node keeps only the latest.
            everyone = now - self._routine_at >= self.report_s
            if everyone:
                self._routine_at = now
            kept: dict[str, tuple[m.Progress, int]] = {}
            for mid, (progress, size) in self._latest.items():
                if not everyone and not progress.commitments:
                    kept[mid] = progress, size
                elif mid in members:
                    self.tell(mid, progress, size, urgent=False)
            self._latest = kept
        self.seq += 1
        self._sent[self.seq] = {mid: self.unacked.get(mid, 0) for mid in self._alive if mid in members}
        self.unacked.clear()
        changed: dict[str, int] = {}
        for mid, step in self._alive.items():
            if mid in members and self._said_steps.get(mid) != step:
                changed[mid] = self._said_steps[mid] = step
        within = HEARD_WITHIN * lease_s
        oldest = 0.0
        unheard: list[str] = []
        ages: list[float] = []
        for mid in members:
            # A session held but silent so far was opened by a hello: heard then, or just before.
            age = now - self._heard_at.setdefault(mid, now)
            if age > within:
                unheard.append(mid)
                ages.append(age)
            elif age > oldest:
                oldest = age
        parts = chunks(self._said, BATCH_BYTES)
        ups = [m.Up(seq=self.seq, alive=list(changed), steps=list(changed.values()), heard_within=oldest,
                    unheard=unheard, unheard_s=ages, said=parts[0], gone=self._gone)]  # fmt: skip
        self._alive, self._said, self._gone, self._said_bytes = {}, [], [], 0
        for said in parts[1:]:  # a burst (hellos after a failover) goes as several batches
            self.seq += 1
            ups.append(m.Up(seq=self.seq, said=said))
        return ups

    def acked(self, seq: int, report_s: float = 0.0) -> list[tuple[str, int]]:
        """The leader acknowledged batches up to ``seq``: each member's seq they carried.
        ``report_s``: how often the leader wants routine reports (0: `REPORT_EVERY_S`)."""
        self.report_s = report_s if report_s > 0 else REPORT_EVERY_S
        out: list[tuple[str, int]] = []
        for done in [s for s in self._sent if s <= seq]:
            out.extend((mid, node_seq) for mid, node_seq in self._sent.pop(done).items() if node_seq)
        return out

    def clear(self) -> None:
        """The link to the leader ended: nothing said on it is sent on another."""
        self.unacked.clear()
        self._alive.clear()
        self._said.clear()
        self._gone.clear()
        self._latest.clear()
        self._sent.clear()
        self._heard_at.clear()
        self._said_steps.clear()
        self._said_bytes = 0

    def _coalesced(self, mid: str, msg: m.Progress, size: int) -> tuple[m.Progress, int]:
        """``msg`` in place of the member's report not sent up yet: the latest figures, with
        the commitments of both (`m.Commitment`: each is checked against, none may be lost)."""
        before = self._latest.get(mid)
        if before is None or not before[0].commitments:
            return msg, size
        kept = [*before[0].commitments, *msg.commitments][-m.COMMITMENTS_MAX :]
        return msg.model_copy(update={"commitments": kept}), size + before[1]
