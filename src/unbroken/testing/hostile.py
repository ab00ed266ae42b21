"""Attacks on a live job's control plane, for tests and ``bench/hostile.py``.

`Flood` opens sessions as fast as they are answered, from this process, without the job's
token: some send a 1 MB first message, some a well-formed knock with a wrong proof.
`Slowloris` holds as many connections as it can, each trickling an HTTP request that never
ends. It is what anyone who can reach the coordinator's port can do; the job must lose
nothing to either.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import socket
import threading
import time

import aiohttp

from unbroken.control import auth
from unbroken.control import messages as m

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
