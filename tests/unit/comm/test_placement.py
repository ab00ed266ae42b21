"""Where a sharded zone's shards live and which backend it uses (a pure function of its
members' devices); the waits an NCCL group needs (polled, aborting the group); and the
relay that carries rank 0's NCCL id over the zone's gloo group."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import HashStore  # type: ignore[attr-defined]

from unbroken.comm.group import EpochScope, wait_polled
from unbroken.comm.nccl import NCCL_ENV, build_nccl, relay_entries
from unbroken.comm.placement import MAX_NCCL_RANKS, Backend, MemberDevice, place
from unbroken.errors import CollectiveFailed, EpochAborted
from unbroken.testing.fake import FakeWorld

pytestmark = pytest.mark.timeout(30)

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


def gpu(uuid: str, name: str = "NVIDIA H100 80GB HBM3", nccl: bool = True) -> MemberDevice:
    return MemberDevice("cuda", uuid, name, nccl)


def test_every_member_on_a_gpu_of_its_own_of_one_kind_takes_nccl_with_the_shards_on_the_device() -> None:
    p = place({"a": gpu("u0"), "b": gpu("u1"), "c": gpu("u2")}, "b", CUDA0)
    assert p.backend is Backend.NCCL and p.shards == CUDA0 and p.compute == CUDA0
    assert not p.staged and p.polled
    assert "NCCL" in p.reason


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        ({"a": gpu("u0"), "b": MemberDevice("cpu")}, "compute on cpu, cuda"),
        ({"a": gpu("u0"), "b": gpu("u0")}, "a and b compute on one GPU"),
        ({"a": gpu("u0"), "b": gpu("u1", name="NVIDIA A100-SXM4-40GB")}, "GPUs of 2 kinds"),
        ({"a": gpu("u0"), "b": gpu("u1", nccl=False)}, "b's torch has no NCCL"),
        ({"a": gpu("u0"), "b": replace(gpu("u1"), forwarded=True)}, "b is reached through a forwarder"),
        (
            {"a": gpu("u0"), "b": replace(gpu("u1"), failed="NCCL error: unhandled system error")},
            "b's NCCL build failed (NCCL error: unhandled system error)",
        ),
    ],
    ids=["a-cpu-member", "one-gpu-shared", "two-gpu-kinds", "no-nccl", "behind-a-forwarder", "nccl-build-failed"],
)
def test_anything_else_takes_gloo_with_the_shards_on_the_cpu_staged_to_the_device(
    devices: dict[str, MemberDevice], why: str
) -> None:
    p = place(devices, "a", CUDA0)
    assert p.backend is Backend.GLOO and p.shards == CPU and p.compute == CUDA0
    assert p.staged and not p.polled
    assert why in p.reason and "gloo" in p.reason and "staged to cuda:0" in p.reason


def test_a_member_nccl_cannot_reach_or_whose_nccl_failed_is_a_fall_back_said_alike_by_every_member() -> None:
    for odd in (replace(gpu("u2"), forwarded=True), replace(gpu("u2"), failed="Duplicate GPU detected")):
        devices = {"a": gpu("u0"), "b": gpu("u1"), "c": odd}
        placements = {m: place(devices, m, CUDA0) for m in devices}
        assert {(p.backend, p.reason, p.fallback) for p in placements.values()} == {
            (Backend.GLOO, placements["a"].reason, True)
        }
        assert placements["a"].reason.startswith("c")
    assert not place({"a": gpu("u0"), "b": MemberDevice()}, "a", CUDA0).fallback  # gloo by kind, not a fall-back
    kept = {"a": replace(gpu("u0"), holds="9f1c"), "b": replace(gpu("u1"), holds="9f1c")}
    assert place(kept, "a", CUDA0).backend is Backend.NCCL  # a group kept is no reason for gloo


def test_a_cpu_member_of_a_mixed_zone_computes_where_it_holds() -> None:
    p = place({"a": gpu("u0"), "b": MemberDevice("cpu")}, "b", CPU)
    assert p.backend is Backend.GLOO and p.shards == CPU and p.compute == CPU and not p.staged


def test_ranged_exchanges_between_zones_and_oversized_zones_keep_the_shards_on_the_cpu() -> None:
    two = {"a": gpu("u0"), "b": gpu("u1")}
    assert place(two, "a", CUDA0).backend is Backend.NCCL
    ranged = place(two, "a", CUDA0, ranged=True)
    assert ranged.backend is Backend.GLOO and "range by range" in ranged.reason
    many = {f"m{i}": gpu(f"u{i}") for i in range(MAX_NCCL_RANKS + 1)}
    assert place(many, "m0", CUDA0).backend is Backend.GLOO


def test_every_member_decides_the_same_backend_from_the_same_reports() -> None:
    for devices in (
        {"a": gpu("u0"), "b": gpu("u1")},
        {"a": gpu("u0"), "b": gpu("u0")},
        {"a": gpu("u0"), "b": MemberDevice()},
    ):
        assert len({place(devices, m, CUDA0).backend for m in devices}) == 1


def test_a_cpu_zone_and_a_device_description_round_trip() -> None:
    p = place({"a": MemberDevice(), "b": MemberDevice()}, "a", CPU)
    assert p.backend is Backend.GLOO and not p.staged
    said = (
        gpu("GPU-1234", "NVIDIA L4"),
        MemberDevice(),
        gpu("x", nccl=False),
        MemberDevice("cuda", "u", "NVIDIA L4", True, True, "ab12", "NCCL error | unhandled system error"),
    )
    for d in said:
        assert MemberDevice.decode(d.encode()) == d
    assert MemberDevice.decode("cuda|u|NVIDIA L4|nccl") == gpu("u", "NVIDIA L4")  # a report from before these
    assert MemberDevice.decode("") == MemberDevice()  # a report without a device: a CPU member
    with pytest.raises(ValueError, match="not among the zone's members"):
        place({"a": MemberDevice()}, "z", CPU)


class Stuck:
    """Device work that never completes, in a group whose abort is recorded."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        raise AssertionError("a polled wait never blocks in wait() on unfinished work")

    def abort(self) -> None:
        self.aborted.set()


def test_a_polled_wait_on_the_abort_aborts_the_group_and_leaves() -> None:
    stuck = Stuck()
    flag: dict[str, EpochAborted] = {}
    scope = EpochScope(threading.Event(), lambda: flag.get("abort"), 20.0)
    threading.Timer(0.1, lambda: flag.setdefault("abort", EpochAborted("n2 failed"))).start()
    t0 = time.monotonic()
    with pytest.raises(EpochAborted, match="n2 failed"):
        wait_polled([stuck], scope, "gathering block Linear", stuck)
    assert time.monotonic() - t0 < 10  # left at the abort, not at the 20 s deadline
    assert stuck.aborted.wait(5), "the group's communicator was not aborted"


def test_a_polled_wait_past_its_deadline_aborts_the_group_and_done_work_is_waited() -> None:
    stuck = Stuck()
    with pytest.raises(CollectiveFailed, match="deadline"):
        wait_polled([stuck], EpochScope(threading.Event(), lambda: None, 0.1), "summing", stuck)
    assert stuck.aborted.wait(5)
    world = FakeWorld(1)
    t = torch.ones(3)
    wait_polled([world.group(0).allreduce([t])], EpochScope(threading.Event(), lambda: None, 5.0), "sum", None)
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_rank_zeros_entries_reach_every_members_store_over_the_group() -> None:
    """What NCCL's build does with its store: rank 0 writes its id, the others wait for it."""
    size = 3
    world = FakeWorld(size)
    stores = [HashStore() for _ in range(size)]
    got: dict[int, Any] = {}

    def member(rank: int) -> None:
        scope = EpochScope(threading.Event(), lambda: None, 10.0)

        def build() -> None:  # as ProcessGroupNCCL's eager connect: rank 0 sets, the others get
            if rank == 0:
                time.sleep(0.05)
                stores[0].set("nccl-3/0", b"\x00\xffid")
            else:
                got[rank] = stores[rank].get("nccl-3/0")

        builder = threading.Thread(target=build)
        builder.start()
        relay_entries(stores[rank], world.group(rank), rank, scope, "building nccl-3", lambda: False)
        builder.join(10)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert got == {1: b"\x00\xffid", 2: b"\x00\xffid"}


def test_a_members_report_of_its_ranges_carries_its_device() -> None:
    from unbroken.train.shard_reports import Report, decode, encode

    said = gpu("GPU-8f2e", "NVIDIA L4").encode()
    assert decode(encode(Report(512, device=said))).device == said
    assert MemberDevice.decode(decode(encode(Report(512))).device) == MemberDevice()  # said nothing: the CPU


class FakeNCCL:
    """What `build_nccl` uses of ``ProcessGroupNCCL``: its options, and an eager connect in
    which rank 0 writes its id to the store and every other rank reads it (blocking)."""

    class Options:
        def __init__(self) -> None:
            self._timeout: timedelta | None = None

    def __init__(self, store: Any, rank: int, size: int, opts: FakeNCCL.Options) -> None:
        self.store, self.rank, self.size, self.opts = store, rank, size, opts
        self.id = b""

    def eager_connect_single_device(self, device: torch.device) -> None:
        if self.rank == 0:
            self.store.set("0", b"\x01nccl-id")
        elif self.rank == 2 and FakeNCCL.refuse:
            raise RuntimeError("NCCL error: unhandled cuda error")
        self.id = bytes(self.store.get("0"))

    refuse = False


@pytest.mark.parametrize("refuse", [False, True], ids=["built", "a-rank-fails"])
def test_an_nccl_group_is_built_over_the_gloo_group_each_member_holding_rank_zeros_id(
    monkeypatch: pytest.MonkeyPatch, refuse: bool
) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(FakeNCCL, "refuse", refuse)
    for key in NCCL_ENV:
        monkeypatch.delenv(key, raising=False)  # put back after the test
    size = 3
    world = FakeWorld(size)
    out: dict[int, Any] = {}

    def member(rank: int) -> None:
        try:
            out[rank] = build_nccl(
                world.group(rank), "nccl-7", rank, size, CPU, EpochScope(threading.Event(), lambda: None, 5.0)
            )
        except BaseException as exc:  # reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    if refuse:
        assert isinstance(out[2], CollectiveFailed) and "building group nccl-7 failed: NCCL error" in str(out[2])
        assert all(not isinstance(out[r], BaseException) for r in (0, 1)), out
        return
    assert all(not isinstance(v, BaseException) for v in out.values()), out
    groups = [out[r][0] for r in range(size)]
    assert [g.id for g in groups] == [b"\x01nccl-id"] * size
    assert [g.rank for g in groups] == [0, 1, 2] and all(g.size == size for g in groups)
    assert all(g.opts._timeout == timedelta(seconds=5.0) for g in groups)
    assert len({out[r].token for r in range(size)}) == 1 and out[0].token  # one communicator, one name
    assert not any(k in os.environ for k in NCCL_ENV), "set once at a node's start, not at every build"
