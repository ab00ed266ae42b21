"""A forwarder for nodes that can only dial out (behind NAT or a firewall): a TURN-like TCP
splice, run by a reachable member (``--offer-forwarding``) or on its own.

gloo connects each pair of ranks once, in one direction: the rank whose rendezvous address
compares greater (`gloo_initiator`, gloo's ``Device::isInitiator``) dials, the other
listens. A node that accepts no inbound connection can dial every peer whose address
compares lower, but not be dialled by the others; which side dials depends on addresses,
not on who can, so it cannot always be the NAT'd node. Its peers reach it here instead::

    NAT'd node                    forwarder (reachable)                 peer
    ──────────                    ─────────────────────                 ────
    control  ── dial out ──────▶  challenge, proof (job token)
             ── open ─────────▶   listens on F:p for it; "opened p"
    its entry for the epoch advertises F:p (`unbroken.comm.tunnel.NatView`)
                                  F:p ◀────────────── gloo connects ── peer
             ◀── dial conn ─────
    attach  ── dial out ──────▶   proof, conn → splice both sockets
    attach ⇄ its own gloo listener (on loopback)

Every connection to the forwarder starts with its challenge; the node answers with an HMAC
of it under the job's token (`proof`), so only the job's members open ports or attach, and
the token never crosses the wire. The forwarder proves itself back on the control session.

Bounds, per node's session (`ForwardLimits`): ports open at once (one per gloo device: a
group's stream of one epoch), connections spliced at once, and bytes per port (one epoch's
group): past them a port or connection is refused, or its connections closed, which the
data plane sees as a failed collective, a fault like any other. A port lives until its
session ends or the node closes it (its epoch is over); a forwarder's death is the
death of every connection through it: the epoch fails and the next one opens new ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import itertools
import json
import logging
import os
import secrets
import socket
import struct
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from unbroken.control.meeting import data_address
from unbroken.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

LINE_BYTES = 4096
"""Longest control line either side reads (a JSON object: all they exchange besides data)."""
HANDSHAKE_S = 10.0
"""How long a connection may take to prove itself, and an inbound one to be attached."""
CHUNK = 1 << 18
PROBES = 16
"""Probes of its own address one session may ask for (each is one connection attempt)."""
PROBE_S = 2.0
"""How long a probe's connection attempt may take."""


@dataclass(frozen=True)
class ForwardLimits:
    """What one node's session may hold at a forwarder."""

    ports: int = 64
    """Ports open at once (one per gloo device: a group's stream in one epoch)."""
    connections: int = 256
    """Connections spliced (or waiting to be) at once."""
    bytes_per_port: int = 64 << 30
    """Bytes through one port, both ways (one epoch's group); past it its connections close."""

    def __post_init__(self) -> None:
        for name in ("ports", "connections", "bytes_per_port"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ForwardLimits.{name} = {getattr(self, name)} must be at least 1")


def proof(token: str, role: str, challenge: str, nonce: str, member: str, conn: int = 0) -> str:
    """HMAC-SHA256 under the job's token of one connection's challenge (``role``: who proves)."""
    message = "\0".join((role, challenge, nonce, member, str(conn))).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def gloo_initiator(local: tuple[str, int], remote: tuple[str, int]) -> bool:
    """Whether gloo, holding the listening address ``local``, dials the peer whose entry
    says ``remote`` (gloo's ``Device::isInitiator``): the addresses' bytes compared as
    memcmp does, then the ports as their network-order bytes read natively (``htons``)."""
    a, b = _packed(local[0]), _packed(remote[0])
    if len(a) != len(b):
        raise ValueError(f"gloo cannot pair addresses of two families: {local[0]} and {remote[0]}")
    if a != b:
        return a > b
    diff = socket.htons(local[1]) - socket.htons(remote[1])
    if diff == 0:
        raise ValueError(f"two ranks share the address {local[0]}:{local[1]}")
    return diff > 0


def _packed(host: str) -> bytes:
    for family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            return socket.inet_pton(family, host.split("%", 1)[0])
    raise ValueError(f"{host!r} is not an IP address")


def entry_with(raw: bytes, host: str, port: int) -> bytes:
    """A gloo rendezvous entry (`unbroken.control.meeting.data_address`) that asks peers to
    connect to ``host:port`` instead (IPv4: where the entry's address is IPv4 too)."""
    data_address(raw)  # a garbled entry is refused here, not sent on
    (name_len,) = struct.unpack_from("<Q", raw, 0)
    at = 8 + name_len + 8
    (family,) = struct.unpack_from("<H", raw, at)
    if family != socket.AF_INET:
        raise ValueError("forwarding carries IPv4 data planes only: give --gloo-host an IPv4 address")
    return raw[:at] + struct.pack("<H", family) + struct.pack(">H", port) + socket.inet_aton(host) + raw[at + 8 :]


# ---------------------------------------------------------------- the wire


async def read_line(reader: asyncio.StreamReader, timeout_s: float) -> dict[str, Any]:
    """One JSON object on a line; `ProtocolError` for anything else, EOF or a line too long."""
    try:
        line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout_s)
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"a forwarding line longer than {CHUNK} bytes") from None
    except asyncio.IncompleteReadError:
        raise ProtocolError("the connection closed") from None
    except TimeoutError:
        raise ProtocolError(f"no line within {timeout_s:g} s") from None
    if len(line) > LINE_BYTES:
        raise ProtocolError(f"a forwarding line longer than {LINE_BYTES} bytes")
    try:
        value = json.loads(line)
    except ValueError:
        raise ProtocolError("a forwarding line that is not JSON") from None
    if not isinstance(value, dict):
        raise ProtocolError("a forwarding line that is not a JSON object")
    return value


WILDCARDS = ("", "0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) stands for this machine alone; a name that
    does not resolve is not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def offered_address(host: str, port: int, job_hosts: Sequence[str], named: str | None = None) -> str:
    """HOST:PORT that epoch orders name for a forwarder listening on ``host``:``port``, for
    members on other machines to dial. Listening on every interface, it is ``named`` (the
    node's ``--gloo-host``) or this machine's name as it resolves.

    A loopback address is only for a job all on this machine: one whose control plane
    (``job_hosts``: its coordinators, relays, etcd) is on loopback too, which no member on
    another machine could reach (it is allowed then: that is how a test cluster runs).

    Raises:
        ConfigError: the address is loopback (given so, or what the machine's name resolves
            to, as with Debian's ``127.0.1.1``) in a job whose control plane is not.
    """
    if host in WILDCARDS:
        host = named or socket.gethostbyname(socket.gethostname())
    if is_loopback(host):
        if not job_hosts or not all(is_loopback(h) for h in job_hosts):
            # Every member moved behind it would dial its own loopback, and be benched.
            raise ConfigError(
                f"--offer-forwarding: {host}:{port} is a loopback address, which members on other "
                f"machines cannot dial: give --offer-forwarding HOST:PORT with an address they reach"
            )
        log.warning(
            "forwarding at %s:%d, a loopback address: only members on this machine can use it "
            "(the job's control plane is on loopback too)",
            host,
            port,
        )
    return f"{host}:{port}"


def job_hosts(coordinators: Sequence[tuple[str, int]], etcd: Sequence[str]) -> list[str]:
    """The hosts of a job's control plane as a process was given them (etcd as URLs)."""
    hosts = [h for h, _ in coordinators]
    hosts += [u.hostname for u in map(urllib.parse.urlsplit, etcd) if u.hostname]
    return hosts


def write_line(writer: asyncio.StreamWriter, value: dict[str, Any]) -> None:
    writer.write(json.dumps(value).encode() + b"\n")


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    count: Callable[[int], bool] = lambda n: True,
) -> None:
    """Copy bytes both ways until either side ends; ``count(n)`` False stops both."""

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(CHUNK):
                if not count(len(data)):
                    return
                dst.write(data)
                await dst.drain()

    tasks = [asyncio.ensure_future(pipe(a[0], b[1])), asyncio.ensure_future(pipe(b[0], a[1]))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for writer in (a[1], b[1]):
            writer.close()


def no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ---------------------------------------------------------------- the forwarder


@dataclass
class _Port:
    server: asyncio.Server
    sent: int = 0
    conns: set[asyncio.StreamWriter] = field(default_factory=set)


@dataclass
class _Session:
    member: str
    control: asyncio.StreamWriter
    ports: dict[int, _Port] = field(default_factory=dict)
    waiting: dict[int, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = field(default_factory=dict)
    live: int = 0
    probes: int = 0
    spliced: int = 0
    """Connections spliced in the session so far."""
    sent: int = 0
    """Bytes through its ports so far, both ways."""


class Forwarder:
    """The forwarder's server: accepts the job's members' sessions on ``host:port`` and
    opens ports on ``host`` for them (run it on a thread of its own: `ForwarderThread`).

    Raises:
        ConfigError: no token (a forwarder open to anyone would let anyone open ports).
    """

    def __init__(self, token: str | None, host: str, port: int = 0, limits: ForwardLimits | None = None) -> None:
        if not token:
            raise ConfigError(
                "offering forwarding needs the job's token (--token-file or $UNBROKEN_TOKEN): members prove it "
                "to open ports"
            )
        self._token = token
        self.host = host
        self.port = port
        self.limits = limits or ForwardLimits()
        self._sessions: dict[str, _Session] = {}
        self._server: asyncio.Server | None = None
        self._conn_ids = itertools.count(1)
        self.refused: list[str] = []
        """Why connections were refused (newest last, a few kept): for logs and tests."""

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._accept, self.host, self.port, limit=CHUNK)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("forwarding for nodes that cannot accept connections at %s:%d", self.host, self.port)
        return self.host, self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for sid in list(self._sessions):
            self._end(sid)

    def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        self.refused = [*self.refused[-15:], why]
        log.warning("forwarding: refused %s: %s", writer.get_extra_info("peername"), why)
        with contextlib.suppress(Exception):
            write_line(writer, {"error": why})
        writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        challenge = secrets.token_hex(16)
        write_line(writer, {"challenge": challenge})
        try:
            knock = await read_line(reader, HANDSHAKE_S)
            kind, member, nonce = str(knock.get("kind")), str(knock.get("member", "")), str(knock.get("nonce", ""))
            conn = knock.get("conn", 0)
            if kind not in ("control", "attach") or not isinstance(conn, int) or len(nonce) < 16:
                raise ProtocolError(f"a knock that is not a forwarding one: {sorted(knock)}")
            expected = proof(self._token, kind, challenge, nonce, member, conn)
            if not hmac.compare_digest(expected, str(knock.get("proof"))):
                raise ProtocolError(f"{member!r} did not prove the job's token (wrong --token?)")
        except ProtocolError as exc:
            self._refuse(writer, str(exc))
            return
        if kind == "attach":
            await self._attach(member, conn, reader, writer)
            return
        sid = secrets.token_hex(8)
        self._sessions[sid] = _Session(member, writer)
        no_delay(writer)
        write_line(writer, {"ok": sid, "proof": proof(self._token, "forwarder", challenge, nonce, member)})
        try:
            while True:
                order = await read_line(reader, float("inf"))
                if "open" in order:
                    write_line(writer, await self._open(sid, order["open"]))
                elif "probe" in order:
                    write_line(writer, await self._probe(sid, order["probe"], order.get("address")))
                elif "close" in order:
                    self._close_port(sid, order["close"])
        except (ProtocolError, ConnectionError):
            pass
        finally:
            self._end(sid)

    async def _open(self, sid: str, req: object) -> dict[str, Any]:
        session = self._sessions[sid]
        if len(session.ports) >= self.limits.ports:
            return {"refused": req, "error": f"{session.member} holds {self.limits.ports} ports already"}
        holder: list[int] = []
        server = await asyncio.start_server(lambda r, w: self._inbound(sid, holder[0], r, w), self.host, 0, limit=CHUNK)
        port = server.sockets[0].getsockname()[1]
        holder.append(port)
        session.ports[port] = _Port(server)
        return {"opened": req, "port": port}

    async def _probe(self, sid: str, req: object, address: object) -> dict[str, Any]:
        """Whether this forwarder can connect to ``address``: the member's own data-plane
        address, which it cannot test from behind its own firewall."""
        session = self._sessions[sid]
        session.probes += 1
        if session.probes > PROBES:
            return {"probed": req, "error": f"{session.member} asked for {PROBES} probes already"}
        if not (isinstance(address, list) and len(address) == 2 and isinstance(address[1], int)):
            return {"probed": req, "error": "a probe names [host, port]"}
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(str(address[0]), address[1]), PROBE_S)
        except TimeoutError:
            return {"probed": req, "error": f"no answer in {PROBE_S:g} s"}
        except OSError as exc:
            return {"probed": req, "error": os.strerror(exc.errno) if exc.errno else str(exc)}
        w.close()
        return {"probed": req}

    def _close_port(self, sid: str, port: object) -> None:
        session = self._sessions.get(sid)
        if session is not None and isinstance(port, int) and port in session.ports:
            self._close_port_of(session, port)

    def _end(self, sid: str) -> None:
        session = self._sessions.pop(sid, None)
        if session is None:
            return
        for port in list(session.ports):
            self._close_port_of(session, port)
        for fut in session.waiting.values():
            fut.cancel()
        session.control.close()
        log.info("forwarding: %s's session ended: %d connections, %d bytes forwarded", session.member,
                 session.spliced, session.sent)  # fmt: skip

    def _close_port_of(self, session: _Session, port: int) -> None:
        entry = session.ports.pop(port)
        entry.server.close()
        for w in list(entry.conns):
            w.close()

    async def _inbound(self, sid: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A peer dialled a forwarded port: ask the node to attach, then splice."""
        session = self._sessions.get(sid)
        entry = session.ports.get(port) if session is not None else None
        if session is None or entry is None:
            writer.close()
            return
        if session.live >= self.limits.connections:
            # Closed without a word: the peer's gloo would read one as data.
            why = f"{session.member} has {self.limits.connections} connections forwarded already"
            self.refused = [*self.refused[-15:], why]
            log.warning("forwarding: refused a connection to port %d: %s", port, why)
            writer.close()
            return
        conn = next(self._conn_ids)
        future: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        future = asyncio.get_running_loop().create_future()
        session.waiting[conn] = future
        session.live += 1
        entry.conns.add(writer)
        no_delay(writer)
        try:
            write_line(session.control, {"dial": conn, "port": port})
            try:
                other = await asyncio.wait_for(future, HANDSHAKE_S)
            except (TimeoutError, asyncio.CancelledError):
                writer.close()
                return
            entry.conns.add(other[1])
            session.spliced += 1
            limit = self.limits.bytes_per_port

            def count(n: int) -> bool:
                entry.sent += n
                session.sent += n
                if entry.sent > limit:
                    log.warning("forwarding: %s's port %d passed %d bytes: its connections close", session.member,
                                port, limit)  # fmt: skip
                    return False
                return True

            await splice((reader, writer), other, count)
            entry.conns.discard(other[1])
        finally:
            session.waiting.pop(conn, None)
            session.live -= 1
            entry.conns.discard(writer)

    async def _attach(self, member: str, conn: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Only the member the connection was forwarded for attaches it: one member's proof
        # counts for no other's connections.
        future = next(
            (s.waiting.get(conn) for s in self._sessions.values() if conn in s.waiting and s.member == member), None
        )
        if future is None or future.done():
            self._refuse(writer, f"no connection {conn} waits for {member!r} to attach it")
            return
        no_delay(writer)
        write_line(writer, {"ok": conn})
        future.set_result((reader, writer))


class LoopThread:
    """An asyncio loop on a named daemon thread, for the synchronous node to call into."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Awaitable[Any], timeout_s: float) -> Any:
        """Run ``coro`` on the loop and wait for it (`TimeoutError` past ``timeout_s``)."""

        async def wrapped() -> Any:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout_s)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class ForwarderThread:
    """A `Forwarder` served on a thread of its own (a node's, beside its training)."""

    def __init__(self, token: str | None, host: str, port: int = 0, limits: ForwardLimits | None = None) -> None:
        self.forwarder = Forwarder(token, host, port, limits)
        self._loop = LoopThread("forwarder")
        try:
            self.address: tuple[str, int] = self._loop.call(self.forwarder.start(), HANDSHAKE_S)
        except BaseException:
            self._loop.stop()
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.call(self.forwarder.close(), HANDSHAKE_S)
        self._loop.stop()
