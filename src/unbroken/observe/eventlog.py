"""The coordinator's event log: the recent events in memory, every kind counted, each event
appended to a file as one JSON line (`unbroken.events` holds the kinds and the records)."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from unbroken.errors import ConfigError
from unbroken.events import Event, Kind, Recorded
from unbroken.observe.quiet import Hush

log = logging.getLogger(__name__)

UNWRITTEN_MAX = 4 << 20
"""Bytes of event lines kept for the event log file while its writes fail (about 15,000
events): the newest are written once it takes writes again, older ones are given up."""


class EventLog:
    """The coordinator's events: the last ``keep`` in memory, every kind counted, every
    event appended to ``path`` (one JSON line each) when there is one.

    The file is opened once, here: a process out of file descriptors (a connection flood)
    still writes its events. A write that fails (a full disk, an I/O error) never fails
    `emit`, which decisions go through: the lines wait, up to `UNWRITTEN_MAX` bytes, for
    the next event's write, and the failure is counted (`health`) and logged (`Hush`).
    """

    def __init__(self, path: Path | None = None, keep: int = 10_000) -> None:
        """Raises:
        ConfigError: ``path`` cannot be opened for appending."""
        self.path = path
        self.keep = keep
        self.seq = 0
        self.counts: collections.Counter[Kind] = collections.Counter()
        """Every event by kind, including those only counted (`count`)."""
        self._recent: collections.deque[Recorded] = collections.deque(maxlen=keep)
        self._fd: int | None = None
        self._unwritten = bytearray()
        self.write_failures = 0
        self.dropped_bytes = 0
        """Event lines given up on: more than `UNWRITTEN_MAX` waited while writes failed."""
        self.last_error: str | None = None
        self._hush = Hush()
        if path is not None:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ConfigError(
                    f"cannot write the event log {path}: {exc.strerror or exc}; "
                    "give --event-log a writable file (or none)"
                ) from None

    def emit(self, ev: Event, node: str | None) -> Recorded:
        """Record ``ev`` (its time on the monotonic clock) of the member called ``node``."""
        wall = time.time() - (time.monotonic() - ev.time)
        self.seq += 1
        rec = Recorded(self.seq, wall, ev.kind, node, ev.member, ev.epoch, ev.step, ev.reason)
        self._recent.append(rec)
        self.counts[ev.kind] += 1
        if self._fd is not None:
            self._unwritten += (json.dumps(rec.to_json()) + "\n").encode()
            self._write()
        return rec

    def _write(self) -> None:
        assert self._fd is not None
        try:
            while self._unwritten:
                del self._unwritten[: os.write(self._fd, self._unwritten)]
            return
        except OSError as exc:
            self.write_failures += 1
            self.last_error = f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
        if len(self._unwritten) > UNWRITTEN_MAX:
            # Whole lines from the oldest: the file keeps the newest, each line readable.
            cut = self._unwritten.find(b"\n", len(self._unwritten) - UNWRITTEN_MAX) + 1
            self.dropped_bytes += cut
            del self._unwritten[:cut]
        counted = self._hush.allow("write", time.monotonic())
        if counted is not None:
            log.error(
                "cannot write the event log %s: %s; the job goes on, %d bytes of events wait for the next write%s",
                self.path,
                self.last_error,
                len(self._unwritten),
                f" ({counted} more failed writes not logged)" if counted else "",
            )

    def health(self) -> dict[str, Any]:
        """The event log file's state, for ``/api/state`` and ``/metrics``."""
        return {
            "path": str(self.path) if self.path is not None else None,
            "write_failures": self.write_failures,
            "unwritten_bytes": len(self._unwritten),
            "dropped_bytes": self.dropped_bytes,
            "last_error": self.last_error,
        }

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if self._unwritten:
                    self._write()
                os.close(self._fd)
            self._fd = None

    def count(self, kind: Kind) -> None:
        """An event too many of its source to list (a flood): counted, not kept."""
        self.counts[kind] += 1

    def __iter__(self) -> Iterator[Recorded]:
        return iter(self._recent)

    def __len__(self) -> int:
        return len(self._recent)

    def since(self, seq: int, kinds: Iterable[Kind] = (), node: str | None = None) -> list[Recorded]:
        """The kept events after ``seq``, of ``kinds`` (all when empty) and ``node`` (any when None)."""
        wanted = set(kinds)
        return [
            r
            for r in self._recent
            if r.seq > seq and (not wanted or r.kind in wanted) and (node is None or r.node == node)
        ]

    def last(self, n: int) -> list[Recorded]:
        return list(self._recent)[-n:] if n > 0 else []
