"""The sync phase's transfer on a real gloo group (one thread per rank, loopback): only the
differing chunks move, several donors share the sending, an interrupted fetch resumes, and
a corrupt chunk or a state that does not match its digest is refused."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.distributed import HashStore  # type: ignore[attr-defined]

from integration.helpers import established_to
from unbroken.comm.group import EpochScope, build_group
from unbroken.comm.transfer import Partial, SyncResult, sync_state
from unbroken.control.meeting import data_address
from unbroken.errors import EpochAborted, TransferError
from unbroken.state import layout
from unbroken.state.snapshot import TrainState

CHUNK = 64 << 10


def make_state(seed: int, frozen_seed: int = 0) -> TrainState:
    torch.manual_seed(frozen_seed)
    backbone = nn.Linear(256, 512)  # 0.5 MB: 9 chunks
    torch.manual_seed(seed)
    head = nn.Linear(512, 16)
    model = nn.Sequential(backbone, head)
    backbone.requires_grad_(False)
    opt = torch.optim.Adam(head.parameters(), lr=0.01)
    st = TrainState(model, opt)
    for _ in range(seed % 3 + 1):
        opt.zero_grad()
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
    st.step, st.cursor = 10 + seed, 40
    return st


class Group:
    """``size`` ranks in threads over one in-memory store; a fresh gloo group per `run`
    (``streams`` connections per pair, connected on first use where ``lazy``)."""

    def __init__(self, size: int, streams: int = 1, lazy: bool = False) -> None:
        self.size, self.streams, self.lazy = size, streams, lazy
        self.store = HashStore()
        self.runs = 0
        self.connections = 0
        """Connections the last run's group had open at its end."""

    def run(self, fn: Any, timeout: float = 30.0) -> list[Any]:
        self.runs += 1
        prefix = f"run{self.runs}"
        wake = threading.Event()
        ended, counted = threading.Barrier(self.size), threading.Barrier(self.size)

        def one(rank: int) -> Any:
            devices = [
                ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=self.lazy) for _ in range(self.streams)
            ]
            pg, _ = build_group(self.store, prefix, rank, self.size, devices, EpochScope(wake, lambda: None, 10.0))
            try:
                return fn(rank, pg)
            except Exception as exc:  # returned, so every rank's outcome can be checked
                return exc
            finally:
                if ended.wait(timeout) == 0:  # every rank's group is still alive: count its connections
                    ports = [self.store.get(f"{prefix}/{s}/{r}") for s in range(self.streams) for r in range(self.size)]
                    self.connections = established_to({data_address(raw)[1] for raw in ports})
                counted.wait(timeout)  # no rank drops its group (closing its side) before the count

        with ThreadPoolExecutor(self.size) as pool:
            return [f.result(timeout) for f in [pool.submit(one, r) for r in range(self.size)]]


def sync(
    states: list[TrainState], partials: dict[int, Partial] | None = None, group: Group | None = None, **kw: Any
) -> list[Any]:
    g = group or Group(len(states))
    partials = partials or {}
    return g.run(
        lambda rank, pg: sync_state(
            pg, rank, len(states), states[rank], EpochScope(threading.Event(), lambda: None, 20.0),
            partial=partials.get(rank), chunk_bytes=CHUNK, **kw,
        )
    )  # fmt: skip


def test_a_joiner_with_the_frozen_layers_already_right_fetches_only_the_rest() -> None:
    donor, joiner = make_state(1), make_state(2)
    joiner.step = 0
    before = joiner.model[0].weight.clone()
    results = sync([donor, joiner])
    r: SyncResult = results[1]
    assert r.role == "receiver" and results[0].role == "source"
    assert joiner.digest() == donor.digest() and torch.equal(joiner.model[0].weight, before)
    frozen = sum(t.numel() * 4 for t in donor.model[0].parameters())
    assert r.state_megabytes * 1e6 > frozen and r.megabytes * 1e6 <= r.state_megabytes * 1e6 - frozen + CHUNK
    assert r.chunks < r.total_chunks and results[0].megabytes == r.megabytes


def test_a_fresh_joiner_takes_everything_from_several_donors() -> None:
    donors = [make_state(1) for _ in range(3)]
    joiner = make_state(2, frozen_seed=5)
    joiner.step = 0
    results = sync([*donors, joiner])
    r = results[3]
    # Everything but the RNG state, which the threads of this test share.
    assert r.chunks == r.total_chunks - 1 and r.peers == (0, 1, 2)
    assert joiner.digest() == donors[0].digest()
    sent = [x.megabytes for x in results[:3]]
    assert min(sent) > 0 and abs(sum(sent) - r.megabytes) < 1e-9, sent
    late = make_state(2, frozen_seed=5)
    late.step = 0
    one = sync([make_state(1), make_state(1), late], max_donors=1)
    assert one[2].peers == (0,) and one[1].megabytes == 0


def test_receivers_behind_and_different_are_all_brought_to_the_majority() -> None:
    a, b, c, d = make_state(1), make_state(1), make_state(1), make_state(2)
    d.step = 3
    with torch.no_grad():
        c.model[1].bias[0] += 1  # silent corruption of one replica
    results = sync([a, b, c, d])
    assert {a.digest()} == {b.digest(), c.digest(), d.digest()}
    assert results[2].chunks == 1, "one corrupted value: one chunk"


@pytest.mark.parametrize("streams", [1, 4])
def test_a_fetch_cut_short_keeps_what_arrived_and_asks_only_for_the_rest(streams: int) -> None:
    donor, joiner = make_state(1), make_state(2, frozen_seed=5)
    joiner.step = 0
    partial = Partial()
    stop, frozen = threading.Event(), threading.Event()
    g = Group(2, streams=streams)

    def hang_after_five(n: int) -> None:
        if n == 5:  # the donor stops sending (as if it died); the group gives up on it
            stop.set()
            frozen.wait(30)

    def first(rank: int, pg: Any) -> Any:
        st = [donor, joiner][rank]
        hook = hang_after_five if rank == 0 else None
        scope = EpochScope(threading.Event(), lambda: EpochAborted("donor gone") if stop.is_set() else None, 20.0)
        return sync_state(
            pg, rank, 2, st, scope, partial=partial if rank == 1 else None, chunk_bytes=CHUNK, on_sent=hook,
        )  # fmt: skip

    cut = g.run(first)
    assert isinstance(cut[1], EpochAborted) and joiner.step == 0, cut
    got = len(partial.fetched)
    assert 0 < got < 12, got
    r = sync([donor, joiner], partials={1: partial}, group=Group(2, streams=streams))[1]
    assert joiner.digest() == donor.digest()
    assert r.resumed_chunks >= got - 1 and r.chunks + r.resumed_chunks <= r.total_chunks, r
    assert partial.key is None, "a finished fetch lets its copy go"
    frozen.set()


def test_a_state_that_does_not_match_its_digest_is_refused_and_fetched_whole_next_time() -> None:
    donor, joiner = make_state(1), make_state(2)
    joiner.step = 0
    digest = donor.digest()
    tree = donor.tree
    # A donor that lies: it reports its true digest and sends another state.
    donor.tree = lambda: {**tree(), "cursor": 41}  # type: ignore[method-assign]
    donor.digest = lambda: digest  # type: ignore[method-assign]
    partial = Partial()
    results = sync([donor, joiner], partials={1: partial})
    assert isinstance(results[1], TransferError) and "does not match its digest" in str(results[1])
    assert joiner.step == 0 and partial.key is None and donor.digest_of(tree()) == digest


@pytest.mark.parametrize("size", [2, 3])
def test_nothing_moves_when_all_agree(size: int) -> None:
    results = sync([make_state(1) for _ in range(size)])
    assert {r.role for r in results} == {"none"}


def test_a_full_resync_fetches_every_chunk_whatever_the_receiver_holds() -> None:
    donor, joiner = make_state(1), make_state(1)
    joiner.step = 0
    r = sync([donor, joiner], incremental=False)[1]
    assert r.chunks == r.total_chunks and joiner.digest() == donor.digest()


def test_what_the_digest_does_not_cover_comes_from_the_source_alone() -> None:
    donors = [make_state(1) for _ in range(4)]
    joiner = make_state(2, frozen_seed=5)
    joiner.step = 0
    for i, d in enumerate(donors[1:], start=1):  # equal digests, different RNG states
        tree = d.tree
        d.tree = lambda tree=tree, i=i: {**tree(), "rng": {"torch": torch.full((5056,), i, dtype=torch.uint8),  # type: ignore[method-assign]
                                                           "python": [i] * 625}}  # fmt: skip
    r = sync([*donors, joiner])[4]
    assert isinstance(r, SyncResult) and joiner.digest() == donors[0].digest(), r
    assert r.peers == (0, 1, 2, 3)


def test_a_donor_whose_layout_differs_where_the_digest_does_not_look_is_left_out() -> None:
    # DiLoCo's case: the inner optimizer is per zone, outside the digest; one zone's holds
    # no state at all, so its chunk numbers would mean other bytes.
    donors = [make_state(1) for _ in range(3)]
    joiner = make_state(2, frozen_seed=5)
    joiner.step = 0
    for st in (*donors, joiner):
        st.optimizer_in_digest = False
    donors[2].optimizer.state.clear()
    r = sync([*donors, joiner])[3]
    assert isinstance(r, SyncResult) and r.peers == (0, 1), r
    assert joiner.digest() == donors[0].digest()


def test_a_later_attempt_keeps_what_an_earlier_one_fetched_from_another_source() -> None:
    st = make_state(1)
    partial = Partial()
    header, _ = layout.split(st.tree())
    partial.prepare((5, 7), layout.slots(header), st.tree())
    tensors, generation = partial.tensors, partial.generation
    random.random()  # another source: another Python RNG state in its header, the same layout
    partial.prepare((5, 7), layout.slots(layout.split(st.tree())[0]), st.tree())
    assert partial.tensors is tensors and partial.generation == generation + 1
    partial.prepare((6, 7), layout.slots(header), st.tree())
    assert partial.tensors is not tensors, "another state: start again from what this node holds"


def test_a_transfer_over_several_streams_uses_each_and_is_exact() -> None:
    # A lazy group connects a stream of a pair only when it carries data: the chunks, each
    # sent with its own tag, take every stream.
    donor, joiner = make_state(1), make_state(2, frozen_seed=5)
    joiner.step = 0
    g = Group(2, streams=4, lazy=True)
    results = sync([donor, joiner], group=g)
    assert results[1].role == "receiver" and results[1].chunks >= 8, results
    assert joiner.digest() == donor.digest()
    assert g.connections == 4, g.connections


def test_a_joiner_lacking_tensors_and_holding_none_that_match_gets_the_exact_state() -> None:
    # A fresh optimizer has no state at all, and the head differs everywhere: nothing of the
    # joiner's own is kept (it is not even copied), everything is fetched, the digest agrees.
    donor = make_state(1)
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 16))
    model[0].requires_grad_(False)
    joiner = TrainState(model, torch.optim.Adam(model[1].parameters(), lr=0.01))
    results = sync([donor, joiner])
    r = results[1]
    # Everything but the RNG state, which the threads of this test share.
    assert r.role == "receiver" and r.chunks == r.total_chunks - 1, r
    assert joiner.digest() == donor.digest()


def test_a_receiver_that_keeps_what_it_fetched_holds_a_copy_apart_from_its_state() -> None:
    # Audits keep the synced state to come back to: the fetched buffers are that copy, so
    # the state must take copies of them, not the buffers themselves (an optimizer keeps the
    # tensors it is given, and its steps would then change the kept copy too).
    donor, joiner = make_state(1), make_state(2)
    joiner.step = 0
    results = sync([donor, joiner], keep=True)
    r: SyncResult = results[1]
    assert r.role == "receiver" and r.fetched is not None and results[0].fetched is None
    assert joiner.digest() == donor.digest() == joiner.digest_of(r.fetched)
    live = {t.data_ptr() for t in layout.split(joiner.tree())[1] if t.numel()}
    assert not live & {t.data_ptr() for t in layout.split(r.fetched)[1] if t.numel()}
    kept = joiner.digest_of(r.fetched)
    joiner.optimizer.zero_grad()
    joiner.model(torch.randn(4, 256)).square().mean().backward()
    joiner.optimizer.step()
    assert joiner.digest_of(r.fetched) == kept != joiner.digest()
    plain = make_state(2)
    plain.step = 0
    assert sync([make_state(1), plain])[1].fetched is None
