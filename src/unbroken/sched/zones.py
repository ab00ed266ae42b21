"""Zones from measured round-trip times, for nodes started with ``--zone auto``.

Nodes of one site see the coordinator at about the same round-trip time; nodes of another
site, a city away, at tens of milliseconds more. Sorting the members' RTTs and cutting
where the next one is far above the previous (``GAP_RATIO`` times and ``MIN_GAP_S`` more)
recovers the sites. The RTT is to the coordinator, so two sites at the same distance from
it fall into one zone: give those nodes ``--zone`` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

AUTO = "auto"
"""The zone a node asks for when the coordinator should choose."""
GAP_RATIO = 2.0
"""A new zone starts where an RTT is at least this many times the previous one..."""
MIN_GAP_S = 0.010
"""...and at least this much longer: a few milliseconds of jitter, or nodes across one city,
must not split a site."""


def group_by_rtt(
    rtts: Mapping[str, float], gap_ratio: float = GAP_RATIO, min_gap_s: float = MIN_GAP_S
) -> dict[str, str]:
    """Each member's zone, ``auto-1`` (nearest the coordinator) to ``auto-N``.

    ``rtts`` maps member ids to their smoothed round-trip time in seconds (0: not measured
    yet, counted as nearest). Members with the same RTT always share a zone; the result
    depends only on the values, not on the order of the mapping.
    """
    ordered = sorted(rtts.items(), key=lambda kv: (kv[1], kv[0]))
    zones: dict[str, str] = {}
    zone = 1
    previous: float | None = None
    for member, rtt in ordered:
        if previous is not None and rtt - previous >= min_gap_s and rtt >= gap_ratio * previous:
            zone += 1
        zones[member] = f"{AUTO}-{zone}"
        previous = rtt
    return zones


WORLD = "world"
"""The name of an epoch's group of all members (its rendezvous entries start with it)."""


@dataclass(frozen=True)
class Zones:
    """Who is in which zone, and who leads each (the first member of a zone in rank order)."""

    of_rank: tuple[str, ...]
    ring: tuple[str, ...] = ()
    """The zones in the leaders' ring order (`sched.links`); the others follow in the order
    of their first members."""

    @cached_property
    def _ranks(self) -> dict[str, tuple[int, ...]]:
        """Each zone's ranks, found once: an order is checked zone by zone, and with a hundred
        zones of ten thousand members a walk over the ranks per zone was most of forming it."""
        out: dict[str, list[int]] = {}
        for r, z in enumerate(self.of_rank):
            out.setdefault(z, []).append(r)
        return {z: tuple(ranks) for z, ranks in out.items()}

    @cached_property
    def _names(self) -> tuple[str, ...]:
        present = self._ranks
        ring = set(self.ring)
        return (*(z for z in dict.fromkeys(self.ring) if z in present), *(z for z in present if z not in ring))

    @property
    def names(self) -> list[str]:
        """The zones in ring order: the leaders' group ranks follow it."""
        return list(self._names)

    def members(self, zone: str) -> list[int]:
        return list(self._ranks.get(zone, ()))

    @property
    def leaders(self) -> list[int]:
        return [self._ranks[z][0] for z in self._names]

    @property
    def multi(self) -> bool:
        return len(self._ranks) > 1

    def streams(self, group: str, streams: int) -> int:
        """Connections per pair of ranks ``group`` has: the order's ``streams`` for the groups
        whose traffic crosses zones (the leaders', and the world's where there are several
        zones: its transfers), one for the rest."""
        return streams if self.multi and group in (WORLD, "leaders") else 1

    def groups(self) -> dict[str, list[int]]:
        """The epoch's process groups by name, each with its ranks in group-rank order:
        the world, then with several zones each zone of more than one member and the
        zone leaders. Nodes build exactly these; the leader checks rendezvous entries
        against them (`unbroken.control.meeting`)."""
        out = {WORLD: list(range(len(self.of_rank)))}
        if self.multi:
            for z, name in enumerate(self.names):
                if len(members := self.members(name)) > 1:
                    out[f"zone{z}"] = members
            out["leaders"] = self.leaders
        return out
