"""A process that keeps the memory it frees for its next allocations (glibc's malloc), if asked.

A training step frees and allocates the same large tensors every step: a 50M-parameter
model's gradient is 200 MB, in tensors of up to 150 MB. glibc serves each allocation over
32 MB with a mapping of its own and unmaps it when freed, so every step faults in 200 MB of
freshly zeroed pages: 49,000 page faults and a third of a 240 ms step on a 2-core VM.
Served from the heap and never trimmed, they are reused from step to step with no fault
(the same step: 140-150 ms); the process keeps its peak memory. On the main thread: a
thread's own arena still maps an allocation over 64 MB afresh.

``UNBROKEN_MALLOC=kept`` asks for it, in a node process or a script's own loop. It is not the
default yet: on a 2-core machine shared by a 2-node job and a third node starting, the
start and the state transfer took about twice as long beside trainers that kept their
memory, for reasons not understood yet (`bench/join.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_done = False


def keep_freed_memory(default: bool = False) -> bool:
    """Large allocations from the heap, which is not trimmed (once per process); whether
    that is in force. ``UNBROKEN_MALLOC``: ``kept`` or ``system`` decide, else ``default``.
    Nothing happens without glibc (``mallopt`` elsewhere is a stub or absent)."""
    global _done
    if _done:
        return True
    choice = os.environ.get("UNBROKEN_MALLOC", "").lower()
    if choice not in ("", "kept", "system"):
        log.warning("UNBROKEN_MALLOC=%s is neither kept nor system: taken as unset", choice)
    if choice == "system" or (choice != "kept" and not default):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 (glibc's alone: another libc's allocator is its own)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(M_TRIM_THRESHOLD, _INT_MAX) and mallopt(M_MMAP_MAX, 0)):
        log.warning("malloc refused to keep freed memory: each step maps its large tensors afresh")
        return False
    _done = True
    log.info("malloc keeps freed memory for reuse (UNBROKEN_MALLOC=kept)")
    return True
