"""Forwarding for nodes that accept no connection (`unbroken.comm.forward`, `unbroken.comm.tunnel`):
gloo's dial direction, the rendezvous view, and real gloo groups through a forwarder on loopback."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from unbroken.comm.forward import ForwarderThread, ForwardLimits, entry_with, gloo_initiator
from unbroken.comm.group import EpochScope, Meeting, build_group
from unbroken.comm.tunnel import LOOPBACK, NOWHERE, ForwardingError, NatView, Tunnel
from unbroken.control.meeting import data_address
from unbroken.errors import ConfigError

TOKEN = "forwarding-test-token-0123456789"


def entry(host: str, port: int, name: bytes = b"vm") -> bytes:
    """A rank's rendezvous entry as gloo's TCP transport writes it (IPv4, no peer sequence numbers)."""
    sockaddr = (socket.AF_INET.to_bytes(2, "little") + port.to_bytes(2, "big") + socket.inet_aton(host)).ljust(
        128, b"\0"
    )
    address = sockaddr + (0).to_bytes(8, "little")
    return len(name).to_bytes(8, "little") + name + len(address).to_bytes(8, "little") + address


def test_gloo_dials_from_the_greater_address_comparing_ports_as_network_order_bytes():
    assert gloo_initiator(("10.0.0.3", 1), ("10.0.0.2", 9))
    assert not gloo_initiator(("10.0.0.2", 9), ("10.0.0.3", 1))
    assert gloo_initiator(("127.0.0.1", 1), ("10.255.255.255", 1))  # bytes, not the dotted strings
    # Same host: gloo compares sin_port, the network-order bytes read natively (htons).
    assert gloo_initiator(("10.0.0.2", 1), ("10.0.0.2", 256)) == (socket.htons(1) > socket.htons(256))
    with pytest.raises(ValueError, match="share the address"):
        gloo_initiator(("10.0.0.2", 5), ("10.0.0.2", 5))


def test_an_entry_rewritten_to_the_forwarder_keeps_its_name_and_parses():
    raw = entry("127.255.255.254", 4000, name=b"host-a")
    moved = entry_with(raw, "10.1.2.3", 7801)
    assert data_address(moved) == ("10.1.2.3", 7801)
    assert len(moved) == len(raw) and moved[:14] == raw[:14]
    with pytest.raises(ValueError):
        entry_with(raw[:20], "10.1.2.3", 7801)


class FakeTunnel:
    def __init__(self) -> None:
        self.splices: list[tuple[str, int]] = []
        self.forgotten: list[int] = []

    def open(self, epoch: int, local: tuple[str, int]) -> tuple[str, int]:
        return "10.0.0.5", 7000 + local[1] % 100

    def local_dial(self, epoch: int, target: tuple[str, int]) -> tuple[str, int]:
        self.splices.append(target)
        return "127.0.0.1", 5555

    def forget(self, epoch: int) -> None:
        self.forgotten.append(epoch)


def test_the_view_makes_gloo_dial_exactly_the_peers_that_wait_for_it():
    tunnel = FakeTunnel()
    view = NatView(tunnel)  # type: ignore[arg-type]
    own = entry(LOOPBACK, 4001)
    advertised = view.advertise(3, own)
    assert data_address(advertised) == ("10.0.0.5", 7001)
    # A peer above the forwarder's address dials it: our gloo must listen for it.
    above = view.translate(3, own, advertised, entry("10.0.0.9", 4000))
    assert data_address(above) == NOWHERE and not gloo_initiator((LOOPBACK, 4001), data_address(above))
    # A peer below it waits for us: our gloo dials it straight (it compares below loopback).
    below = entry("10.0.0.2", 4000)
    assert view.translate(3, own, advertised, below) == below and gloo_initiator((LOOPBACK, 4001), ("10.0.0.2", 4000))
    # A peer below the forwarder but above 127/8 can only be dialled through a local splice.
    tunnel.open = lambda epoch, local: ("200.0.0.5", 7001)  # type: ignore[method-assign]
    advertised = view.advertise(3, own)
    public = view.translate(3, own, advertised, entry("150.0.0.2", 4000))
    assert data_address(public) == ("127.0.0.1", 5555) and tunnel.splices == [("150.0.0.2", 4000)]
    assert gloo_initiator((LOOPBACK, 4001), data_address(public))


def test_a_meeting_with_a_view_holds_peers_entries_until_its_own_is_advertised():
    tunnel = FakeTunnel()
    sent: list[tuple[str, bytes]] = []
    meeting = Meeting(lambda e, k, v: sent.append((k, v)), keep=2, view=NatView(tunnel))  # type: ignore[arg-type]
    meeting.deliver(1, {"world/0/0": entry("10.0.0.9", 4000)})
    store = meeting.store(1)
    assert not store.check(["world/0/0"]), "gloo must not read a peer's entry before the view translated it"
    assert meeting.complete(1, "world", 1)
    store.set("world/0/1", entry(LOOPBACK, 4001))  # what gloo writes for this node
    meeting.publish(1)
    assert [(k, data_address(v)) for k, v in sent] == [("world/0/1", ("10.0.0.5", 7001))]
    assert data_address(store.get("world/0/0")) == NOWHERE
    assert {r: data_address(raw) for r, raw in meeting.entries(1, "world").items()} == {
        0: ("10.0.0.9", 4000), 1: ("10.0.0.5", 7001),
    }  # fmt: skip
    meeting.store(2), meeting.store(3)
    assert tunnel.forgotten == [1], "an epoch the rendezvous drops closes its ports"


def gloo_world(hosts: list[str], nat: dict[int, Tunnel], epoch: int = 5) -> list[float]:
    """An all-reduce over ranks listening on ``hosts``; ranks in ``nat`` behind a forwarder."""
    size = len(hosts)
    nodes: list[Meeting] = []

    def publish(rank: int, e: int, key: str, value: bytes) -> None:
        for other, node in enumerate(nodes):
            if other != rank:
                node.deliver(e, {key: value})

    for rank in range(size):
        view = NatView(nat[rank]) if rank in nat else None
        nodes.append(Meeting(lambda e, k, v, rank=rank: publish(rank, e, k, v), view=view))
    wake = threading.Event()

    def one(rank: int) -> float:
        node = nodes[rank]
        host = LOOPBACK if rank in nat else hosts[rank]
        pg, _ = build_group(
            node.store(epoch), "world", rank, size, node.devices(epoch, "world", host),
            EpochScope(wake, lambda: None, 20.0), lambda: node.publish(epoch),
        )  # fmt: skip
        t = torch.ones(1 << 16) * (rank + 1)
        for _ in range(3):
            pg.allreduce([t]).wait()
        return float(t[0])

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(one, range(size)))


def test_a_rank_behind_a_forwarder_reduces_with_peers_that_dial_it_and_peers_it_dials():
    forwarder = ForwarderThread(TOKEN, "127.0.0.5")
    tunnel = Tunnel((forwarder.address,), TOKEN, "nat")
    try:
        # 127.0.0.2 is below the forwarder (the NAT'd rank dials it), 127.0.0.9 above (it dials the forwarder).
        assert gloo_world(["127.0.0.2", "127.0.0.9", "unused"], {2: tunnel}) == [6.0 * 9] * 3
        sessions = list(forwarder.forwarder._sessions.values())
        assert len(sessions) == 1 and sessions[0].spliced >= 1 and sessions[0].sent > 3 * 4 * (1 << 16)
    finally:
        tunnel.close()
        forwarder.close()


def test_a_forwarder_refuses_a_wrong_token_and_bounds_the_ports_of_a_session():
    with pytest.raises(ConfigError, match="token"):
        ForwarderThread(None, "127.0.0.1")
    forwarder = ForwarderThread(TOKEN, "127.0.0.1", limits=ForwardLimits(ports=1))
    wrong = Tunnel((forwarder.address,), "another-job-token-0123456789", "intruder")
    right = Tunnel((forwarder.address,), TOKEN, "nat")
    try:
        with pytest.raises(ForwardingError, match="did not prove the job's token"):
            wrong.open(1, ("127.0.0.1", 9))
        right.open(1, ("127.0.0.1", 9))
        with pytest.raises(ForwardingError, match="holds 1 ports already"):
            right.open(1, ("127.0.0.1", 10))
        right.forget(1)  # closes the epoch's port: room for the next one
        deadline = time.monotonic() + 5
        while True:
            try:
                right.open(2, ("127.0.0.1", 10))
                break
            except ForwardingError:
                assert time.monotonic() < deadline, "a port closed by forget was never freed"
                time.sleep(0.05)
    finally:
        wrong.close()
        right.close()
        forwarder.close()


def test_a_forwarder_tells_a_node_whether_it_can_connect_to_the_nodes_own_address():
    forwarder = ForwarderThread(TOKEN, "127.0.0.1")
    tunnel = Tunnel((forwarder.address,), TOKEN, "maybe-nat")
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        assert tunnel.probe(("127.0.0.1", listening.getsockname()[1])) is None
        why = tunnel.probe(("127.0.0.1", closed_port))
        assert why is not None and "refused" in why.lower()
    finally:
        listening.close()
        tunnel.close()
        forwarder.close()


def echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_forwarded_port_splices_both_ways_and_closes_past_its_byte_bound():
    forwarder = ForwarderThread(TOKEN, "127.0.0.1", limits=ForwardLimits(bytes_per_port=100_000))
    tunnel = Tunnel((forwarder.address,), TOKEN, "nat")
    echo = echo_server()
    try:
        host, port = tunnel.open(1, echo.getsockname())
        with socket.create_connection((host, port), timeout=5) as peer:
            peer.sendall(b"x" * 1000)
            got = b""
            while len(got) < 1000:
                got += peer.recv(65536)
            assert got == b"x" * 1000
            # Past 100 kB through the port (both ways counted) the forwarder closes it.
            with pytest.raises(OSError):
                for _ in range(200):
                    peer.sendall(b"y" * 10_000)
                    if not peer.recv(65536):
                        raise ConnectionResetError("closed by the forwarder")
    finally:
        echo.close()
        tunnel.close()
        forwarder.close()
