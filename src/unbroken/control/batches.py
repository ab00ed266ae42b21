"""What a relay sends up to the leader: its members' liveness and words, batched.

The relay's I/O (`unbroken.control.relay`) feeds this and sends what it returns; the
batching itself holds no socket and no clock of its own, so the control-plane simulator
(`unbroken.testing.simulate`) drives the same code::

    heard ──▶ alive (the newest step), unacked seq          ┐
          ──▶ routine progress: the newest kept, sent up     ├──▶ take(now) ──▶ Up, Up, ...
              every `REPORT_EVERY_S`                         │      (a tenth of a lease, or
          ──▶ anything else: said, in order (urgent)         │       at once when urgent)
    ended ──▶ gone                                           ┘
    acked(seq) ──▶ the members' seqs that batch carried: their heartbeats are acknowledged

Each batch sums its members' liveness up (DESIGN.md §2, "the leader sees zones"): every
member whose session the relay holds was heard within ``HEARD_WITHIN`` leases, except those
it lists, and only the members whose step changed are named with it. The leader renews a
member's lease from its relay's newest summary when that lease comes due (`roster.Leases`),
so a batch costs it the changes it carries, not one entry per member.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from unbroken.control import messages as m

REPORT_EVERY_S = 1.0
"""Members' routine progress reports go up this often (the newest of each); a report that
opens an epoch or carries the loss curve goes up with the next batch."""
HEARD_WITHIN = 0.35
"""A batch vouches for the members heard within this many leases (members heartbeat every
fifth of a lease): the leader counts them heard that long before the batch, so a frozen
member's lease lapses about one lease after it was last heard, as a direct member's does."""
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
        self._gone: list[m.Gone] = []
        self._sent: dict[int, dict[str, int]] = {}
        """Per batch sent up and not yet acknowledged: the members' seqs it carried."""
        self._heard_at: dict[str, float] = {}
        """Per member, a time at or before it was last heard (the batch before it was)."""
        self._said_steps: dict[str, int] = {}
        """Per member, the step the leader was last told (a batch names only changes)."""
        self._taken_at = -math.inf

    def heard(self, member_id: str, msg: m.NodeMessage, size: int) -> bool:
        """A member's message (``size`` bytes on the wire); True: send a batch now."""
        if isinstance(msg, (m.Heartbeat, m.Progress)):
            self._alive[member_id] = msg.step
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

    def tell(self, member_id: str, msg: m.NodeMessage, size: int, urgent: bool) -> bool:
        """Carry ``msg`` in the next batch; True: send a batch now."""
        self._said.append((m.Said(member=member_id, msg=msg), size))
        self._said_bytes += size
        return urgent or self._said_bytes >= BATCH_BYTES

    def ended(self, member_id: str, reason: str) -> None:
        """A member's session with the relay ended: the leader hears it with the next batch."""
        self.unacked.pop(member_id, None)
        self._heard_at.pop(member_id, None)
        self._said_steps.pop(member_id, None)
        self._gone.append(m.Gone(member=member_id, reason=reason))

    def take(self, now: float, members: Collection[str], lease_s: float) -> list[m.Up]:
        """The batches to send now (``members``: whose sessions the relay holds; ``lease_s``:
        the leader's lease)."""
        if now - self._reported_at >= REPORT_EVERY_S:
            self._reported_at = now
            for mid, (progress, size) in self._latest.items():
                if mid in members:
                    self.tell(mid, progress, size, urgent=False)
            self._latest.clear()
        self.seq += 1
        self._sent[self.seq] = {mid: self.unacked.get(mid, 0) for mid in self._alive if mid in members}
        self.unacked.clear()
        changed: dict[str, int] = {}
        for mid, step in self._alive.items():
            if mid in members:
                self._heard_at[mid] = self._taken_at  # heard since the last batch, at least
                if self._said_steps.get(mid) != step:
                    changed[mid] = self._said_steps[mid] = step
        self._taken_at = now
        within = HEARD_WITHIN * lease_s
        unheard = [mid for mid in members if now - self._heard_at.get(mid, -math.inf) > within]
        parts = chunks(self._said, BATCH_BYTES)
        ups = [m.Up(seq=self.seq, alive=list(changed), steps=list(changed.values()), heard_within=within,
                    unheard=unheard, said=parts[0], gone=self._gone)]  # fmt: skip
        self._alive, self._said, self._gone, self._said_bytes = {}, [], [], 0
        for said in parts[1:]:  # a burst (hellos after a failover) goes as several batches
            self.seq += 1
            ups.append(m.Up(seq=self.seq, said=said))
        return ups

    def acked(self, seq: int) -> list[tuple[str, int]]:
        """The leader acknowledged batches up to ``seq``: each member's seq they carried."""
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
        self._taken_at = -math.inf
        self._said_bytes = 0

    def _coalesced(self, mid: str, msg: m.Progress, size: int) -> tuple[m.Progress, int]:
        """``msg`` in place of the member's report not sent up yet: the latest figures, with
        the commitments of both (`m.Commitment`: each is checked against, none may be lost)."""
        before = self._latest.get(mid)
        if before is None or not before[0].commitments:
            return msg, size
        kept = [*before[0].commitments, *msg.commitments][-m.COMMITMENTS_MAX :]
        return msg.model_copy(update={"commitments": kept}), size + before[1]
