"""A node that lost its coordinator session trains on in an outage only while it has evidence
that no coordinator can have formed an epoch without it (`unbroken.control.client`). The chaos
soak's double commit: a node cut off during a leader change kept its outage trust, and when
the cut healed it committed the step in flight from its peers' buffered data after the new
leader had ordered an epoch without it. These ask a real etcd cluster and real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from integration.helpers import slowdown
from unbroken.control import messages as m
from unbroken.control import records
from unbroken.control.client import ControlClient
from unbroken.control.connection import State
from unbroken.control.election import epoch_key, leader_key
from unbroken.control.etcd import Etcd, View
from unbroken.testing.etcd import EtcdCluster

PREFIX = "/unbroken/outage-test"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    with EtcdCluster(tmp_path / "etcd") as cluster:
        yield cluster


def refusing_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def silent_listener() -> socket.socket:
    """Accepts connections in its backlog and never answers: a frozen process."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def client(addresses: list[tuple[str, int]], etcd: list[str] = (), lease_s: float = 1.0) -> ControlClient:  # type: ignore[assignment]
    c = ControlClient(
        addresses, lambda mid: None,  # type: ignore[arg-type,return-value]
        name="n", connect_timeout_s=1, wake=threading.Event(), etcd=etcd, etcd_prefix=PREFIX,
    )  # fmt: skip
    c.connection.welcomed(welcome(lease_s), hello_sent=0.0)  # a lease, long spent
    return c


def welcome(lease_s: float) -> m.Welcome:
    return m.Welcome(lease_s=lease_s, heartbeat_s=lease_s / 4, coordinator_id="c")


def vouched(c: ControlClient, endpoints: list[str]) -> bool:
    async def ask() -> bool:
        async with Etcd(endpoints, timeout_s=0.5) as e:
            return await c._nobody_else_leads(e)

    return asyncio.run(ask())


def put_leader(endpoints: list[str], address: str) -> int:
    """A leader record under its own lease, as a coordinator campaigns; its term."""

    async def put() -> int:
        async with Etcd(endpoints) as e:
            lease = await e.grant(30)
            record = {"address": address, "coordinator_id": "the-old-leader", "lease": lease}
            won, kv = await e.create(leader_key(PREFIX), records.seal(None, leader_key(PREFIX), record), lease)
            assert won and kv is not None
            return kv.create_revision

    return asyncio.run(put())


def put(endpoints: list[str], key: bytes, value: dict[str, object]) -> None:
    async def go() -> None:
        async with Etcd(endpoints) as e:
            await e.put(key, json.dumps(value).encode())

    asyncio.run(go())


def test_etcd_evidence_is_no_newer_leader_no_newer_epoch_and_an_old_leader_gone(etcd: EtcdCluster) -> None:
    eps = etcd.endpoints
    c = client([], etcd=eps)
    c._on_message(m.EpochOrder(epoch=3, term=0, members=["n"], shares=[4], urgent=False, reason="test"))
    assert vouched(c, eps), "nobody leads and no newer epoch: no coordinator can have left this node out"
    frozen = silent_listener()
    try:
        slow = slowdown()  # the deadline holds on an idle machine; a busy one stretches it
        start = time.monotonic()
        assert vouched(c, [*eps, f"http://127.0.0.1:{frozen.getsockname()[1]}"]), "a silent member changes nothing"
        took = time.monotonic() - start
        assert took < 0.75 * c.connection.lease_s * slow, ("the renewal's deadline", took, slow)
    finally:
        frozen.close()
    put(eps, epoch_key(PREFIX), {"epoch": 3, "term": 1})
    assert vouched(c, eps), "the epoch published is this node's own"
    # The leader of this node's term: alive (its address answers) it may expel this node.
    alive = silent_listener()
    try:
        c.term = put_leader(eps, f"127.0.0.1:{alive.getsockname()[1]}")
        assert not vouched(c, eps), "a leader that may be alive counts this node's lease, not its outage"
    finally:
        alive.close()
    assert vouched(c, eps), "the old leader's key outlives it, but its address refuses: it is gone"
    c.term -= 1  # the key is of a newer term than any this node was welcomed in
    assert not vouched(c, eps), "a newer leader may have formed an epoch without this node"
    c.term += 1
    put(eps, epoch_key(PREFIX), {"epoch": 4, "term": 1})
    assert not vouched(c, eps), "an epoch newer than this node's was published"


def test_no_etcd_majority_is_evidence_and_a_silent_member_is_not(etcd: EtcdCluster) -> None:
    eps = etcd.endpoints
    c = client([], etcd=eps)
    etcd.kill(0)
    # A majority is left and nobody leads (once a new raft leader serves reads, if member 0 led).
    assert eventually(lambda: vouched(c, eps)), "a majority is left and nobody leads"
    etcd.kill(1)
    assert eventually(lambda: View.LED not in asyncio.run(_views(eps)))
    views = asyncio.run(_views(eps))
    assert views.count(View.DOWN) == 2 and View.LEADERLESS in views, views
    assert vouched(c, eps), "one member left without a leader, two refusing: nobody can be elected"
    alive = [e for e, v in zip(eps, views, strict=True) if v is View.LEADERLESS]
    assert not vouched(c, alive), "told of one member of three: the others may hold a majority"
    frozen = silent_listener()
    try:
        with_silent = [*eps, f"http://127.0.0.1:{frozen.getsockname()[1]}"]
        assert not vouched(c, with_silent), "a member that does not answer may be leading a majority elsewhere"
    finally:
        frozen.close()
    etcd.kill(2)
    # Every member this node knows of refuses: it cannot learn how many the cluster has (it
    # may have been told of a few), so this is no evidence.
    assert not vouched(c, eps)


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


async def _views(endpoints: list[str]) -> list[View]:
    async with Etcd(endpoints, timeout_s=0.5) as e:
        return await e.views()


def test_without_etcd_the_evidence_is_a_coordinator_address_that_refuses() -> None:
    port = refusing_port()
    c = client([("127.0.0.1", port)])

    async def ask() -> bool:
        return await c._nobody_else_leads(None)

    assert asyncio.run(ask()), "nothing listens at the coordinator's address: none can have started"
    frozen = silent_listener()
    try:
        c.addresses.append(frozen.getsockname())
        assert not asyncio.run(ask()), "a coordinator that accepts (or a cut-off node's timeout) is no evidence"
    finally:
        frozen.close()


def test_outage_trust_is_renewed_by_evidence_and_a_lapse_is_not_renewed() -> None:
    """The session thread's renewal, run for real: a coordinator address that refuses keeps the
    outage trusted past several leases, from a lease nearly spent when the outage began; once
    it stops refusing, trust lapses within a lease,
    counts as a lapse, and is not renewed when the refusals come back."""
    port = refusing_port()
    # A short lease, stretched by the machine's load: the renewals run on a thread that a
    # busy machine schedules late (0.4 s lapsed under two CPU-bound processes).
    lease = 0.4 * slowdown()
    c = client([("127.0.0.1", port)], lease_s=lease)
    loop = asyncio.new_event_loop()
    began = asyncio.Event()
    task = loop.create_task(c._vouch_forever(None, began))

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    # The session drops with its lease nearly spent: evidence is asked for at once.
    c.connection.welcomed(welcome(lease), hello_sent=time.monotonic() + lease / 8 - lease)
    assert c.connection.dropped(expelled=False) is State.SUSPENDED
    began.set()  # before the loop runs: an Event binds to the loop that first waits on it
    thread.start()
    try:
        time.sleep(3.75 * lease)  # almost four leases
        assert c.commit_allowed() and c.lapses == 0, "refusals every quarter lease keep the outage trusted"
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))
        listener.listen(4)
        try:
            deadline = time.monotonic() + 5 * lease
            while c.commit_allowed() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not c.commit_allowed() and c.lapses == 1 and not c.outage
        finally:
            listener.close()
        time.sleep(1.25 * lease)
        assert not c.commit_allowed() and c.lapses == 1, "a lapse waits for a coordinator's answer"
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=5)


def test_a_calls_own_deadline_wins_over_the_clients() -> None:
    """A leader's lease renewal gives its request a deadline shorter than the client's."""
    from unbroken.errors import EtcdUnavailable

    frozen = silent_listener()

    async def renew() -> float:
        async with Etcd([f"http://127.0.0.1:{frozen.getsockname()[1]}"], timeout_s=60.0) as e:
            start = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                await e.keepalive(1, timeout_s=0.2)
            return time.monotonic() - start

    try:
        # 0.2 s on an idle machine, stretched by the load, and far below the client's 60 s.
        assert asyncio.run(renew()) < min(2.0 * slowdown(), 30.0)
    finally:
        frozen.close()
