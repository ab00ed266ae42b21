"""A few events per source and window, then a count: floods stay out of the history."""

from __future__ import annotations

import enum
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
