"""Fuzzing the running coordinator: hostile sessions (random JSON, mutated hellos, forged
proofs, binary and oversized frames, plain garbage) while two members are in the job.
The service never crashes, never changes membership, never keeps a dead session, and its
memory stays bounded."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken import Coordinator, CoordinatorConfig, MembershipConfig, ServiceConfig
from unbroken.control import auth, identity
from unbroken.control import messages as m
from unbroken.events import Kind

pytestmark = pytest.mark.timeout(300)

TOKEN = "fuzz-token-0123456789abcdef"
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=15,
)
HELLO = m.Hello(job="j", job_identity="i", fingerprint=[], member_id="x#1", name="x", batch_size=8).model_dump()
KNOCK = m.Knock(member_id="x#1").model_dump()


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


class Member(threading.Thread):
    """A well-behaved member: handshake, then heartbeats until stopped."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(name=f"member-{name}", daemon=True)
        self.key = identity.ephemeral()
        self.url, self.member_id = url, identity.member_id(name, self.key)
        self.stop = threading.Event()
        self.welcomed = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as http, http.ws_connect(self.url) as ws:
            challenge = m.parse_coordinator_message((await ws.receive()).data)
            assert isinstance(challenge, m.Challenge)
            knock = identity.knock(self.member_id, challenge.nonce, TOKEN, self.key)
            await ws.send_str(m.encode(knock))
            seal = auth.Seal(TOKEN, challenge.nonce, knock.nonce, self.member_id, sending="up")
            hello = m.Hello(
                job="j", job_identity="i", fingerprint=[], member_id=self.member_id, name=self.member_id, batch_size=8
            )  # fmt: skip
            await ws.send_str(seal.seal(m.encode(hello)))
            seq = 0
            while not self.stop.is_set():
                seq += 1
                await ws.send_str(seal.seal(m.encode(m.Heartbeat(seq=seq, step=0))))
                try:
                    msg = await asyncio.wait_for(ws.receive(), timeout=0.1)
                    if msg.type == aiohttp.WSMsgType.TEXT and '"welcome"' in seal.open(msg.data):
                        self.welcomed.set()
                except TimeoutError:
                    pass
                await asyncio.sleep(0.1)


async def hostile(url: str, frames: list[str | bytes]) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        for frame in frames:
            try:
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_str(frame)
            except (ConnectionError, RuntimeError):
                break
        with_deadline = time.monotonic() + 10
        while time.monotonic() < with_deadline:
            msg = await asyncio.wait_for(ws.receive(), timeout=10)
            if msg.type != aiohttp.WSMsgType.TEXT:
                return


frames = st.lists(
    st.one_of(
        JSON.map(json.dumps),
        st.builds(lambda k, v: json.dumps({**HELLO, k: v}), st.sampled_from(list(HELLO)), JSON),
        st.builds(lambda k, v: json.dumps({**KNOCK, k: v}), st.sampled_from(list(KNOCK)), JSON),
        st.just(json.dumps({**KNOCK, "nonce": "00", "proof": "f" * 64})),  # a forged proof
        st.binary(max_size=64),
        st.just("x" * (2 << 20)),
    ),
    min_size=1,
    max_size=3,
)


def test_hostile_sessions_never_crash_the_coordinator_or_change_membership():
    coord = Coordinator(
        CoordinatorConfig(ServiceConfig(port=0, token=TOKEN), MembershipConfig(recovery_window_s=0, lease_s=2.0))
    ).start()
    host, port = coord.address
    url = f"http://{host}:{port}/ws"
    members = [Member(url, "a"), Member(url, "b")]
    try:
        for mem in members:
            mem.start()
        assert all(mem.welcomed.wait(10) for mem in members)
        time.sleep(0.5)
        before = coord.state()
        assert before["epoch"] >= 1 and len(before["members"]) == 2
        rss_start = rss_bytes()

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(frames)
        def attack(fs: list[str | bytes]) -> None:
            asyncio.run(hostile(url, fs))

        attack()
        time.sleep(0.5)
        after = coord.state()
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as r:
            assert json.load(r)["ok"]
        assert after["epoch"] == before["epoch"], "hostile sessions must not change membership"
        assert sorted(x["id"] for x in after["members"]) == sorted(x["id"] for x in before["members"])
        assert len(coord.sessions) == 2, "every hostile session must be gone"
        assert len(coord.events) <= 10_000
        growth = rss_bytes() - rss_start
        assert growth < 64 << 20, f"memory grew by {growth >> 20} MB over 150 hostile sessions"
        # Counted, all of them; listed, a few per source and window (the rest would push
        # the job's own events out of the history).
        counts = coord.events.counts
        listed = len(coord.events.since(0, [Kind.PROTOCOL, Kind.REFUSED]))
        print(f"hostile sessions: {counts[Kind.PROTOCOL]} dropped, {counts[Kind.REFUSED]} refused, {listed} listed")
        assert counts[Kind.PROTOCOL] > 0 and counts[Kind.REFUSED] > 0, counts
        assert listed <= 60, listed
    finally:
        for mem in members:
            mem.stop.set()
        coord.stop()
