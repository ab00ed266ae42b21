"""Writing checkpoint bytes to the disk without the page cache.

A write through the page cache costs a core 0.1-1.4 s per 400 MB (allocating and copying
its pages, writing them back later), taken from training wherever no core is free; with
``O_DIRECT`` the disk's DMA reads the buffer itself and the core spends about 20 ms. Direct
I/O wants the buffer's address, the file offset and the length page-aligned: checkpoint
buffers are anonymous mappings (page-aligned) cut into whole pages. Where a file system
refuses direct I/O (tmpfs) or the system has none, the same bytes go through the page cache.

Direct I/O is not free either: its completions run on whichever core takes the disk's
interrupts, often one that trains (a 400 MB write slowed a compute loop on the other core by
10-20 % for its 0.2 s, 20-40 ms in all). Where a core stands idle the page cache's copy costs
training nothing, so `IdleCores` tells a writer which of the two to use.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

PAGE = 4096
"""What direct I/O wants aligned: buffer addresses, file offsets and lengths."""
O_DIRECT = getattr(os, "O_DIRECT", 0)
CHUNK = 32 << 20
"""Bytes per write call: a process killed mid-write exits once the call under way is done
(its thread cannot die inside it), so a call is kept to a few tens of milliseconds."""


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def pages(n: int) -> int:
    """``n`` bytes rounded up to whole pages (at least one)."""
    return max(round_up(n, PAGE), PAGE)


def buffer(n: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of at least ``n`` bytes (whole pages: `pages`), its
    pages allocated at once (one call instead of a fault per page on the first capture)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, pages(n), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)


def aligned(view: memoryview) -> bool:
    """Whether direct I/O can take ``view`` as it is."""
    if len(view) % PAGE or view.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE == 0


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` at ``offset``; a direct descriptor the file system turns down after
    all (or that took part of a call) goes on through the page cache."""
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done : done + CHUNK], offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP) or not _through_page_cache(fd):
                raise
            continue
        if n <= 0:
            raise OSError(errno.EIO, f"a write of {len(view) - done} bytes took none")
        if n % PAGE:
            _through_page_cache(fd)  # the next offset is no longer aligned
        done += n


def _through_page_cache(fd: int) -> bool:
    """Turn direct I/O off on ``fd``; False where it was not on."""
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not O_DIRECT or not flags & O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
    return True


def go_direct(fd: int) -> bool:
    """Turn direct I/O on for ``fd`` (a file already created: a create with ``O_DIRECT`` on
    a file system that refuses it fails after making the file); False where the file
    system or the system has none."""
    import fcntl

    if not O_DIRECT:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return False
    return True


_TEMP = re.compile(
    r"^(?:ckpt-\d{9}\.pt|frag-\d{9}\.(?:\d{3}|json)|shard-\d{9}-\d{12}-\d{12}\.pt)"
    r"\.(?P<pid>\d{1,10})(?:-[0-9a-f]{16})?@(?P<writer>[\w.-]+)\.tmp$"
)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@functools.cache
def _writer() -> str:
    """This process's machine and process-id namespace, as a file name can hold them: its
    host name, its boot's id (machines named alike differ by it) and its pid namespace
    (containers on one host, sharing its name, number their processes each their own way)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8])
    with contextlib.suppress(OSError):
        parts.append("".join(ch for ch in os.readlink("/proc/self/ns/pid") if ch.isdigit()))
    return re.sub(r"[^\w.-]", "_", "-".join(parts))


def temp_path(final: Path) -> Path:
    """Where ``final`` is written before it is renamed into place: named by the writing
    process and where it runs (`_writer`), so that `remove_stale` can tell a dead writer's
    file from a live one's in a directory other machines or containers share, and by a
    random token, so that no one can put a link there ahead of the writer."""
    return final.with_name(f"{final.name}.{os.getpid()}-{secrets.token_hex(8)}@{_writer()}.tmp")


def open_directory(path: Path) -> int:
    """A descriptor of the directory ``path``, refused where ``path`` is a symbolic link (a
    link put in place of a checkpoint directory redirects no write: a directory the operator
    named through a link is resolved once, when the writer starts)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC)


class Temp:
    """A new file in ``directory`` under a temporary name (`temp_path`), renamed to ``final``
    once complete (`commit`) or removed (`discard`). The file is created with ``O_EXCL`` and
    ``O_NOFOLLOW``, and created, renamed and removed relative to the directory's descriptor:
    a link or file planted at the temporary or final name, or a directory swapped for a link
    meanwhile, never sends the bytes anywhere else (a planted link at ``final`` is replaced,
    not followed).

    Raises:
        OSError: the directory cannot be opened (gone, a link, not a directory) or written.
    """

    def __init__(self, directory: Path, final: str) -> None:
        self.directory, self.final = directory, final
        self.dir_fd = open_directory(directory)
        self.fd = -1
        try:
            for _ in range(8):
                self.name = temp_path(directory / final).name
                try:
                    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
                    self.fd = os.open(self.name, flags, 0o644, dir_fd=self.dir_fd)
                    break
                except FileExistsError:
                    continue  # something at a name no one could predict: take another
            else:
                raise FileExistsError(errno.EEXIST, f"no free temporary name for {final} in {directory}")
        except BaseException:
            os.close(self.dir_fd)
            raise

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def commit(self, sync: bool = True) -> None:
        """Rename the file to its final name (fsynced first where ``sync``); removed instead
        where that fails (and the error raised). Closes it."""
        try:
            if sync:
                os.fsync(self.fd)
            os.replace(self.name, self.final, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            self.discard()
            raise
        self.close()

    def discard(self) -> None:
        """Remove the file (the name in this directory: a link put there is removed, not
        what it points to) and close it."""
        if self.dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.dir_fd)
        self.close()

    def close(self) -> None:
        for fd in (self.fd, self.dir_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dir_fd = -1


def open_read(path: Path) -> BinaryIO:
    """``path`` open for reading, refused (``ELOOP``) where it is a symbolic link: a
    checkpoint is read from its directory, not from wherever a link planted there points."""
    return open(path, "rb", opener=lambda p, flags: os.open(p, flags | NOFOLLOW | CLOEXEC))


def write_whole(directory: Path, name: str, write: Callable[[BinaryIO], object]) -> Path:
    """``directory/name`` holding what ``write`` puts into the file it is given, whole or not
    at all (`Temp`: fsynced, then renamed into place; nothing planted in the directory takes
    the bytes elsewhere)."""
    temp = Temp(directory, name)
    try:
        with open(temp.fd, "wb", closefd=False) as f:
            write(f)
        temp.commit()
    except BaseException:
        temp.discard()
        raise
    return directory / name


def copy_file(source: Path, directory: Path) -> Path:
    """``source`` copied into ``directory`` under its own name, whole or not at all (`Temp`;
    ``source`` not followed where it is a link: `open_read`); the copy's path. A file copied
    onto itself is left as it is."""
    final = directory / source.name
    if final.resolve() == source.resolve():
        return final
    with open_read(source) as src:
        write_whole(directory.resolve(), source.name, lambda dst: shutil.copyfileobj(src, dst))
    return final


def read_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` (not followed where it is a link: `open_read`), refused where
    there are more than ``limit``."""
    with open_read(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{size:,} bytes, more than the {limit:,} expected")
        return f.read(limit + 1)


def move_aside(directory: Path, names: list[str], why: str, label: str = "set-aside") -> Path:
    """Move ``names`` (files of ``directory``) into a new subdirectory of it, with a
    ``WHY.txt`` that says ``why``; returns the subdirectory. Renames never follow a link:
    a link is moved as a link."""
    stamp = f"{label}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    aside = directory / stamp
    n = 0
    while True:
        try:
            aside.mkdir()
            break
        except FileExistsError:
            n += 1
            aside = directory / f"{stamp}-{n}"
    for name in names:
        with contextlib.suppress(FileNotFoundError):  # pruned meanwhile by another writer
            os.rename(directory / name, aside / name)
    fd = os.open(aside / "WHY.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(why + "\n")
    return aside


def remove_stale(directory: Path) -> list[Path]:
    """Remove the temporary files (`temp_path`) whose writer ran here (this machine, this
    process-id namespace) and runs no more (a node killed mid-write leaves hundreds of MB
    behind), and links planted under such names (the link, not what it points to); returns
    them. Others' files are left alone: whether their writer lives cannot be told from here.
    A file that cannot be removed is left with a warning."""
    removed = []
    for p in directory.iterdir():
        mt = _TEMP.match(p.name)
        if mt is None or mt.group("writer") != _writer() or _alive(int(mt.group("pid"))):
            continue
        try:
            if stat.S_ISDIR(p.lstat().st_mode):
                continue
            p.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove %s, left by a writer that no longer runs: %s", p, exc)
            continue
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; no such pid can be
        return True
    return True


def write_file(path: Path, data: bytes | memoryview, direct: bool = True) -> None:
    """``path`` holding exactly ``data``, fsynced, written whole under a temporary name and
    renamed into place (`Temp`): by direct I/O where ``direct`` and ``data`` is `aligned`."""
    view = memoryview(data)
    temp = Temp(path.parent, path.name)
    try:
        if direct and aligned(view):
            go_direct(temp.fd)
        pwrite_all(temp.fd, view, 0)
    except BaseException:
        temp.discard()
        raise
    temp.commit()


FREE = 0.75
"""Idle cores (on average) from which a core counts as free: the page cache's copy can run there."""


class IdleCores:
    """How many of this process's cores stood idle between two looks (Linux ``/proc/stat``)."""

    def __init__(self) -> None:
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._last = self._read()

    def _read(self) -> tuple[int, int, float] | None:
        """Idle and total ticks of this process's cores so far, and when."""
        wanted = {f"cpu{i}" for i in self._cpus}
        idle = total = 0
        try:
            with open("/proc/stat", encoding="ascii") as f:
                for line in f:
                    name, *ticks = line.split()
                    if name in wanted:
                        values = [int(t) for t in ticks[:8]]  # guest time is already in user time
                        idle += values[3] + values[4]  # idle and waiting for I/O
                        total += sum(values)
        except (OSError, ValueError):
            return None
        return (idle, total, time.monotonic()) if total else None

    def since_last(self, min_s: float = 0.0) -> tuple[float, float] | None:
        """Idle cores on average since the last look, and over how many seconds; None where
        that cannot be known or the last look is under ``min_s`` old (kept for the next)."""
        now, last = self._read(), self._last
        if now is None or last is None or now[1] <= last[1]:
            self._last = now
            return None
        if now[2] - last[2] < min_s:
            return None
        self._last = now
        return (now[0] - last[0]) / (now[1] - last[1]) * len(self._cpus), now[2] - last[2]

    def free(self, busy_s: float = 0.0) -> bool:
        """Whether a core stood free over the last second or more, counting ``busy_s`` of CPU
        the caller itself spent meanwhile as idle (a write through the page cache must not
        take its own copying for training). False where unknown: direct I/O, which costs
        least in all."""
        seen = self.since_last(min_s=1.0)
        return seen is not None and seen[0] + busy_s / seen[1] >= FREE
