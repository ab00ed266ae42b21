"""A node's side of the rendezvous (`unbroken.comm.group.Meeting`) with real gloo builds."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from integration.helpers import established_to
from unbroken.comm.codecs import Codec, make_codec
from unbroken.comm.group import EpochScope, Meeting, build_group
from unbroken.comm.reach import Stall, accuse, reach, refusing
from unbroken.comm.reduce import Reducer
from unbroken.control import messages as m
from unbroken.control.meeting import data_address, with_port
from unbroken.errors import BadContribution, CollectiveFailed
from unbroken.sched.zones import Zones
from unbroken.testing.faults import dropping_sockets, refusing_socket


class Leader:
    """Stands in for the leader: whatever one node publishes reaches every other node."""

    def __init__(self, size: int) -> None:
        self.nodes: list[Meeting] = []
        self.sent: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        for rank in range(size):
            self.nodes.append(Meeting(lambda e, k, v, rank=rank: self.publish(rank, e, k, v)))

    def publish(self, rank: int, epoch: int, key: str, value: bytes) -> None:
        with self.lock:
            self.sent.append((rank, key))
        for other, node in enumerate(self.nodes):
            if other != rank:
                node.deliver(epoch, {key: value})


def test_groups_meet_through_the_leader_and_each_rank_sends_only_its_own_entry():
    size = 3
    leader = Leader(size)
    wake = threading.Event()

    def one(rank: int) -> float:
        node = leader.nodes[rank]
        pg, _ = build_group(
            node.store(7), "world", rank, size, node.devices(7, "world", "127.0.0.1"),
            EpochScope(wake, lambda: None, 10.0), lambda: node.publish(7),
        )  # fmt: skip
        t = torch.ones(2) * (rank + 1)
        pg.allreduce([t]).wait()
        return float(t[0])

    with ThreadPoolExecutor(size) as pool:
        assert list(pool.map(one, range(size))) == [6.0] * size
    assert sorted(leader.sent) == [(r, f"world/0/{r}") for r in range(size)], leader.sent
    entries = leader.nodes[0].entries(7, "world")
    assert sorted(entries) == [0, 1, 2] and leader.nodes[0].complete(7, "world", size)
    addresses = {r: data_address(raw) for r, raw in entries.items()}
    host_name = len(socket.gethostname().encode())
    assert {len(raw) for raw in entries.values()} == {8 + host_name + 8 + 136}, "no sequence number per peer"
    assert {host for host, _ in addresses.values()} == {"127.0.0.1"}
    assert len({port for _, port in addresses.values()}) == size
    # Each build's listener lives as long as the node keeps the epoch: reachable after it.
    assert reach({str(r): a for r, a in addresses.items()}) == {}


def closed_port() -> tuple[socket.socket, int]:
    """A port where nothing listens (bound, so nothing else takes it meanwhile)."""
    s = refusing_socket("127.0.0.1")
    return s, s.getsockname()[1]


def test_reach_names_what_it_cannot_connect_to():
    listening = socket.create_server(("127.0.0.1", 0))
    held, dead = closed_port()
    with listening, held:
        failed = reach({"up": ("127.0.0.1", listening.getsockname()[1]), "down": ("127.0.0.1", dead)})
    assert list(failed) == ["down"] and "refused" in failed["down"].lower()


def test_only_an_address_that_refuses_counts_as_a_process_gone():
    listening = socket.create_server(("127.0.0.1", 0))
    held, dead = closed_port()
    dropping = dropping_sockets("127.0.0.1")
    with listening, held, dropping[0], dropping[1]:
        targets = {
            "alive": ("127.0.0.1", listening.getsockname()[1]),
            "dead": ("127.0.0.1", dead),
            "cut-off": ("127.0.0.1", dropping[0].getsockname()[1]),  # no answer: it may still train
        }
        assert refusing(targets, timeout_s=0.3) == ["dead"]


def test_a_build_with_an_unreachable_peer_fails_and_its_peers_name_that_peer():
    """One rank's entry gives a port nobody listens on (a firewall rejecting inbound TCP):
    the builds that must connect to it fail, and a node that tries every address names it."""
    size = 3
    held, dead = closed_port()
    faults: list[m.Fault] = []
    nodes: list[Meeting] = []

    def publish(rank: int, epoch: int, key: str, value: bytes) -> None:
        if rank == 2:
            value = with_port(value, dead)
        for other, node in enumerate(nodes):
            if other != rank:
                node.deliver(epoch, {key: value})

    nodes.extend(Meeting(lambda e, k, v, rank=rank: publish(rank, e, k, v)) for rank in range(size))
    wake = threading.Event()

    def one(rank: int) -> object:
        node = nodes[rank]
        try:
            return build_group(
                node.store(1), "world", rank, size, node.devices(1, "world", "127.0.0.1"),
                EpochScope(wake, lambda: None, 1.0), lambda: node.publish(1),
            )  # fmt: skip
        except CollectiveFailed as exc:
            return exc

    with held, ThreadPoolExecutor(size) as pool:
        outcomes = list(pool.map(one, range(size)))
        assert any(isinstance(o, CollectiveFailed) for o in outcomes), outcomes
        ids = ["a", "b", "walled"]
        for rank in (0, 1):
            assert accuse(1, "world", nodes[rank].entries(1, "world"), ids, rank, faults.append)
        assert not accuse(1, "world", nodes[2].entries(1, "world"), ids, 2, faults.append), "it reaches the others"
    assert [(f.culprit, f.kind) for f in faults] == [("walled", "unreachable")] * 2
    assert f"127.0.0.1:{dead}" in faults[0].reason and "firewall or NAT" in faults[0].reason
    # The walled rank's build waits on in gloo past its caller's deadline: let it end here,
    # not at interpreter exit (gloo aborts the process when it times out during teardown).
    for thread in [t for t in threading.enumerate() if t.name.startswith("pg-build-")]:
        thread.join(timeout=60)
        assert not thread.is_alive(), thread.name


def test_a_node_that_reaches_few_of_its_peers_names_itself():
    held = [closed_port() for _ in range(3)]
    mine = socket.create_server(("127.0.0.1", 0))
    with mine:
        entries = {0: with_port(gloo_like(), mine.getsockname()[1])}
        entries |= {r + 1: with_port(gloo_like(), port) for r, (_, port) in enumerate(held)}
        faults: list[m.Fault] = []
        assert accuse(4, "world", entries, ["me", "x", "y", "z"], 0, faults.append)
        zone: list[m.Fault] = []  # in a zone's group, a few bad addresses must not make it name itself
        assert accuse(4, "zone0", entries, ["me", "x", "y", "z"], 0, zone.append)
    for s, _ in held:
        s.close()
    assert [(f.culprit, f.kind) for f in faults] == [("me", "unreachable")]
    assert sorted(f.culprit for f in zone) == ["x", "y", "z"]
    assert "reaches 0 of its 3 peers" in faults[0].reason


def gloo_like() -> bytes:
    """A real entry of this machine's gloo for a group of 4, to vary the port of."""
    nodes = [Meeting(lambda e, k, v: None)]
    wake = threading.Event()
    with pytest.raises(CollectiveFailed):  # alone in a group of four: times out, having written its entry
        build_group(
            nodes[0].store(1), "g", 0, 4, nodes[0].devices(1, "g", "127.0.0.1"), EpochScope(wake, lambda: None, 0.2),
            lambda: nodes[0].publish(1),
        )  # fmt: skip
    return nodes[0].entries(1, "g")[0]


def test_a_stall_is_reported_once_after_the_deadline_from_the_last_entry():
    complete = threading.Event()
    calls: list[float] = []
    stall = Stall(complete.is_set, 0.2, lambda: calls.append(time.monotonic()))
    stall()
    time.sleep(0.3)
    stall()
    assert calls == [], "entries still missing: that is the leader's to name (absent), not a stall"
    complete.set()
    stall()
    since = time.monotonic()
    while time.monotonic() - since < 0.6:
        stall()
        time.sleep(0.01)
    assert len(calls) == 1 and calls[0] - since >= 0.2


def test_republish_sends_only_what_this_node_wrote():
    sent: list[str] = []
    node = Meeting(lambda e, k, v: sent.append(k))
    node.deliver(1, {"world/0/1": b"theirs"})
    node.store(1).set("world/0/0", b"mine")
    node.publish(1)
    assert sent == ["world/0/0"]
    node.republish()
    assert sent == ["world/0/0", "world/0/0"]
    node.reset()
    node.republish()
    assert sent == ["world/0/0", "world/0/0"]


class Marking:
    """A view that marks what it advertises and translates."""

    def advertise(self, epoch: int, raw: bytes) -> bytes:
        return b"via-forwarder:" + raw

    def translate(self, epoch: int, own: bytes, advertised: bytes, peer: bytes) -> bytes:
        return b"translated:" + peer

    def forget(self, epoch: int) -> None:
        pass


def test_a_node_moved_behind_a_forwarder_goes_through_it_from_that_epoch_on():
    sent: dict[tuple[int, str], bytes] = {}
    node = Meeting(lambda e, k, v: sent.__setitem__((e, k), v))
    node.behind(Marking(), 2)
    for epoch in (1, 2):
        node.store(epoch).set("world/0/0", b"mine")
        node.publish(epoch)
        node.deliver(epoch, {"world/0/1": b"theirs"})
    assert sent == {(1, "world/0/0"): b"mine", (2, "world/0/0"): b"via-forwarder:mine"}
    assert node.store(1).get("world/0/1") == b"theirs", "an epoch before the move keeps its entries"
    assert node.store(2).get("world/0/1") == b"translated:theirs"


def test_a_lazy_group_connects_only_the_pairs_that_exchange_data():
    size, late = 10, 3
    leader = Leader(size)
    held = threading.Event()
    publish = leader.publish

    def slow_publish(rank: int, epoch: int, key: str, value: bytes) -> None:
        if rank == late:  # this rank's entry reaches the others after their gathers began
            # Marked held before the entry is out: the gathers cannot end without it, so the mark
            # is always there once they have (set after the publish, it raced the assertion).
            threading.Timer(0.5, lambda: (held.set(), publish(rank, epoch, key, value))).start()
        else:
            publish(rank, epoch, key, value)

    leader.publish = slow_publish  # type: ignore[method-assign]
    wake = threading.Event()
    built: list[float] = [0.0] * size
    groups: list[object] = [None] * size  # alive until the connections are counted

    def one(rank: int) -> list[int]:
        node = leader.nodes[rank]
        device = node.devices(7, "world", "127.0.0.1", lazy=True)
        pg, built[rank] = build_group(node.store(7), "world", rank, size, device, EpochScope(wake, lambda: None, 10.0),
                                      lambda: node.publish(7))  # fmt: skip
        groups[rank] = pg
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        pg.allgather([out], [torch.tensor([rank * 10])]).wait()
        if rank in (0, 6):  # a transfer between two ranks that are not ring neighbours
            t = torch.full((4,), 5.0) if rank == 0 else torch.zeros(4)
            (pg.send([t], 6, 1) if rank == 0 else pg.recv([t], 0, 1)).wait()
            assert rank == 0 or t.sum() == 20.0
        return [int(x) for x in out]

    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(one, range(size)))
        assert held.is_set()
        assert results == [[r * 10 for r in range(size)]] * size
        assert max(built) < 0.5, "a lazy build does not wait for its peers"
        ports = {data_address(raw)[1] for raw in leader.nodes[0].entries(7, "world").values()}
        connections = established_to(ports)
    # A ring all-gather connects each rank to its neighbours, the transfer one more pair;
    # a full mesh would be size × (size − 1) / 2 = 45.
    assert size <= connections <= size + 2, connections


class _HeldStore(torch.distributed.Store):
    """A store whose writes wait until ``open`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.distributed.HashStore()
        self.open = threading.Event()

    def set(self, key: str, value: bytes) -> None:
        self.open.wait()
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()


def test_a_lazy_build_publishes_every_entry_it_wrote_even_the_one_written_as_it_returned():
    # A lazy build writes its streams' entries and returns at once; a peer's first use of a
    # stream waits for that stream's entry. A publish that read the store before the build
    # wrote must not be the last one made (a busy machine once left a stream unconnected).
    sent: list[str] = []
    store = _HeldStore()
    ended = threading.Event()  # the scope's wake: set as the build ends

    def publish() -> None:
        keys = store.list_keys()
        if not store.open.is_set():  # the first call: the build writes and returns meanwhile
            store.open.set()
            assert ended.wait(10)
        sent.extend(k for k in keys if k not in sent)

    devices = Meeting(lambda e, k, v: None).devices(7, "leaders", "127.0.0.1", lazy=True, streams=4)
    build_group(store, "leaders", 0, 2, devices, EpochScope(ended, lambda: None, 10.0), publish)
    assert sorted(sent) == [f"leaders/{s}/0" for s in range(4)]


def stream_ports(node: object, epoch: int, group: str, streams: int, size: int) -> set[int]:
    store = node.store(epoch)  # type: ignore[attr-defined]
    return {data_address(store.get(f"{group}/{s}/{r}"))[1] for s in range(streams) for r in range(size)}


@pytest.mark.parametrize("streams", [1, 4])
def test_an_exchange_posted_in_pieces_travels_over_every_stream_and_sums_the_same(streams: int) -> None:
    # Two zone leaders exchange an int8-compressed payload over a lazy group: a pair connects
    # a stream only when it carries data, so the connections show which streams were used.
    size = 2
    leader = Leader(size)
    wake = threading.Event()
    zones = Zones(("A", "B"))
    groups: list[object] = [None] * size
    flats = [torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def one(rank: int) -> torch.Tensor:
        node = leader.nodes[rank]
        devices = node.devices(7, "leaders", "127.0.0.1", lazy=True, streams=streams)
        pg, _ = build_group(node.store(7), "leaders", rank, size, devices, EpochScope(wake, lambda: None, 10.0),
                            lambda: node.publish(7))  # fmt: skip
        groups[rank] = pg
        reducer = Reducer(rank, zones, None, leaders_pg=pg, codec=make_codec("int8"), compressed=4000, streams=streams)
        flat = flats[rank].clone()
        reducer.allreduce(flat, EpochScope(wake, lambda: None, 10.0), "exchange")
        return flat

    with ThreadPoolExecutor(size) as pool:
        a, b = pool.map(one, range(size))
        connections = established_to(stream_ports(leader.nodes[0], 7, "leaders", streams, size))
    assert torch.equal(a, b)
    # What one leader alone computes from both payloads, in zone order, bit for bit.
    payloads = [make_codec("int8").encode(f[:4000]) for f in flats]
    total = make_codec("int8").decode(payloads[0], 4000) + make_codec("int8").decode(payloads[1], 4000)
    assert torch.equal(a[:4000], total) and torch.equal(a[4000:], flats[0][4000:] + flats[1][4000:])
    assert connections == streams, connections


def test_an_eager_group_with_streams_connects_every_stream_of_every_pair():
    # gloo connects a group's streams one after another: each stream's entries are written
    # once the stream before connected, and the first stream's say who came.
    size, streams = 3, 3
    leader = Leader(size)
    wake = threading.Event()
    groups: list[object] = [None] * size

    def one(rank: int) -> float:
        node = leader.nodes[rank]
        devices = node.devices(7, "leaders", "127.0.0.1", streams=streams)
        pg, _ = build_group(node.store(7), "leaders", rank, size, devices, EpochScope(wake, lambda: None, 10.0),
                            lambda: node.publish(7))  # fmt: skip
        groups[rank] = pg
        t = torch.ones(2) * (rank + 1)
        pg.allreduce([t]).wait()
        return float(t[0])

    with ThreadPoolExecutor(size) as pool:
        assert list(pool.map(one, range(size))) == [6.0] * size
        connections = established_to(stream_ports(leader.nodes[0], 7, "leaders", streams, size))
    assert all(leader.nodes[r].complete(7, "leaders", size) for r in range(size))
    assert sorted(key for _, key in leader.sent) == sorted(
        f"leaders/{s}/{r}" for s in range(streams) for r in range(size)
    )
    assert connections == streams * size * (size - 1) // 2, connections


def test_a_leader_whose_payload_does_not_decode_is_named_by_every_leader() -> None:
    size = 2
    leader = Leader(size)
    wake = threading.Event()
    zones = Zones(("A", "B"))
    groups: list[object] = [None] * size

    class Lying(Codec):  # a codec whose scales a broken (or hostile) leader spoiled
        name = "int8"

        def __init__(self) -> None:
            self.inner = make_codec("int8")

        def payload_bytes(self, numel: int) -> int:
            return self.inner.payload_bytes(numel)

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            payload = self.inner.encode(x)
            payload[:4] = torch.tensor([float("nan")]).view(torch.uint8)
            return payload

        def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
            return self.inner.decode(payload, numel)

    def one(rank: int) -> object:
        node = leader.nodes[rank]
        devices = node.devices(7, "leaders", "127.0.0.1", streams=2)
        pg, _ = build_group(node.store(7), "leaders", rank, size, devices, EpochScope(wake, lambda: None, 10.0),
                            lambda: node.publish(7))  # fmt: skip
        groups[rank] = pg
        codec = Lying() if rank == 1 else make_codec("int8")
        reducer = Reducer(rank, zones, None, leaders_pg=pg, codec=codec, compressed=300, streams=2)
        try:
            reducer.allreduce(torch.randn(400), EpochScope(wake, lambda: None, 10.0), "exchange")
        except BadContribution as exc:
            return exc
        return None

    with ThreadPoolExecutor(size) as pool:
        verdicts = list(pool.map(one, range(size)))
    assert all(isinstance(v, BadContribution) and v.rank == 1 for v in verdicts), verdicts
