"""A sharded zone's NCCL group on the CPU, with a stand-in ``ProcessGroupNCCL``: rank 0's
failure reaches the others at once, the environment is set once and a user's own setting
kept and said, a group is kept while the zone's members stay, a build this member's own
NCCL refused (or that failed twice with the same members) makes the zone's next placement
gloo on every member until its members change, and a peer's death marks no survivor."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar

import pytest
import torch
from torch.distributed import HashStore  # type: ignore[attr-defined]

from unbroken.comm.group import EpochScope
from unbroken.comm.nccl import NCCL_ENV, RELAY_BYTES, Communicator, build_nccl, nccl_environment, relay_entries
from unbroken.comm.placement import Backend, MemberDevice
from unbroken.errors import CollectiveFailed, NcclRefused
from unbroken.testing.fake import FakeWorld
from unbroken.train.shard_devices import ZoneDevices

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")
DEADLINE_S = 20.0


class Stand:
    """A stand-in ``ProcessGroupNCCL``: rank 0 writes its id to the store, and every rank
    then waits, as NCCL's connect does, until all ranks have connected. ``refuse``: the
    rank whose build raises, and when: in the constructor (``made``), before rank 0's id
    is written (``early``, as ncclGetUniqueId does) or after (``late``, as a connect)."""

    refuse: tuple[int, str] | None = None
    built: ClassVar[list[int]] = []
    connected: ClassVar[threading.Barrier]
    """The ranks of one build (`each` makes a class of its own for each: a build a test left
    waiting must not take a place in the next test's)."""

    class Options:
        def __init__(self) -> None:
            self._timeout: timedelta | None = None

    def __init__(self, store: Any, rank: int, size: int, opts: Stand.Options) -> None:
        if Stand.refuse == (rank, "made"):
            raise RuntimeError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
        self.store, self.rank, self.size = store, rank, size

    def eager_connect_single_device(self, device: torch.device) -> None:
        refuse = Stand.refuse
        if refuse == (self.rank, "early"):
            raise RuntimeError("NCCL error: ncclGetUniqueId failed: no socket interface found")
        if self.rank == 0:
            self.store.set("0", b"\x01nccl-id-" + str(time.monotonic_ns()).encode())
        self.id = bytes(self.store.get("0"))
        if refuse == (self.rank, "late"):
            raise RuntimeError("NCCL error: unhandled cuda error")
        self.connected.wait(DEADLINE_S * 2)  # a rank that failed never comes: NCCL waits on
        Stand.built.append(self.rank)


@pytest.fixture
def stand(monkeypatch: pytest.MonkeyPatch) -> type[Stand]:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "ProcessGroupNCCL", Stand, raising=False)
    monkeypatch.setattr(Stand, "refuse", None)
    monkeypatch.setattr(Stand, "built", [])
    return Stand


def scope(deadline_s: float = DEADLINE_S) -> EpochScope:
    return EpochScope(threading.Event(), lambda: None, deadline_s)


def each(size: int, fn: Callable[[int], Any]) -> dict[int, Any]:
    """``fn(rank)`` on a thread per rank, their builds meeting on a barrier of their own:
    what each returned or raised, and when."""
    import torch.distributed as dist

    meeting: type[Stand] = type("Stand", (Stand,), {"connected": threading.Barrier(size)})
    dist.ProcessGroupNCCL = meeting  # type: ignore[attr-defined]
    out: dict[int, Any] = {}

    def target(rank: int) -> None:
        t0 = time.monotonic()
        try:
            out[rank] = fn(rank)
        except BaseException as exc:  # reported to the test
            exc.add_note(f"after {time.monotonic() - t0:.2f} s")
            out[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S * 2)
    return out


def took(exc: BaseException) -> float:
    return float(exc.__notes__[-1].split()[1])


@pytest.mark.parametrize("early", [True, False], ids=["before-its-id", "after-its-id"])
def test_rank_zeros_failed_build_fails_every_member_at_once_with_its_reason(stand: type[Stand], early: bool) -> None:
    stand.refuse = (0, "early" if early else "late")
    world = FakeWorld(3)
    out = each(3, lambda r: build_nccl(world.group(r), "nccl-4", r, 3, CPU, scope()))
    reason = "ncclGetUniqueId failed" if early else "unhandled cuda error"
    assert isinstance(out[0], CollectiveFailed) and reason in str(out[0])
    assert out[0].__cause__ is not None, "rank 0's own error, chained"
    # Drawing the id depends on no peer; a failure once the id went out may be a peer's doing.
    assert isinstance(out[0], NcclRefused) is early
    for r in (1, 2):
        assert isinstance(out[r], CollectiveFailed), out
        assert f"building group nccl-4 failed on rank 0: NCCL error: {'ncclGetUniqueId' if early else 'unhandled'}" in (
            str(out[r])
        )
        assert not isinstance(out[r], NcclRefused), "not its own NCCL's refusal"
        assert took(out[r]) < DEADLINE_S / 2, "waited for the deadline, not for rank 0's word"


def test_a_constructor_that_refuses_on_another_rank_is_that_ranks_own_refusal(stand: type[Stand]) -> None:
    stand.refuse = (2, "made")
    world = FakeWorld(3)
    short = 1.0  # ranks 0 and 1 wait in the connect for rank 2 until the deadline
    out = each(3, lambda r: build_nccl(world.group(r), "nccl-5", r, 3, CPU, scope(short)))
    assert isinstance(out[2], NcclRefused) and "no GPUs found" in str(out[2]), out
    assert all(isinstance(out[r], CollectiveFailed) and not isinstance(out[r], NcclRefused) for r in (0, 1)), out


def test_a_build_that_succeeds_names_one_communicator_and_a_new_build_another(stand: type[Stand]) -> None:
    world = FakeWorld(2)
    first = each(2, lambda r: build_nccl(world.group(r), "nccl-1", r, 2, CPU, scope()))
    second = each(2, lambda r: build_nccl(world.group(r), "nccl-2", r, 2, CPU, scope()))
    assert first[0].token == first[1].token and second[0].token == second[1].token
    assert first[0].token != second[0].token
    assert first[1].pg.id == first[0].pg.id


def test_the_environment_is_set_once_and_a_users_own_setting_is_kept_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "PATH": "/bin"}
    with caplog.at_level(logging.WARNING, logger="unbroken.comm.nccl"):
        theirs = nccl_environment(env)
    assert theirs == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "0", "PATH": "/bin"}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in said[0] and "kept over ours (2)" in said[0]
    mine: dict[str, str] = {}
    assert nccl_environment(mine) == {} and mine == NCCL_ENV


def gpu(i: int) -> MemberDevice:
    return MemberDevice("cuda", f"GPU-{i}", "NVIDIA L4", True)


class Zone:
    """``size`` members' `ZoneDevices` (computing on the CPU, said to be on L4s of their own)
    placing their zone over in-memory groups, as a sync phase does with their reports."""

    def __init__(self, size: int) -> None:
        self.names = [f"m{i}" for i in range(size)]
        self.devices = {m: ZoneDevices(CPU) for m in self.names}
        self.epoch = 0

    def said(self, m: str, members: list[str]) -> MemberDevice:
        return MemberDevice.decode(self.devices[m].said(False, members))

    def reports(self, members: list[str]) -> dict[str, MemberDevice]:
        said = {m: self.said(m, members) for m in members}
        return {m: replace(gpu(i), holds=d.holds, failed=d.failed) for i, (m, d) in enumerate(said.items())}

    def place(self, members: list[str], dead: frozenset[str] = frozenset(), ranged: bool = False) -> dict[str, Any]:
        """Each member's (placement, group, gloo group), or what it raised; ``dead``: members
        killed once their reports went out (every collective of theirs fails on the others)."""
        self.epoch += 1
        reports, ranks, world = self.reports(members), {m: i for i, m in enumerate(members)}, FakeWorld(len(members))
        for m in dead:
            world.kill(ranks[m])

        def one(r: int) -> Any:
            m = members[r]
            if m in dead:
                return None
            gloo = world.group(r)
            placement, group = self.devices[m].place(
                f"nccl-{self.epoch}", m, reports, ranks, gloo, scope(), ranged=ranged
            )
            return placement, group, gloo

        out = each(len(members), one)
        return {members[r]: v for r, v in out.items() if members[r] not in dead}


def backends(out: dict[str, Any]) -> set[Backend]:
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    return {p.backend for p, _, _ in out.values()}


def test_a_zone_whose_members_stay_keeps_its_nccl_group_and_builds_anew_on_a_change(stand: type[Stand]) -> None:
    zone = Zone(3)
    first = zone.place(zone.names)
    assert all(p.backend is Backend.NCCL for p, _, _ in first.values()) and len(stand.built) == 3
    again = zone.place(zone.names)
    assert len(stand.built) == 3, "the same members and ranks: no new build"
    assert all(again[m][1] is first[m][1] for m in zone.names)
    zone.devices["m1"].comm.drop()  # a failure on m1's group: it says it keeps none
    third = zone.place(zone.names)
    assert len(stand.built) == 6 and all(third[m][1] is not first[m][1] for m in zone.names)
    fewer = zone.place(["m0", "m2"])  # a member lost: the ranks changed
    assert len(stand.built) == 8 and all(fewer[m][1] is not third[m][1] for m in ("m0", "m2"))


def test_a_member_whose_own_nccl_refused_takes_its_zone_to_gloo_until_its_members_change(
    stand: type[Stand], caplog: pytest.LogCaptureFixture
) -> None:
    zone = Zone(3)
    stand.refuse = (0, "early")  # drawing its id: no peer has a part in it
    failed = zone.place(zone.names)
    assert all(isinstance(v, CollectiveFailed) for v in failed.values()), failed
    stand.refuse = None
    assert "ncclGetUniqueId failed" in zone.said("m0", zone.names).failed
    assert not any(zone.said(m, zone.names).failed for m in ("m1", "m2"))
    with caplog.at_level(logging.WARNING, logger="unbroken.train.shard_devices"):
        after = zone.place(zone.names)
    assert backends(after) == {Backend.GLOO} and len({p for p, _, _ in after.values()}) == 1
    assert all(group is gloo for _, group, gloo in after.values()), "the zone's gloo group sums"
    assert any("m0's NCCL build failed (NCCL error: ncclGetUniqueId failed" in r.getMessage() for r in caplog.records)
    assert backends(zone.place(zone.names)) == {Backend.GLOO}, "the mark holds while the members stay"
    assert stand.built == []
    fewer = zone.place(["m0", "m2"])  # another membership: NCCL is tried again
    assert backends(fewer) == {Backend.NCCL} and len(stand.built) == 2
    assert not zone.said("m0", ["m0", "m2"]).failed


def test_a_peer_that_dies_during_the_build_marks_no_survivor_and_their_next_zone_builds_nccl(
    stand: type[Stand],
) -> None:
    zone = Zone(3)
    out = zone.place(zone.names, dead=frozenset({"m1"}))
    for m in ("m0", "m2"):
        assert isinstance(out[m], CollectiveFailed) and not isinstance(out[m], NcclRefused), out
        assert "rank 1 is gone" in str(out[m])
    survivors = ["m0", "m2"]
    assert not any(zone.said(m, survivors).failed for m in survivors), "a peer's death is not its own NCCL's"
    assert backends(zone.place(survivors)) == {Backend.NCCL}


def test_builds_failed_twice_in_a_row_with_the_same_members_take_the_zone_to_gloo_until_they_change(
    stand: type[Stand],
) -> None:
    """Rank 0's connect fails after its id went out (a peer could be the cause): once says
    nothing, a build that succeeds in between starts the count again, twice takes gloo."""
    zone = Zone(3)
    names = zone.names

    def fails() -> None:
        stand.refuse = (0, "late")
        out = zone.place(names)
        assert all(isinstance(v, CollectiveFailed) and not isinstance(v, NcclRefused) for v in out.values()), out
        stand.refuse = None

    fails()
    assert not any(zone.said(m, names).failed for m in names)
    assert backends(zone.place(names)) == {Backend.NCCL}
    zone.devices["m1"].comm.drop()  # the next placement builds anew
    fails()
    assert not any(zone.said(m, names).failed for m in names), "the build between started the count again"
    assert backends(zone.place(names, ranged=True)) == {Backend.GLOO}, "exchanging range by range"
    fails()
    assert not any(zone.said(m, names).failed for m in names), "an epoch that built nothing broke the row"
    fails()
    assert all("2 builds in a row: building group" in zone.said(m, names).failed for m in names)
    assert backends(zone.place(names)) == {Backend.GLOO}
    assert backends(zone.place(["m0", "m1"])) == {Backend.NCCL}


def test_a_group_is_kept_only_where_every_member_keeps_the_same_one() -> None:
    comm = Communicator()
    assert comm.reusable([""], ["a"]) is None
    pg = object()
    comm.token, comm.members, comm.pg = "t1", ("a", "b"), pg
    assert comm.reusable(["t1", "t1"], ["a", "b"]) is pg
    assert comm.reusable(["t1", ""], ["a", "b"]) is None  # b dropped its own
    assert comm.reusable(["t1", "t2"], ["a", "b"]) is None
    assert comm.reusable(["t1", "t1"], ["b", "a"]) is None  # the same members in other ranks


MALFORMED = {
    "not-json": (b"{entries", "the relay: Invalid JSON"),
    "not-an-object": (b"[1]", "the relay: Input should be an object"),
    "no-entries": (b"{}", "neither an entry nor an error"),
    "unknown-field": (b'{"entrys": {"0": "AAE="}}', "entrys: Extra inputs are not permitted"),
    "not-base64": (b'{"entries": {"0": "n!cc!"}}', "entries.0: Value error, Only base64 data is allowed"),
    "a-number": (b'{"entries": {"0": 5}}', "entries.0: Value error, expected base64 text, got int"),
    "both": (b'{"entries": {"0": "AAE="}, "error": "x"}', "it carries entries and an error"),
}


def relayed(length: int, body: bytes) -> tuple[BaseException | dict[str, bytes], Any]:
    """What rank 1's `relay_entries` makes of a relay rank 0 sends as ``length`` then ``body``
    (sent only where ``length`` is one a member takes), and rank 1's store after."""
    world, store = FakeWorld(2), HashStore()

    def rank_zero() -> None:
        group = world.group(0)
        group.broadcast(torch.tensor([length], dtype=torch.int64), 0).wait()
        if 0 < length <= RELAY_BYTES:
            group.broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8), 0).wait()

    sender = threading.Thread(target=rank_zero, daemon=True)
    sender.start()
    try:
        out: BaseException | dict[str, bytes] = relay_entries(
            store, world.group(1), 1, scope(5.0), "building group nccl-9", lambda: False
        )
    except Exception as exc:  # what the test looks at
        out = exc
    sender.join(5)
    return out, store


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_relay_fails_the_build_naming_rank_0_and_what_is_wrong(case: str) -> None:
    body, wrong = MALFORMED[case]
    out, store = relayed(len(body), body)
    assert isinstance(out, CollectiveFailed) and not isinstance(out, NcclRefused), out
    assert "building group nccl-9: rank 0's relay of its NCCL id is malformed" in str(out) and wrong in str(out), out
    assert store.num_keys() == 0


@pytest.mark.parametrize("length", [0, -1, RELAY_BYTES + 1, 1 << 40])
def test_a_relay_whose_length_is_out_of_bounds_fails_the_build_before_anything_is_allocated(length: int) -> None:
    out, store = relayed(length, b"")
    assert isinstance(out, CollectiveFailed), out
    assert f"rank 0's relay of its NCCL id says it takes {length} bytes, not 1 to {RELAY_BYTES}" in str(out)
    assert store.num_keys() == 0


def test_a_well_formed_relay_reaches_the_store() -> None:
    out, store = relayed(len(b'{"entries": {"0": "AAE="}}'), b'{"entries": {"0": "AAE="}}')
    assert out == {"0": b"\x00\x01"} and bytes(store.get("0")) == b"\x00\x01"


def test_entries_too_long_to_relay_fail_every_member_with_rank_zeros_word() -> None:
    world = FakeWorld(2)
    stores = [HashStore(), HashStore()]
    stores[0].set("0", b"\x01" * RELAY_BYTES)
    out = each(
        2, lambda r: relay_entries(stores[r], world.group(r), r, scope(5.0), "building group nccl-9", lambda: False)
    )
    for r in (0, 1):
        assert isinstance(out[r], CollectiveFailed), out
        assert "failed on rank 0: its entries take" in str(out[r]) and f"over the {RELAY_BYTES}" in str(out[r])
    assert stores[1].num_keys() == 0
