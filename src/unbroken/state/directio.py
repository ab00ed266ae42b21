"""Writing checkpoint bytes to the disk without the page cache.

A write through the page cache costs a core 0.1-1.4 s per 400 MB (allocating and copying
its pages, writing them back later), taken from training wherever no core is free; with
``O_DIRECT`` the disk's DMA reads the buffer itself and the core spends about 20 ms. Direct
I/O wants the buffer's address, the file offset and the length page-aligned: checkpoint
buffers are anonymous mappings (page-aligned) cut into whole pages. Where a file system
refuses direct I/O (tmpfs) or the system has none, the same bytes go through the page cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

PAGE = 4096
"""What direct I/O wants aligned: buffer addresses, file offsets and lengths."""
O_DIRECT = getattr(os, "O_DIRECT", 0)
CHUNK = 32 << 20
"""Bytes per write call: a process killed mid-write exits once the call under way is done
(its thread cannot die inside it), so a call is kept to a few tens of milliseconds."""


def pages(n: int) -> int:
    """``n`` bytes rounded up to whole pages (at least one)."""
    return max(-(-n // PAGE) * PAGE, PAGE)


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


@contextlib.contextmanager
def opened(path: Path, create: bool = False) -> Iterator[int]:
    """``path`` open for writing (``create``: created or truncated), direct where the file
    system allows it."""
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    try:
        fd = os.open(path, flags | O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not O_DIRECT:
            raise
        fd = os.open(path, flags, 0o644)
    try:
        yield fd
    finally:
        os.close(fd)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + CHUNK], offset + done)


def write_file(path: Path, data: bytes | memoryview) -> None:
    """``path`` holding exactly ``data``, fsynced: by direct I/O where ``data`` is `aligned`."""
    view = memoryview(data)
    if aligned(view):
        with opened(path, create=True) as fd:
            pwrite_all(fd, view, 0)
            os.fsync(fd)
        return
    with open(path, "wb") as f:
        f.write(view)
        f.flush()
        os.fsync(f.fileno())
