"""The control plane simulated: the real coordinator and relay batching on a virtual clock.

Thousands of nodes in zones behind relays, in one process and without sockets, through
storms of failures and joins::

    sim = Simulation(SimConfig(nodes=10_000, zone_size=100))
    sim.admit()                                   # every node welcomed, one epoch everywhere
    report = sim.storms(events=20, every_s=3.0, storm=10)
    print(report.epoch_change_s, report.false_expulsions)

What is real and what is modelled:

* the coordinator is `unbroken.control.coordinator.Coordinator` itself, not served: a
  relay's batch is parsed with the real parser and handed to ``relay_up`` as its websocket
  handler does, and its clock is the virtual one (its tick is ``_tick``; what it schedules
  with ``call_soon`` runs on its `Process`). Everything it decides and encodes is its own:
  membership, leases, the planner, the orders' compaction (`orders.compact`), `send_all`.
  What it does not run is aiohttp: websocket framing and the event loop's own cost;
* each relay is the real batching (`unbroken.control.batches`), fed the way the relay's
  websocket handlers feed it: node messages are parsed with the real parser, batches and
  fanned-out orders encoded with the real encoder, so every size on the wire is real;
* nodes are modelled as `unbroken.testing.fakes` nodes are: a progress report per step
  (naming the newest epoch it heard of, as a training node's does), heartbeats when idle
  for a heartbeat period (the welcome's), a rejoin as a new member after an expulsion.
  Their CPU is not counted: they are other machines;
* the network is modelled (`unbroken.testing.virtual`): latency, bandwidth and loss per
  link, TCP-like retransmission; a crash closes the node's session (its relay sees it one
  latency later), a freeze stops what it sends and receives until it thaws;
* each coordinator and relay is a single-threaded server whose handlers take the CPU time
  they took here: a saturated coordinator queues, as a real one does.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel

from unbroken.config import CoordinatorConfig, MembershipConfig
from unbroken.control import auth, identity
from unbroken.control import messages as m
from unbroken.control.batches import Batches
from unbroken.control.coordinator import TICK_S, Coordinator
from unbroken.control.sessions import RelayLink
from unbroken.testing.fakes import FINGERPRINT
from unbroken.testing.virtual import COLLECTIONS, Link, LinkSpec, Network, Process, Timer, VirtualClock

V = m.PROTOCOL_VERSION
_EPOCH = re.compile(r'"epoch":(\d+)')
_EPOCH_ORDER = f'{{"v":{V},"type":"epoch"'
_EXPELLED = f'{{"v":{V},"type":"expelled"'
RECONNECT_S = 0.1
"""A node whose hello was refused, or that was expelled, tries again this much later."""
RELAY_GONE = "its session with the relay ended"
RECONNECT_DELAY_S = 0.1
"""A relay links again this long after its link ended (`relay.RECONNECT_DELAY_S`)."""
BETWEEN_ZONES = LinkSpec(latency_s=0.025, bandwidth_Bps=125e6)
IN_ZONE = LinkSpec(latency_s=0.0005, bandwidth_Bps=1.25e9)


@dataclass(frozen=True)
class SimConfig:
    """One simulated job: its size, its network and its nodes' habits."""

    nodes: int
    """Nodes at the start (joins add more)."""
    zone_size: int = 100
    """Nodes per relay (one relay, and one zone, per this many)."""
    zoned: bool = True
    """Nodes name their relay's zone in their hello (the planner groups by zone); False:
    they name none, as `unbroken.testing.fakes` nodes do."""
    reports_epoch: bool = True
    """Reports name the epoch the node trains in; False: epoch 0, as `fakes` nodes' do (the
    coordinator then keeps no step times, reviews no plan and sees no member train)."""
    lease_s: float = 1.0
    step_s: float = 0.5
    """A node's step time: one progress report each."""
    between_zones: LinkSpec = BETWEEN_ZONES
    """Relay ↔ coordinator (50 ms round trip, a gigabit)."""
    in_zone: LinkSpec = IN_ZONE
    """Node ↔ relay (1 ms round trip, 10 gigabits)."""
    ramp_s: float = 2.0
    """The first hellos are spread over this long."""
    recovery_window_s: float = 1.0
    """The coordinator's wait for members of an earlier incarnation (there are none)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"SimConfig.nodes is {self.nodes}: simulate one node at least")
        if self.zone_size < 1:
            raise ValueError(f"SimConfig.zone_size is {self.zone_size}: a relay holds one node at least")
        if self.step_s <= 0 or self.lease_s <= 0:
            raise ValueError(f"SimConfig: step_s ({self.step_s}) and lease_s ({self.lease_s}) must be positive")

    @property
    def relays(self) -> int:
        return max(1, round(self.nodes / self.zone_size))


@dataclass
class SimNode:
    """A node as the control plane sees it (module docstring)."""

    name: str
    relay: SimRelay
    key: Ed25519PrivateKey
    up: Link
    down: Link
    member_id: str = ""
    session: int = 0
    """Its session's number: timers of an ended session do nothing."""
    welcomed_at: float | None = None
    killed_at: float | None = None
    freezes: list[tuple[float, float]] = field(default_factory=list)
    """Its freezes: from, until."""
    epochs: dict[int, float] = field(default_factory=dict)
    """Epoch → when its order reached this node."""
    expulsions: list[tuple[float, bool]] = field(default_factory=list)
    """When it was expelled, and whether it had been frozen (else: a false expulsion)."""
    refusals: int = 0
    epoch: int = 0
    """The newest epoch it heard of (its reports say it trains there)."""
    seq: int = 0
    step: int = 0
    next_step: float = 0.0
    said_at: float = 0.0

    @property
    def thaws_at(self) -> float:
        """When its last freeze ends (0: never frozen)."""
        return self.freezes[-1][1] if self.freezes else 0.0

    def down_at(self, t: float) -> bool:
        """Whether it was dead or frozen at ``t``."""
        return self.down_between(t, t)

    def down_between(self, start: float, end: float) -> bool:
        """Whether it was dead or frozen at any time from ``start`` to ``end``."""
        if self.killed_at is not None and self.killed_at <= end:
            return True
        return any(f0 <= end and f1 > start for f0, f1 in self.freezes)


class Sent:
    """What one link of a relay sends down: the coordinator's side of it (a `Sender`)."""

    def __init__(self, sim: Simulation, relay: SimRelay, link: SimLink) -> None:
        self.sim = sim
        self.relay = relay
        self.link = link
        self.member_id = f"relay:{relay.relay_id}"

    def send(self, msg: BaseModel) -> None:
        self.send_text(m.encode(msg))

    def send_text(self, text: str) -> None:
        relay, link = self.relay, self.link
        self.sim.coordinator.send(self.sim.net, relay.from_leader, len(text), lambda: relay.heard_leader(link, text))

    def close(self) -> None:
        """The coordinator ends the link (it found the relay silent): the relay sees it end."""
        relay, link = self.relay, self.link
        self.sim.coordinator.send(
            self.sim.net, relay.from_leader, 0, lambda: relay.process.submit(lambda: relay.unlinked(link, "dropped"))
        )


class SimLink(RelayLink):
    """A relay's link at the coordinator, without a websocket (`RelayLink`'s state)."""

    def __init__(self, sim: Simulation, relay: SimRelay) -> None:
        # Not RelayLink.__init__: it starts a websocket writer; the state is the same.
        self.relay_id = relay.relay_id
        self.zone = relay.zone
        self.session = Sent(sim, relay, self)  # type: ignore[assignment]
        self.nonce = auth.new_nonce()
        self._used: set[int] = set()
        self._floor = -1
        self.members: set[str] = set()
        self.heard_at = sim.clock.now
        self.forwarding = ""


class SimRelay:
    """A relay: the real batching (`Batches`) behind modelled sessions."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim = sim
        self.relay_id = f"relay{index}"
        self.zone = f"z{index}"
        self.process = Process(sim.clock, self.relay_id)
        self.batches = Batches()
        self.members: dict[str, SimNode] = {}
        self.hellos: dict[str, SimNode] = {}
        self.to_leader = sim.net.link(sim.config.between_zones)
        self.from_leader = sim.net.link(sim.config.between_zones)
        self.link: SimLink | None = None
        """The link to the leader (None: not linked now)."""
        self.challenges = 0
        self.period = sim.config.lease_s / 10
        self._timer: Timer | None = None
        self._flush_due = False
        self.acked_at = 0.0
        self.longest_unacked_s = 0.0
        """The longest it went without an acknowledged batch."""
        self.links_lost: list[str] = []
        """Why each of its links to the leader ended (``dropped``: by the leader, which heard
        nothing for half a lease; ``unacknowledged``: by the relay, after two leases)."""

    def relink(self) -> None:
        """Link to the leader: a hello and its answer, one round trip (`relay.Relay._link`)."""
        hello = 512  # a relay's hello: its id, zone, key and signature

        def at_leader() -> None:
            link = SimLink(self.sim, self)
            self.sim.coord.relay_joined(link)
            welcome = m.encode(
                m.RelayWelcome(
                    coordinator_id=self.sim.coord.coordinator_id,
                    term=0,
                    lease_s=self.sim.config.lease_s,
                    link=link.nonce,
                )
            )
            self.sim.coordinator.send(
                self.sim.net, self.from_leader, len(welcome), lambda: self.process.submit(lambda: self._linked(link))
            )

        self.sim.net.send(self.to_leader, hello, lambda: self.sim.coordinator.submit(at_leader))

    def _linked(self, link: SimLink) -> None:
        self.link = link
        self.acked_at = self.sim.clock.now
        self._schedule()

    def unlinked(self, link: SimLink, why: str) -> None:
        """The link ended: every member's session ends with it (`relay.Relay._unlink`); the
        members reconnect and the relay links again."""
        if self.link is not link:
            return
        self.link = None
        self.links_lost.append(why)
        if self._timer is not None:
            self._timer.cancel()
        ended = [*self.members.values(), *self.hellos.values()]
        self.members.clear()
        self.hellos.clear()
        self.batches.clear()
        for node in ended:
            self.process.send(self.sim.net, node.down, 0, partial(self.sim.dropped, node, node.session))
        self.process.later(RECONNECT_DELAY_S, self.relink)

    def _schedule(self) -> None:
        self._timer = self.sim.clock.after(self.period, self._due)

    def _due(self) -> None:
        self._flush_due = True
        self.process.submit(self._flush)
        self._schedule()

    def _urgent(self) -> None:
        # The relay's loop wakes at once for an urgent batch; its next routine one is a period later.
        if self.link is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        if not self._flush_due:
            self._flush_due = True
            self.process.submit(self._flush)
        self._schedule()

    def _flush(self) -> None:
        self._flush_due = False
        link, now = self.link, self.sim.clock.now
        if link is None:
            return
        self.longest_unacked_s = max(self.longest_unacked_s, now - self.acked_at)
        if now - self.acked_at > 2 * self.sim.config.lease_s:
            # A leader that stopped answering: leave it (the leader sees the session end).
            self.sim.net.send(self.to_leader, 0, lambda: self.sim.coordinator.submit(lambda: self.sim.relay_gone(link)))
            self.unlinked(link, "unacknowledged")
            return
        for up in self.batches.take(now, self.members, self.sim.config.lease_s):
            text = m.encode(up)
            self.process.send(self.sim.net, self.to_leader, len(text), partial(self.sim.leader_heard, link, text))

    # ------------------------------------------------------------- from its nodes

    def opened(self, node: SimNode, session: int) -> None:
        if self.link is None:  # a relay with no leader refuses hellos, naming the leader
            refused = m.encode(m.Refused(reason=f"relay {self.relay_id} has no link to the leader", standby=True))
            self.process.send(self.sim.net, node.down, len(refused), partial(self.sim.answered, node, refused))
            return
        self.challenges += 1
        challenge = m.Challenge(nonce=f"{self.link.nonce}.{self.challenges}", auth=False)
        text = m.encode(challenge)
        self.process.send(self.sim.net, node.down, len(text), lambda: self.sim.challenged(node, session, text))

    def knocked(self, node: SimNode, challenge: str, knock_text: str, hello_text: str) -> None:
        knock = m.parse_knock(knock_text)
        hello = m.parse_node_message(hello_text)
        if not isinstance(hello, m.Hello) or hello.member_id != knock.member_id:
            raise AssertionError(f"{node.name} sent no hello of its own")  # the simulated nodes' bug
        signed = m.Identity(key=knock.key, signature=knock.signature, challenge=challenge, nonce=knock.nonce)
        hello = hello.model_copy(update={"identity": signed})
        self.hellos[hello.member_id] = node
        if self.batches.tell(hello.member_id, hello, len(hello_text), urgent=True):
            self._urgent()

    def heard(self, node: SimNode, mid: str, text: str) -> None:
        if self.members.get(mid) is not node:
            return  # its session here ended
        msg = m.parse_node_message(text)
        if self.batches.heard(mid, msg, len(text), self.sim.clock.now):
            self._urgent()

    def closed(self, mid: str) -> None:
        if self.members.pop(mid, None) is not None and mid not in self.hellos:
            self.batches.ended(mid, RELAY_GONE)
            self._urgent()

    # ------------------------------------------------------------- from the leader

    def heard_leader(self, link: SimLink, text: str) -> None:
        self.process.submit(lambda: self._from_leader(link, text))

    def _from_leader(self, link: SimLink, text: str) -> None:
        if self.link is not link:
            return  # a link that ended: nothing more is read from it
        msg = m.parse_leader_message(text)
        sim = self.sim
        if isinstance(msg, m.Ack):
            self.acked_at = sim.clock.now
            for mid, seq in self.batches.acked(msg.seq, msg.report_s):
                node = self.members.get(mid)
                if node is not None:  # counted on the wire; a modelled node needs no ack
                    sim.net.arrival(node.down, len(m.encode(m.Ack(seq=seq))), self.process.busy_until)
            return
        if not isinstance(msg, m.Down):
            raise AssertionError(f"the coordinator sent a relay {msg.type!r}")
        inner = msg.msg
        if isinstance(inner, (m.Welcome, m.Refused)):
            for mid in msg.to:
                node = self.hellos.pop(mid, None)
                if node is None:
                    continue
                if isinstance(inner, m.Welcome):
                    self.members[mid] = node
                    self.batches.unacked.pop(mid, None)
                answer = m.encode(inner)
                self.process.send(sim.net, node.down, len(answer), partial(sim.answered, node, answer))
            return
        out = m.encode(inner)
        for mid in msg.to:
            node = self.members.get(mid)
            if node is None:
                continue
            self.process.send(sim.net, node.down, len(out), partial(sim.told, node, mid, out))
            if isinstance(inner, m.Expel):
                self.closed(mid)  # the relay ends an expelled member's session


class Simulation:
    """A coordinator, its relays and their nodes on one virtual clock (module docstring)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.clock = VirtualClock()
        self.net = Network(self.clock, random.Random(config.seed + 1))
        self.coordinator = Process(self.clock, "coordinator")
        membership = MembershipConfig(lease_s=config.lease_s, recovery_window_s=config.recovery_window_s)
        self.coord = Coordinator(CoordinatorConfig(membership=membership), clock=self.clock)
        # What the coordinator schedules on its event loop runs on its simulated process.
        self.coord._loop = cast(asyncio.AbstractEventLoop, self.coordinator)
        self.relays = [SimRelay(self, i) for i in range(config.relays)]
        self.nodes: list[SimNode] = []
        self.epochs_formed: dict[int, float] = {}
        """Epoch → when the coordinator formed it."""
        self.epoch_cpu_s: dict[int, float] = {}
        """Epoch → the CPU of the coordinator's handler that formed it."""
        self.relay_texts = 0
        """Messages the relays heard from their nodes (heartbeats, reports, hellos)."""
        self._last_tick = self.clock.now
        for relay in self.relays:
            relay.relink()
        self.clock.after(TICK_S, self._tick_due)
        self.add(config.nodes, ramp_s=config.ramp_s)

    # ------------------------------------------------------------- the coordinator

    def _tick_due(self) -> None:
        self.coordinator.submit(self._tick)

    def _tick(self) -> None:
        def tick() -> None:
            self._last_tick = self.coord._tick(self._last_tick)

        self._watched(tick)
        self.coordinator.later(TICK_S, self._tick_due)  # its loop sleeps a tick after each

    def _watched(self, fn: Callable[[], None]) -> None:
        """Run a coordinator handler, noting the epochs it formed and its CPU (collections
        left out, as `Process` leaves them out: they walk the simulated nodes' objects)."""
        before = self.coord.membership.epoch
        t0, gc0 = time.thread_time(), COLLECTIONS.total_s
        fn()
        epoch = self.coord.membership.epoch
        if epoch != before:
            self.epochs_formed[epoch] = self.clock.now
            self.epoch_cpu_s[epoch] = max(0.0, time.thread_time() - t0 - (COLLECTIONS.total_s - gc0))

    def leader_heard(self, link: SimLink, text: str) -> None:
        self.coordinator.submit(partial(self._watched, partial(self._relay_up, link, text)))

    def relay_gone(self, link: SimLink) -> None:
        """A relay ended its link (`sessions.serve_relay`'s end)."""
        self.coord.relay_lost(link)

    def _relay_up(self, link: SimLink, text: str) -> None:
        """What `sessions.serve_relay` does with a relay's batch."""
        if self.coord.relays.links.get(link.relay_id) is not link:
            return  # the coordinator dropped this link (it found the relay silent)
        link.heard_at = self.clock.now  # when read, as the server does: a late read hastens no lapse
        up = m.parse_relay_message(text)
        if not isinstance(up, m.Up):
            raise AssertionError(f"{link.relay_id} sent its hello twice")
        link.session.send(self.coord.relay_up(link, up, cast(web.Request, None)))

    # ------------------------------------------------------------- nodes

    def add(self, count: int, ramp_s: float = 0.0) -> list[SimNode]:
        """``count`` new nodes, each to the relay with the fewest members."""
        new = []
        for i in range(count):
            relay = self.relays[len(self.nodes) % len(self.relays)]
            node = SimNode(
                f"sim{len(self.nodes)}",
                relay,
                identity.ephemeral(),
                self.net.link(self.config.in_zone),
                self.net.link(self.config.in_zone),
            )
            self.nodes.append(node)
            new.append(node)
            self.clock.after(ramp_s * i / max(count, 1), partial(self._connect, node, True))
        return new

    def _connect(self, node: SimNode, new_member: bool) -> None:
        """A new session (``new_member``: as a new member, after an expulsion or at the start;
        else as the member it was, its session having dropped)."""
        if node.killed_at is not None:
            return
        node.session += 1
        if new_member:
            node.member_id = identity.member_id(node.name, node.key)
        node.welcomed_at = None
        session, relay = node.session, node.relay
        self.net.send(node.up, 64, lambda: relay.process.submit(lambda: relay.opened(node, session)))

    def challenged(self, node: SimNode, session: int, text: str) -> None:
        if node.session != session or node.killed_at is not None:
            return
        challenge = m.parse_coordinator_message(text)
        assert isinstance(challenge, m.Challenge)
        knock = m.encode(identity.knock(node.member_id, challenge.nonce, None, node.key))
        hello = m.encode(
            m.Hello(
                job="sim-job",
                job_identity="sim",
                fingerprint=FINGERPRINT,
                member_id=node.member_id,
                name=node.name,
                batch_size=max(self.config.nodes, 1),
                zone=node.relay.zone if self.config.zoned else "",
            )
        )
        relay = node.relay
        self.relay_texts += 1
        self.net.send(
            node.up,
            len(knock) + len(hello),
            lambda: relay.process.submit(lambda: relay.knocked(node, challenge.nonce, knock, hello)),
        )

    def answered(self, node: SimNode, text: str) -> None:
        """The answer to its hello reached the node."""
        if node.killed_at is not None:
            return
        if self._frozen(node, lambda: self.answered(node, text)):
            return
        if not text.startswith(f'{{"v":{V},"type":"welcome"'):
            node.refusals += 1
            self.clock.after(RECONNECT_S, partial(self._connect, node, False))
            return
        welcome = m.parse_coordinator_message(text)
        assert isinstance(welcome, m.Welcome)
        now = self.clock.now
        node.welcomed_at = now
        node.next_step = now + self.config.step_s * self.rng.random()
        node.said_at = now
        self._talk(node, node.session, welcome.heartbeat_s)

    def _talk(self, node: SimNode, session: int, heartbeat_s: float) -> None:
        """A progress report per step, a heartbeat when it said nothing for a heartbeat period."""
        if node.session != session or node.killed_at is not None:
            return
        now = self.clock.now
        if now < node.thaws_at:
            self.clock.at(node.thaws_at, lambda: self._talk(node, session, heartbeat_s))
            return
        node.seq += 1
        if now >= node.next_step:
            node.step += 1
            text = (
                f'{{"v":{V},"type":"progress","epoch":{node.epoch if self.config.reports_epoch else 0},'
                f'"step":{node.step},"loss":1.0,'
                f'"wall_time":{now},"samples_per_s":10.0,"compute_s":0.01,"seq":{node.seq}}}'
            )
            node.next_step += self.config.step_s
        else:
            text = f'{{"v":{V},"type":"heartbeat","seq":{node.seq},"step":{node.step}}}'
        node.said_at = now
        relay, mid = node.relay, node.member_id
        self.relay_texts += 1
        self.net.send(node.up, len(text), lambda: relay.process.submit(lambda: relay.heard(node, mid, text)))
        wake = max(min(node.next_step, now + heartbeat_s), now + 0.005)
        self.clock.at(wake, lambda: self._talk(node, session, heartbeat_s))

    def told(self, node: SimNode, mid: str, text: str) -> None:
        """A message of the leader reached the node."""
        if node.killed_at is not None or node.member_id != mid:
            return
        if self._frozen(node, lambda: self.told(node, mid, text)):
            return
        now = self.clock.now
        if text.startswith(_EPOCH_ORDER):
            found = _EPOCH.search(text, 0, 200)
            if found:
                epoch = int(found.group(1))
                node.epochs.setdefault(epoch, now)
                node.epoch = max(node.epoch, epoch)
        elif text.startswith(_EXPELLED):
            was_frozen = node.down_between(now - 3 * self.config.lease_s, now)
            node.expulsions.append((now, was_frozen))
            node.welcomed_at = None
            node.session += 1  # its talk stops; it rejoins as a new member, as a node does
            self.clock.after(RECONNECT_S, partial(self._connect, node, True))

    def dropped(self, node: SimNode, session: int) -> None:
        """Its relay ended its session (the relay's link ended): it connects again, as the
        same member (a real node would try the leader next; here it comes back through its
        relay once that relay linked again)."""
        if node.session != session or node.killed_at is not None:
            return
        if self._frozen(node, lambda: self.dropped(node, session)):
            return
        node.session += 1
        node.welcomed_at = None
        self.clock.after(RECONNECT_S, partial(self._connect, node, False))

    def _frozen(self, node: SimNode, later: Callable[[], None]) -> bool:
        """A frozen node reads nothing until it thaws (what was sent to it waits)."""
        if self.clock.now < node.thaws_at:
            self.clock.at(node.thaws_at, later)
            return True
        return False

    # ------------------------------------------------------------- faults

    def live(self) -> list[SimNode]:
        now = self.clock.now
        return [n for n in self.nodes if n.welcomed_at is not None and not n.down_at(now)]

    def kill(self, count: int) -> list[SimNode]:
        """Crash ``count`` live nodes: their relays see their sessions close."""
        victims = self.rng.sample(self.live(), min(count, len(self.live())))
        for node in victims:
            node.killed_at = self.clock.now
            relay, mid = node.relay, node.member_id
            self.net.send(node.up, 0, partial(relay.process.submit, partial(relay.closed, mid)))
        return victims

    def freeze(self, count: int, seconds: float) -> list[SimNode]:
        """Freeze ``count`` live nodes for ``seconds`` (SIGSTOP: the session stays open)."""
        victims = self.rng.sample(self.live(), min(count, len(self.live())))
        for node in victims:
            node.freezes.append((self.clock.now, self.clock.now + seconds))
        return victims
