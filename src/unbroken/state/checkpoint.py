"""Asynchronous, atomic checkpoints in a directory.

The step loop only copies the state, at the step boundary, into buffers the checkpointer
keeps from one checkpoint to the next (a memcpy: no allocation and no page faults on the
step, which cost 6x the copy for a 400 MB state); serialising and writing run on a
background thread into a temporary file (``ckpt-<step>.pt.<pid>-<random>@<writer>.tmp``: a
checkpointer started later on the same machine removes it if its writer died), fsynced,
then renamed, so a file named ``ckpt-<step>.pt`` is always complete. If the previous write
is still running, the new checkpoint is skipped rather than blocking the step (its buffers
are still being written from; the node reports it).

The writer keeps the step loop's CPU priority. A thread at idle priority (or nice +10)
that shares the process's GIL holds the whole process up on a busy machine: preempted
while it holds the GIL, or owed the GIL by a thread that dropped it (CPython makes the
dropping thread wait until the requester takes it), it leaves the step loop and the
session's heartbeats waiting until the scheduler grants it a core, which took 1 to 3 s
beside CPU-bound neighbours and lapsed 1 s leases (a node expelled at every checkpoint).

The file is what ``torch.save`` writes (``torch.load`` reads it), but where no core stood
free since the last checkpoint its tensor bytes go straight from those buffers to the disk
(`unbroken.state.directio`). So the buffers are laid out as the file wants them: one
page-aligned region per dtype (one storage each: ``torch.save`` keeps one storage per
record), each record's bytes at a page-aligned offset of the file.

Whoever can write into the directory cannot make a node write or read a file outside it:
files are created (``O_EXCL|O_NOFOLLOW``), renamed and removed relative to the directory's
descriptor (`directio.Temp`), and read without following links. Pruning keeps the newest
checkpoints that load, and sets corrupt ones aside rather than counting them (`_prune`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.state import directio, layout
from unbroken.state.ckpt_files import (
    Found,
    checkpoint_path,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    load_newest,
    set_aside,
    unusable,
)
from unbroken.state.directio import PAGE
from unbroken.state.fragments import ALIGN, Packed, shared, write_fragments
from unbroken.state.snapshot import snapshot_digest

__all__ = [
    "KEEP",
    "Checkpointer",
    "Found",
    "Later",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "load_newest",
    "set_aside",
    "unusable",
]

log = logging.getLogger(__name__)

Later = Callable[[torch.Tensor], bool]
"""Picks the tensors a capture may copy after the step goes on (`Checkpointer.save_async`)."""

KEEP = 3


class Checkpointer:
    """Writes captured states in the background, one at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # Resolved once: a link the operator named the directory by is followed now,
            # and a link put in the directory's place later redirects nothing (`directio.Temp`).
            self._dir = directory.resolve()
            directio.Temp(self._dir, ".probe").discard()
        except OSError as exc:
            raise ConfigError(
                f"checkpoint directory {directory} cannot be written ({exc.strerror or exc}): give a writable "
                "--checkpoint-dir, or none"
            ) from None
        for stale in directio.remove_stale(self._dir):
            log.info("removed %s: its writer was stopped before it was complete", stale)
        self.failure: str | None = None
        """Why the last write failed (None after a write that succeeded)."""
        self._thread: threading.Thread | None = None
        self._syncer: threading.Thread | None = None
        """The thread fsyncing a checkpoint written through the page cache (`_write`)."""
        self._sync_cpu_s = 0.0
        """CPU the last fsync took on its thread."""
        self._arena: _Arena | Packed | None = None
        """The buffers of the last copy handed to the writer; the next one is copied into them."""
        self._laying: threading.Thread | None = None
        """The thread laying out buffers ahead of a checkpoint (`prepare`)."""
        self._captured: threading.Event | None = None
        """Set once the last capture holds its own copy of every tensor."""
        self.written: list[tuple[int, float]] = []
        self.set_aside: list[Path] = []
        """Where `_prune` moved the corrupt checkpoints it found among the newest."""
        self.skipped = 0
        self.staged_s: list[float] = []
        """How long each capture held the step up (the copies not left to the writer)."""
        self.captured_s: list[float] = []
        """How long each capture's copies on the writer's thread took."""
        self._idle = directio.IdleCores()
        """Whether a core stood free since the last checkpoint: its write then goes through
        the page cache, whose copy costs training nothing there (`directio`)."""
        self.direct: list[bool] = []
        """Whether each write went past the page cache."""
        self.overran = False
        """A write through the page cache was still running when the next checkpoint was
        due: the writes after it go past the page cache, free core or not. Its writeback
        keeps a disk far from busy (400 MB fsynced in 2.7-3.3 s on this machine's disk, which
        takes it directly in 0.15-0.25 s), and a checkpoint skipped is worse than a step a
        few per cent longer."""
        self._write_cpu_s = 0.0
        """CPU the last write took on its thread (the writer's own, not training's)."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save_async(self, tree: dict[str, Any], later: Later | None = None) -> bool:
        """Capture ``tree`` (a state's own tensors: `TrainState.tree`) and start writing the
        capture; returns False (and skips) if a write is still running. Tensors that ``later``
        picks (parameters, optimizer state: what only the next update changes) are copied on
        the writer's thread while the next step computes; whatever changes them first calls
        `wait_captured`. The others are copied now."""
        if self.busy:
            self.skipped += 1
            self._overdue()
            return False
        self._start(self._write, tree, later, None)
        return True

    def save_fragments_async(
        self,
        tree: dict[str, Any],
        k: int,
        m: int,
        mine: list[int],
        optimizer_in_digest: bool = True,
        later: Later | None = None,
    ) -> bool:
        """Start writing this node's erasure-coded fragments of ``tree`` (`unbroken.state.fragments`)."""
        if self.busy:
            self.skipped += 1
            self._overdue()
            return False
        self._start(self._write_fragments, shared(tree), later, k, m, mine, optimizer_in_digest)
        return True

    def prepare(self, tree: dict[str, Any], fragments: int | None = None) -> None:
        """Lay out, on a thread, the buffers the next capture of a state like ``tree`` will
        fill (``fragments``: packed for that many data fragments), so that the step of the
        first checkpoint only copies, as later ones do: allocating and touching 400 MB took
        that step 1 s or more. A capture that finds another layout allocates its own."""
        if self.has_buffers:
            return
        # Only shapes and dtypes are wanted: no copy of a GPU state to the host.
        header, _ = layout.split(tree if fragments is None else shared(tree), as_they_are=True)

        def run() -> None:
            try:
                arena = _Arena(header) if fragments is None else Packed(header, fragments)
            except Exception as exc:  # out of memory now: the capture tries again
                log.warning("checkpoint buffers could not be laid out ahead: %s", exc)
                return
            self._arena = arena  # nothing else sets it meanwhile: a capture or `release` joins this thread first

        self._laying = threading.Thread(target=run, name="checkpoint-buffers", daemon=True)
        self._laying.start()

    @property
    def has_buffers(self) -> bool:
        """Buffers are laid out, or being laid out, for the next capture."""
        return self._arena is not None or self._laying is not None

    def release(self) -> None:
        """Give the buffers back (this node writes no more checkpoints: it is not rank 0
        any more); a later capture or `prepare` lays them out again."""
        if self.busy:
            return
        self._laid()
        self._arena = None

    def _laid(self) -> None:
        """Wait for the buffers `prepare` lays out (a capture needs them now)."""
        laying, self._laying = self._laying, None
        if laying is not None:
            laying.join()

    def _overdue(self) -> None:
        """The next checkpoint is due and the last one is still being written."""
        if self.direct and not self.direct[-1] and not self.overran:
            self.overran = True
            log.info("a checkpoint written through the page cache outlasted the checkpoint period: the next go past it")

    def wait_captured(self) -> None:
        """Block until the last capture holds its own copy of every tensor."""
        if self._captured is not None:
            self._captured.wait()

    def _buffers(self, header: Any, tensors: list[torch.Tensor], k: int | None) -> _Arena | Packed:
        """Where this capture goes: the last one's buffers if the layout is the same (for a
        whole file, ``k`` None; packed for k data fragments otherwise)."""
        self._laid()
        arena = self._arena
        if k is None:
            if not isinstance(arena, _Arena) or not arena.fits(header):
                arena = _Arena(header)
        elif not isinstance(arena, Packed) or not arena.fits(header, k):
            arena = Packed(header, k)
        self._arena = arena
        return arena

    def _start(
        self, write: Callable[..., None], tree: dict[str, Any], later: Later | None, k: int | None, *args: Any
    ) -> None:
        start = time.monotonic()
        if not self.direct:  # the first checkpoint: whether a core is free now, not during start-up
            self._idle.since_last()
        header, tensors = layout.split(tree)
        tensors = [t if later is not None and later(t) else t.clone() for t in tensors]
        self.staged_s.append(time.monotonic() - start)
        captured = self._captured = threading.Event()

        def run() -> None:
            try:
                begun = time.monotonic()
                staged = self._buffers(header, tensors, k).fill(header, tensors)
                self.captured_s.append(time.monotonic() - begun)
            except Exception as exc:  # out of memory: this checkpoint is lost, the job is not
                log.error("capturing the state of step %s failed: %s", tree.get("step"), exc)
                self._synced()  # the last one's success does not come after this failure
                self.failure = f"the state of step {tree.get('step')} could not be captured: {exc}"
                return
            finally:
                captured.set()
            if k is None:
                write(staged)
            else:
                write(staged, k, *args)

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _write_fragments(self, snap: dict[str, Any], k: int, m: int, mine: list[int], in_digest: bool) -> None:
        packed = self._arena
        assert isinstance(packed, Packed), "a fragments capture fills a packed buffer"
        start, cpu = time.monotonic(), time.thread_time()
        try:
            direct = self._direct(True)
            write_fragments(self._dir, packed, k, m, mine, snapshot_digest(snap, in_digest), direct)
            self._write_cpu_s = time.thread_time() - cpu
            self.written.append((int(snap["step"]), time.monotonic() - start))
            self.failure = None
        except Exception as exc:  # a disk's error or a codec's: this checkpoint is lost, the job is not
            log.error("fragments of step %d failed: %s", snap["step"], exc)
            self.failure = f"fragments of step {snap['step']} could not be written to {self.directory}: {exc}"

    def _write(self, snap: dict[str, Any]) -> None:
        step = int(snap["step"])
        start = time.monotonic()
        try:
            temp = directio.Temp(self._dir, checkpoint_path(self._dir, step).name)
        except OSError as exc:  # the directory is gone, or a link now: this checkpoint is lost
            self._synced()
            self._failed(step, None, exc)
            return
        try:
            durable = self._save(snap, temp)
        except Exception as exc:  # a disk's error or torch's: this checkpoint is lost, the job is not
            self._synced()
            self._failed(step, temp, exc)
            return
        # The last checkpoint's bytes reach the disk first (at most one fsync in flight: a
        # disk slower than the checkpoints keeps this writer busy, and the next is skipped).
        self._synced()
        if durable:
            self._finish(step, temp, start)
            return

        def sync() -> None:
            cpu = time.thread_time()
            try:
                os.fsync(temp.fd)
            except OSError as exc:
                self._failed(step, temp, exc)
                return
            finally:
                self._sync_cpu_s = time.thread_time() - cpu
            self._finish(step, temp, start)

        # The buffers are free once the page cache holds their bytes: the next checkpoint
        # may copy into them while these reach the disk (seconds where the disk is slow).
        self._syncer = threading.Thread(target=sync, name="checkpoint-sync", daemon=True)
        self._syncer.start()

    def _synced(self) -> None:
        """Wait for the last checkpoint's fsync (`_write`)."""
        if self._syncer is not None:
            self._syncer.join()

    def _finish(self, step: int, temp: directio.Temp, start: float) -> None:
        try:
            temp.commit(sync=False)  # fsynced already
        except OSError as exc:
            self._failed(step, temp, exc)
            return
        self.written.append((step, time.monotonic() - start))
        log.debug(
            "checkpoint of step %d: captured in %.3f s, written in %.3f s",
            step, self.captured_s[-1] if self.captured_s else 0.0, self.written[-1][1],
        )  # fmt: skip
        self.failure = None
        self._prune()

    def _failed(self, step: int, temp: directio.Temp | None, exc: BaseException) -> None:
        log.error("checkpoint of step %d failed: %s", step, exc)
        self.failure = f"checkpoint of step {step} could not be written to {self.directory}: {exc}"
        if temp is not None:
            temp.discard()

    def _direct(self, possible: bool) -> bool:
        """Whether this write goes past the page cache (where ``possible``): where no core
        stood free since the last one, or the page cache could not keep up (`overran`)."""
        direct = possible and (self.overran or not self._idle.free(self._write_cpu_s + self._sync_cpu_s))
        if not self.direct or self.direct[-1] != direct:
            log.info(
                "checkpoints are written %s",
                "past the page cache (no core stood free)" if direct else "through the page cache",
            )
        self.direct.append(direct)
        return direct

    def _save(self, snap: dict[str, Any], temp: directio.Temp) -> bool:
        """``torch.save(snap)`` into ``temp``: the tensor bytes written directly from the
        arena where this torch and the file system allow it, and the file fsynced then (True);
        through the page cache otherwise, not yet fsynced (False)."""
        arena = self._arena
        cpu = time.thread_time()
        direct = self._direct(_DIRECT_SAVE and isinstance(arena, _Arena) and arena.holds(snap))
        with os.fdopen(temp.fd, "w+b", closefd=False) as f:
            if direct:
                assert isinstance(arena, _Arena), "a direct write is one the arena allows (`_direct`)"
                with _aligned_records(), torch.serialization.skip_data():
                    torch.save(snap, f)  # the pickle and the zip's records, with holes for the bytes
                f.flush()
                f.seek(0)
                arena.write(temp.fd, _record_offsets(f, snap))
                os.fsync(temp.fd)
            else:
                torch.save(snap, f)
                f.flush()
        self._write_cpu_s = time.thread_time() - cpu
        return direct

    def _prune(self) -> None:
        """Keep the `KEEP` newest checkpoints that load (this writer's own, or whole when
        read back: `unusable` on the meta device, the pickle only), and delete older ones. A
        corrupt one among the newest is neither counted nor deleted: it is set aside (a
        subdirectory, with why), so it can never push a good checkpoint out, nor hide the
        good ones at the next start, and the operator still has its bytes to look at (a file
        this torch cannot read may be another version's)."""
        mine = {step for step, _ in self.written}
        kept = 0
        corrupt: list[tuple[Path, str]] = []
        for step, p in reversed(checkpoint_steps(self._dir)):
            if kept >= KEEP:
                p.unlink(missing_ok=True)
                continue
            why = None if step in mine else unusable(p, map_location="meta")
            if why is None:
                kept += 1
            else:
                corrupt.append((p, why))
        if corrupt:
            why = "; ".join(f"{p.name} cannot be used ({w})" for p, w in corrupt)
            try:
                aside = set_aside(self._dir, f"corrupt checkpoints: {why}", [p.name for p, _ in corrupt])
            except OSError as exc:
                log.warning("%s: could not be set aside (%s); left in place, not counted", why, exc)
                return
            self.set_aside.append(aside)
            log.warning("%s: moved to %s", why, aside)

    def close(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
        if self._syncer is not None:
            self._syncer.join(max(0.0, end - time.monotonic()))


def _can_save_with_holes() -> bool:
    """Whether this torch saves with holes for the bytes at aligned offsets (``skip_data``
    and ``storage_alignment``: 2.7 and newer) and this system has direct I/O."""
    if not directio.O_DIRECT or not hasattr(torch.serialization, "skip_data"):
        return False
    try:
        from torch.utils.serialization import config
    except ImportError:
        return False
    return hasattr(config.save, "storage_alignment")


_DIRECT_SAVE = _can_save_with_holes()


@contextlib.contextmanager
def _aligned_records() -> Any:
    """``torch.save`` places each record's bytes at a page-aligned offset (its global
    setting for the duration: a save in another thread meanwhile is only padded more)."""
    from torch.utils.serialization import config

    old = config.save.storage_alignment
    config.save.storage_alignment = PAGE
    try:
        yield
    finally:
        config.save.storage_alignment = old


def _record_offsets(f: Any, snap: dict[str, Any]) -> list[int]:
    """Where each tensor's storage (in `layout.split` order) starts in the file ``torch.save``
    wrote (``f``, open at its start): read back from its pickle alone (tensors on the meta
    device are not read)."""
    meta = torch.load(f, map_location="meta", weights_only=True)
    _, tensors = layout.split(meta, as_they_are=True)
    offsets = [t.untyped_storage()._checkpoint_offset for t in tensors]
    if len(offsets) != len(layout.split(snap)[1]) or None in offsets:
        raise OSError(errno.EIO, "the file just saved does not hold its tensors")
    return [int(at) for at in offsets if at is not None]


class _Arena:
    """A capture's buffers: each tensor a view of its dtype's region of one anonymous,
    page-aligned mapping, each region a whole number of pages (one storage per region, so
    a region is one record of the file, its bytes ready for direct I/O as they are)."""

    def __init__(self, header: Any) -> None:
        self.slots = layout.slots(header)
        spans: dict[torch.dtype, int] = {}
        where: list[int] = []
        for slot in self.slots:
            start = spans.get(slot.dtype, 0)
            where.append(start)
            spans[slot.dtype] = start + directio.round_up(slot.nbytes, ALIGN)
        self.regions: list[tuple[int, int, torch.Tensor]] = []
        """(offset in the mapping, bytes, the region as a tensor of its dtype)"""
        sized = {dtype: directio.pages(n) for dtype, n in spans.items()}
        self._map = directio.buffer(sum(sized.values()))
        region_of: dict[torch.dtype, torch.Tensor] = {}
        offset = 0
        for dtype, n in sized.items():
            itemsize = torch.empty(0, dtype=dtype).element_size()
            region = torch.frombuffer(self._map, dtype=dtype, count=n // itemsize, offset=offset)
            region_of[dtype] = region
            self.regions.append((offset, n, region))
            offset += n
        self.views = [
            region_of[slot.dtype][start // region_of[slot.dtype].element_size() :][: slot.numel].view(slot.shape)
            for slot, start in zip(self.slots, where, strict=True)
        ]

    def fits(self, header: Any) -> bool:
        return layout.slots(header) == self.slots

    def fill(self, header: Any, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """The tree of ``header`` with ``tensors`` copied into this arena's views."""
        for dst, src in zip(self.views, tensors, strict=True):
            dst.copy_(src)
        return dict(layout.join(header, self.views))

    def holds(self, snap: dict[str, Any]) -> bool:
        """Whether every tensor of ``snap`` is this arena's (a tree filled by `fill`)."""
        mine = {v.data_ptr() for v in self.views}
        return all(t.data_ptr() in mine for t in layout.split(snap)[1])

    def write(self, fd: int, offsets: list[int]) -> None:
        """Each region's bytes at its record's offset in the file ``fd`` (direct I/O, or
        through the page cache where the file system refuses it: tmpfs)."""
        start_of: dict[int, int] = {}
        for view, offset in zip(self.views, offsets, strict=True):
            start_of.setdefault(view.untyped_storage().data_ptr(), offset)
        memory = memoryview(self._map)
        directio.go_direct(fd)
        for base, n, region in self.regions:
            at = start_of[region.untyped_storage().data_ptr()]
            if at % PAGE:
                raise OSError(errno.EINVAL, f"a record at offset {at} is not page-aligned")
            directio.pwrite_all(fd, memory[base : base + n], at)
