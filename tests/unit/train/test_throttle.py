"""Throttle: emulated slow devices, parsed from --throttle, by step."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken import specs as throttle  # where Throttle lives (unbroken.train.throttle keeps its names)
from unbroken.errors import ConfigError
from unbroken.train.throttle import Throttle, parse_throttle

# ---------------------------------------------------------------- parsing


def test_a_single_factor_holds_throughout() -> None:
    t = parse_throttle("0.25")
    assert t.schedule == ((0, 0.25),)
    assert t.active
    assert [t.factor(s) for s in (0, 1, 40, 10**9)] == [0.25] * 4


def test_a_schedule_changes_speed_at_the_given_steps() -> None:
    t = parse_throttle("1,40:0.25,80:1")
    assert t.schedule == ((0, 1.0), (40, 0.25), (80, 1.0))
    assert t.active
    assert t.factor(0) == 1.0
    assert t.factor(39) == 1.0
    assert t.factor(40) == 0.25
    assert t.factor(79) == 0.25
    assert t.factor(80) == 1.0
    assert t.factor(10**6) == 1.0


def test_a_schedule_starting_later_implies_full_speed_before() -> None:
    t = parse_throttle("40:0.5")
    assert t.schedule == ((0, 1.0), (40, 0.5))
    assert t.factor(0) == 1.0
    assert t.factor(39) == 1.0
    assert t.factor(40) == 0.5
    assert t.factor(1000) == 0.5


def test_a_schedule_from_step_zero_adds_nothing() -> None:
    assert parse_throttle("0:0.5,10:1").schedule == ((0, 0.5), (10, 1.0))


@pytest.mark.parametrize("text", ["", "   ", "1"])
def test_empty_or_one_means_full_speed(text: str) -> None:
    t = parse_throttle(text)
    assert not t.active
    assert t.factor(0) == 1.0 and t.factor(123) == 1.0


def test_the_default_throttle_is_full_speed() -> None:
    assert Throttle() == parse_throttle("")
    assert not Throttle().active


def test_whitespace_around_parts_is_ignored() -> None:
    assert parse_throttle(" 1 , 40:0.25 , 80:1 ").schedule == ((0, 1.0), (40, 0.25), (80, 1.0))


@pytest.mark.parametrize("text", ["0", "1.5", "-1", "-0.5", "2", "40:0", "1,40:1.01"])
def test_a_factor_outside_zero_to_one_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="greater than 0 and at most 1"):
        parse_throttle(text)


@pytest.mark.parametrize("text", ["abc", "1,x:0.5", "0.5,", "1;40:0.5", "40:", "1,40:0.5:2", "1.5:0.5"])
def test_a_malformed_part_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_throttle(text)
    msg = str(info.value)
    assert "is not FACTOR or STEP:FACTOR" in msg
    assert "0.25" in msg  # the example


@pytest.mark.parametrize("text", ["1,80:0.5,40:1", "1,40:0.5,40:1", "0.5,0:1"])
def test_steps_out_of_order_or_repeated_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="each step once, in order"):
        parse_throttle(text)


def test_a_negative_step_is_refused() -> None:
    with pytest.raises(ConfigError, match="non-negative"):
        parse_throttle("1,-5:0.5")


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        parse_throttle("abc")


@given(
    steps=st.lists(st.integers(1, 10_000), min_size=0, max_size=6, unique=True).map(sorted),
    factors=st.lists(st.floats(0.01, 1.0), min_size=7, max_size=7),
    probe=st.integers(0, 20_000),
)
def test_the_factor_is_the_last_one_whose_step_has_been_reached(
    steps: list[int], factors: list[float], probe: int
) -> None:
    text = ",".join([repr(factors[0])] + [f"{s}:{f!r}" for s, f in zip(steps, factors[1:], strict=False)])
    t = parse_throttle(text)
    reached = [f for s, f in t.schedule if s <= probe]
    assert t.factor(probe) == reached[-1]
    assert t.active == any(f < 1 for _, f in t.schedule)


# ---------------------------------------------------------------- stretch


def test_stretch_idles_as_long_as_the_slower_device_would_take() -> None:
    t = parse_throttle("0.5")
    touches: list[float] = []
    start = time.monotonic()
    idle = t.stretch(0.01, step=0, touch=lambda: touches.append(time.monotonic()))
    took = time.monotonic() - start
    assert idle == pytest.approx(0.01)  # 0.01 * (1/0.5 - 1)
    assert took >= 0.01 - 1e-3
    assert took < 0.01 + 0.2  # generous: the machine may be busy
    assert touches, "touch() keeps the node's lease alive while it idles"


def test_stretch_follows_the_schedule() -> None:
    t = parse_throttle("1,40:0.25")
    assert t.stretch(0.004, step=10) == 0.0  # full speed before step 40
    start = time.monotonic()
    idle = t.stretch(0.004, step=40)
    took = time.monotonic() - start
    assert idle == pytest.approx(0.012)  # 0.004 * (1/0.25 - 1)
    assert 0.012 - 1e-3 <= took < 0.012 + 0.2


def test_stretch_at_full_speed_returns_at_once_without_touching() -> None:
    touched = []
    start = time.monotonic()
    assert Throttle().stretch(5.0, step=3, touch=lambda: touched.append(1)) == 0.0
    assert time.monotonic() - start < 0.05
    assert touched == []


def test_stretch_touches_at_least_every_fifty_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a clock of its own: a busy machine oversleeps, which says nothing of the sleeps asked for.
    clock = SimpleNamespace(now=0.0, asked=[])

    def sleep(s: float) -> None:
        clock.asked.append(s)
        clock.now += s

    monkeypatch.setattr(throttle, "time", SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep))
    touches: list[float] = []
    idle = parse_throttle("0.5").stretch(0.12, step=0, touch=lambda: touches.append(clock.now))
    assert idle == pytest.approx(0.12) and clock.now == pytest.approx(0.12)
    assert clock.asked == pytest.approx([0.05, 0.05, 0.02]), "at most 50 ms between touches"
    assert touches == pytest.approx([0.05, 0.10, 0.12]), "a touch after every sleep"


def test_stretch_of_no_work_idles_not_at_all() -> None:
    assert parse_throttle("0.1").stretch(0.0, step=0) == 0.0
