"""Zones from round-trip times: sites separated by a clear gap, jitter never splits one."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from unbroken.sched.zones import group_by_rtt


def test_three_sites_by_distance_from_the_coordinator() -> None:
    rtts = {"here1": 0.0002, "here2": 0.0004, "lyon1": 0.021, "lyon2": 0.024, "nyc": 0.090}
    assert group_by_rtt(rtts) == {
        "here1": "auto-1", "here2": "auto-1", "lyon1": "auto-2", "lyon2": "auto-2", "nyc": "auto-3",
    }  # fmt: skip


def test_jitter_on_one_site_does_not_split_it() -> None:
    # 0.1 ms to 8 ms: a factor of 80 but under the 10 ms floor.
    assert set(group_by_rtt({"a": 0.0001, "b": 0.0008, "c": 0.008}).values()) == {"auto-1"}


def test_a_site_spread_wider_than_the_ratio_stays_whole_when_the_steps_are_small() -> None:
    # 20, 25, 31, 39 ms: each step is under 2x, so one site even though 39/20 is almost 2.
    assert set(group_by_rtt({"a": 0.020, "b": 0.025, "c": 0.031, "d": 0.039}).values()) == {"auto-1"}


def test_unmeasured_members_count_as_nearest() -> None:
    assert group_by_rtt({"new": 0.0, "near": 0.0003, "far": 0.050}) == {
        "new": "auto-1", "near": "auto-1", "far": "auto-2",
    }  # fmt: skip


def test_empty() -> None:
    assert group_by_rtt({}) == {}


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.floats(0, 1), max_size=12))
def test_order_free_and_monotone(rtts: dict[str, float]) -> None:
    zones = group_by_rtt(rtts)
    items = list(rtts.items())
    random.Random(0).shuffle(items)
    assert group_by_rtt(dict(items)) == zones
    by_rtt = sorted(rtts, key=lambda m: rtts[m])
    numbers = [int(zones[m].split("-")[1]) for m in by_rtt]
    assert numbers == sorted(numbers)  # farther never means a nearer zone
    for a in rtts:
        for b in rtts:
            if rtts[a] == rtts[b]:
                assert zones[a] == zones[b]
