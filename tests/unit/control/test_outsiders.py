"""The leash of connections that have not proven the job token (`unbroken.control.outsiders`)."""

from __future__ import annotations

import asyncio
import resource

import pytest

from unbroken.control.outsiders import Door, Guard, Limits, raise_open_files_limit


class FakeTransport(asyncio.Transport):
    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer = peer
        self.aborted = self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return (self.peer, 40000) if name == "peername" else default

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True


class Inner(asyncio.Protocol):
    """aiohttp's protocol, as the guard sees it: what reached it."""

    def __init__(self) -> None:
        self.made = False
        self.data = b""
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class Request:
    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport


def connect(guard: Guard, peer: str) -> tuple[asyncio.Protocol, FakeTransport, Inner]:
    inner = Inner()
    proto = guard.protocol(lambda: inner)()
    transport = FakeTransport(peer)
    proto.connection_made(transport)
    return proto, transport, inner


def test_the_door_caps_each_address_and_the_total() -> None:
    d = Door(per_address=2, total=3)
    assert d.admit("a") is None and d.admit("a") is None
    assert d.admit("a") == "address"
    assert d.admit("b") is None
    assert d.admit("c") == "total"
    d.leave("a")
    assert d.admit("c") is None and d.holding == 3
    for peer in ("a", "b", "c"):
        d.leave(peer)
    assert d.holding == 0 and not d.held


def test_limits_name_a_bad_value() -> None:
    with pytest.raises(ValueError, match=r"Limits\.request_s must be positive"):
        Limits(request_s=0)


def test_the_total_is_at_most_half_the_open_files() -> None:
    g = Guard(Limits(total=4096))
    g.fit(1024)
    assert g.door.total == 512
    g.fit(1 << 20)
    assert g.door.total == 4096


def test_connections_over_the_cap_are_reset_before_aiohttp_sees_them() -> None:
    async def scenario() -> None:
        g = Guard(Limits(per_address=2, total=10))
        kept = [connect(g, "10.0.0.1") for _ in range(2)]
        _, third, inner = connect(g, "10.0.0.1")
        assert third.aborted and not inner.made
        assert all(inner.made and not t.aborted for _, t, inner in kept)
        _, other, _ = connect(g, "10.0.0.2")
        assert not other.aborted  # another address has its own
        assert g.state()["cut"] == {"address": 1}

    asyncio.run(scenario())


def test_a_proven_connection_is_not_counted_nor_limited() -> None:
    async def scenario() -> None:
        g = Guard(Limits(per_address=1, total=10, unproven_bytes=100, request_s=0.05))
        proto, transport, inner = connect(g, "10.0.0.1")
        g.prove(Request(transport))  # type: ignore[arg-type]
        assert g.door.holding == 0
        proto.data_received(b"x" * 1000)
        assert inner.data == b"x" * 1000 and not transport.aborted
        _, second, _ = connect(g, "10.0.0.1")
        assert not second.aborted  # the member's session left its address's slot
        await asyncio.sleep(0.1)
        assert not transport.aborted and not transport.closed  # no deadline either
        proto.connection_lost(None)
        assert inner.lost and g.door.holding == 1

    asyncio.run(scenario())


def test_an_unproven_connection_sending_too_much_is_cut_and_its_slot_freed() -> None:
    async def scenario() -> None:
        g = Guard(Limits(unproven_bytes=100))
        proto, transport, inner = connect(g, "10.0.0.1")
        proto.data_received(b"x" * 60)
        proto.data_received(b"x" * 60)
        assert transport.aborted and inner.data == b"x" * 60  # the excess never reached aiohttp
        proto.connection_lost(None)
        assert inner.lost and g.door.holding == 0 and g.state()["cut"] == {"large": 1}

    asyncio.run(scenario())


def test_a_request_not_complete_in_time_is_cut_and_an_idle_one_closed() -> None:
    async def scenario() -> None:
        g = Guard(Limits(request_s=0.05))
        half, half_t, _ = connect(g, "10.0.0.1")
        half.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and no more: a slowloris
        _, idle_t, _ = connect(g, "10.0.0.1")
        _, served_t, _ = connect(g, "10.0.0.1")
        g._open[served_t].started()  # a request being handled keeps its own deadlines
        await asyncio.sleep(0.15)
        assert half_t.aborted and g.state()["cut"] == {"slow": 1}
        assert idle_t.closed and not idle_t.aborted
        assert not served_t.aborted and not served_t.closed
        g._open[served_t].ended()  # its response went out: the next request has the deadline
        await asyncio.sleep(0.15)
        assert served_t.closed

    asyncio.run(scenario())


def test_the_soft_limit_of_open_files_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if soft > 64:
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        got = raise_open_files_limit()
        assert got == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert got == min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else got == 1 << 20
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
