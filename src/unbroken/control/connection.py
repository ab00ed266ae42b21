"""The state of a node's control session, as an explicit state machine (kazoo's
connected / suspended / lost), fed by the session thread and read by the commit fence::

                   welcome                    session dropped, lease fresh
      LOST ─────────────────▶ CONNECTED ──────────────────────────────▶ SUSPENDED
       ▲ ▲                    ▲    │                                  │   │
       │ │                    │    │ session dropped, lease stale     │   │
       │ │                    │    │ (a lapse)                        │   │
       │ └────────────────────┼────┘                                  │   │
       │                      └──────────────── welcome ──────────────┘   │
       └────────────── trust in the outage lapsed (a lapse) ───────────────┘

CONNECTED: a session is up; the node may commit while a heartbeat it sent less than a
lease ago was acknowledged. SUSPENDED: the session dropped while the lease was fresh, so
the node takes it for a coordinator outage and keeps training, trusting it one
`messages.OUTAGE_TRUST_LEASES` at a time as evidence comes in (`vouched`). LOST: no
session and no trust (before the first welcome, after an expelled node's session ended,
or after a lapse); nothing commits until a coordinator answers.

The machine also keeps the lease's books: each heartbeat or report that keeps the lease is
numbered as it goes out (`sending`), and its acknowledgement (`acked`) moves the lease's
start to when it was sent, and gives a round-trip time.

A *lapse* is a move to LOST with the lease stale: the coordinator may have formed an epoch
without this node meanwhile, which no later welcome disproves (`StepProtocol.fence` counts
them). Every transition is told once to the listener, outside the machine's lock, on the
thread that caused it; the clock is injected, so the machine is tested without sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from unbroken.control import messages as m

log = logging.getLogger(__name__)

Clock = Callable[[], float]

RTT_SAMPLES = 10
"""Round trips measured before this node reports its RTT (zones by RTT group on it)."""


class State(Enum):
    """Where a node's control session stands (the module docstring draws the transitions)."""

    CONNECTED = "connected"
    SUSPENDED = "suspended"
    LOST = "lost"


@dataclass(frozen=True)
class Change:
    """One transition of the session's state, as told to its listener."""

    old: State
    new: State
    lapse: bool = False
    """The move to LOST happened with the lease stale (see the module docstring)."""
    welcome: m.Welcome | None = None
    """On a move to CONNECTED: the welcome that made it."""
    new_coordinator: bool = False
    """On a move to CONNECTED: the welcome came from another coordinator incarnation than
    the last one (its rendezvous entries and its view of the epoch are not the last one's)."""


class Connection:
    """The session's state machine. Thread-safe: the session thread drives it, the step
    loop asks `commit_allowed` (which may itself end a lapsed outage)."""

    def __init__(self, notify: Callable[[Change], None], clock: Clock = time.monotonic) -> None:
        self._notify = notify
        self._clock = clock
        self._lock = threading.Lock()
        self._state = State.LOST
        self.welcome: m.Welcome | None = None
        """The last welcome (kept across sessions: it says which coordinator was last)."""
        self.lease_s = 1.0
        """The lease the last welcome gave."""
        self.lapses = 0
        """Lapses so far (moves to LOST with the lease stale)."""
        self.last_acked_send = 0.0
        """When the latest heartbeat or report that a coordinator acknowledged was sent (its
        lease runs from there: the coordinator counts from when it received it, later)."""
        self._trusted_until = 0.0
        self._seq = 0
        self._sent: dict[int, float] = {}
        self.counted_at = 0.0
        """When a message that keeps the lease (heartbeat or progress report) last went out."""
        self._rtts: deque[float] = deque(maxlen=20)
        self.rtt_s = 0.0
        """Round-trip time of heartbeats to the coordinator (the least of the last 20)."""

    @property
    def state(self) -> State:
        return self._state

    @property
    def trust_s(self) -> float:
        """How long one piece of evidence vouches for an outage."""
        return self.lease_s * m.OUTAGE_TRUST_LEASES

    def unacked_s(self) -> float:
        """Seconds since the latest acknowledged send went out."""
        return self._clock() - self.last_acked_send

    def welcomed(self, welcome: m.Welcome, hello_sent: float) -> None:
        """A coordinator welcomed this node; the lease runs from its hello, not the answer."""
        with self._lock:
            old = self._state
            new_coordinator = self.welcome is None or self.welcome.coordinator_id != welcome.coordinator_id
            self.welcome = welcome
            self.lease_s = welcome.lease_s
            self.last_acked_send = hello_sent
            self._state = State.CONNECTED
        self._notify(Change(old, State.CONNECTED, welcome=welcome, new_coordinator=new_coordinator))

    def sending(self) -> int:
        """Number a message that keeps the lease, going out now (its acknowledgement will
        say when it was sent)."""
        with self._lock:
            self._seq += 1
            self.counted_at = self._clock()
            self._sent[self._seq] = self.counted_at
            for old in [s for s in self._sent if s < self._seq - 64]:
                del self._sent[old]
            return self._seq

    def acked(self, seq: int) -> None:
        """The message numbered ``seq`` was acknowledged: the lease runs from when it was sent."""
        with self._lock:
            sent = self._sent.get(seq)
            if sent is None:
                return
            self.last_acked_send = max(self.last_acked_send, sent)
            self._rtts.append(self._clock() - sent)
            # The least of recent round trips is the path's latency; a busy node's scheduling
            # delays only add to it (zones by RTT must not follow load). Until there are
            # enough of them it says nothing: a node busy starting up answers its first
            # acknowledgements late, and would be put in a zone of its own on the same site.
            self.rtt_s = min(self._rtts) if len(self._rtts) >= RTT_SAMPLES else 0.0

    def dropped(self, *, expelled: bool) -> State:
        """The session ended: SUSPENDED if the lease is fresh (an outage, trusted until the
        lease runs out unless evidence comes), else LOST, a lapse unless ``expelled`` with a
        fresh lease (the coordinator said why: there is nothing to trust). The new state."""
        with self._lock:
            old = self._state
            fresh = self._clock() - self.last_acked_send < self.lease_s
            new = State.SUSPENDED if fresh and not expelled else State.LOST
            self._trusted_until = self.last_acked_send + self.trust_s
            lapse = not fresh and old is not State.LOST
            self.lapses += lapse
            self._state = new
        if new is not old:
            self._notify(Change(old, new, lapse=lapse))
        return new

    def vouched(self, asked: float) -> bool:
        """Evidence asked for at ``asked`` came back: the outage is trusted a while from then
        (if it still is: a lapse is not renewed). Whether the outage is still trusted."""
        if not self.trusted():
            return False
        with self._lock:
            if self._state is State.SUSPENDED:
                self._trusted_until = max(self._trusted_until, asked + self.trust_s)
            return self._state is State.SUSPENDED

    def trusted(self) -> bool:
        """Whether the node is SUSPENDED with its trust unspent; a trust that ran out is a
        lapse, and the node LOST."""
        with self._lock:
            if self._state is not State.SUSPENDED:
                return False
            if self._clock() < self._trusted_until:
                return True
            self._state = State.LOST
            self.lapses += 1
        log.warning("outage: no recent evidence that no coordinator leads without this node")
        self._notify(Change(State.SUSPENDED, State.LOST, lapse=True))
        return False

    def commit_allowed(self) -> bool:
        """Whether this node can be sure it is still a member as far as its session knows
        (the commit fence; expulsion is the client's to add)."""
        if self._state is State.CONNECTED:
            return self.unacked_s() < self.lease_s
        return self.trusted()

    def forget_lease(self) -> None:
        """A new member (after an expulsion): nothing it sent before was acknowledged."""
        with self._lock:
            self.last_acked_send = 0.0
