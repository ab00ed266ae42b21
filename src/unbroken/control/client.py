"""A node's persistent session to the coordinator, run on its own thread.

The session joins, heartbeats, forwards reports and receives orders. The step loop reads
what it learned through a few thread-safe properties and waits on `wake`, which is set
whenever something arrives that may end the step in flight.

The commit fence: a node may only commit while it is sure it has not been expelled. While
connected, that means a heartbeat *sent* less than one lease ago was acknowledged (the
coordinator counts the lease from when it *received* that heartbeat, which is later). A
node whose session dropped while its lease was fresh assumes a coordinator outage and
keeps training with its group (a trust renewed by evidence, `outage`); one that finds its
lease stale (it was frozen) must not commit until the coordinator has answered.

The session's state (connected, suspended in an outage, lost) is a state machine of its
own (`connection`), tested on a fake clock; what vouches for an outage is in `outage`.
Every transition, and every order the step loop does not itself poll for (an operator's
command, rendezvous entries, probes, checks), goes to the client's listeners, in one list.

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
import math
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeAlias

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel

from unbroken.config import parse_address
from unbroken.control import auth, identity, leaders, resumes
from unbroken.control import messages as m
from unbroken.control.connection import Change, Clock, Connection, State
from unbroken.control.etcd import Etcd, EtcdTLS
from unbroken.control.orders import complete
from unbroken.control.outage import nobody_else_leads
from unbroken.errors import ConfigError, CoordinatorUnreachable, JoinRefused, ProtocolError

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.1

Notice: TypeAlias = "Change | m.EpochOrder | m.Command | m.Met | m.Probe | m.Check | m.Verify"
"""What a listener is told: a change of the session's state (a welcome among them), an
order the step loop does not poll for, or an epoch order as it arrives (the step loop
polls it later; what must change before the epoch's rendezvous entries arrive changes now)."""
Listener = Callable[[Notice], None]
"""Called on the thread that caused the notice (mostly the control thread): it must not block."""


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
        clock: Clock = time.monotonic,
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
        self._resume_in_full = False
        """The coordinator asked for the resume's lists (`unbroken.control.resumes`)."""
        self._token = token
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.wake = wake
        self._lock = threading.Lock()
        self.member_id = self._new_member_id()
        self._clock = clock
        self._listeners: list[Listener] = []
        self.connection = Connection(self._changed, clock)
        """The session's state (`connection`): connected, suspended in an outage, or lost."""
        self.orders: list[m.EpochOrder] = []
        self.expelled: str | None = None
        self.quarantined = False
        """The expulsion is final: this node must not come back (`Expel.final`)."""
        self.finished: int | None = None
        self.halted: str | None = None
        """The job was stopped on this error rather than finished (`Finished.error`)."""
        self.final_digest = ""
        """Once ``finished``: the state the job finished with, as the leader said (may be empty)."""
        self._outage_began = asyncio.Event()
        """Set (on the session thread's loop) when an outage starts: its renewals begin."""
        self.step = 0
        """The step this node has committed (what its heartbeats say)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[BaseModel | None] | None = None
        self._thread: threading.Thread | None = None
        self._first = threading.Event()
        self._first_error: BaseException | None = None
        self._closing = False
        self._run_id = 0
        self.stall_timeout_s = stall_timeout_s
        self._loop_alive_at = clock()
        self._stall_reported = False
        self._late_said_at = -math.inf

    def add_listener(self, listener: Listener) -> None:
        """Tell ``listener`` every notice from now on (see `Notice`)."""
        self._listeners = [*self._listeners, listener]  # a new list: notices read it unlocked

    def _tell(self, notice: Notice) -> None:
        for listener in self._listeners:
            listener(notice)

    def _changed(self, change: Change) -> None:
        log.debug("%s: control session %s -> %s", self.name, change.old.value, change.new.value)
        self._tell(change)
        self.wake.set()

    @property
    def rtt_s(self) -> float:
        """Round-trip time of heartbeats to the coordinator (`Connection.rtt_s`)."""
        return self.connection.rtt_s

    @property
    def welcome(self) -> m.Welcome | None:
        """The last welcome (None before the first)."""
        return self.connection.welcome

    @property
    def connected(self) -> bool:
        return self.connection.state is State.CONNECTED

    @property
    def outage(self) -> bool:
        """The session dropped with the lease fresh, and the outage is still trusted."""
        return self.connection.state is State.SUSPENDED

    @property
    def lapses(self) -> int:
        """Sessions lost with the lease already stale (`connection`)."""
        return self.connection.lapses

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
        self.connection.forget_lease()
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
        self._loop_alive_at = self._clock()

    def latest_order(self) -> m.EpochOrder | None:
        with self._lock:
            return self.orders[-1] if self.orders else None

    def commit_allowed(self) -> bool:
        """True while this node can be sure it is still a member (see module docstring)."""
        with self._lock:
            if self.expelled is not None:
                return False
        return self.connection.commit_allowed()

    def expel(self, reason: str) -> None:
        """Take this node for expelled (``reason``): the step loop rejoins as a new member."""
        with self._lock:
            self.expelled = reason
        self.wake.set()

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
        deadline = self._clock() + self.connect_timeout_s
        last_error = "no attempt"
        given = {*self.addresses, *self.relays}
        async with aiohttp.ClientSession() as http:
            while not self._stale(run_id):
                candidates, self._why_no_leader = await leaders.candidates(
                    etcd, self.etcd_prefix, self._token, self.addresses, self.relays
                )
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
                        self.expel(f"reconnect refused: {exc}")
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
                if not self._first.is_set() and self._clock() > deadline:
                    self._first_error = CoordinatorUnreachable(self._unreachable_message(last_error))
                    self._first.set()
                    return
                await asyncio.sleep(RECONNECT_DELAY_S)

    def _unreachable_message(self, why: str) -> str:
        return leaders.unreachable_message(
            self.addresses, self.etcd_endpoints, self.etcd_prefix, self.connect_timeout_s, self._why_no_leader or why
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
            hello_sent = self._clock()
            seal = auth.seal(self._token, challenge.nonce, nonce, self.member_id, sending="up")
            await ws.send_str(m.encode(knock))
            hello = self._hello(self.member_id)
            if hello.resume is not None and not self._resume_in_full:
                hello = hello.model_copy(update={"resume": resumes.digested(hello.resume)})
            await ws.send_str(auth.sealed(seal, m.encode(hello)))
            msg = await self._answer(ws, seal)
            if isinstance(msg, m.Refused) and msg.resume_in_full and not self._resume_in_full:
                # The coordinator holds no lists its digest matches (it has just started): say
                # them, on a new session at once (a hello is answered once).
                self._resume_in_full = True
                await ws.close()
                return await self._session(http, host, port, run_id)
            self._resume_in_full = False
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
            self._via_relay = (host, port) in self.relays
            self._current = (host, port)
            if self._shunned == self._current:
                self._shunned = None
            self.connection.welcomed(msg, hello_sent)  # the listeners' welcome comes first
            self._first.set()
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
                now = self.connection.dropped(expelled=self.expelled is not None)
                if now is State.SUSPENDED:
                    self._outage_began.set()
                if not self._closing and self.expelled is None:
                    log.warning(
                        "lost the coordinator session (%s)",
                        "lease fresh: outage" if now is State.SUSPENDED else "lease stale",
                    )

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
            patience = (2.0 if self._via_relay else 3.0) * self.connection.lease_s
            if self.connection.unacked_s() > patience:
                log.warning("no heartbeat acknowledged for %.1f s; dropping the session", patience)
                self._shunned = self._current  # tried last next time: a frozen peer answers no handshake
                await ws.close()
                return
            if self._clock() - self.connection.counted_at < period:
                await self._nap(period)  # a progress report just kept the lease: no heartbeat needed
                continue
            stalled = self._clock() - self._loop_alive_at
            if stalled > self.stall_timeout_s:
                # Heartbeats say "this node trains"; a step loop stuck this long does not,
                # so stay silent and let the lease expel it rather than stall the group.
                if not self._stall_reported:
                    log.error("step loop made no progress for %.0f s: withholding heartbeats", stalled)
                    self._stall_reported = True
            else:
                self._stall_reported = False
                self._queue.put_nowait(m.Heartbeat(seq=0, step=self.step))
            await self._nap(period)

    async def _nap(self, period: float) -> None:
        """Sleep ``period``; say when this thread woke much later (the process did not run: a
        thread holding the GIL, or a machine too busy for the lease)."""
        due = self._clock() + period
        await asyncio.sleep(period)
        late, lease = self._clock() - due, self.connection.lease_s
        if late > lease / 2 and due - self._late_said_at > 60:
            self._late_said_at = due
            log.warning("heartbeat %.2f s late (lease %.1f s): a machine this busy needs a longer --lease", late, lease)

    async def _watch_leader(self, ws: aiohttp.ClientWebSocketResponse, period: float) -> None:
        """Leave a leader that stopped answering as soon as etcd shows it lost its lease (its
        own task: a slow etcd member must not hold up the heartbeats)."""
        while True:
            await asyncio.sleep(period)
            if (
                self.connection.unacked_s() > self.connection.lease_s / 2
                and self.term > 0
                and await leaders.leader_moved(self._etcd, self.etcd_prefix, self._token, self.term)
            ):
                log.warning("the leader of term %d lost its etcd lease: leaving its session", self.term)
                await ws.close()
                return

    async def _vouch_forever(self, etcd: Etcd | None, began: asyncio.Event) -> None:
        """During each outage (``began`` is set as it starts), renew its trust four times a
        trust while there is evidence, the first time at once: the lease it starts from may
        be nearly spent (a leader losing etcd holds its acknowledgements back)."""
        while True:
            await began.wait()
            began.clear()
            while self.connection.trusted():
                asked = self._clock()
                trust_s = self.connection.trust_s
                try:
                    vouched = await asyncio.wait_for(self._nobody_else_leads(etcd), timeout=trust_s * 0.75)
                except asyncio.TimeoutError:
                    vouched = False
                except Exception:  # a bug here must not end the renewals: no evidence, the lease decides
                    log.exception("asking for evidence of an outage failed")
                    vouched = False
                if vouched:
                    self.connection.vouched(asked)
                await asyncio.sleep(trust_s / 4)

    async def _nobody_else_leads(self, etcd: Etcd | None) -> bool:
        """Evidence, as of when this was called, that no coordinator has started since this
        node's last session (`outage.nobody_else_leads`)."""
        newest = self.latest_order()
        return await nobody_else_leads(
            etcd, self.addresses, self.etcd_prefix, self._token, term=self.term,
            epoch=newest.epoch if newest else 0, trust_s=self.connection.trust_s,
        )  # fmt: skip

    async def _writer(self, ws: aiohttp.ClientWebSocketResponse, seal: auth.Seal | None) -> None:
        assert self._queue is not None
        while True:
            msg = await self._queue.get()
            if msg is None:
                await ws.close()
                return
            if isinstance(msg, (m.Heartbeat, m.Progress)):
                msg = msg.model_copy(update={"seq": self.connection.sending()})
            await ws.send_str(auth.sealed(seal, m.encode(msg)))

    def _on_message(self, msg: m.CoordinatorMessage) -> None:
        if isinstance(msg, m.Ack):
            self.connection.acked(msg.seq)
            return
        with self._lock:
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
        if isinstance(msg, (m.EpochOrder, m.Command, m.Met, m.Probe, m.Check, m.Verify)):
            self._tell(msg)  # an order completed above, and newer than any before
        if not isinstance(msg, (m.Met, m.Probe, m.Check, m.Verify)):
            self.wake.set()  # a rendezvous entry or a check: nothing for the step loop to wake for
