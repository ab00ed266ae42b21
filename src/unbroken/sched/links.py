"""The zone leaders' ring, ordered by measured bandwidth.

The leaders' exchange is a ring all-gather: every payload crosses every link of the ring,
so the ring runs at the rate of its slowest link. By default zones stand in the order their
first members joined. With four zones or more (with three, every pair is adjacent anyway)
another order can leave a slow pair out of the ring. The leaders measure each pair when an
epoch order asks them to (``probe_links``; `comm.links.probe`), each reports the rate at
which it received from every other zone (`messages.Links`), and the coordinator orders the
next epochs' ring to make its slowest link as fast as it can (ties: the larger sum, then
the order before), reordering only for a gain of `GAIN`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

RING_MIN_ZONES = 4
"""Below this every pair of zones is adjacent in any ring: nothing to order."""
MAX_AGE_S = 600.0
"""A pair measured longer ago than this is measured again (links change: routes, load)."""
GAIN = 4.0
"""A new ring only when its slowest link is this much faster than the ring in force's: links
worth avoiding differ by far more (a continent against a region: 20 against 800 Mbit/s),
while loopback pairs probed at once on this busy 2-core machine measured 320-1750 MB/s."""
EXHAUSTIVE = 8
"""Up to this many zones every ring is tried (7! orders); beyond, the nearest fast neighbour."""

Rate = Callable[[str, str], float]


def bottleneck(ring: Sequence[str], rate: Rate) -> float:
    """The slowest link of ``ring`` (it closes on itself)."""
    return min(rate(a, b) for a, b in zip(ring, [*ring[1:], ring[0]], strict=True))


def _score(ring: Sequence[str], rate: Rate) -> tuple[float, float]:
    return bottleneck(ring, rate), sum(rate(a, b) for a, b in zip(ring, [*ring[1:], ring[0]], strict=True))


def best_ring(zones: Sequence[str], rate: Rate) -> list[str]:
    """The order of ``zones`` whose slowest link (``rate``, symmetric) is fastest, then whose
    links sum most; among equals the first found from ``zones``' own order, so the same
    rates always give the same ring."""
    if len(zones) < RING_MIN_ZONES:
        return list(zones)
    first, rest = zones[0], list(zones[1:])
    if len(zones) <= EXHAUSTIVE:
        best, best_score = list(zones), _score(zones, rate)
        for perm in itertools.permutations(rest):
            ring = [first, *perm]
            score = _score(ring, rate)
            if score > best_score:
                best, best_score = ring, score
        return best
    ring = [first]
    while rest:  # greedy: the fastest link out of the last zone placed (first in order on ties)
        nxt = max(rest, key=lambda z: (rate(ring[-1], z), -rest.index(z)))
        ring.append(nxt)
        rest.remove(nxt)
    return ring


class Links:
    """What the zone leaders measured: MB/s received by one zone from another, and when."""

    def __init__(self) -> None:
        self._rates: dict[tuple[str, str], tuple[float, float]] = {}

    def report(self, to: str, rates: Mapping[str, float], now: float) -> None:
        for src, mb_s in rates.items():
            if src != to:
                self._rates[to, src] = (mb_s, now)

    def rate(self, a: str, b: str, now: float) -> float | None:
        """The pair's rate (the slower direction measured within `MAX_AGE_S`), or None."""
        fresh = []
        for key in ((a, b), (b, a)):
            got = self._rates.get(key)
            if got is not None and now - got[1] <= MAX_AGE_S:
                fresh.append(got[0])
        return min(fresh) if fresh else None

    def rates(self, now: float) -> Rate:
        """`rate` as a function of the pair (0 where not measured)."""
        return lambda a, b: self.rate(a, b, now) or 0.0

    def complete(self, zones: Sequence[str], now: float) -> bool:
        """Whether every pair of ``zones`` has a fresh rate."""
        return all(self.rate(a, b, now) is not None for a, b in itertools.combinations(zones, 2))

    def ring(self, zones: Sequence[str], current: Sequence[str], now: float) -> list[str]:
        """The ring for an epoch of ``zones``: ``current`` (the ring in force, or ``zones``'
        own order) unless every pair is measured and another ring's slowest link is `GAIN`
        times faster."""
        order = [z for z in current if z in zones] + [z for z in zones if z not in current]
        if len(zones) < RING_MIN_ZONES or not self.complete(zones, now):
            return order
        rate = self.rates(now)
        best = best_ring(order, rate)
        return best if bottleneck(best, rate) >= GAIN * bottleneck(order, rate) else order
