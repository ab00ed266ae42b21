"""Admissions: strikes against churning keys and addresses, on an injected clock."""

from __future__ import annotations

import pytest

from unbroken.control import admissions
from unbroken.control.admissions import BASE_S, CAP_S, FADE_S, FREE_PER_KEY, FREE_PER_SOURCE, Admissions


def test_joins_of_keys_and_addresses_that_never_churned_do_not_wait() -> None:
    a = Admissions()
    assert a.wait("k1", "10.0.0.1", 0.0) is None
    a.churned("k1", "10.0.0.1", 0.0)  # one crash while joining is allowed for free
    assert a.wait("k1", "10.0.0.1", 0.0) is None
    assert a.wait("k2", "10.0.0.2", 0.0) is None


def test_a_key_that_keeps_churning_waits_longer_each_time_up_to_the_cap() -> None:
    a = Admissions()
    waits = []
    for i in range(12):
        a.churned("k", f"10.0.0.{i}", 0.0)  # a fresh address each time: the key alone tells
        w = a.wait("k", "10.0.0.99", 0.0)
        waits.append(w.until if w is not None else 0.0)
    free = int(FREE_PER_KEY)
    assert waits[:free] == [0.0] * free
    assert waits[free] == pytest.approx(BASE_S)
    assert waits[free + 1] == pytest.approx(2 * BASE_S) and waits[free + 2] == pytest.approx(4 * BASE_S)
    assert waits[-1] == CAP_S
    w = a.wait("k", "10.0.0.99", 0.0)
    assert w is not None and "its node key" in w.reason and "10.0.0.99" not in w.reason


def test_fresh_keys_from_one_address_wait_once_the_address_used_its_free_strikes() -> None:
    a = Admissions()
    for i in range(int(FREE_PER_SOURCE)):
        a.churned(f"key{i}", "10.0.0.7", 0.0)
        assert a.wait(f"new{i}", "10.0.0.7", 0.0) is None, "a few nodes behind one address may crash while joining"
    a.churned("another", "10.0.0.7", 0.0)
    w = a.wait("never-seen", "10.0.0.7", 0.0)
    assert w is not None and w.until == pytest.approx(BASE_S) and "from 10.0.0.7" in w.reason
    assert a.wait("never-seen", "10.0.0.8", 0.0) is None, "other addresses are not held"


def test_strikes_fade_after_a_quiet_period() -> None:
    a = Admissions()
    for _ in range(6):
        a.churned("k", "10.0.0.1", 0.0)
    assert a.wait("k", "10.0.0.1", 0.0) is not None
    later = 6 * FADE_S
    assert a.wait("k", "10.0.0.1", later) is None
    a.churned("k", "10.0.0.1", later)  # counted afresh: one strike, within the free ones
    assert a.wait("k", "10.0.0.1", later) is None


def test_a_sustained_churner_settles_near_one_churn_per_fade_period() -> None:
    a, now, churns = Admissions(), 0.0, 0
    while now < 600.0:
        w = a.wait("k", "10.0.0.1", now)
        now = w.until if w is not None else now
        a.churned("k", "10.0.0.1", now)  # joins as soon as let in, leaves at once
        churns += 1
        now += 0.05
    late = churns / (600.0 / FADE_S)
    assert late < 1.5, f"{churns} churns in 600 s"


def test_no_key_or_address_is_nobodys_and_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    a = Admissions()
    for _ in range(10):
        a.churned("", "", 0.0)
    assert a.wait("", "", 0.0) is None
    monkeypatch.setattr(admissions, "TRACKED", 50)
    for _ in range(5):
        a.churned("old", "10.0.0.1", 0.0)
    assert a.wait("old", "10.0.0.2", 0.0) is not None
    for i in range(500):
        a.churned(f"fresh{i}", "", 0.0)
    assert len(a.keys._level) == 50
    assert a.wait("old", "10.0.0.2", 0.0) is None, "the oldest strikes are forgotten first"
    assert a.wait("x", "10.0.0.1", 0.0) is not None, "its address still tells"
