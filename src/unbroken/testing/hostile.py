"""Attacks on a live job's control plane, for tests and ``bench/hostile.py``.

`Flood` opens sessions as fast as they are answered, from this process, without the job's
token: some send a 1 MB first message, some a well-formed knock with a wrong proof. It is
what anyone who can reach the coordinator's port can do; the job must lose nothing to it.
"""

from __future__ import annotations

import asyncio
import threading

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
