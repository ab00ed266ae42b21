"""A zone's sub-coordinator: it holds its members' sessions and speaks for them to the leader.

::

    unbroken relay --coordinator ROOT:29400 --port 29450 --zone eu [--token-file F]
    unbroken node job.py --coordinator RELAY:29450,ROOT:29400 --zone eu

Nodes connect to a relay exactly as to a coordinator (same challenge, hello, heartbeats).
The relay checks each node's token proof itself, forwards its hello, and from then on:

* liveness: it collects its members' heartbeats and progress reports and sends the leader,
  every tenth of a lease, one batch (`messages.Up`) listing who was heard and what they
  said; a node's heartbeat is acknowledged only once the leader acknowledged the batch
  that carried it, so a node's commit fence still means "the leader counts my lease";
* orders: the leader sends each epoch order once per relay (`messages.Down`, addressed to
  the members it is for); the relay fans it out;
* failures: a member whose session with the relay drops is reported at once (it fails as
  a dropped direct session does); if the relay itself dies, its members lose only their
  session: they reconnect to the next address they were given (the leader, or another
  relay) within their lease and the leader takes them back as they were, with no epoch
  change. A relay cut off from the leader refuses hellos as a standby naming the leader,
  so nodes go there directly.

The leader sees one session per relay instead of one per node: at a hundred members a
relay, ten thousand nodes are a hundred sessions and about a thousand batches a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from unbroken.config import parse_address
from unbroken.control import auth, browsers, identity
from unbroken.control import messages as m
from unbroken.control.batches import Batches
from unbroken.control.election import find_leader
from unbroken.control.etcd import Etcd, EtcdTLS
from unbroken.control.office import Gate
from unbroken.control.outsiders import listen
from unbroken.control.service import ThreadedService
from unbroken.control.sessions import HELLO_TIMEOUT_S, Doorman, Session, greet, parse_off_loop, read_hello, turn_away
from unbroken.errors import ConfigError, EtcdUnavailable, ProtocolError

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.1
RELINK_WAIT_S = 3.0
"""After its leader's session ended (the leader died, or was deposed), how long the relay holds
a node that connects before it challenges it, waiting to link to the next leader: its
members come back through it rather than around it, and an election takes about the
leader's etcd lease. A relay that left a silent leader (cut off) waits for nothing: its
members go to the leader directly within the leases the leader keeps for them."""


@dataclass
class RelayConfig:
    coordinators: list[tuple[str, int]] = field(default_factory=list)
    """The leader, or any coordinator of the job (a standby names the leader)."""
    host: str = "127.0.0.1"
    port: int = 0
    zone: str = ""
    token: str | None = None
    etcd: list[str] = field(default_factory=list)
    etcd_prefix: str = "/unbroken/job"
    etcd_tls: EtcdTLS | None = None
    """Certificates for an etcd that serves TLS (``--etcd-cacert``, ``--etcd-cert``, ``--etcd-key``)."""
    relay_id: str = ""
    """The relay's name (default: the host's); its id adds its key's (`identity.member_id`)."""
    max_message_bytes: int = 1 << 20
    """The largest message a node may send."""
    key: Ed25519PrivateKey | None = None
    """The relay's identity (`unbroken.control.identity`; None: one of its own for the process)."""
    tls_cert: Path | None = None
    """Serve the relay's nodes over TLS with this certificate chain (PEM)..."""
    tls_key: Path | None = None
    """...and this private key (PEM)."""
    tls_ca: Path | None = None
    """Link to the leader over TLS, trusting this CA bundle (PEM): the job's coordinators
    serve TLS (``--tls-cert``)."""

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("a relay serving TLS needs both --tls-cert and --tls-key, or neither")
        for path in (self.tls_cert, self.tls_key, self.tls_ca):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"TLS file {path} does not exist")

    def server_tls(self) -> ssl.SSLContext | None:
        """What the relay's nodes connect to: None for plain TCP."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def client_tls(self) -> ssl.SSLContext | None:
        """How the relay dials the leader: None for plain TCP."""
        return ssl.create_default_context(cafile=str(self.tls_ca)) if self.tls_ca is not None else None


async def _text(ws: aiohttp.ClientWebSocketResponse) -> str:
    raw = await ws.receive(timeout=HELLO_TIMEOUT_S)
    if raw.type != WSMsgType.TEXT:
        raise ProtocolError(f"the leader's session ended during the handshake ({raw.type.name})")
    return str(raw.data)


def _answer(text: str, seal: auth.Seal | None) -> m.LeaderMessage:
    """The leader's answer to a relay's hello: sealed, or a plain refusal of its proof."""
    if seal is not None and text.startswith("{"):
        answer = m.parse_leader_message(text)
        if not isinstance(answer, m.Refused):
            raise ProtocolError(f"the leader's {answer.type!r} came unsealed: not the job's leader")
        return m.Refused(reason=answer.reason)  # unproven: no leader hint to follow
    return m.parse_leader_message(auth.opened(seal, text))


async def _always() -> Gate:
    return Gate.SEND  # the leader decided when to send; a relay passes it on at once


class _Member:
    def __init__(self, ws: web.WebSocketResponse, member_id: str, seal: auth.Seal | None) -> None:
        self.member_id = member_id
        self.seal = seal
        self.session = Session(ws, member_id, _always, seal)


class Relay(ThreadedService):
    """One relay process's service (``serve``), or from Python: ``Relay(config).start()``."""

    name = "relay"

    def __init__(self, config: RelayConfig) -> None:
        super().__init__()
        self.config = config
        self.key = config.key or identity.ephemeral()
        self.relay_id = identity.member_id(config.relay_id or socket.gethostname(), self.key)
        self.address: tuple[str, int] = (config.host, config.port)
        self.forwarding = ""
        """Where a forwarder beside it takes members behind NAT (HOST:PORT), as its hello says."""
        self.leader: tuple[str, int] | None = None
        """The leader this relay is linked to (None: none now)."""
        self.term = 0
        self.lease_s = 1.0
        self._leader_hint: tuple[str, int] | None = None
        self._up: aiohttp.ClientWebSocketResponse | None = None
        self._members: dict[str, _Member] = {}
        self._hellos: dict[str, asyncio.Future[m.CoordinatorMessage]] = {}
        self._link_nonce = ""
        """The leader's part of the challenges sent to nodes (`m.RelayWelcome.link`)."""
        self._challenges = 0
        self._early: dict[str, list[str]] = {}
        self.doorman = Doorman()
        """Messages for members welcomed but not yet registered (their welcome came in the same read)."""
        self._batches = Batches()
        """What goes up to the leader next (`unbroken.control.batches`)."""
        self._acked_at = 0.0
        self._urgent: asyncio.Event | None = None
        self._linked: asyncio.Event | None = None
        """Set while linked to a leader."""
        self._relink_by = 0.0
        """Until when a node that connects waits for a link (`RELINK_WAIT_S`; monotonic)."""
        self._left_silent = False
        self.batches_sent = 0
        self.messages_down = 0

    # ---------------------------------------------------------------- lifecycle

    async def serve(self) -> None:
        stopping = self._begin()
        self._urgent = asyncio.Event()
        self._linked = asyncio.Event()
        names = await browsers.names_of(self.config.host)  # a page of another site opens no session here
        app = web.Application(
            client_max_size=self.config.max_message_bytes, middlewares=[self.guard.middleware, browsers.guard(names)]
        )
        app.router.add_get("/ws", self._downstream)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/healthz", self._health)
        runner, port = await listen(app, self.guard, self.config.host, self.config.port, self.config.server_tls())
        self.address = (self.config.host, port)
        log.info("relay %s on %s:%d (zone %r)", self.relay_id, *self.address, self.config.zone)
        upstream = asyncio.create_task(self._upstream_forever(), name="relay-upstream")
        self._listening()
        try:
            await stopping.wait()
        finally:
            upstream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await upstream
            for member in list(self._members.values()):
                member.session.close()
            await runner.cleanup()

    def snapshot(self) -> dict[str, Any]:
        return {
            "relay_id": self.relay_id,
            "zone": self.config.zone,
            "leader": f"{self.leader[0]}:{self.leader[1]}" if self.leader else None,
            "term": self.term,
            "members": sorted(self._members),
            "batches_sent": self.batches_sent,
            "messages_down": self.messages_down,
            "outsiders": self.guard.state(),
        }

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "relay_id": self.relay_id, "linked": self._up is not None})

    # ---------------------------------------------------------------- upstream

    async def _upstream_forever(self) -> None:
        etcd = Etcd(self.config.etcd, timeout_s=0.5, tls=self.config.etcd_tls) if self.config.etcd else None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=2)) as http:
            while True:
                for host, port in await self._candidates(etcd):
                    try:
                        await self._link(http, host, port)
                    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ProtocolError) as exc:
                        log.debug("relay link to %s:%d: %s", host, port, exc)
                    except Exception:  # the link must be tried again whatever went wrong
                        log.exception("relay link to %s:%d failed", host, port)
                    if self._leader_hint is not None:
                        break  # a standby named the leader: try it first
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def _candidates(self, etcd: Etcd | None) -> list[tuple[str, int]]:
        found: list[tuple[str, int]] = []
        if self._leader_hint is not None:
            found.append(self._leader_hint)
            self._leader_hint = None
        if etcd is not None:
            with contextlib.suppress(EtcdUnavailable, ConfigError):
                leader = await find_leader(etcd, self.config.etcd_prefix, self.config.token)
                if leader is not None:
                    found.append(parse_address(str(leader[0].get("address", ""))))
        return list(dict.fromkeys(found + list(self.config.coordinators)))

    async def _link(self, http: aiohttp.ClientSession, host: str, port: int) -> None:
        tls = self.config.client_tls()
        url = f"{'https' if tls else 'http'}://{host}:{port}/relay"
        async with http.ws_connect(url, heartbeat=None, max_msg_size=256 << 20, ssl=tls if tls else True) as ws:
            challenge = m.parse_leader_message(await _text(ws))
            if not isinstance(challenge, m.Challenge):
                raise ProtocolError(f"expected a challenge, got {challenge.type!r}")
            token = self.config.token
            nonce = auth.new_nonce()
            proof = auth.node_proof(token, challenge.nonce, nonce, self.relay_id) if token else ""
            signature = identity.sign(self.key, challenge.nonce, nonce, self.relay_id, role="relay")
            hello = m.RelayHello(
                relay_id=self.relay_id, zone=self.config.zone, nonce=nonce, proof=proof,
                key=identity.public_text(self.key), signature=signature, forwarding=self.forwarding,
            )  # fmt: skip
            await ws.send_str(m.encode(hello))
            seal = auth.seal(token, challenge.nonce, nonce, self.relay_id, sending="up")
            answer = _answer(await _text(ws), seal)
            if isinstance(answer, m.Refused):
                if answer.standby and answer.leader:
                    self._leader_hint = parse_address(answer.leader)
                    return
                raise ProtocolError(f"refused by {host}:{port}: {answer.reason}")
            if not isinstance(answer, m.RelayWelcome):
                raise ProtocolError(f"expected a relay welcome, got {answer.type!r}")
            if token and not auth.same(
                auth.coordinator_proof(token, challenge.nonce, nonce, self.relay_id), answer.proof
            ):
                raise ProtocolError(f"{host}:{port} could not prove it holds the job token")
            self._up, self.leader, self.term, self.lease_s = ws, (host, port), answer.term, answer.lease_s
            self._link_nonce = answer.link
            self._left_silent = False
            if self._linked is not None:
                self._linked.set()
            log.info("relay %s linked to %s:%d (term %d)", self.relay_id, host, port, answer.term)
            flusher = asyncio.create_task(self._flush_forever(ws, seal))
            try:
                async for raw in ws:
                    if raw.type != WSMsgType.TEXT:
                        break
                    self._from_leader(m.parse_leader_message(auth.opened(seal, raw.data)))
            finally:
                flusher.cancel()
                self._unlink(f"lost the leader at {host}:{port}")

    def _unlink(self, why: str) -> None:
        """Without a leader the members' sessions end: they come back through this relay once
        it links to the next leader, or fall back to their next address."""
        self._up, self.leader, self._link_nonce = None, None, ""
        if self._linked is not None:
            self._linked.clear()
        self._relink_by = 0.0 if self._left_silent else time.monotonic() + RELINK_WAIT_S
        log.warning("relay %s: %s; ending %d member sessions", self.relay_id, why, len(self._members))
        for member in list(self._members.values()):
            member.session.close()
        self._members.clear()
        for fut in self._hellos.values():
            if not fut.done():
                fut.set_exception(ProtocolError(why))
        self._hellos.clear()
        self._early.clear()
        self._batches.clear()

    async def _flush_forever(self, ws: aiohttp.ClientWebSocketResponse, seal: auth.Seal | None) -> None:
        assert self._urgent is not None
        period = self.lease_s / 10
        self._acked_at = time.monotonic()
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), timeout=period)
            self._urgent.clear()
            if time.monotonic() - self._acked_at > 2 * self.lease_s:
                # A leader that stopped answering (frozen, cut off) sends no reset: leave it,
                # so the members fall back and this relay links to whoever leads now.
                log.warning("relay %s: no batch acknowledged for %.1f s; leaving the leader", self.relay_id,
                            2 * self.lease_s)  # fmt: skip
                self._left_silent = True
                await ws.close()
                return
            ups = self._batches.take(time.monotonic(), self._members, self.lease_s)
            for up in ups:
                await ws.send_str(auth.sealed(seal, m.encode(up)))
            self.batches_sent += len(ups)

    def _from_leader(self, msg: m.LeaderMessage) -> None:
        if isinstance(msg, m.Ack):
            self._acked_at = time.monotonic()
            for mid, node_seq in self._batches.acked(msg.seq, msg.report_s):
                member = self._members.get(mid)
                if member is not None:
                    member.session.send(m.Ack(seq=node_seq))
            return
        if not isinstance(msg, m.Down):
            raise ProtocolError(f"unexpected {msg.type!r} from the leader")
        inner = msg.msg
        if isinstance(inner, (m.Welcome, m.Refused)):
            for mid in msg.to:
                fut = self._hellos.pop(mid, None)
                if fut is not None and not fut.done():
                    fut.set_result(inner)
                    if isinstance(inner, m.Welcome):
                        self._early[mid] = []  # what comes before its session is registered
            return
        text = m.encode(inner)
        for mid in msg.to:
            member = self._members.get(mid)
            if member is None:
                if mid in self._early:
                    self._early[mid].append(text)  # read in the same batch as its welcome
                continue
            member.session.send_text(text)
            self.messages_down += 1
            if isinstance(inner, m.Expel):
                member.session.close()

    # ---------------------------------------------------------------- members

    def _tell(self, member_id: str, msg: m.NodeMessage, size: int, urgent: bool) -> None:
        if self._batches.tell(member_id, msg, size, urgent) and self._urgent is not None:
            self._urgent.set()

    async def _downstream(self, request: web.Request) -> web.StreamResponse:
        limit = self.config.max_message_bytes
        ws = web.WebSocketResponse(max_msg_size=limit, heartbeat=None)
        await ws.prepare(request)
        peer = request.remote or "?"
        ticket = await self.doorman.enter(peer)
        if ticket is None:
            await turn_away(ws)
            return ws
        member: _Member | None = None
        try:
            if self._up is None and self._linked is not None and (wait := self._relink_by - time.monotonic()) > 0:
                # Its challenge must name the next leader's link: hold it until there is one.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._linked.wait(), timeout=wait)
            self._challenges += 1
            mine = f"{self._link_nonce}.{self._challenges}" if self._link_nonce else ""  # unlinked: refused anyway
            challenge, first = await greet(ws, self.config.token is not None, mine)
            knock = m.parse_knock(first)
            why = auth.unproven(
                self.config.token, challenge, knock.nonce, knock.member_id, knock.proof, who="node", checker="relay"
            )
            if why is not None:
                await ws.send_str(m.encode(m.Refused(reason=why)))
                return ws
            ticket.done()
            self.guard.prove(request)
            seal = auth.seal(self.config.token, challenge, knock.nonce, knock.member_id, sending="down")
            hello, size = await read_hello(ws, knock, limit, seal)
            signed = m.Identity(key=knock.key, signature=knock.signature, challenge=challenge, nonce=knock.nonce)
            hello = hello.model_copy(update={"identity": signed})  # the leader checks the node's key
            answer = await self._forward_hello(hello, size)
            if not isinstance(answer, m.Welcome):
                await ws.send_str(auth.sealed(seal, m.encode(answer)))
                return ws
            token = self.config.token
            proof = auth.coordinator_proof(token, challenge, knock.nonce, knock.member_id) if token else ""
            member = _Member(ws, hello.member_id, seal)
            old = self._members.pop(hello.member_id, None)
            if old is not None:
                old.session.close()
            self._members[hello.member_id] = member
            self._batches.unacked.pop(hello.member_id, None)  # seqs of a session it replaced
            member.session.send(answer.model_copy(update={"proof": proof}))
            for text in self._early.pop(hello.member_id, []):
                member.session.send_text(text)
            async for raw in ws:
                if raw.type != WSMsgType.TEXT:
                    raise ProtocolError(f"unexpected {raw.type.name} frame")
                msg = await parse_off_loop(m.parse_node_message, auth.opened(seal, raw.data), limit)
                if isinstance(msg, m.Hello):
                    raise ProtocolError("hello sent twice on one session")
                urgent = self._batches.heard(member.member_id, msg, len(raw.data), time.monotonic())
                if urgent and self._urgent is not None:
                    self._urgent.set()
        except ProtocolError as exc:
            log.warning("relay %s: dropping a session: %s", self.relay_id, exc)
        except (TimeoutError, asyncio.TimeoutError):
            log.warning("relay %s: a session sent no hello, or its hello got no answer", self.relay_id)
        finally:
            ticket.done()
            if member is not None and self._members.get(member.member_id) is member:
                del self._members[member.member_id]
                if member.member_id not in self._hellos:  # else a new session replaces this one
                    self._batches.ended(member.member_id, "its session with the relay ended")
                if self._urgent is not None:
                    self._urgent.set()
            if member is not None:
                member.session.close()
            elif not ws.closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.close(), timeout=1.0)
        return ws

    async def _forward_hello(self, hello: m.Hello, size: int) -> m.CoordinatorMessage:
        """The leader's answer to a node's hello (a refusal when the token is wrong or no
        leader is linked: a standby's, naming the leader, so the node goes there)."""
        if self._up is None:
            leader = self._leader_hint or (self.config.coordinators[0] if self.config.coordinators else None)
            return m.Refused(
                reason=f"relay {self.relay_id} has no link to the leader",
                standby=True,
                leader=f"{leader[0]}:{leader[1]}" if leader else "",
            )
        assert self._loop is not None
        fut: asyncio.Future[m.CoordinatorMessage] = self._loop.create_future()
        self._hellos[hello.member_id] = fut
        self._tell(hello.member_id, hello, size, urgent=True)
        try:
            return await asyncio.wait_for(fut, timeout=HELLO_TIMEOUT_S)
        finally:
            if self._hellos.get(hello.member_id) is fut:
                del self._hellos[hello.member_id]
