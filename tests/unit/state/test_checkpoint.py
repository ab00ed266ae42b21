"""Checkpointer: asynchronous, atomic checkpoints; only complete files are ever visible."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from unbroken.state import checkpoint as ck
from unbroken.state import directio, layout
from unbroken.state.checkpoint import KEEP, Checkpointer, checkpoint_path, latest_checkpoint, load_checkpoint
from unbroken.state.fragments import Packed, shared
from unbroken.state.snapshot import TrainState


def snap(step: int) -> dict[str, Any]:
    return {"step": step, "cursor": step * 4, "model": {"w": torch.full((3,), float(step))}}


def ckpt_names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_checkpoint_paths_sort_by_step() -> None:
    assert checkpoint_path(Path("/x"), 42) == Path("/x/ckpt-000000042.pt")


def test_latest_of_a_missing_or_empty_directory_is_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nope") is None
    assert latest_checkpoint(tmp_path) is None


def test_latest_checkpoint_ignores_temporary_and_foreign_files(tmp_path: Path) -> None:
    for name in ("ckpt-000000005.pt", "ckpt-000000003.pt"):
        torch.save(snap(0), tmp_path / name)
    (tmp_path / "ckpt-000000009.pt.1234.tmp").write_bytes(b"half a checkpo")
    (tmp_path / "ckpt-9.pt").write_bytes(b"")
    (tmp_path / "ckpt-000000008.pt.bak").write_bytes(b"")
    (tmp_path / "notes.txt").write_bytes(b"")
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000000005.pt"


def test_a_dead_writers_temporary_file_on_this_host_is_removed_and_no_other(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead = int(done.stdout)
    here = directio.temp_path(tmp_path / "x").name.split("@", 1)[1].removesuffix(".tmp")
    assert here.startswith(socket.gethostname().replace("/", "_"))
    left = [tmp_path / f"ckpt-000000009.pt.{dead}@{here}.tmp", tmp_path / f"frag-000000009.001.{dead}@{here}.tmp"]
    kept = [
        tmp_path / f"ckpt-000000010.pt.{os.getpid()}@{here}.tmp",  # a live writer's
        tmp_path / f"ckpt-000000010.pt.{dead}@another-{here}.tmp",  # a machine or container sharing the directory
        tmp_path / f"ckpt-000000010.pt.{10**30}@{here}.tmp",  # no such pid: not ours to judge
        tmp_path / "ckpt-000000008.pt.1234.tmp",  # not a writer-named file
        tmp_path / f"notes.{dead}@{here}.tmp",  # not a checkpoint's
        tmp_path / f"frag-000000009.001.{dead}@{here}.tmp.bak",
    ]
    for p in [*left, *kept]:
        p.write_bytes(b"half a checkpo")
    (tmp_path / f"ckpt-000000011.pt.{dead}@{here}.tmp").mkdir()  # not a file: left alone
    kept.append(tmp_path / f"ckpt-000000011.pt.{dead}@{here}.tmp")
    torch.save(snap(5), tmp_path / "ckpt-000000005.pt")
    Checkpointer(tmp_path)
    assert not any(p.exists() for p in left)
    assert all(p.exists() for p in kept)
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000000005.pt"


def test_save_async_writes_a_checkpoint_that_loads_back(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path / "ckpts")
    assert c.save_async(snap(7)) is True
    c.close()
    path = latest_checkpoint(tmp_path / "ckpts")
    assert path == tmp_path / "ckpts" / "ckpt-000000007.pt"
    back = load_checkpoint(path)
    assert back["step"] == 7 and back["cursor"] == 28
    assert torch.equal(back["model"]["w"], torch.full((3,), 7.0))
    assert [s for s, _ in c.written] == [7]
    assert ckpt_names(tmp_path / "ckpts") == ["ckpt-000000007.pt"]  # no temporary left behind


def test_a_train_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), step=0, cursor=0)
    state.model(torch.randn(4, 3)).sum().backward()
    state.optimizer.step()
    state.step, state.cursor = 1, 4
    c = Checkpointer(tmp_path)
    c.save_async(state.capture())
    c.close()

    torch.manual_seed(1)
    other_model = nn.Linear(3, 2)
    other = TrainState(other_model, torch.optim.SGD(other_model.parameters(), lr=0.01, momentum=0.9))
    assert other.digest() != state.digest()
    path = latest_checkpoint(tmp_path)
    assert path is not None
    other.restore(load_checkpoint(path))
    assert other.digest() == state.digest()


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    for step in (10, 20, 30, 40, 50):
        assert c.save_async(snap(step))
        c.close()
    assert KEEP == 3
    assert ckpt_names(tmp_path) == ["ckpt-000000030.pt", "ckpt-000000040.pt", "ckpt-000000050.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000000050.pt"


@pytest.fixture
def slow_save(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make torch.save write a few bytes, then wait until released."""
    started, release = threading.Event(), threading.Event()
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04partial")
        f.flush()
        started.set()
        assert release.wait(5), "test never released the writer"
        f.seek(0)
        f.truncate()
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save)
    return started, release


def test_a_checkpoint_being_written_is_invisible_until_complete(
    tmp_path: Path, slow_save: tuple[threading.Event, threading.Event]
) -> None:
    started, release = slow_save
    c = Checkpointer(tmp_path)
    try:
        c.save_async(snap(3))
        assert started.wait(5)
        assert c.busy
        assert latest_checkpoint(tmp_path) is None
        names = ckpt_names(tmp_path)
        assert len(names) == 1 and names[0].startswith("ckpt-000000003.pt.") and names[0].endswith(".tmp")
    finally:
        release.set()
        c.close()
    assert not c.busy
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000000003.pt"
    assert ckpt_names(tmp_path) == ["ckpt-000000003.pt"]


def test_a_save_while_busy_is_skipped_not_queued(
    tmp_path: Path, slow_save: tuple[threading.Event, threading.Event]
) -> None:
    started, release = slow_save
    c = Checkpointer(tmp_path)
    try:
        assert c.save_async(snap(1)) is True
        assert started.wait(5)
        assert c.save_async(snap(2)) is False
        assert c.save_async(snap(3)) is False
        assert c.skipped == 2
    finally:
        release.set()
        c.close()
    assert ckpt_names(tmp_path) == ["ckpt-000000001.pt"]
    assert c.save_async(snap(4)) is True  # free again once the write is done
    c.close()
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000000004.pt"


def test_a_failed_write_leaves_no_file_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = Checkpointer(tmp_path)
    c.save_async(snap(1))
    c.close()

    def broken_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"garbage")
        raise OSError(28, os.strerror(28))  # ENOSPC

    monkeypatch.setattr(ck.torch, "save", broken_save)
    assert c.save_async(snap(2))
    c.close()
    assert ckpt_names(tmp_path) == ["ckpt-000000001.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000000001.pt"
    assert [s for s, _ in c.written] == [1]


def test_the_copy_goes_into_buffers_kept_from_one_checkpoint_to_the_next(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(300, 200)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    c = Checkpointer(tmp_path)
    c.save_async(state.tree())
    c.close()
    assert c._arena is not None
    first = [t.data_ptr() for t in c._arena.views]
    with torch.no_grad():
        model.weight += 1  # the live state moves on; the checkpoint taken before must not
    state.step = 1
    c.save_async(state.tree())
    c.close()
    assert [t.data_ptr() for t in c._arena.views] == first, "no new allocation for an unchanged layout"
    back = load_checkpoint(checkpoint_path(tmp_path, 1))
    assert torch.equal(back["model"]["weight"], model.weight) and len(c.staged_s) == 2
    assert not torch.equal(load_checkpoint(checkpoint_path(tmp_path, 0))["model"]["weight"], model.weight)


def mixed(step: int) -> dict[str, Any]:
    """A state with every kind of tensor a capture meets: dtypes side by side, a scalar,
    empty ones, one of an odd size."""
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "cursor": step,
        "model": {"w": torch.randn(513, 77, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
        "rng": torch.randint(0, 255, (5003,), dtype=torch.uint8, generator=g),
        "seen": torch.tensor([True, False, True]),
        "count": torch.tensor(step, dtype=torch.int64),
        "nothing": [torch.empty(0), torch.empty(0, 4, dtype=torch.int32)],
    }


def spy_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int]]:
    """(direct I/O?, bytes) of every positioned write a checkpoint makes."""
    import fcntl

    seen: list[tuple[bool, int]] = []
    real = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        seen.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)), len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    return seen


def same(a: Any, b: Any) -> bool:
    ha, ta = layout.split(a)
    hb, tb = layout.split(b)
    return ha == hb and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


@pytest.mark.skipif(not ck._DIRECT_SAVE, reason="this torch or system has no direct checkpoint writes")
def test_the_tensor_bytes_go_to_the_disk_directly_and_the_file_is_torch_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = spy_writes(monkeypatch)
    c = Checkpointer(tmp_path)
    c._idle = Cores(free=False)  # training keeps every core busy
    for step in (1, 2):
        assert c.save_async(mixed(step))
        c.close()
        assert c.failure is None
        back = torch.load(checkpoint_path(tmp_path, step), weights_only=True)
        assert same(back, mixed(step))
    tensors = layout.split(mixed(1))[1]
    payload = sum(t.numel() * t.element_size() for t in tensors)
    dtypes = len({t.dtype for t in tensors})
    assert writes and all(direct for direct, _ in writes), "every tensor byte by direct I/O"
    assert payload <= sum(n for _, n in writes) // 2 < payload + dtypes * ck.PAGE, "each region once, in pages"
    reader = torch._C.PyTorchFileReader(str(checkpoint_path(tmp_path, 2)))
    data = [r for r in reader.get_all_records() if r.startswith("data/")]
    assert len(data) == dtypes == 6, "a record per dtype"
    assert all(reader.get_record_offset(r) % ck.PAGE == 0 for r in data)
    assert c.direct == [True, True]


class Cores(directio.IdleCores):
    """Whether a core stood free, as a test says."""

    def __init__(self, free: bool) -> None:
        self._free = free

    def since_last(self, min_s: float = 0.0) -> tuple[float, float] | None:
        return None

    def free(self, busy_s: float = 0.0) -> bool:
        return self._free


def test_where_a_core_stood_free_the_page_cache_writes_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = spy_writes(monkeypatch)
    c = Checkpointer(tmp_path)
    c._idle = Cores(free=True)
    assert c.save_async(mixed(4))
    c.close()
    assert same(load_checkpoint(checkpoint_path(tmp_path, 4)), mixed(4))
    assert c.direct == [False] and writes == [], "torch.save wrote it all, through the page cache"


@pytest.mark.skipif(not ck._DIRECT_SAVE, reason="this torch or system has no direct checkpoint writes")
def test_a_write_through_the_page_cache_that_outlasts_the_period_sends_the_next_past_it(
    tmp_path: Path, slow_save: tuple[threading.Event, threading.Event]
) -> None:
    started, release = slow_save
    c = Checkpointer(tmp_path)
    c._idle = Cores(free=True)
    assert c.save_async(mixed(1))
    assert started.wait(5)
    assert not c.save_async(mixed(2)), "still writing: skipped"
    release.set()
    c.close()
    assert c.overran and c.save_async(mixed(3))
    c.close()
    assert c.failure is None and c.direct == [False, True], "a core is free, the disk did not keep up"
    assert same(load_checkpoint(checkpoint_path(tmp_path, 3)), mixed(3))


@pytest.fixture
def held_fsync(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make a checkpoint's fsync wait until released (a slow disk)."""
    syncing, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        syncing.set()
        assert release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(ck.os, "fsync", fsync)
    return syncing, release


def test_the_next_checkpoint_is_copied_while_the_last_ones_bytes_reach_the_disk(
    tmp_path: Path, held_fsync: tuple[threading.Event, threading.Event]
) -> None:
    # Through the page cache the write is a copy, then an fsync that takes seconds on a slow
    # disk: the buffers are free for the next checkpoint meanwhile, the file is named only
    # once it is on the disk, and the files are named in order.
    syncing, release = held_fsync
    c = Checkpointer(tmp_path)
    c._idle = Cores(free=True)
    try:
        assert c.save_async(mixed(1))
        assert syncing.wait(10)
        deadline = time.monotonic() + 10
        while c.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not c.busy and latest_checkpoint(tmp_path) is None, "copied, not yet on the disk"
        assert c.save_async(mixed(2)), "the next is not skipped"
        while not list(tmp_path.glob("ckpt-000000002.pt.*.tmp")) and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        time.sleep(0.1)
        assert c.busy and latest_checkpoint(tmp_path) is None, "the second waits for the first's fsync"
    finally:
        release.set()
        c.close()
    assert c.failure is None and c.direct == [False, False] and c.skipped == 0
    assert ckpt_names(tmp_path) == ["ckpt-000000001.pt", "ckpt-000000002.pt"]
    assert same(load_checkpoint(checkpoint_path(tmp_path, 1)), mixed(1)), "its buffers were reused only once copied"
    assert same(load_checkpoint(checkpoint_path(tmp_path, 2)), mixed(2))


def test_a_failure_after_a_checkpoint_still_reaching_the_disk_is_reported_after_its_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_fsync: tuple[threading.Event, threading.Event]
) -> None:
    syncing, release = held_fsync
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if obj["step"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save)
    c = Checkpointer(tmp_path)
    c._idle = Cores(free=True)
    try:
        assert c.save_async(mixed(1))
        assert syncing.wait(10)
        while c.busy:
            time.sleep(0.01)
        assert c.save_async(mixed(2))
        time.sleep(0.1)
    finally:
        release.set()
        c.close()
    assert c.failure is not None and "step 2" in c.failure and "No space" in c.failure
    assert ckpt_names(tmp_path) == ["ckpt-000000001.pt"]


def test_idle_cores_are_counted_from_the_processs_own_cores() -> None:
    idle = directio.IdleCores()
    if idle._read() is None:
        pytest.skip("no /proc/stat")
    busy_until = time.monotonic() + 0.3
    while time.monotonic() < busy_until:  # this core is busy: at most the others are idle
        pass
    seen = idle.since_last()
    assert seen is not None and 0.0 <= seen[0] <= len(os.sched_getaffinity(0)) - 0.5 and seen[1] >= 0.3


def test_a_core_is_free_only_over_a_second_or_more_and_the_writers_own_copying_counts_as_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks = iter([(0, 0, 0.0), (50, 100, 0.5), (60, 200, 1.5), (90, 300, 3.0), (110, 400, 4.5)])
    monkeypatch.setattr(directio.IdleCores, "_read", lambda self: next(ticks))
    idle = directio.IdleCores()
    idle._cpus = [0, 1]
    assert not idle.free(), "half a second is too short to tell (direct I/O then)"
    assert not idle.free(), "0.6 idle cores over 1.5 s"
    assert idle.free(busy_s=0.3), "0.6 idle cores over 1.5 s, plus the writer's own 0.2 of a core"
    assert not idle.free(busy_s=0.3), "0.4 + 0.2 < 0.75"


def test_a_file_system_without_direct_io_gets_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    real = fcntl.fcntl
    refused: list[int] = []

    def refusing(fd: int, cmd: int, arg: int = 0) -> Any:  # as tmpfs before Linux 6.6 does
        if cmd == fcntl.F_SETFL and arg & directio.O_DIRECT:
            refused.append(fd)
            raise OSError(22, os.strerror(22))
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing)
    c = Checkpointer(tmp_path)
    c._idle = Cores(free=False)
    assert c.save_async(mixed(3))
    c.close()
    assert c.failure is None and same(load_checkpoint(checkpoint_path(tmp_path, 3)), mixed(3))
    assert refused or not ck._DIRECT_SAVE, "the write asked for direct I/O and was refused"


def test_an_error_that_is_not_the_disks_is_a_failure_too_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK")
        raise RuntimeError("a torch that changed under us")

    monkeypatch.setattr(ck.torch, "save", broken)
    c = Checkpointer(tmp_path)
    assert c.save_async(mixed(5))
    c.close()
    assert c.failure is not None and "changed under us" in c.failure and ckpt_names(tmp_path) == []


def test_a_new_layout_gets_new_buffers_and_the_old_checkpoint_is_untouched(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_async(mixed(1))
    c.close()
    grown = mixed(2)
    grown["model"]["extra"] = torch.arange(10.0)
    c.save_async(grown)
    c.close()
    assert same(load_checkpoint(checkpoint_path(tmp_path, 1)), mixed(1))
    assert same(load_checkpoint(checkpoint_path(tmp_path, 2)), grown)


def test_the_newest_checkpoint_that_loads_is_used_and_the_bad_ones_are_named(tmp_path: Path) -> None:
    torch.save(snap(10), checkpoint_path(tmp_path, 10))
    good = checkpoint_path(tmp_path, 20)
    torch.save(snap(20), good)
    checkpoint_path(tmp_path, 30).write_bytes(good.read_bytes()[:100])  # truncated
    checkpoint_path(tmp_path, 40).write_bytes(b"garbage, not a checkpoint")
    torch.save({"weights": torch.zeros(2)}, checkpoint_path(tmp_path, 50))  # loads, holds no state
    found = ck.load_newest(tmp_path)
    assert found.path == good and found.snap is not None and found.snap["step"] == 20
    assert [b.split(" cannot")[0] for b in found.bad] == [str(checkpoint_path(tmp_path, s)) for s in (50, 40, 30)]
    assert "no training state" in found.bad[0] and not found.all_corrupt
    assert ck.load_newest(tmp_path / "nope") == ck.Found()


def test_an_unwritable_checkpoint_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ck.ConfigError, match=r"cannot be written.*writable --checkpoint-dir"):
        Checkpointer(tmp_path / "a-file" / "ckpts")


def test_a_directory_removed_mid_run_is_a_failure_until_a_write_succeeds(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path / "ckpts")
    (tmp_path / "ckpts").rmdir()
    assert c.save_async(snap(3))
    c.close()
    assert c.failure is not None and "step 3 could not be written" in c.failure
    (tmp_path / "ckpts").mkdir()
    assert c.save_async(snap(4))
    c.close()
    assert c.failure is None


def test_set_aside_moves_only_checkpoints_and_says_why(tmp_path: Path) -> None:
    torch.save(snap(5), checkpoint_path(tmp_path, 5))
    (tmp_path / "notes.txt").write_text("mine")
    aside = ck.set_aside(tmp_path, "another run's")
    assert ck.load_newest(tmp_path) == ck.Found() and (tmp_path / "notes.txt").exists()
    assert (aside / "ckpt-000000005.pt").exists() and "another run's" in (aside / "WHY.txt").read_text()


def test_the_parameters_are_copied_while_the_next_step_computes_and_the_rest_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture leaves the parameters and optimizer state (what only the next update changes)
    to the writer's thread: the step goes on at once, and the update waits for the copy. A
    buffer, which the next forward pass may change, is copied before `save_async` returns."""
    torch.manual_seed(0)
    model = nn.BatchNorm1d(1000)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    params = {p.data_ptr() for p in model.parameters()}
    c = Checkpointer(tmp_path)
    weight, mean = model.weight.detach().clone(), model.running_mean.clone()
    gate = threading.Event()
    fill = ck._Arena.fill

    def held(arena: Any, header: Any, tensors: list[torch.Tensor]) -> Any:
        assert gate.wait(10), "the writer's copy waits until the test has changed the buffer"
        return fill(arena, header, tensors)

    monkeypatch.setattr(ck._Arena, "fill", held)
    assert c.save_async(state.tree(), later=lambda t: t.data_ptr() in params)
    model.running_mean += 1  # the next forward pass: the capture already holds the old buffer
    assert c._captured is not None and not c._captured.is_set(), "the parameters are still to be copied"
    gate.set()
    c.wait_captured()
    with torch.no_grad():
        model.weight += 1  # the next update, after `wait_captured`
    c.close()
    back = load_checkpoint(checkpoint_path(tmp_path, 0))
    assert torch.equal(back["model"]["weight"], weight) and torch.equal(back["model"]["running_mean"], mean)


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies")
def test_the_writer_keeps_the_step_loops_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A writer at idle priority (or niced) that shares the GIL held the step loop and the
    # heartbeats up for 1-3 s beside CPU-bound neighbours: 1 s leases lapsed at checkpoints.
    seen: list[tuple[int, int]] = []
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        tid = threading.get_native_id()
        seen.append((os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save)
    c = Checkpointer(tmp_path)
    for step in (1, 2):
        assert c.save_async(snap(step))
        c.close()
    mine = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert seen == [mine, mine]


def test_the_first_checkpoints_buffers_are_laid_out_ahead_on_a_thread_of_their_own(
    tmp_path: Path, arenas_laid: list[str]
) -> None:
    c = Checkpointer(tmp_path)
    c.prepare(mixed(0))
    c.prepare(mixed(0))  # once
    c.save_async(mixed(1))
    c.close()
    assert arenas_laid == ["checkpoint-buffers"], "the capture found its buffers laid out"
    assert same(load_checkpoint(checkpoint_path(tmp_path, 1)), mixed(1))


def test_buffers_laid_out_for_another_layout_are_replaced_by_the_capture(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.prepare(mixed(0))
    grown = mixed(1)
    grown["model"]["extra"] = torch.arange(10.0)
    c.save_async(grown)
    c.close()
    assert same(load_checkpoint(checkpoint_path(tmp_path, 1)), grown)


def test_fragments_buffers_are_laid_out_packed_for_their_k(tmp_path: Path) -> None:
    model = nn.Linear(30, 20)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    model(torch.ones(1, 30)).sum().backward()
    state.optimizer.step()  # the momentum exists: the layout of every later state
    c = Checkpointer(tmp_path)
    c.prepare(state.tree(), fragments=2)
    c._laid()
    packed = c._arena
    assert isinstance(packed, Packed) and packed.fits(layout.split(shared(state.tree()))[0], 2)
    state.step = 1
    c.save_fragments_async(state.tree(), 2, 1, [0, 1, 2])
    c.close()
    assert c._arena is packed and c.failure is None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("frag")), list(tmp_path.iterdir())


def test_a_node_that_writes_no_more_checkpoints_gives_its_buffers_back(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.prepare(mixed(0))
    assert c.has_buffers
    c.release()
    assert not c.has_buffers and c._arena is None
    c.save_async(mixed(1))  # lays them out again
    c.close()
    assert c.has_buffers and same(load_checkpoint(checkpoint_path(tmp_path, 1)), mixed(1))


# ---------------------------------------------------------------- hostile directories


def test_a_link_planted_at_the_temporary_or_final_name_writes_nothing_outside(tmp_path: Path) -> None:
    ckpts, outside = tmp_path / "ckpts", tmp_path / "outside"
    ckpts.mkdir()
    outside.mkdir()
    victims = {name: outside / name for name in ("a", "b", "c")}
    for p in victims.values():
        p.write_bytes(b"precious " + p.name.encode())
    writer = directio.temp_path(ckpts / "x").name.split("@", 1)[1]
    final = checkpoint_path(ckpts, 7)
    # The name a writer of this process used to take, the name of a temporary its writer
    # died with, and the final name: all links to files outside.
    (ckpts / f"{final.name}.{os.getpid()}@{writer}").symlink_to(victims["a"])
    (ckpts / f"{final.name}.999999999@{writer}").symlink_to(victims["b"])
    final.symlink_to(victims["c"])
    c = Checkpointer(ckpts)
    assert c.save_async(snap(7))
    c.close()
    assert c.failure is None
    assert {n: p.read_bytes() for n, p in victims.items()} == {n: b"precious " + n.encode() for n in victims}
    assert not final.is_symlink() and load_checkpoint(final)["step"] == 7
    # The dead writer's link is gone (the link itself), the live name is not this writer's.
    assert not (ckpts / f"{final.name}.999999999@{writer}").is_symlink() and victims["b"].exists()


def test_a_directory_swapped_for_a_link_is_a_failure_not_a_write_elsewhere(tmp_path: Path) -> None:
    ckpts, outside = tmp_path / "ckpts", tmp_path / "outside"
    c = Checkpointer(ckpts)
    assert c.save_async(snap(1))
    c.close()
    ckpts.rename(tmp_path / "moved")
    outside.mkdir()
    ckpts.symlink_to(outside)
    assert c.save_async(snap(2))
    c.close()
    assert c.failure is not None and "step 2 could not be written" in c.failure
    assert list(outside.iterdir()) == []


def test_a_directory_named_through_a_link_by_the_operator_is_written(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    (tmp_path / "ckpts").symlink_to(tmp_path / "disk")
    c = Checkpointer(tmp_path / "ckpts")
    assert c.save_async(snap(4))
    c.close()
    assert c.failure is None and load_checkpoint(checkpoint_path(tmp_path / "disk", 4))["step"] == 4


def test_a_checkpoint_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    torch.save(snap(5), checkpoint_path(tmp_path, 5))
    (tmp_path / "elsewhere").mkdir()
    torch.save(snap(9), tmp_path / "elsewhere" / "state.pt")
    checkpoint_path(tmp_path, 9).symlink_to(tmp_path / "elsewhere" / "state.pt")
    found = ck.load_newest(tmp_path)
    assert found.path == checkpoint_path(tmp_path, 5)
    assert len(found.bad) == 1 and "ckpt-000000009.pt" in found.bad[0] and "symbolic link" in found.bad[0]


def test_every_checkpoint_corrupt_is_told_apart_from_none_and_from_refused(tmp_path: Path) -> None:
    checkpoint_path(tmp_path, 30).write_bytes(b"garbage")
    checkpoint_path(tmp_path, 40).write_bytes(b"PK\x03\x04 truncated")
    found = ck.load_newest(tmp_path)
    assert found.path is None and found.all_corrupt and len(found.bad) == 2
    assert not ck.load_newest(tmp_path, usable=lambda step: "its shard files are not all there").all_corrupt
    assert not ck.load_newest(tmp_path / "empty").all_corrupt


def test_pruning_keeps_the_newest_good_checkpoints_and_sets_corrupt_newer_ones_aside(tmp_path: Path) -> None:
    torch.save(snap(100), checkpoint_path(tmp_path, 100))
    checkpoint_path(tmp_path, 100).write_bytes(checkpoint_path(tmp_path, 100).read_bytes()[:200])  # truncated
    checkpoint_path(tmp_path, 90).write_bytes(b"not a checkpoint")
    corrupt = {s: checkpoint_path(tmp_path, s).read_bytes() for s in (90, 100)}
    c = Checkpointer(tmp_path)
    for step in (10, 20, 30, 40):
        assert c.save_async(snap(step))
        c.close()
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert names == [checkpoint_path(tmp_path, s).name for s in (20, 30, 40)]
    assert ck.load_newest(tmp_path).path == checkpoint_path(tmp_path, 40)
    # Not deleted: set aside, bytes intact, with why.
    assert len(c.set_aside) == 1
    aside = c.set_aside[0]
    assert {s: (aside / checkpoint_path(tmp_path, s).name).read_bytes() for s in (90, 100)} == corrupt
    assert "ckpt-000000090.pt cannot be used" in (aside / "WHY.txt").read_text()


def test_pruning_counts_a_good_checkpoint_another_writer_left(tmp_path: Path) -> None:
    torch.save(snap(50), checkpoint_path(tmp_path, 50))  # another node's, in a shared directory
    c = Checkpointer(tmp_path)
    for step in (10, 20, 30):
        assert c.save_async(snap(step))
        c.close()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == [
        checkpoint_path(tmp_path, s).name for s in (20, 30, 50)
    ]
    assert c.set_aside == []
