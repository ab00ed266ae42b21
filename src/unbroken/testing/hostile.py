"""Attacks on a live job's control plane, for tests and ``bench/hostile.py``.

`Flood` opens sessions as fast as they are answered, from this process, without the job's
token: some send a 1 MB first message, some a well-formed knock with a wrong proof.
`Slowloris` holds as many connections as it can, each trickling an HTTP request that never
ends. It is what anyone who can reach the coordinator's port can do; the job must lose
nothing to either.

The rest are insiders: they hold the job token and keys of their own, and say the job's
true hello (`hello_for`). `Churner` rejoins under fresh member ids as fast as it can,
`Impersonator` says hello as a member in training, `FalseDone` has sessions say the job is
done with a state nobody trained. Each member is itself (docs/design.md, promise 8): none of
them may cost the honest members more than a share of their commits.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from unbroken.control import auth, identity
from unbroken.control import messages as m
from unbroken.errors import ProtocolError

JUNK = f'{{"v":{m.PROTOCOL_VERSION},"type":"hello","name":"' + "x" * (1 << 20) + '"}'


class Flood(threading.Thread):
    """``big`` connections sending 1 MB first messages and ``knocks`` sending refused knocks,
    until `stop`; ``sent`` counts each kind."""

    def __init__(self, url: str, big: int = 12, knocks: int = 4) -> None:
        super().__init__(name="flood", daemon=True)
        self.url, self.big, self.knocks = url, big, knocks
        self.sent = {"big": 0, "knock": 0}
        self._halt = threading.Event()

    def run(self) -> None:
        async def all_of_them() -> None:
            async with aiohttp.ClientSession() as http:
                await asyncio.gather(
                    *[self._loop(http, self._big) for _ in range(self.big)],
                    *[self._loop(http, self._knock) for _ in range(self.knocks)],
                )

        asyncio.run(all_of_them())

    def stop(self, timeout: float = 30.0) -> None:
        self._halt.set()
        self.join(timeout)

    async def _loop(self, http: aiohttp.ClientSession, attack: object) -> None:
        while not self._halt.is_set():
            try:
                async with http.ws_connect(self.url, max_msg_size=0) as ws:
                    challenge = await ws.receive(timeout=5)
                    await attack(ws, challenge.data)  # type: ignore[operator]
                    await ws.receive(timeout=5)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, TypeError):
                await asyncio.sleep(0.01)

    async def _big(self, ws: aiohttp.ClientWebSocketResponse, challenge: str) -> None:
        await ws.send_str(JUNK)
        self.sent["big"] += 1

    async def _knock(self, ws: aiohttp.ClientWebSocketResponse, challenge: str) -> None:
        c = m.parse_coordinator_message(challenge)
        assert isinstance(c, m.Challenge)
        nonce = auth.new_nonce()
        proof = auth.node_proof("not-the-token-of-this-job", c.nonce, nonce, "intruder#1")
        await ws.send_str(m.encode(m.Knock(member_id="intruder#1", nonce=nonce, proof=proof)))
        self.sent["knock"] += 1


class Slowloris(threading.Thread):
    """Keeps up to ``connections`` connections to ``host:port`` from ``source`` (another
    loopback address: the per-address caps are then the attacker's alone), each with an HTTP
    request it never finishes (a header line every ``trickle_s``), opening at most ``rate``
    a second, until `stop`. ``lifetimes`` holds how long each connection the service ended
    was held; `longest_held_s` counts those still open too."""

    def __init__(
        self,
        host: str,
        port: int,
        connections: int = 300,
        source: str = "127.0.0.2",
        trickle_s: float = 1.0,
        rate: float = 200.0,
    ) -> None:
        super().__init__(name="slowloris", daemon=True)
        self.address, self.connections, self.source = (host, port), connections, source
        self.trickle_s, self.rate = trickle_s, rate
        self.opened = 0
        self.lifetimes: list[float] = []
        self._open: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def stop(self, timeout: float = 10.0) -> None:
        self._halt.set()
        self.join(timeout)

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._open)

    def longest_held_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            return max([*self.lifetimes, *(now - t for t in self._open.values())], default=0.0)

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        next_open, next_trickle = time.monotonic(), time.monotonic() + self.trickle_s
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                while len(self._open) < self.connections and now >= next_open:
                    next_open += 1.0 / self.rate
                    self._connect(sel)
                if now >= next_trickle:
                    next_trickle = now + self.trickle_s
                    for s in list(self._open):
                        self._send(sel, s, b"X-Slow: 1\r\n")
                for key, _ in sel.select(timeout=min(0.05, 1.0 / self.rate)):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        if sock.recv(4096):
                            continue  # an answer (a 408 or 400): the end follows
                    except OSError:
                        pass
                    self._ended(sel, sock)
        finally:
            for s in list(self._open):
                sel.unregister(s)
                s.close()
            sel.close()

    def _connect(self, sel: selectors.BaseSelector) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((self.source, 0))
            s.settimeout(2.0)
            s.connect(self.address)
            s.setblocking(False)
        except OSError:
            s.close()
            return
        self.opened += 1
        with self._lock:
            self._open[s] = time.monotonic()
        sel.register(s, selectors.EVENT_READ)
        self._send(sel, s, b"GET /healthz HTTP/1.1\r\nHost: coordinator\r\n")

    def _send(self, sel: selectors.BaseSelector, s: socket.socket, data: bytes) -> None:
        try:
            s.send(data)
        except BlockingIOError:
            pass
        except OSError:
            self._ended(sel, s)

    def _ended(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        with self._lock:
            since = self._open.pop(s, None)
            if since is not None:
                self.lifetimes.append(time.monotonic() - since)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(s)
        s.close()


HelloOf = Callable[[str, str], m.Hello]
"""A member id and a name → the job's true hello under them."""


def hello_for(job: Any) -> HelloOf:
    """The hello an honest node of ``job`` (a `unbroken.Job`) says, for any member id and name."""
    from unbroken.state.snapshot import fingerprint

    model, optimizer = job.build()
    shape = {
        "job": job.name,
        "job_identity": job.identity(optimizer),
        "fingerprint": fingerprint(model),
        "batch_size": job.batch_size,
        "steps": job.num_steps,
    }
    return lambda member_id, name: m.Hello(member_id=member_id, name=name, **shape)


class _Insider(threading.Thread, abc.ABC):
    """Sessions of a token holder with keys of its own, one `_round` after another until `stop`."""

    def __init__(self, url: str, token: str, hello_of: HelloOf, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.url, self.token, self.hello_of = url, token, hello_of
        self.answers: dict[str, int] = {}
        """What the coordinator answered each hello (its message type), counted."""
        self._halt = threading.Event()

    def stop(self, timeout: float = 30.0) -> None:
        self._halt.set()
        self.join(timeout)

    def run(self) -> None:
        async def rounds() -> None:
            async with aiohttp.ClientSession() as http:
                while not self._halt.is_set():
                    try:
                        await self._round(http)
                    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ProtocolError, ValueError):
                        await asyncio.sleep(0.05)

        asyncio.run(rounds())

    @abc.abstractmethod
    async def _round(self, http: aiohttp.ClientSession) -> None:
        """One attempt (a session or a few)."""

    async def _hello(
        self, ws: aiohttp.ClientWebSocketResponse, member_id: str, name: str, key: Ed25519PrivateKey
    ) -> tuple[auth.Seal, m.CoordinatorMessage]:
        """Knock with the token and ``key``, say hello as ``member_id``: the seal and the answer."""
        challenge = m.parse_coordinator_message((await ws.receive(timeout=10)).data)
        assert isinstance(challenge, m.Challenge), challenge
        knock = identity.knock(member_id, challenge.nonce, self.token, key)
        await ws.send_str(m.encode(knock))
        seal = auth.Seal(self.token, challenge.nonce, knock.nonce, member_id, sending="up")
        await ws.send_str(seal.seal(m.encode(self.hello_of(member_id, name))))
        text = (await ws.receive(timeout=10)).data
        answer = m.parse_coordinator_message(text if text.startswith("{") else seal.open(text))
        kind = type(answer).__name__.lower()
        self.answers[kind] = self.answers.get(kind, 0) + 1
        return seal, answer


class Churner(_Insider):
    """Rejoins under a fresh member id (and a fresh key: with the token, keys cost nothing)
    as fast as it can. Each session heartbeats, waits up to ``patience_s`` for an epoch to
    take it, stays in that epoch ``stay_s`` without ever joining its data plane (the group's
    build waits for it), then drops. ``joins`` counts its welcomed hellos, ``entered`` those
    an epoch took."""

    def __init__(self, url: str, token: str, hello_of: HelloOf, stay_s: float = 0.8, patience_s: float = 3.0) -> None:
        super().__init__(url, token, hello_of, "churner")
        self.stay_s, self.patience_s = stay_s, patience_s
        self.joins = 0
        self.entered = 0

    async def _round(self, http: aiohttp.ClientSession) -> None:
        key = identity.ephemeral()
        member_id = identity.member_id("churner", key)
        async with http.ws_connect(self.url) as ws:
            seal, answer = await self._hello(ws, member_id, "churner", key)
            if not isinstance(answer, m.Welcome):
                await asyncio.sleep(0.05)
                return
            self.joins += 1
            beat = answer.heartbeat_s
            until = time.monotonic() + self.patience_s
            seq, inside = 0, False
            while (left := until - time.monotonic()) > 0 and not self._halt.is_set():
                seq += 1
                await ws.send_str(seal.seal(m.encode(m.Heartbeat(seq=seq, step=0))))
                try:
                    raw = await ws.receive(timeout=min(left, beat))
                except asyncio.TimeoutError:
                    continue
                if raw.type != aiohttp.WSMsgType.TEXT:
                    return
                msg = m.parse_coordinator_message(seal.open(raw.data))
                if not inside and isinstance(msg, m.EpochOrder) and member_id in [*msg.members, *msg.added]:
                    inside = True
                    self.entered += 1
                    until = time.monotonic() + self.stay_s


class Impersonator(_Insider):
    """Says hello as ``member_id`` (an honest member's, read from ``/api/state``) with a key
    of its own, again and again."""

    def __init__(self, url: str, token: str, hello_of: HelloOf, member_id: str) -> None:
        super().__init__(url, token, hello_of, "impersonator")
        self.member_id = member_id

    async def _round(self, http: aiohttp.ClientSession) -> None:
        async with http.ws_connect(self.url) as ws:
            await self._hello(ws, self.member_id, "impostor", identity.ephemeral())


class FalseDone(_Insider):
    """``sessions`` sessions at a time, each saying the job is done at ``step`` (its last) with
    the same made-up digest, every ``every_s``; each lingers until the next round."""

    def __init__(self, url: str, token: str, hello_of: HelloOf, step: int, sessions: int = 2, every_s: float = 1.0):
        super().__init__(url, token, hello_of, "false-done")
        self.step, self.sessions, self.every_s = step, sessions, every_s
        self.said = 0

    async def _round(self, http: aiohttp.ClientSession) -> None:
        key = identity.ephemeral()
        done = m.encode(m.Done(step=self.step, digest="f" * 16))

        async def one(i: int) -> None:
            member_id = identity.member_id(f"done{i}", key)
            async with http.ws_connect(self.url) as ws:
                seal, answer = await self._hello(ws, member_id, f"done{i}", key)
                if isinstance(answer, m.Welcome):
                    await ws.send_str(seal.seal(done))
                    self.said += 1
                    await asyncio.sleep(self.every_s)

        await asyncio.gather(*(one(i) for i in range(self.sessions)))
