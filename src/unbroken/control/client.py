"""A node's persistent session to the coordinator, run on its own thread.

The session joins, heartbeats, forwards reports and receives orders. The step loop reads
what it learned through a few thread-safe properties and waits on `wake`, which is set
whenever something arrives that may end the step in flight.

The commit fence: a node may only commit while it is sure it has not been expelled. While
connected, that means a heartbeat *sent* less than one lease ago was acknowledged (the
coordinator counts the lease from when it *received* that heartbeat, which is later). A
node whose session dropped while its lease was fresh assumes a coordinator outage and
keeps training with its group; one that finds its lease stale (it was frozen) must not
commit until the coordinator has answered.

An outage is trusted a lease at a time (`messages.OUTAGE_TRUST_LEASES`): each needs
evidence, asked for at once and then every quarter lease, counted from when it was asked,
that no coordinator can have formed an epoch without this node. A coordinator that starts
(or takes over) does not leave out a member of the epoch it finds until as long after it
started (`Membership`) unless most of that epoch's other members find nothing listening at
the member's data-plane address (its process is gone: it commits nothing), so the evidence
is that none started: with etcd, no leader of a newer term and no newer epoch published
(the old leader's key may outlive it while its address refuses connections), or no etcd
majority at all (every member refuses or answers that it has no raft leader, and one that
answers lists no more members than this node was given: nobody can be elected); without
etcd, every coordinator address refuses connections.
Trust that lapses (this node cut off: no answer at all) counts as a lapse and is not
renewed by later evidence: the step in flight is not committed, and the node waits for a
coordinator's order. A refused connection is taken to mean that nothing listens there: a
firewall that rejects (rather than drops) this node's packets to a live coordinator would
mislead it.

Leaders and terms: with etcd, the node asks it who leads before trying the addresses it
was given, and a standby it reaches names the leader. Every welcome and order carries
the leader's term; the node remembers the highest it has seen and refuses a session or
an order of an older one (a deposed leader that has not noticed yet). A leader that stops
acknowledging heartbeats (frozen, cut off) is looked up in etcd: once etcd shows it lost
its lease, the node leaves its session at once and joins the new leader, instead of
waiting three leases for a frozen process. (It still stops committing once its own lease is
stale: it cannot tell a frozen leader from a link that lost its heartbeats on the way, after
which a live leader would have expelled it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel

from unbroken.config import parse_address
from unbroken.control import auth, identity, records
from unbroken.control import messages as m
from unbroken.control.election import epoch_key, find_leader, leader_key
from unbroken.control.etcd import Etcd, EtcdTLS, View
from unbroken.control.orders import complete
from unbroken.errors import ConfigError, CoordinatorUnreachable, EtcdUnavailable, JoinRefused, ProtocolError

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.1
RTT_SAMPLES = 10
"""Round trips measured before this node reports its RTT (zones by RTT group on it)."""


class _Standby(Exception):
    """The coordinator reached is a standby; ``leader`` is where it says the leader is."""

    def __init__(self, leader: str, reason: str) -> None:
        super().__init__(reason)
        self.leader = leader


class ControlClient:
    """The node side of the control plane."""

    def __init__(
        self,
        addresses: Sequence[tuple[str, int]],
        hello: Callable[[str], m.Hello],
        *,
        name: str,
        connect_timeout_s: float,
        wake: threading.Event,
        stall_timeout_s: float = 300.0,
        token: str | None = None,
        tls_ca: str | None = None,
        etcd: Sequence[str] = (),
        etcd_prefix: str = "",
        etcd_tls: EtcdTLS | None = None,
        relays: Sequence[tuple[str, int]] = (),
        key: Ed25519PrivateKey | None = None,
    ) -> None:
        self._key = key or identity.ephemeral()
        """This node's identity (`unbroken.control.identity`): its own for the process without ``--key``."""
        self._ssl = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
        self.addresses = list(addresses)
        self.relays = list(relays)
        self._via_relay = False
        self._current: tuple[str, int] | None = None
        self._shunned: tuple[str, int] | None = None
        """An address whose session went silent: tried after the others."""
        self.etcd_endpoints = list(etcd)
        self.etcd_prefix = etcd_prefix
        self.etcd_tls = etcd_tls
        self.term = 0
        """The highest leader term this node has seen (sessions and orders of older ones are refused)."""
        self._etcd: Etcd | None = None
        self._why_no_leader = ""
        self._hello = hello
        self._token = token
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.wake = wake
        self._lock = threading.Lock()
        self.member_id = self._new_member_id()
        self.welcome: m.Welcome | None = None
        self.orders: list[m.EpochOrder] = []
        self.expelled: str | None = None
        self.quarantined = False
        """The expulsion is final: this node must not come back (`Expel.final`)."""
        self.finished: int | None = None
        self.halted: str | None = None
        """The job was stopped on this error rather than finished (`Finished.error`)."""
        self.final_digest = ""
        """Once ``finished``: the state the job finished with, as the leader said (may be empty)."""
        self.connected = False
        self.outage = False
        self._trusted_until = 0.0
        """While in an outage: when this node's trust in its epoch lapses (module docstring)."""
        self._outage_began = asyncio.Event()
        """Set (on the session thread's loop) when an outage starts: its renewals begin."""
        self.lapses = 0
        """Sessions lost with the lease already stale: the coordinator may have ordered an
        epoch without this node meanwhile, which no later session's welcome disproves."""
        self.lease_s = 1.0
        self.step = 0
        self._last_acked_send = 0.0
        self._sent: dict[int, float] = {}
        self.rtt_s = 0.0
        """Round-trip time of heartbeats to the coordinator (the least of the last 20)."""
        self._rtts: deque[float] = deque(maxlen=20)
        self.on_command: Callable[[m.Command], None] | None = None
        """Called (on the control thread) with an operator's command."""
        self.on_met: Callable[[m.Met], None] | None = None
        """Called (on the control thread) with rendezvous entries for this node's group builds."""
        self.on_probe: Callable[[m.Probe], None] | None = None
        """Called (on the control thread) when the leader asks to try a member's data-plane address."""
        self.on_check: Callable[[m.Check], None] | None = None
        """Called (on the control thread) when a new leader asks which members of this node's
        last epoch left nothing listening at their data-plane addresses."""
        self.on_verify: Callable[[m.Verify], None] | None = None
        """Called (on the control thread) when the leader asks to check a trainer's work."""
        self.on_welcome: Callable[[m.Welcome, bool], None] | None = None
        """Called (on the control thread) after each welcome, with whether it came from
        another coordinator incarnation than the last one."""
        self._seq = 0
        self._counted_at = 0.0
        """When a message that keeps the lease (heartbeat or progress report) last went out."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[BaseModel | None] | None = None
        self._thread: threading.Thread | None = None
        self._first = threading.Event()
        self._first_error: BaseException | None = None
        self._closing = False
        self._run_id = 0
        self.stall_timeout_s = stall_timeout_s
        self._loop_alive_at = time.monotonic()
        self._stall_reported = False

    def _new_member_id(self) -> str:
        return identity.member_id(self.name, self._key)

    # ---------------------------------------------------------------- step-loop API

    def start(self) -> m.Welcome:
        """Connect and join; raises `CoordinatorUnreachable` or `JoinRefused`."""
        self._first.clear()
        self._first_error = None
        self._run_id += 1
        self._thread = threading.Thread(
            target=self._run, args=(self._run_id,), name=f"control-{self.name}", daemon=True
        )
        self._thread.start()
        if not self._first.wait(self.connect_timeout_s + 5):
            raise CoordinatorUnreachable(self._unreachable_message("no answer"))
        if self._first_error is not None:
            raise self._first_error
        assert self.welcome is not None
        return self.welcome

    def rejoin(self) -> m.Welcome:
        """After an expulsion: join again as a new member (a new member id)."""
        self.close()
        with self._lock:
            self.member_id = self._new_member_id()
            self.expelled = None
            self.orders.clear()
            self._closing = False
            self._last_acked_send = 0.0
        return self.start()

    def close(self) -> None:
        self._closing = True
        if self._loop is not None and self._queue is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None

    def send(self, msg: BaseModel) -> None:
        """Queue a report; dropped silently while the coordinator is unreachable."""
        loop, queue = self._loop, self._queue
        if loop is not None and queue is not None and self.connected:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, msg)

    def touch(self) -> None:
        """The step loop is alive (called from its every wait and micro-batch)."""
        self._loop_alive_at = time.monotonic()

    def latest_order(self) -> m.EpochOrder | None:
        with self._lock:
            return self.orders[-1] if self.orders else None

    def commit_allowed(self) -> bool:
        """True while this node can be sure it is still a member (see module docstring)."""
        with self._lock:
            if self.expelled is not None:
                return False
            if self.connected:
                return time.monotonic() - self._last_acked_send < self.lease_s
            return self._outage_trusted(time.monotonic())

    def _outage_trusted(self, now: float) -> bool:
        """(Under the lock.) Whether the outage is still vouched for; a lapse ends it."""
        if self.outage and now >= self._trusted_until:
            self.outage = False
            self.lapses += 1
            log.warning("outage: no recent evidence that no coordinator leads without this node")
            self.wake.set()
        return self.outage

    # ---------------------------------------------------------------- session thread

    def _run(self, run_id: int) -> None:
        asyncio.run(self._main(run_id))

    def _stale(self, run_id: int) -> bool:
        """A session thread left over from before a `rejoin` must do nothing more."""
        return self._closing or run_id != self._run_id

    async def _main(self, run_id: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        etcd = Etcd(self.etcd_endpoints, timeout_s=0.5, tls=self.etcd_tls) if self.etcd_endpoints else None
        self._etcd = etcd
        self._outage_began = asyncio.Event()
        # Its own client: its requests get shorter deadlines than the session's lookups.
        asking = Etcd(self.etcd_endpoints, tls=self.etcd_tls) if self.etcd_endpoints else None
        vouch = asyncio.create_task(self._vouch_forever(asking, self._outage_began))
        try:
            await self._connect_forever(run_id, etcd)
        finally:
            vouch.cancel()
            if asking is not None:
                await asking.close()
            if etcd is not None:
                await etcd.close()  # this run's client: a later run has its own

    async def _connect_forever(self, run_id: int, etcd: Etcd | None) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        last_error = "no attempt"
        given = {*self.addresses, *self.relays}
        async with aiohttp.ClientSession() as http:
            while not self._stale(run_id):
                candidates = await self._candidates(etcd)
                if self._shunned in candidates:
                    candidates = [a for a in candidates if a != self._shunned] + [self._shunned]
                tried: set[tuple[str, int]] = set()
                # A refusal at an address this node was not given (etcd or a standby named
                # it, and etcd may be written by others): final only if no address of the
                # round admits this node.
                hearsay: JoinRefused | None = None
                while candidates:
                    host, port = candidates.pop(0)
                    if (host, port) in tried:
                        continue
                    tried.add((host, port))
                    try:
                        await self._session(http, host, port, run_id)
                        last_error = "session ended"
                    except _Standby as exc:
                        last_error = f"{host}:{port}: {exc}"
                        with contextlib.suppress(ConfigError):
                            if exc.leader:
                                candidates.insert(0, parse_address(exc.leader))
                    except JoinRefused as exc:
                        if not self._first.is_set() and (host, port) not in given and set(candidates) - tried:
                            log.warning("%s; trying the other coordinators", exc)
                            hearsay = hearsay or exc
                            continue
                        if not self._first.is_set():
                            self._first_error = exc
                            self._first.set()
                            return
                        # A refused reconnect means the coordinator already counts us gone.
                        self._mark_expelled(f"reconnect refused: {exc}")
                        return
                    except ProtocolError as exc:  # the peer said something no coordinator says
                        log.warning("control session with %s:%d dropped: %s", host, port, exc)
                        last_error = f"{type(exc).__name__}: {exc}"
                    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                        last_error = f"{type(exc).__name__}: {exc}"
                    except Exception as exc:  # never let the session thread die silently
                        log.exception("control session failed; reconnecting")
                        last_error = f"{type(exc).__name__}: {exc}"
                    if self._stale(run_id) or self.expelled is not None:
                        return
                if hearsay is not None and not self._first.is_set():
                    self._first_error = hearsay
                    self._first.set()
                    return
                if not self._first.is_set() and time.monotonic() > deadline:
                    self._first_error = CoordinatorUnreachable(self._unreachable_message(last_error))
                    self._first.set()
                    return
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def _candidates(self, etcd: Etcd | None) -> list[tuple[str, int]]:
        """Where to look for the leader: through a relay first, then the leader etcd names,
        then the given addresses."""
        out = list(self.addresses)
        if etcd is None:
            return self.relays + out
        try:
            found = await find_leader(etcd, self.etcd_prefix, self._token)
        except EtcdUnavailable as exc:
            self._why_no_leader = str(exc)
            return self.relays + out
        if found is None:
            self._why_no_leader = f"etcd has no leader under {self.etcd_prefix!r} that may be followed"
            return self.relays + out
        leader = parse_address(str(found[0]["address"]))  # checked by `records.leader_problem`
        self._why_no_leader = ""
        return [*self.relays, leader, *(a for a in out if a != leader)]

    def _unreachable_message(self, why: str) -> str:
        where = ", ".join(f"{h}:{p}" for h, p in self.addresses)
        if self.etcd_endpoints:
            etcd = ", ".join(self.etcd_endpoints)
            return (
                f"found no coordinator leading under {self.etcd_prefix!r} in etcd at {etcd}"
                f"{' or at ' + where if where else ''} within {self.connect_timeout_s:g} s "
                f"({self._why_no_leader or why}); check that `unbroken coordinator --etcd ...` runs with "
                "the same --etcd-prefix, and that a majority of etcd is up"
            )
        return (
            f"could not reach a coordinator at {where} within {self.connect_timeout_s:g} s "
            f"({why}); check the address and that `unbroken coordinator` is running there"
        )

    async def _receive(self, ws: aiohttp.ClientWebSocketResponse, doing: str) -> m.CoordinatorMessage:
        return m.parse_coordinator_message(await self._receive_text(ws, doing))

    async def _receive_text(self, ws: aiohttp.ClientWebSocketResponse, doing: str) -> str:
        first = await asyncio.wait_for(ws.receive(), timeout=10)
        if first.type != aiohttp.WSMsgType.TEXT:
            raise ProtocolError(f"coordinator closed the session before {doing} ({first.type.name})")
        return str(first.data)

    async def _answer(self, ws: aiohttp.ClientWebSocketResponse, seal: auth.Seal | None) -> m.CoordinatorMessage:
        """The answer to a hello: sealed, or a plain refusal of the knock (a wrong token)."""
        text = await self._receive_text(ws, "welcoming")
        if seal is None:
            return m.parse_coordinator_message(text)
        impostor = "could not prove it holds the job token: not the job's coordinator (wrong address or an impostor)"
        if text.startswith("{"):
            msg = m.parse_coordinator_message(text)
            if not isinstance(msg, m.Refused):
                raise self._unproven(f"its {msg.type!r} came unsealed: it {impostor}")
            if self.welcome is not None:
                raise ProtocolError(f"an unsealed refusal ({msg.reason}) after this node was admitted: ignored")
            return m.Refused(reason=msg.reason)  # the refusal of a knock: nothing else it says is proven
        try:
            return m.parse_coordinator_message(seal.open(text))
        except ProtocolError:
            raise self._unproven(f"its answer failed its authentication: it {impostor}") from None

    def _unproven(self, why: str) -> Exception:
        """Fatal before this node was ever admitted (it is at the wrong address), retried
        after (someone on the path: the real coordinator is still there)."""
        return JoinRefused(f"coordinator {why}") if self.welcome is None else ProtocolError(why)

    async def _session(self, http: aiohttp.ClientSession, host: str, port: int, run_id: int) -> None:
        url = f"{'https' if self._ssl else 'http'}://{host}:{port}/ws"
        connect = asyncio.wait_for(
            http.ws_connect(
                url,
                timeout=aiohttp.ClientWSTimeout(ws_close=0.2),  # a frozen peer never answers a close
                max_msg_size=64 << 20,
                heartbeat=None,
                ssl=self._ssl if self._ssl is not None else True,
            ),
            timeout=5.0,
        )
        async with await connect as ws:
            if self._stale(run_id):
                return
            challenge = await self._receive(ws, "challenging")
            if not isinstance(challenge, m.Challenge):
                raise ProtocolError(f"expected a challenge from the coordinator, got {challenge.type}")
            if challenge.auth and self._token is None:
                raise JoinRefused(
                    f"coordinator at {host}:{port} requires the job token: pass --token, --token-file "
                    f"or set ${auth.ENV_TOKEN}"
                )
            if self._token is not None and not challenge.auth:
                raise self._unproven(
                    f"at {host}:{port} does not ask for a token but this node has one: refusing to train "
                    "under it (wrong address, or a coordinator started without --token?)"
                )
            knock = identity.knock(self.member_id, challenge.nonce, self._token, self._key)
            nonce = knock.nonce
            hello_sent = time.monotonic()
            seal = auth.seal(self._token, challenge.nonce, nonce, self.member_id, sending="up")
            await ws.send_str(m.encode(knock))
            await ws.send_str(auth.sealed(seal, m.encode(self._hello(self.member_id))))
            msg = await self._answer(ws, seal)
            if isinstance(msg, m.Refused) and msg.standby:
                raise _Standby(msg.leader, msg.reason)
            if isinstance(msg, m.Refused):
                if msg.finished:
                    with self._lock:
                        self.final_digest = msg.final_digest  # first: the step loop reads `finished` unlocked
                        self.finished = 0
                raise JoinRefused(f"coordinator at {host}:{port} refused {self.name}: {msg.reason}")
            if not isinstance(msg, m.Welcome):
                raise ProtocolError(f"expected welcome, got {msg.type}")
            if self._token is not None:
                expected = auth.coordinator_proof(self._token, challenge.nonce, nonce, self.member_id)
                if not auth.same(expected, msg.proof):
                    raise JoinRefused(
                        f"coordinator at {host}:{port} could not prove it holds the job token: "
                        "not the job's coordinator (wrong address or an impostor)"
                    )
            with self._lock:
                if msg.term < self.term:
                    raise ProtocolError(
                        f"coordinator at {host}:{port} leads term {msg.term}, older than term {self.term}: deposed"
                    )
                self.term = msg.term
                other = self.welcome is None or self.welcome.coordinator_id != msg.coordinator_id
                self.welcome = msg
                self.lease_s = msg.lease_s
                self.connected = True
                self.outage = False
                self._last_acked_send = hello_sent  # the lease runs from our hello, not its answer
            self._via_relay = (host, port) in self.relays
            self._current = (host, port)
            if self._shunned == self._current:
                self._shunned = None
            if self.on_welcome is not None:
                self.on_welcome(msg, other)
            self._first.set()
            self.wake.set()
            log.info("%s joined coordinator %s at %s:%d", self.member_id, msg.coordinator_id, host, port)
            beats = asyncio.create_task(self._heartbeats(msg.heartbeat_s, ws))
            watch = asyncio.create_task(self._watch_leader(ws, msg.heartbeat_s))
            writer = asyncio.create_task(self._writer(ws, seal))
            try:
                async for raw in ws:
                    if raw.type != aiohttp.WSMsgType.TEXT:
                        break
                    self._on_message(m.parse_coordinator_message(auth.opened(seal, raw.data)))
            finally:
                beats.cancel()
                watch.cancel()
                writer.cancel()
                with self._lock:
                    fresh = time.monotonic() - self._last_acked_send < self.lease_s
                    self.connected = False
                    self.outage = fresh and self.expelled is None
                    self._trusted_until = self._last_acked_send + self._outage_trust_s
                    self.lapses += 0 if fresh else 1
                if self.outage:
                    self._outage_began.set()
                self.wake.set()
                if not self._closing and self.expelled is None:
                    log.warning("lost the coordinator session (%s)", "lease fresh: outage" if fresh else "lease stale")

    async def _heartbeats(self, period: float, ws: aiohttp.ClientWebSocketResponse) -> None:
        assert self._queue is not None
        while True:
            # A coordinator that went silent (host down, cable cut) sends no reset: give up on
            # the session so we reconnect or fail over to another address; but not while it
            # may only be stalled (it forgives the time it was not listening, and a session
            # dropped then would be a failure). With etcd a leader that lost its lease is left
            # sooner (`_watch_leader`). A relay's members leave it after two leases (its
            # acknowledgements wait for the leader's, slower under load): the leader keeps
            # their leases three and a half leases after it finds the relay silent.
            patience = (2.0 if self._via_relay else 3.0) * self.lease_s
            if time.monotonic() - self._last_acked_send > patience:
                log.warning("no heartbeat acknowledged for %.1f s; dropping the session", patience)
                self._shunned = self._current  # tried last next time: a frozen peer answers no handshake
                await ws.close()
                return
            if time.monotonic() - self._counted_at < period:
                await asyncio.sleep(period)  # a progress report just kept the lease: no heartbeat needed
                continue
            stalled = time.monotonic() - self._loop_alive_at
            if stalled > self.stall_timeout_s:
                # Heartbeats say "this node trains"; a step loop stuck this long does not,
                # so stay silent and let the lease expel it rather than stall the group.
                if not self._stall_reported:
                    log.error("step loop made no progress for %.0f s: withholding heartbeats", stalled)
                    self._stall_reported = True
            else:
                self._stall_reported = False
                self._queue.put_nowait(m.Heartbeat(seq=0, step=self.step))
            await asyncio.sleep(period)

    async def _watch_leader(self, ws: aiohttp.ClientWebSocketResponse, period: float) -> None:
        """Leave a leader that stopped answering as soon as etcd shows it lost its lease (its
        own task: a slow etcd member must not hold up the heartbeats)."""
        while True:
            await asyncio.sleep(period)
            unacked = time.monotonic() - self._last_acked_send
            if unacked > self.lease_s / 2 and self.term > 0 and await self._leader_moved():
                log.warning("the leader of term %d lost its etcd lease: leaving its session", self.term)
                await ws.close()
                return

    async def _leader_moved(self) -> bool:
        """True when etcd shows no leader, or one of another term than this session's."""
        if self._etcd is None:
            return False
        try:
            kv = await self._etcd.get(leader_key(self.etcd_prefix))
        except EtcdUnavailable:
            return False  # cut off from etcd too: nothing is known; the lease decides
        if kv is not None and records.leader(kv, self._token) is None:
            return False  # a record nobody may follow says nothing of the leader: the lease decides
        return kv is None or kv.create_revision != self.term

    @property
    def _outage_trust_s(self) -> float:
        return self.lease_s * m.OUTAGE_TRUST_LEASES

    async def _vouch_forever(self, etcd: Etcd | None, began: asyncio.Event) -> None:
        """During each outage (``began`` is set as it starts), renew its trust four times a
        trust while there is evidence, the first time at once: the lease it starts from may
        be nearly spent (a leader losing etcd holds its acknowledgements back)."""
        while True:
            await began.wait()
            began.clear()
            while True:
                with self._lock:
                    if not self._outage_trusted(time.monotonic()):
                        break
                asked = time.monotonic()
                try:
                    vouched = await asyncio.wait_for(self._nobody_else_leads(etcd), timeout=self._outage_trust_s * 0.75)
                except asyncio.TimeoutError:
                    vouched = False
                except Exception:  # a bug here must not end the renewals: no evidence, the lease decides
                    log.exception("asking for evidence of an outage failed")
                    vouched = False
                with self._lock:
                    if vouched and self._outage_trusted(time.monotonic()):
                        self._trusted_until = max(self._trusted_until, asked + self._outage_trust_s)
                await asyncio.sleep(self._outage_trust_s / 4)

    async def _nobody_else_leads(self, etcd: Etcd | None) -> bool:
        """Evidence, as of when this was called, that no coordinator has started since this
        node's last session: none can have formed an epoch without it (module docstring)."""
        if etcd is None:
            wait = self._outage_trust_s / 4
            refusals = await asyncio.gather(*(_refuses(h, p, wait) for h, p in self.addresses))
            return bool(refusals) and all(refusals)
        etcd.timeout_s = self._outage_trust_s / 6  # a silent member must not use up the check
        views = await etcd.views()
        if View.LED not in views:
            # Every member down or outside a majority: nobody can be elected. (A silent one
            # might be leading a majority that this node cannot see; so might members this
            # node was not told of.)
            if not all(v in (View.DOWN, View.LEADERLESS) for v in views):
                return False
            try:
                return await etcd.cluster_size() <= len(set(etcd.endpoints))
            except EtcdUnavailable:
                return False
        try:
            held = await etcd.get(leader_key(self.etcd_prefix))
            published = await etcd.get(epoch_key(self.etcd_prefix))
        except EtcdUnavailable:
            return False
        newest = self.latest_order()
        # A record that may not be believed hides what was there: no evidence either way.
        epoch_record = records.epoch(published, self._token) if published is not None else {"epoch": 0}
        if epoch_record is None or epoch_record["epoch"] > (newest.epoch if newest else 0):
            return False  # an epoch this node has not had (or a record it cannot believe)
        if held is None:
            return True
        record = records.leader(held, self._token)
        if record is None or held.create_revision != self.term:
            return False
        try:  # the leader of this node's term: still there unless its address refuses connections
            host, port = parse_address(str(record.get("address", "")))
        except ConfigError:
            return False
        return await _refuses(host, port, self._outage_trust_s / 4)

    async def _writer(self, ws: aiohttp.ClientWebSocketResponse, seal: auth.Seal | None) -> None:
        assert self._queue is not None
        while True:
            msg = await self._queue.get()
            if msg is None:
                await ws.close()
                return
            if isinstance(msg, (m.Heartbeat, m.Progress)):
                msg = msg.model_copy(update={"seq": self._count_send()})
            await ws.send_str(auth.sealed(seal, m.encode(msg)))

    def _count_send(self) -> int:
        """Number a message that keeps the lease (its acknowledgement says when it was sent)."""
        self._seq += 1
        self._counted_at = time.monotonic()
        with self._lock:
            self._sent[self._seq] = self._counted_at
            for old in [s for s in self._sent if s < self._seq - 64]:
                del self._sent[old]
        return self._seq

    def _on_message(self, msg: m.CoordinatorMessage) -> None:
        with self._lock:
            if isinstance(msg, m.Ack):
                sent = self._sent.get(msg.seq)
                if sent is not None:
                    self._last_acked_send = max(self._last_acked_send, sent)
                    self._rtts.append(time.monotonic() - sent)
                    # The least of recent round trips is the path's latency; a busy node's
                    # scheduling delays only add to it (zones by RTT must not follow load).
                    # Until there are enough of them it says nothing: a node busy starting up
                    # answers its first acknowledgements late, and would be put in a zone of
                    # its own on the same site.
                    self.rtt_s = min(self._rtts) if len(self._rtts) >= RTT_SAMPLES else 0.0
                return
            fenced = (m.EpochOrder, m.Command, m.Expel, m.Finished, m.Met, m.Probe, m.Check, m.Verify)
            if isinstance(msg, fenced) and msg.term < self.term:
                log.warning("refusing a %s of term %d (have seen term %d): fenced", msg.type, msg.term, self.term)
                return
            if isinstance(msg, m.EpochOrder):
                newest = self.orders[-1].epoch if self.orders else -1
                if msg.epoch <= newest:
                    log.warning("ignoring order for epoch %d (have %d): fenced", msg.epoch, newest)
                    return
                msg = complete(msg, self.orders[-1] if self.orders else None)
                self.orders.append(msg)
                del self.orders[:-8]
            elif isinstance(msg, m.Expel):
                self.quarantined = msg.final  # first: the step loop reads `expelled` unlocked
                self.expelled = msg.reason
            elif isinstance(msg, m.Finished):
                self.final_digest = msg.digest  # first: the step loop reads `finished` unlocked
                self.halted = msg.error or None
                self.finished = msg.step
        if isinstance(msg, m.Command) and self.on_command is not None:
            self.on_command(msg)
        if isinstance(msg, m.Met):
            if self.on_met is not None:
                self.on_met(msg)
            return  # nothing for the step loop to wake for: the build waits on its store
        if isinstance(msg, m.Probe):
            if self.on_probe is not None:
                self.on_probe(msg)
            return
        if isinstance(msg, m.Check):
            if self.on_check is not None:
                self.on_check(msg)
            return
        if isinstance(msg, m.Verify):
            if self.on_verify is not None:
                self.on_verify(msg)
            return
        self.wake.set()

    def _mark_expelled(self, reason: str) -> None:
        with self._lock:
            self.expelled = reason
        self.wake.set()


async def _refuses(host: str, port: int, timeout_s: float) -> bool:
    """True when ``host:port`` refuses a connection (nothing listens there); False when it
    accepts or does not answer in time."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False
