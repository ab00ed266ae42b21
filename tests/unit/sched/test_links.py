"""The zone leaders' ring ordered by measured bandwidth: which ring, when, and from whom."""

from __future__ import annotations

import itertools

import pytest

from unbroken.sched.links import GAIN, MAX_AGE_S, Links, best_ring, bottleneck
from unbroken.sched.zones import Zones

SLOW = {frozenset("AB"), frozenset("CD")}
"""In rank order A B C D, the ring uses A-B and C-D: both slow."""


def rates(slow: set[frozenset[str]], fast: float = 100.0, slow_rate: float = 2.5):  # type: ignore[no-untyped-def]
    return lambda a, b: slow_rate if frozenset((a, b)) in slow else fast


def test_the_best_ring_leaves_the_slow_pairs_out_and_is_the_same_for_the_same_rates() -> None:
    rate = rates(SLOW)
    ring = best_ring(list("ABCD"), rate)
    assert bottleneck(ring, rate) == 100.0 and bottleneck(list("ABCD"), rate) == 2.5
    assert ring[0] == "A" and ring == best_ring(list("ABCD"), rate)
    every = max(bottleneck(["A", *p], rate) for p in itertools.permutations("BCD"))
    assert bottleneck(ring, rate) == every


@pytest.mark.parametrize("n", [4, 7, 11])
def test_no_ring_is_slower_than_rank_order_and_large_ones_are_greedy(n: int) -> None:
    zones = [f"z{i}" for i in range(n)]
    slow = {frozenset((zones[i], zones[i + 1])) for i in range(0, n - 1, 2)}
    rate = rates(slow)
    ring = best_ring(zones, rate)
    assert sorted(ring) == sorted(zones) and bottleneck(ring, rate) >= bottleneck(zones, rate)
    assert bottleneck(ring, rate) == 100.0


def test_three_zones_are_left_as_they_are() -> None:
    assert best_ring(list("CBA"), rates({frozenset("CB")})) == list("CBA")


def test_a_ring_changes_only_once_every_pair_is_measured_and_for_a_real_gain() -> None:
    links = Links()
    zones = list("ABCD")
    for to in zones[:3]:  # D has not reported: A-B and C-D are known from one side only...
        links.report(to, {z: rates(SLOW)(to, z) for z in zones if z != to}, now=0.0)
    assert links.complete(zones, 0.0)  # ...which is enough: every pair has a rate
    assert links.ring(zones, zones, 1.0) == ["A", "C", "B", "D"]
    assert links.rate("A", "B", 1.0) == 2.5 and links.rate("B", "A", 1.0) == 2.5
    assert links.ring(zones, zones, MAX_AGE_S + 1) == zones, "stale rates order nothing"
    assert not links.complete(zones, MAX_AGE_S + 1)
    near = Links()  # a ring barely faster than the one in force: kept
    for to in zones:
        near.report(to, {z: 100.0 if frozenset((to, z)) not in SLOW else 100.0 / GAIN * 1.01 for z in zones}, 0.0)
    assert near.ring(zones, zones, 0.0) == zones


def test_the_slower_direction_is_the_pairs_rate() -> None:
    links = Links()
    links.report("A", {"B": 50.0}, 0.0)
    links.report("B", {"A": 80.0}, 0.0)
    assert links.rate("A", "B", 0.0) == links.rate("B", "A", 0.0) == 50.0
    assert links.rate("A", "C", 0.0) is None


def test_zones_in_ring_order_make_the_leaders_group() -> None:
    z = Zones(("A", "A", "B", "C", "D", "D"), ring=("A", "C", "B", "D"))
    assert z.names == ["A", "C", "B", "D"]
    assert z.leaders == [0, 3, 2, 4]
    assert z.groups()["leaders"] == [0, 3, 2, 4]
    assert Zones(("A", "B", "C"), ring=("C", "X")).names == ["C", "A", "B"], "absent zones are ignored"
