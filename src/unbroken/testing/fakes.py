"""Fake nodes: many sessions that speak the real control protocol from one event loop.

For tests and benchmarks of the control plane at a scale that real node processes cannot
reach on one machine. A fake node joins (challenge, hello, welcome), heartbeats every
``heartbeat_s`` the welcome gives, answers nothing else, and records what it hears: the
round trip of each heartbeat, the epoch orders, an expulsion. It never joins the data
plane, so the coordinator sees members that are alive but never commit::

    with FakeNodes(("127.0.0.1", 29400), 200) as fakes:   # a thread running the loop
        fakes.wait_joined(30)
        ...
        assert fakes.expelled() == 0
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import aiohttp

from unbroken.control import messages as m

FINGERPRINT = [m.TensorSpec(name="fake.weight", shape=[4, 4], dtype="float32")]


@dataclass
class FakeNode:
    name: str
    welcomed: bool = False
    expelled: str | None = None
    epochs: list[int] = field(default_factory=list)
    rtts: list[float] = field(default_factory=list)
    error: str | None = None


class FakeNodes:
    """``count`` fake nodes against the coordinator at ``address``, on a thread of their own."""

    def __init__(self, address: tuple[str, int], count: int, *, job: str = "fake-job", batch_size: int = 0) -> None:
        self.address = address
        self.nodes = [FakeNode(f"fake{i}") for i in range(count)]
        self.job = job
        self.batch_size = batch_size or max(count, 1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.silent = False
        """Set to stop every heartbeat while the sessions stay open (members that hang)."""
        self._thread = threading.Thread(target=self._run, name="fake-nodes", daemon=True)

    def __enter__(self) -> FakeNodes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=20)

    def joined(self) -> int:
        return sum(n.welcomed for n in self.nodes)

    def expelled(self) -> int:
        return sum(n.expelled is not None for n in self.nodes)

    def wait_joined(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.joined() < len(self.nodes):
            if time.monotonic() > deadline:
                errors = {n.error for n in self.nodes if n.error}
                raise TimeoutError(f"{self.joined()} of {len(self.nodes)} fake nodes joined; errors: {errors}")
            time.sleep(0.05)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            tasks = [asyncio.create_task(self._node(http, n)) for n in self.nodes]
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _node(self, http: aiohttp.ClientSession, node: FakeNode) -> None:
        host, port = self.address
        try:
            async with http.ws_connect(f"http://{host}:{port}/ws", heartbeat=None, max_msg_size=64 << 20) as ws:
                challenge = m.parse_coordinator_message((await ws.receive(timeout=30)).data)
                assert isinstance(challenge, m.Challenge)
                hello = m.Hello(
                    job=self.job,
                    job_identity="fake",
                    fingerprint=FINGERPRINT,
                    member_id=f"{node.name}#fake",
                    name=node.name,
                    batch_size=self.batch_size,
                )
                await ws.send_str(m.encode(hello))
                welcome = m.parse_coordinator_message((await ws.receive(timeout=30)).data)
                if not isinstance(welcome, m.Welcome):
                    node.error = f"not welcomed: {welcome}"
                    return
                node.welcomed = True
                sent: dict[int, float] = {}
                beats = asyncio.create_task(self._heartbeats(ws, welcome.heartbeat_s, sent))
                try:
                    async for raw in ws:
                        if raw.type != aiohttp.WSMsgType.TEXT:
                            break
                        msg = m.parse_coordinator_message(raw.data)
                        if isinstance(msg, m.Ack) and msg.seq in sent:
                            node.rtts.append(time.monotonic() - sent.pop(msg.seq))
                        elif isinstance(msg, m.EpochOrder):
                            node.epochs.append(msg.epoch)
                        elif isinstance(msg, m.Expel):
                            node.expelled = msg.reason
                            return
                finally:
                    beats.cancel()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, AssertionError) as exc:
            node.error = f"{type(exc).__name__}: {exc}"

    async def _heartbeats(self, ws: aiohttp.ClientWebSocketResponse, period: float, sent: dict[int, float]) -> None:
        seq = 0
        while True:
            if not self.silent:
                seq += 1
                sent[seq] = time.monotonic()
                await ws.send_str(m.encode(m.Heartbeat(seq=seq, step=0)))
            await asyncio.sleep(period)
