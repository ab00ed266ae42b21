"""Fake nodes: many sessions that speak the real control protocol from one event loop.

For tests and benchmarks of the control plane at a scale that real node processes cannot
reach on one machine. A fake node joins (challenge, hello, welcome), reports progress once
per ``step_s`` as a training node does (each report keeps its lease), heartbeats only
when it has said nothing for a heartbeat period, and records what it hears: the round
trip of each acknowledgement, when each epoch order arrived, an expulsion. Expelled, it
rejoins as a new member (as a real node does); if its session drops, it reconnects with
the same identity to the next address it has (a relay died: it falls back to the leader).
It never joins the data plane::

    with FakeNodes([("127.0.0.1", 29400)], 200) as fakes:   # a thread running the loop
        fakes.wait_joined(30)
        killed_at = fakes.kill(1)
        ...
        assert fakes.expelled() == 0
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from unbroken.control import identity
from unbroken.control import messages as m
from unbroken.errors import ProtocolError

V = m.PROTOCOL_VERSION
"""The protocol version the fakes' hand-written frames carry."""

FINGERPRINT = [m.TensorSpec(name="fake.weight", shape=[4, 4], dtype="float32")]
_EPOCH = re.compile(r'"epoch":(\d+)')


@dataclass
class FakeNode:
    name: str
    first: int
    """Index of the address it tries first."""
    source: int = 0
    """Index of the loopback address it connects from (`FakeNodes` ``sources``)."""
    member_id: str = ""
    key: Ed25519PrivateKey = field(default_factory=identity.ephemeral)
    welcomed: bool = False
    welcomed_at: float = 0.0
    expelled: str | None = None
    """The last expulsion's reason."""
    expulsions: int = 0
    silent_expulsions: int = 0
    """Expulsions that followed this node's own silence: nothing sent for most of a lease
    (its loop stalled on a busy machine), so the lease lapsed honestly."""
    last_sent: float = 0.0
    gaps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=16))
    """(when, seconds): long gaps between this node's own messages, as they ended."""
    killed: bool = False
    epochs: dict[int, float] = field(default_factory=dict)
    """Epoch number -> when its order arrived (monotonic)."""
    rtts: list[float] = field(default_factory=list)
    reconnects: int = 0
    error: str | None = None
    task: asyncio.Task[None] | None = None

    def sent_now(self, now: float, heartbeat_s: float) -> None:
        if self.last_sent and now - self.last_sent >= 2 * heartbeat_s:
            self.gaps.append((now, now - self.last_sent))
        self.last_sent = now

    def was_silent(self, now: float, lease_s: float) -> bool:
        """Whether this node itself sent nothing for most of a lease lately."""
        if now - self.last_sent >= 0.8 * lease_s:
            return True
        return any(now - t <= 2 * lease_s and gap >= 0.8 * lease_s for t, gap in self.gaps)

    @property
    def live(self) -> bool:
        return self.welcomed and not self.killed


class FakeNodes:
    """``count`` fake nodes against the coordinators or relays at ``addresses`` (node i uses
    address i mod n, then ``fallback`` in turn), on a thread of their own."""

    def __init__(
        self,
        addresses: Sequence[tuple[str, int]] | tuple[str, int],
        count: int,
        *,
        job: str = "fake-job",
        batch_size: int = 0,
        step_s: float = 0.5,
        ramp_s: float = 0.0,
        fallback: Sequence[tuple[str, int]] = (),
        sources: int = 1,
    ) -> None:
        """``sources``: how many loopback addresses (127.0.0.2, ...) the nodes connect from, as
        a fleet comes from many hosts: what the control plane allows one address (unproven
        sessions read 16 at a time) must not throttle a whole fleet's admission."""
        if addresses and isinstance(addresses[0], str):
            addresses = [addresses]  # type: ignore[list-item]
        self.addresses: list[tuple[str, int]] = list(addresses)  # type: ignore[arg-type]
        self.fallback = list(fallback)
        """Tried in turn after a node's own address fails (relays' nodes fall back to the leader)."""
        self.nodes: list[FakeNode] = []
        self._initial = count
        self.job = job
        self.batch_size = batch_size or max(count, 1)
        self.step_s = step_s
        self.ramp_s = ramp_s
        """Spread the first connections over this long (a real fleet does not start at once)."""
        self.silent = False
        """Set to stop every heartbeat and report while the sessions stay open (members that hang)."""
        self.sent = 0
        self.received = 0
        self.longest_stall_s = 0.0
        """The longest this side's own loop ran late (its machine is busy): heartbeats it
        could not send then were not the control plane's to lose."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.sources = max(1, min(sources, 250))
        self._https: list[aiohttp.ClientSession] = []
        self._rng = random.Random(0)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-nodes", daemon=True)

    def __enter__(self) -> FakeNodes:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------- what the test sees

    def live(self) -> list[FakeNode]:
        return [n for n in self.nodes if n.live]

    def joined(self) -> int:
        return sum(n.welcomed for n in self.nodes)

    def expelled(self) -> int:
        """Expulsions of nodes nobody killed (false ones, for a node that kept talking)."""
        return sum(n.expulsions for n in self.nodes if not n.killed)

    def expelled_while_silent(self) -> int:
        """False expulsions of nodes that had themselves sent nothing for most of a lease
        just before (this side's loop stalled): the lease lapsed for the fake, not for the
        control plane."""
        return sum(n.silent_expulsions for n in self.nodes if not n.killed)

    def wait_joined(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.joined() < len(self.nodes) or len(self.nodes) < self._initial:
            if time.monotonic() > deadline:
                errors = {n.error for n in self.nodes if n.error}
                raise TimeoutError(f"{self.joined()} of {len(self.nodes)} fake nodes joined; errors: {errors}")
            time.sleep(0.05)

    def newest_epoch(self) -> int:
        return max((max(tuple(n.epochs), default=0) for n in self.live()), default=0)

    def all_reached(self, epoch: int) -> float | None:
        """When the last live node heard of an epoch at least ``epoch`` (None: not all yet)."""
        times = []
        for n in self.live():
            later = [t for e, t in tuple(n.epochs.items()) if e >= epoch]
            if not later:
                return None
            times.append(min(later))
        return max(times, default=None)

    def rtts(self) -> list[float]:
        """Every acknowledgement's round trip since the last `clear_rtts`."""
        return [r for n in self.nodes for r in n.rtts]

    def clear_rtts(self) -> None:
        for n in self.nodes:
            n.rtts.clear()

    def kill(self, count: int) -> float:
        """End ``count`` live nodes' sessions abruptly (a crash); returns when, monotonic."""
        assert self._loop is not None
        victims = self._rng.sample(self.live(), min(count, len(self.live())))
        for v in victims:
            v.killed = True
        at = time.monotonic()
        for v in victims:
            if v.task is not None:
                self._loop.call_soon_threadsafe(v.task.cancel)
        return at

    def add(self, count: int) -> float:
        """Start ``count`` more nodes (joins); returns when, monotonic."""
        assert self._loop is not None
        at = time.monotonic()
        self._loop.call_soon_threadsafe(self._spawn, count, 0.0)
        return at

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with contextlib.AsyncExitStack() as stack:
            for i in range(self.sources):
                local = (f"127.0.0.{2 + i}", 0) if self.sources > 1 else None
                connector = aiohttp.TCPConnector(limit=0, local_addr=local)
                self._https.append(await stack.enter_async_context(aiohttp.ClientSession(connector=connector)))
            self._spawn(self._initial, self.ramp_s)
            self._started.set()
            watch = asyncio.create_task(self._watch())
            await self._stop.wait()
            watch.cancel()
            tasks = [n.task for n in self.nodes if n.task is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, every_s: float = 0.02) -> None:
        """Record this side's own loop lag: a sleep that wakes late."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(every_s)
            self.longest_stall_s = max(self.longest_stall_s, time.monotonic() - t - every_s)

    def _spawn(self, count: int, ramp_s: float) -> None:
        base = len(self.nodes)
        for i in range(base, base + count):
            node = FakeNode(f"fake{i}", first=i % len(self.addresses), source=i % self.sources)
            self.nodes.append(node)
            node.task = asyncio.create_task(self._node(node, ramp_s * (i - base) / max(count, 1)))

    async def _node(self, node: FakeNode, delay: float) -> None:
        await asyncio.sleep(delay)
        attempt = 0
        while not node.killed:
            if not node.member_id or node.expelled is not None:
                node.member_id, node.expelled = identity.member_id(node.name, node.key), None
            order = [self.addresses[node.first], *self.fallback]
            host, port = order[attempt % len(order)]
            try:
                silenced = await self._session(node, host, port)
                attempt = attempt + 1 if silenced else 0  # a silent peer is tried after the others
            except asyncio.CancelledError:
                return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, ProtocolError) as exc:
                node.error = f"{type(exc).__name__}: {exc}"
                attempt += 1
            node.reconnects += 1
            await asyncio.sleep(0.1)

    async def _session(self, node: FakeNode, host: str, port: int) -> bool:
        """One session; True when it ended because its peer went silent."""
        http = self._https[node.source]
        async with http.ws_connect(
            f"http://{host}:{port}/ws",
            heartbeat=None,
            max_msg_size=256 << 20,
            timeout=aiohttp.ClientWSTimeout(ws_close=0.2),  # as a node: a frozen peer never answers a close
        ) as ws:
            first = await ws.receive(timeout=30)
            if first.type != aiohttp.WSMsgType.TEXT:
                raise ValueError(f"closed before its challenge ({first.type.name})")
            challenge = m.parse_coordinator_message(first.data)
            if not isinstance(challenge, m.Challenge):
                raise ValueError(f"expected a challenge, got {challenge}")
            hello = m.Hello(
                job=self.job,
                job_identity="fake",
                fingerprint=FINGERPRINT,
                member_id=node.member_id,
                name=node.name,
                batch_size=self.batch_size,
            )
            await ws.send_str(m.encode(identity.knock(node.member_id, challenge.nonce, None, node.key)))
            await ws.send_str(m.encode(hello))
            welcome = m.parse_coordinator_message((await ws.receive(timeout=30)).data)
            if not isinstance(welcome, m.Welcome):
                raise ValueError(f"not welcomed: {welcome}")
            # (a standby's refusal names the leader; the next address is tried instead)
            node.welcomed, node.welcomed_at, node.error = True, time.monotonic(), None
            sent: dict[int, float] = {}
            acked = [time.monotonic()]
            silenced = [False]
            # As a real node: leave a session that stops acknowledging (a relay's sooner).
            patience = welcome.lease_s * (2.0 if self.fallback else 3.0)
            talker = asyncio.create_task(self._talk(node, ws, welcome.heartbeat_s, sent, acked, patience, silenced))
            try:
                async for raw in ws:
                    if raw.type != aiohttp.WSMsgType.TEXT:
                        break
                    self.received += 1
                    data = raw.data
                    if data.startswith(f'{{"v":{V},"type":"ack"'):
                        seq = json.loads(data)["seq"]
                        if seq in sent:
                            at = sent.pop(seq)
                            acked[0] = max(acked[0], at)
                            node.rtts.append(time.monotonic() - at)
                    elif data.startswith(f'{{"v":{V},"type":"epoch"'):
                        # The epoch number is read off the front: a fake node does not build
                        # groups, and parsing a 10,000-member order 10,000 times is the fake
                        # side's cost, not the control plane's.
                        found = _EPOCH.search(data, 0, 200)
                        if found:
                            node.epochs.setdefault(int(found.group(1)), time.monotonic())
                    elif data.startswith(f'{{"v":{V},"type":"expelled"'):
                        node.expelled = json.loads(data)["reason"]
                        node.expulsions += 1
                        if node.was_silent(time.monotonic(), welcome.lease_s):
                            node.silent_expulsions += 1
                        return False
            finally:
                talker.cancel()
            return silenced[0]

    async def _talk(
        self,
        node: FakeNode,
        ws: aiohttp.ClientWebSocketResponse,
        heartbeat_s: float,
        sent: dict[int, float],
        acked: list[float],
        patience: float,
        silenced: list[bool],
    ) -> None:
        """Progress every step, heartbeats in between when a step is longer than a heartbeat."""
        seq, step, counted = 0, 0, 0.0
        next_step = time.monotonic() + self.step_s * self._rng.random()
        while True:
            now = time.monotonic()
            if now - acked[0] > patience and not self.silent:
                silenced[0] = True  # its coordinator or relay went silent: reconnect elsewhere
                await ws.close()
                return
            if not self.silent:
                if now >= next_step:
                    step += 1
                    seq += 1
                    sent[seq] = counted = now
                    text = (
                        f'{{"v":{V},"type":"progress","epoch":0,"step":{step},"loss":1.0,'
                        f'"wall_time":{time.time()},"samples_per_s":10.0,"compute_s":0.01,"seq":{seq}}}'
                    )
                    await ws.send_str(text)
                    self.sent += 1
                    node.sent_now(now, heartbeat_s)
                    next_step += self.step_s
                elif now - counted >= heartbeat_s:
                    seq += 1
                    sent[seq] = counted = now
                    await ws.send_str(f'{{"v":{V},"type":"heartbeat","seq":{seq},"step":{step}}}')
                    self.sent += 1
                    node.sent_now(now, heartbeat_s)
                if len(sent) > 64:
                    for old in sorted(sent)[:-64]:
                        del sent[old]
            wake = min(next_step, counted + heartbeat_s) - time.monotonic()
            await asyncio.sleep(max(wake, 0.005))
