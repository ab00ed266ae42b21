"""Anomaly detection: each kind fires on its cause, with the figures, once; noise does not fire."""

from __future__ import annotations

import math
import random

from unbroken.observe.anomaly import BASELINE, FLAP_COUNT, FLAP_WINDOW_S, RECENT, WINDOW, Detector


def feed_losses(d: Detector, losses: list[float], start: int = 0) -> list[tuple[int, str]]:
    return [(start + i, a.kind) for i, x in enumerate(losses) for a in d.loss(start + i, x)]


def test_a_loss_spike_is_reported_with_its_size() -> None:
    d = Detector()
    calm = [1.0 - 0.01 * i for i in range(30)]
    assert feed_losses(d, calm) == []
    found = d.loss(30, 5.0)
    assert [a.kind for a in found] == ["loss-spike"]
    assert "5 at step 30" in found[0].reason and "x the median" in found[0].reason


def test_noisy_but_healthy_losses_raise_nothing() -> None:
    rng = random.Random(0)
    d = Detector()
    # A decaying loss with 20% multiplicative noise per step, as mini-batch losses have.
    losses = [(2.0 * math.exp(-i / 200) + 0.3) * (1 + 0.2 * rng.gauss(0, 1)) for i in range(1000)]
    assert feed_losses(d, losses) == []


def test_a_spike_is_reported_once_per_window() -> None:
    d = Detector()
    feed_losses(d, [1.0] * 20)
    assert [a.kind for a in d.loss(20, 10.0)] == ["loss-spike"]
    assert d.loss(21, 10.0) == []  # still the same incident
    feed_losses(d, [1.0] * WINDOW, start=22)
    assert [a.kind for a in d.loss(22 + WINDOW, 10.0)] == ["loss-spike"]


def test_a_nan_loss_is_reported_and_not_taken_into_the_baseline() -> None:
    d = Detector()
    feed_losses(d, [1.0] * 12)
    assert [a.kind for a in d.loss(12, float("nan"))] == ["loss-nan"]
    assert [a.kind for a in d.loss(13, float("inf"))] == []  # same incident window
    assert d.loss(14, 1.0) == []


def test_a_throughput_collapse_names_the_drop_and_whether_members_left() -> None:
    d = Detector()
    out = [a for s in range(BASELINE) for a in d.throughput(s, 1000.0, 4)]
    out += [a for s in range(BASELINE, BASELINE + RECENT) for a in d.throughput(s, 100.0, 4)]
    assert [a.kind for a in out] == ["throughput-collapse"]
    assert "10%" in out[0].reason and "still 4 members" in out[0].reason
    # Stays reported until it recovers, then may fire again.
    assert [a for s in range(100, 140) for a in d.throughput(s, 100.0, 4)] == []


def test_a_drop_with_fewer_members_says_so_and_a_mild_slowdown_is_not_a_collapse() -> None:
    d = Detector()
    for s in range(BASELINE):
        assert d.throughput(s, 1000.0, 4) == []
    assert [a for s in range(BASELINE, BASELINE + 20) for a in d.throughput(s, 700.0, 4)] == []
    d = Detector()
    for s in range(BASELINE):
        d.throughput(s, 1000.0, 4)
    found = [a for s in range(BASELINE, BASELINE + RECENT) for a in d.throughput(s, 50.0, 1)]
    assert "members 4 -> 1" in found[0].reason


def test_flapping_needs_repeated_failures_inside_the_window() -> None:
    d = Detector()
    assert d.failure("x", 0.0, "crashed") == []
    assert d.failure("x", FLAP_WINDOW_S + 10, "crashed") == []
    assert d.failure("y", 5.0, "crashed") == []  # another node's failures do not count
    # Spread wider than the window, failures do not add up; close together, they do.
    times = [300.0 + 10 * k for k in range(FLAP_COUNT)]
    found = [a for t in times for a in d.failure("x", t, "its session dropped")]
    assert [(a.kind, a.member) for a in found] == [("flapping", "x")]
    assert f"failed {FLAP_COUNT} times in 20 s" in found[0].reason and "its session dropped" in found[0].reason
    assert d.failure("x", times[-1] + 5, "again") == []  # reported once per window
