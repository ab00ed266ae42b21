"""The coordinator service: node sessions, leases, epochs, the data plane's rendezvous, JSON state.

Run it with ``unbroken coordinator --host H --port P``, or from Python::

    coord = Coordinator(CoordinatorConfig(ServiceConfig(port=0)))
    coord.start()            # serves from a background thread
    print(coord.address)     # ("127.0.0.1", 41234)
    coord.stop()

Its state is soft: a coordinator restarted on the same address rebuilds its view from the
nodes' reconnecting sessions, and a stable group keeps training while it is down.

With ``etcd`` set, any number of coordinators serve one job: one leads (`election`), the
others stand by and answer every node with the leader's address. Whatever a coordinator
sends — epoch orders, expulsions, commands — goes out only while it is sure it leads, and
an epoch is ordered only after its record was written to etcd under the leader's term:
a deposed leader that has not noticed yet can neither publish an epoch nor reach a node
(which refuses an older term anyway). A new leader rebuilds its view from the nodes, as
after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from unbroken.config import CoordinatorConfig
from unbroken.control import browsers, identity
from unbroken.control import messages as m
from unbroken.control.entry import serve_node
from unbroken.control.meeting import Rendezvous
from unbroken.control.membership import Decision, Membership
from unbroken.control.office import Office
from unbroken.control.orders import compact
from unbroken.control.outsiders import listen
from unbroken.control.relaying import Relays
from unbroken.control.resumes import Resumes
from unbroken.control.service import ThreadedService
from unbroken.control.sessions import (
    Doorman,
    RelayLink,
    Sender,
    send_all,
    serve_relay,
)
from unbroken.errors import ProtocolError
from unbroken.events import Event, Kind, goes_back
from unbroken.observe.board import state_json
from unbroken.observe.chronicle import Chronicle
from unbroken.observe.web import add_routes

log = logging.getLogger(__name__)

TICK_S = 0.02
LAG_FORGIVEN_S = 0.1
"""A tick this much later than due extends every lease by the delay (see `_tick_forever`)."""
REPORT_S = 0.05
"""How often a training node reports progress, at least (a lease's heartbeat period, if longer)."""
MEET_BATCH_S = 0.003
"""Rendezvous entries arriving within this long go to the members in one message."""


class Coordinator(ThreadedService):
    """Membership service for one job."""

    name = "coordinator"

    def __init__(self, config: CoordinatorConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the time every decision is taken at (a virtual one in the control-plane
        simulator, `unbroken.testing.simulate`)."""
        super().__init__()
        self.clock = clock
        self.config = config or CoordinatorConfig()
        self.coordinator_id = uuid.uuid4().hex[:12]
        self.token = self.config.service.token
        keys = self.config.service.allowed_keys
        self.allowed = identity.Allowed(keys) if keys is not None else None
        self._keys_checked_at = 0.0
        self.membership = self._new_membership()
        self.office = Office(
            self.config.service,
            self.coordinator_id,
            lambda: self.address,
            job=lambda: self.membership.job,
            step=lambda: self.membership.step,
            on_elected=self._elected,
            on_deposed=self._deposed,
            deliver=self._send_decision,
        )
        self.chronicle = Chronicle(self.config.service.event_log, lambda: self.membership, clock)
        self.events = self.chronicle.events
        """The job's events (``/api/events?since=`` pages by their ``seq``)."""
        self.history = self.chronicle.history
        self.recoveries = self.chronicle.recoveries
        self.sessions: dict[str, Sender] = {}
        self.relays = Relays(self)
        self._last_order: m.EpochOrder | None = None
        self.resumes = Resumes()
        """The epochs' lists a reconnecting member's digest is checked against."""
        self._told: dict[str, int] = {}
        """The epoch of the last order each member's session was sent."""
        self.rendezvous = Rendezvous(self.config.membership.build_deadline_s)
        """The data plane's rendezvous entries of the last epochs (`control.meeting`)."""
        self._meet_flush: asyncio.Handle | None = None
        self.doorman = Doorman()
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] = (self.config.service.host, self.config.service.port)
        self._prompted = False
        self.loop_lag_s = 0.0
        """The longest stall of the event loop seen (leases were extended by each)."""

    def _new_membership(self) -> Membership:
        self._asked_vanished: set[tuple[int, tuple[str, ...]]] = set()
        """(epoch found, members missing) that members back were asked about (`_ask_who_vanished`)."""
        ms = Membership(self.config.membership, now=self.clock(), recovering=True, policy=self.config.policy)
        ms.roster.leases.vouched = lambda mid: self.relays.vouched(mid)  # relays' summaries renew leases
        return ms

    # ---------------------------------------------------------------- lifecycle

    async def serve(self) -> None:
        """Serve until `stop` is called (or the task is cancelled)."""
        stopping = self._begin()
        service = self.config.service
        names = await browsers.names_of(service.host, service.advertise, service.allow_hosts)
        app = web.Application(
            client_max_size=service.max_message_bytes, middlewares=[self.guard.middleware, browsers.guard(names)]
        )
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/relay", self._relay)
        add_routes(app, self)
        ssl_context = None
        if service.tls_cert is not None and service.tls_key is not None:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(service.tls_cert, service.tls_key)
        self._runner, port = await listen(app, self.guard, service.host, service.port, ssl_context)
        self.membership.listening(self.clock())  # a node's evidence (refusals) ended only now
        self.address = (service.host, port)
        log.info("coordinator %s on %s:%d", self.coordinator_id, *self.address)
        ticker = asyncio.create_task(self._tick_forever(), name="coordinator-tick")
        try:
            await self.office.start()
            self._listening()
            await stopping.wait()
        finally:
            await self.office.close()
            ticker.cancel()
            for s in list(self.sessions.values()):
                s.close()
            await self._runner.cleanup()
            self.events.close()

    # ---------------------------------------------------------------- leadership

    def leading(self) -> bool:
        """True while this coordinator may send (see `office.Office`)."""
        return self.office.leading()

    def in_office(self) -> bool:
        return self.office.in_office()

    @property
    def term(self) -> int:
        return self.office.term

    def _elected(self, term: int, epoch_floor: int, verdicts: list[m.Refusal]) -> None:
        """A fresh view for the new term: the nodes hand theirs over as they reconnect; the
        audits' verdicts come from the last epoch published."""
        self.chronicle.record(
            Event(self.clock(), Kind.LEADER, None, 0, 0, f"{self.office.advertised} leads (term {term})")
        )
        self._drop_sessions()
        self.rendezvous = Rendezvous(self.config.membership.build_deadline_s)  # the new term's epochs meet anew
        self.membership = self._new_membership()
        self.membership.term = term
        self.membership.number_above(epoch_floor)
        self.membership.remember_verdicts(verdicts)

    def _deposed(self, reason: str) -> None:
        self._drop_sessions()
        self.membership = self._new_membership()
        advertised = self.office.advertised
        self.chronicle.record(Event(self.clock(), Kind.DEPOSED, None, 0, 0, f"{advertised} stops leading: {reason}"))

    def _drop_sessions(self) -> None:
        for session in list(self.sessions.values()):
            session.close()
        self.relays.close()
        self.sessions.clear()
        self._told.clear()
        self._last_order = None

    # ---------------------------------------------------------------- HTTP

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "coordinator_id": self.coordinator_id})

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    def state(self, timeout: float = 5.0) -> dict[str, Any]:
        """The `snapshot`, safe to call from any thread while the service runs."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return self.snapshot()
        try:
            if asyncio.get_running_loop() is loop:
                return self.snapshot()
        except RuntimeError:
            pass

        async def take() -> dict[str, Any]:
            return self.snapshot()

        return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout)

    def snapshot(self) -> dict[str, Any]:
        """The view ``/api/state`` serves (`observe.board`), on the event loop."""
        return state_json(self)

    # ---------------------------------------------------------------- sessions

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        return await serve_node(self, request)

    def join(
        self,
        hello: m.Hello,
        peer: str,
        open_session: Callable[[], Sender],
        proof: str,
        key: str,
    ) -> Sender | m.Refused:
        """Admit a proven member's hello (``key``: the public key its knock was signed with;
        ``peer``: its address, or its relay's id): its new session, welcomed, or the refusal
        to send. A join whose key or address churned lately waits (`admissions`)."""
        if hello.resume is not None:
            if (resume := self.resumes.expand(hello.resume, self._last_order)) is None:
                unknown = f"this coordinator holds no lists of epoch {hello.resume.epoch} that match its digest"
                log.info("asked %s from %s for its resume in full: %s", hello.name, peer, unknown)
                return m.Refused(reason=f"{unknown}: send them", resume_in_full=True)
            hello = hello.model_copy(update={"resume": resume})
        mid = hello.member_id
        ms = self.membership
        if (why := ms.unbound(mid, key, one_per_key=self.allowed is not None)) is not None:
            # Before its session is touched: a hello as another member must not end that one's.
            log.warning("refused %s from %s: %s", hello.name, peer, why)
            self.chronicle.refusal(peer, f"{hello.name}: {why}")
            return m.Refused(reason=why)
        old = self.sessions.pop(mid, None)
        if old is not None:
            old.close()  # the node reconnected before its old session ended here: it replaces it
        back = old is not None or mid in self.relays.detached
        self.relays.detached.discard(mid)
        now = self.clock()
        training = ms.recovering_until is None and any(mid in ms.members for mid in ms.epoch_members)
        group_step = ms.reported_step() if training else 0  # 0: no group trains (a cold start)
        decision = self.membership.admit(hello, now, reconnect=back, key=key, source=peer)
        if decision.refuse is not None:
            log.warning("refused %s from %s: %s", hello.name, peer, decision.refuse)
            self.chronicle.refusal(peer, f"{hello.name}: {decision.refuse}")
            finished = ms.finished and ms.halted is None
            return m.Refused(reason=decision.refuse, finished=finished, final_digest=ms.final_digest or "")
        session = open_session()
        self.sessions[mid] = session
        self._told.pop(mid, None)  # a new session: its next order goes in full
        lease = self.config.membership.lease_s
        session.send(
            m.Welcome(
                lease_s=lease,
                heartbeat_s=lease / 5,
                report_s=max(REPORT_S, lease / 5),
                coordinator_id=self.coordinator_id,
                proof=proof,
                term=self.term,
                group_step=group_step,
                build_deadline_s=self.config.membership.build_deadline_s,
            )
        )
        self._apply(decision)
        last = self._last_order
        if back and last is not None and hello.last_epoch < last.epoch and mid in last.members:
            # Formed while it was away (its relay died, its session was being replaced): the
            # order it missed, in full, or it would never build the epoch it belongs to.
            session.send(compact(last))
            self._told[mid] = last.epoch
        if back and last is not None and mid in last.members and (entries := self.rendezvous.entries(last.epoch)):
            session.send(m.Met(epoch=last.epoch, term=self.term, entries=entries))
        return session

    def session_ended(self, session: Sender) -> None:
        mid = session.member_id
        if self.sessions.get(mid) is session and self.in_office():
            del self.sessions[mid]
            self._told.pop(mid, None)
            self._apply(self.membership.session_closed(mid, self.clock()))

    # ---------------------------------------------------------------- relays

    def relay_joined(self, link: RelayLink) -> None:
        self.relays.joined(link)
        if link.forwarding:
            self.membership.roster.relay_forwarders[link.relay_id] = link.forwarding

    def relay_up(self, link: RelayLink, up: m.Up, request: web.Request) -> m.Ack:
        """A relay's batch, handled; returns its acknowledgement to send."""
        self.relays.up(link, up)
        return m.Ack(seq=up.seq, report_s=self.relays.report_s())

    def _check_keys(self, now: float) -> None:
        """Once a second: members whose key was taken off ``--allowed-keys`` are expelled."""
        if self.allowed is None or now < self._keys_checked_at + 1.0:
            return
        self._keys_checked_at = now
        self._apply(self.membership.revoke(self.allowed.admits, now))

    def relay_lost(self, link: RelayLink) -> None:
        self.relays.lost(link)
        self.membership.roster.relay_forwarders.pop(link.relay_id, None)

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        return await serve_relay(self, request)

    def check_key(
        self, key: str, signature: str, challenge: str, nonce: str, member_id: str, role: str = "node"
    ) -> str | None:
        """Why a node's (or relay's) knock does not prove its key (`unbroken.control.identity`),
        or its id is not made from that key, or the key is not one the job admits, or None."""
        if not key:
            return "this node sends no node key: run the same unbroken version on every node and coordinator"
        if (why := identity.verify(key, signature, challenge, nonce, member_id, role)) is not None:
            return why
        if not identity.owns(key, member_id):
            return f"member id {member_id!r} is not made from its node key: no node may speak as another member"
        if self.allowed is not None and not self.allowed.admits(key):
            return (
                f"its node key {key} (id {identity.key_id(key)}) is not among the job's allowed keys "
                f"({self.allowed.path}): make the node a key of its own with `unbroken keygen FILE`, add the "
                "line it prints to that file, and start the node with --key FILE (a node without --key has "
                "a key for its process alone)"
            )
        return None

    def drop(self, session: Sender, reason: str) -> None:
        """Expel a relayed member for a message no honest node sends, as a lapsed lease is
        (a direct session ends by raising `ProtocolError` out of its reader)."""
        d = self.membership.fail(session.member_id, self.clock(), reason)
        d.expel[session.member_id] = reason
        self._apply(d)

    def dispatch(self, session: Sender, msg: m.NodeMessage) -> None:
        now = self.clock()
        mid = session.member_id
        ms = self.membership
        step = getattr(msg, "step", None)
        if step is not None and (why := ms.beyond(step)) is not None:
            raise ProtocolError(f"{type(msg).__name__.lower()} claims {why}")
        if isinstance(msg, m.Heartbeat):
            ms.heartbeat(mid, msg.step, now)
            session.send(m.Ack(seq=msg.seq))
        elif isinstance(msg, m.Progress):
            ms.progress(
                mid,
                msg.step,
                msg.loss,
                msg.samples_per_s,
                now,
                epoch=msg.epoch,
                compute_s=msg.compute_s,
                caps=msg.capabilities,
                wire=(msg.bytes_intra, msg.bytes_inter),
            )
            if msg.seq:
                session.send(m.Ack(seq=msg.seq))
            self.chronicle.progress(mid, msg)
            if msg.commitments:
                self._apply(ms.committed(mid, msg.commitments, now))
        elif isinstance(msg, m.Report):
            if (mem := ms.members.get(mid)) is not None and msg.kind in (Kind.CHECKPOINT_OK, Kind.CHECKPOINT_FAILED):
                mem.checkpoint_error = msg.reason if msg.kind is Kind.CHECKPOINT_FAILED else None
            # Every member says its fall-back to a checkpoint (the group's step goes back once all
            # did); the first to say it makes the job's one event.
            if goes_back(msg.kind, msg.reason) and not ms.roster.went_back(mid, msg.step):
                return
            self.chronicle.record(
                Event(now, msg.kind, mid, ms.epoch, msg.step, f"{self.chronicle.name(mid)}: {msg.reason}")
            )
        elif isinstance(msg, m.Fault):
            if msg.kind is Kind.UNREACHABLE and msg.culprit is not None and msg.culprit != mid:
                self._ask_to_probe(msg.epoch, msg.culprit, msg.group, mid)
            self._apply(
                ms.fault(
                    mid,
                    msg.epoch,
                    msg.reason,
                    now,
                    culprit=msg.culprit,
                    kind=msg.kind,
                    rollback_to=msg.rollback_to,
                    zone_only=msg.zone_only,
                    step=msg.step,
                )
            )
        elif isinstance(msg, m.Leave):
            self._apply(ms.leave(mid, now, msg.reason, last=msg.last))
        elif isinstance(msg, m.Done):
            was_finished = ms.finished
            self._apply(ms.done(mid, msg.step, msg.digest, msg.metrics, now))
            if ms.finished and not was_finished:  # told once, not again at every later Done
                finished = m.Finished(step=ms.step, term=self.term, digest=ms.final_digest or "")
                send_all(self.sessions, {o: finished for o in self.sessions if o not in ms.final_digests})
        elif isinstance(msg, m.Validation):
            self._apply(ms.validation(mid, msg.step, msg.metrics, msg.seconds, now))
        elif isinstance(msg, m.Checked):
            self._apply(ms.checked(mid, msg, now))
        elif isinstance(msg, m.Vanished):
            self._apply(ms.vanished(mid, msg.epoch, msg.members, now))
        elif isinstance(msg, m.Links):
            self._apply(ms.links_measured(mid, msg.epoch, msg.rates, now))
        elif isinstance(msg, m.Meet):
            self.rendezvous.put(mid, msg, now)
            if self._meet_flush is None and self._loop is not None:
                self._meet_flush = self._loop.call_later(MEET_BATCH_S, self._send_meetings)
        elif isinstance(msg, m.Hello):
            raise ProtocolError("hello sent twice on one session")

    def _send_meetings(self) -> None:
        """Rendezvous entries written since the last call, to their epochs' members: one
        message per epoch, encoded once (`send_all`), however many members wrote."""
        self._meet_flush = None
        for epoch, (members, entries) in self.rendezvous.take().items():
            met = m.Met(epoch=epoch, term=self.term, entries=entries)
            send_all(self.sessions, {mid: met for mid in members if mid in self.sessions})

    def _ask_who_vanished(self, now: float) -> None:
        """Recovering, and only the outage fence left to wait for: the members back from the
        epoch found try the addresses the missing ones had there (`m.Check`), once for each
        set of missing members; a dead one is then not waited for (`Membership.vanished`)."""
        awaited = self.membership.awaited(now)
        if awaited is None or (key := (awaited.epoch, tuple(awaited.missing))) in self._asked_vanished:
            return
        self._asked_vanished.add(key)
        check = m.Check(epoch=awaited.epoch, term=self.term, members=awaited.missing[: m.CHECKED_MAX])
        send_all(self.sessions, {mid: check for mid in awaited.back if mid in self.sessions})

    def _ask_to_probe(self, epoch: int, culprit: str, group: str, accuser: str) -> None:
        """One member says it cannot connect to ``culprit``'s data plane (in ``group``): the
        epoch's other members try the same address, and each that cannot says so too
        (`Membership.fault` benches the culprit once most of them did)."""
        asked = self.rendezvous.probe(epoch, culprit, group, accuser)
        if asked is None:
            return
        members, host, port = asked
        probe = m.Probe(epoch=epoch, term=self.term, member=culprit, group=group, host=host, port=port)
        send_all(self.sessions, {mid: probe for mid in members if mid in self.sessions})

    def _name_absent(self, now: float) -> None:
        """Members of the epoch that never wrote their rendezvous entries, ``--build-deadline``
        after most of their group did, are benched: the group cannot form without them, and a
        member that heartbeats but never joins the data plane would hold every epoch up."""
        last = self._last_order
        if last is None:
            return
        for mid, groups in self.rendezvous.absent(last.epoch, now).items():
            why = (
                f"did not join the data plane of epoch {last.epoch} "
                f"within {self.config.membership.build_deadline_s:g} s "
                f"of most of its group (no rendezvous entry for {', '.join(groups)}): its data plane is "
                "not running, or stuck before building its groups"
            )
            self._apply(self.membership.absent(mid, last.epoch, why, now))

    # ---------------------------------------------------------------- decisions

    async def _tick_forever(self) -> None:
        last = self.clock()
        while True:
            await asyncio.sleep(TICK_S)
            last = self._tick(last)

    def _tick(self, last: float) -> float:
        """The clock's decisions, ``last`` the previous tick's time; returns this one's."""
        now = self.clock()
        # Time this loop was not listening (a stall: GC, swap, a burst of work) does not
        # count against anyone's lease, as etcd extends leases after a leader pause; and
        # heartbeats may still sit unread in the sockets, so this tick expires nothing.
        lag = now - last - TICK_S
        late = lag > self.config.membership.lease_s / 2
        if lag > LAG_FORGIVEN_S:
            self.membership.pause(lag)
            self.relays.pause(lag)
            self.loop_lag_s = max(self.loop_lag_s, lag)
        if not self.leading():
            # Not sure of the lease this instant (a renewal is late, or this process just
            # woke from a freeze and will find itself deposed): decide nothing now.
            return now
        try:
            if not late:
                self.relays.check(now)
                self._check_keys(now)
                self._name_absent(now)
                self._ask_who_vanished(now)
            self._apply(self.membership.tick(now, expire=not late))
        except Exception:  # a bug here must not stop the service
            self.chronicle.complain("coordinator tick failed")
        return now

    def _apply(self, d: Decision) -> None:
        """Deliver a decision, then let the clock act on it at once (a failure's epoch now):
        right after whatever else this loop already has to handle, so that sessions that
        dropped together (a host with many nodes, a switch) make one epoch, not one each."""
        self._deliver(d)
        if d.events and not self._prompted and self._loop is not None:
            self._prompted = True
            self._loop.call_soon(self._prompt)

    def _prompt(self) -> None:
        self._prompted = False
        if self.leading():
            # Leases expire in the tick loop alone, which forgives the time the loop stalled:
            # a burst of session drops read right after a stall must not expel everyone else.
            self._deliver(self.membership.tick(self.clock(), expire=False))

    def _deliver(self, d: Decision) -> None:
        # The decision goes out before its events are recorded: recording them may fail (the
        # event log cannot fail, but an anomaly's detector can), and a decision lost there
        # once left a group committing nothing for 140 s.
        self.office.submit(d)
        for ev in d.events:
            try:
                self.chronicle.record(ev)
            except Exception:  # the decision stands; its record is what is lost
                self.chronicle.complain("recording an event failed")

    def _send_decision(self, d: Decision) -> None:
        expel = {mid: (reason, False) for mid, reason in d.expel.items()}
        expel |= {mid: (reason, True) for mid, reason in d.quarantine.items()}
        for mid, (reason, final) in expel.items():
            self._told.pop(mid, None)
            s = self.sessions.pop(mid, None)
            if s is not None:
                s.send(m.Expel(reason=reason, term=self.term, final=final))
                s.close()
        if d.halt is not None:
            halted = m.Finished(step=self.membership.step, term=self.term, error=d.halt)
            send_all(self.sessions, dict.fromkeys(self.sessions, halted))
        if d.orders:
            send_all(self.sessions, self._compact(d.orders))
        for mid, verify in d.verify.items():
            if (session := self.sessions.get(mid)) is not None:
                session.send(verify.model_copy(update={"term": self.term}))

    def _compact(self, orders: dict[str, m.EpochOrder]) -> dict[str, m.EpochOrder]:
        """Orders as sent (`orders.compact`): a member whose session got the previous order
        gets this one as a change to it, anyone else in full. Each order's epoch opens its
        rendezvous."""
        out: dict[str, m.EpochOrder] = {}
        for order in sorted({id(o): o for o in orders.values()}.values(), key=lambda o: o.epoch):
            self.rendezvous.order(order)
            last, self._last_order = self._last_order, order
            full = compact(order)
            delta = compact(order, last) if last is not None else full
            for mid, o in orders.items():
                if o is order and mid in self.sessions:
                    out[mid] = delta if delta.base and self._told.get(mid) == delta.base else full
                    self._told[mid] = order.epoch
        return out

    def command(self, name: str, action: str, reason: str) -> bool:
        """Send an operator's action to the connected node called ``name`` (from the event loop)."""
        for mid, session in self.sessions.items():
            mem = self.membership.members.get(mid)
            if mem is not None and mem.name == name:
                if not self.leading():
                    return False
                session.send(m.Command(action=action, reason=reason, term=self.term))  # type: ignore[arg-type]
                ms = self.membership
                self.chronicle.record(Event(self.clock(), Kind.OPERATOR, mid, ms.epoch, ms.step, f"{name}: {reason}"))
                return True
        return False
