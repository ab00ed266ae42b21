"""A few events per source and window, then a count: floods stay out of the history (`Quiet`)
and out of the logs (`Hush`)."""

from __future__ import annotations

import enum
import errno
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


class Say(enum.Enum):
    YES = "yes"
    LAST = "last"
    """The last one of the window: say that the rest will only be counted."""
    NO = "no"


@dataclass
class Quiet:
    per_source: int = 5
    """Events one source may add per window."""
    total: int = 50
    """Events all sources together may add per window."""
    window_s: float = 10.0
    _counts: dict[str, int] = field(default_factory=dict)
    _all: int = 0
    _since: float | None = None

    def allow(self, source: str, now: float) -> Say:
        if self._since is None or now - self._since >= self.window_s:
            self._since, self._counts, self._all = now, {}, 0
        n = self._counts[source] = self._counts.get(source, 0) + 1
        self._all += 1
        if n > self.per_source or self._all > self.total:
            return Say.NO
        return Say.LAST if n == self.per_source or self._all == self.total else Say.YES


RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ENOSPC})
"""Out of file descriptors, buffers, memory or disk: met by every connection or every write
at once, and their tracebacks say nothing the first line does not."""


class Hush:
    """One log line per kind of trouble and interval, then how many more there were: a fault
    met by every connection or every event (no file descriptor left, a full disk) once wrote
    a traceback each, 465 to 580 MB of them in 2.5 minutes."""

    def __init__(self, interval_s: float = 10.0, kinds: int = 1024) -> None:
        self.interval_s = interval_s
        self.kinds = kinds
        """Kinds remembered at most (the oldest is forgotten first): keys are not unbounded."""
        self._seen: dict[Hashable, tuple[float, int]] = {}

    def allow(self, kind: Hashable, now: float) -> int | None:
        """None: count this one and say nothing; else say it, with how many of its kind were
        counted since the last one said (0 the first time)."""
        seen = self._seen.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            self._seen[kind] = (seen[0], seen[1] + 1)
            return None
        self._seen.pop(kind, None)
        if len(self._seen) >= self.kinds:
            del self._seen[next(iter(self._seen))]
        self._seen[kind] = (now, 0)
        return 0 if seen is None else seen[1]


class HushFilter(logging.Filter):
    """A `Hush` over a logger's warnings and errors, keyed by the message's template and the
    exception's type and errno; a resource error's traceback becomes its one-line message."""

    def __init__(self, hush: Hush | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.hush = hush or Hush()
        self.clock = clock

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        kind = (record.name, str(record.msg), type(exc).__name__, getattr(exc, "errno", None))
        counted = self.hush.allow(kind, self.clock())
        if counted is None:
            return False
        message = record.getMessage()
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            message += f": {exc}"
            record.exc_info, record.exc_text = None, None
        if counted:
            message += f" ({counted} more like it in the last {self.hush.interval_s:g} s were not logged)"
        record.msg, record.args = message, None
        return True


LIBRARY_LOGGERS = ("asyncio", "aiohttp.server", "aiohttp.web", "aiohttp.websocket")
"""Where the event loop and aiohttp report each connection's error (an ``accept`` out of
file descriptors, a handler's exception)."""


def hush_library_logs() -> None:
    """Put a `HushFilter` on `LIBRARY_LOGGERS`, once per process."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, HushFilter) for f in logger.filters):
            logger.addFilter(HushFilter())
