"""The cost model a node reports (its calibration scaled by its steps) and the noise it
reports with it: the standard error of its median step."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import pytest

from unbroken.train.device import Calibration
from unbroken.train.measure import RECENT_STEPS, Meter, relative_error


def test_steady_steps_have_no_noise() -> None:
    assert relative_error([0.01] * RECENT_STEPS, 0.01) == 0.0


def test_too_few_steps_say_nothing() -> None:
    assert relative_error([0.01, 0.03], 0.02) == 0.0


def test_noise_is_the_standard_error_of_the_median() -> None:
    rng = random.Random(0)
    errors = []
    for _ in range(400):
        steps = [rng.gauss(1.0, 0.2) for _ in range(RECENT_STEPS)]
        errors.append(relative_error(steps, statistics.median(steps)))
    # sigma 0.2 per step: the median of 9 is good to about 1.2533 * 0.2 / 3 = 0.084.
    assert statistics.median(errors) == pytest.approx(0.084, rel=0.25)


def test_one_descheduled_step_hardly_moves_it() -> None:
    steps = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01, 5.0]
    assert relative_error(steps, statistics.median(steps)) < 0.02


def meter(cal: Calibration) -> Meter:
    m = Meter(job=Any, replica=Any, throttle=Any, name="n")  # type: ignore[arg-type]
    m.calibration = m.shape = cal
    return m


def test_a_calibration_slowed_at_start_up_is_scaled_by_the_steps_not_re_measured() -> None:
    # Measured while other processes started: everything took 1.8x. The steps (fixed cost
    # 0.2 s, 0.01 s a sample) put both parts right; the share it would take next is predicted.
    m = meter(Calibration(0.018, 0.36, 100, 7))
    for _ in range(5):
        m.observe(12, 1, 0.2 + 12 * 0.01)
    cal = m.calibration
    assert cal is not None and (cal.activation_bytes_per_sample, cal.activation_bytes_fixed) == (100, 7)
    assert cal.per_sample_s == pytest.approx(0.01) and cal.overhead_s == pytest.approx(0.2)
    assert cal.overhead_s * 2 + 30 * cal.per_sample_s == pytest.approx(0.4 + 30 * 0.01), "2 micro-batches of 15"


def test_a_lasting_slowdown_shows_within_five_steps_and_one_slow_step_does_not() -> None:
    m = meter(Calibration(0.01, 0.2, 100, 7))
    for _ in range(RECENT_STEPS):
        m.observe(12, 1, 0.32)
    m.observe(12, 1, 3.2)  # descheduled once
    assert m.calibration is not None and m.calibration.per_sample_s == pytest.approx(0.01)
    for _ in range(RECENT_STEPS):
        m.observe(12, 1, 0.32)
    for _ in range(4):
        m.observe(12, 1, 0.64)  # throttled to half speed
    assert m.calibration.per_sample_s == pytest.approx(0.01)
    m.observe(12, 1, 0.64)
    assert m.calibration.per_sample_s == pytest.approx(0.02) and m.calibration.overhead_s == pytest.approx(0.4)


def test_a_node_that_could_not_calibrate_takes_its_first_step_as_the_cost_per_sample() -> None:
    m = meter(Calibration(0.0, 0.0, 1, 0))  # out of memory before joining, or the user's own loop
    m.observe(10, 1, 0.5)
    m.observe(20, 1, 1.0)
    assert m.calibration is not None and m.calibration.per_sample_s == pytest.approx(0.05)
    assert m.calibration.overhead_s == 0.0 and m.noise == 0.0


def test_a_probe_is_the_new_shape_and_the_steps_before_it_are_dropped() -> None:
    m = meter(Calibration(0.01, 0.2, 100, 7))
    for _ in range(3):
        m.observe(12, 1, 0.64)
    m.probed(Calibration(0.005, 0.1, 100, 7))
    m.observe(12, 1, 0.16)
    assert m.calibration is not None and m.calibration.per_sample_s == pytest.approx(0.005)


def test_a_calibration_that_could_not_tell_its_costs_apart_takes_the_per_sample_cost_from_the_steps() -> None:
    # Small passes bound by the fixed cost (a GPU): the per-sample cost was only a floor.
    # The steps, 256 samples in one micro-batch, say the rest: 10 ms + 0.2 ms a sample.
    m = meter(Calibration(0.0000625, 0.009875, 100, 7, apart=False))
    for _ in range(5):
        m.observe(256, 1, 0.010 + 256 * 0.0002)
    cal = m.calibration
    assert cal is not None and cal.overhead_s == pytest.approx(0.009875)
    assert cal.per_sample_s == pytest.approx((0.0612 - 0.009875) / 256)
    # ...and a fixed cost above what whole steps take (measured while others started) is cut.
    slowed = meter(Calibration(0.001, 0.28, 100, 7, apart=False))
    for _ in range(5):
        slowed.observe(6, 1, 0.16)
    assert slowed.calibration is not None and slowed.calibration.overhead_s == pytest.approx(0.152)
    assert slowed.calibration.per_sample_s == pytest.approx(0.008 / 6)


def test_a_step_of_no_measurable_time_is_left_out() -> None:
    m = meter(Calibration(0.0, 0.0, 1, 0))
    m.observe(10, 1, 0.0)
    m.observe(10, 1, 0.5)
    assert m.calibration is not None and m.calibration.per_sample_s == pytest.approx(0.05)


def test_steps_far_from_a_calibration_ask_for_it_again_and_one_share_could_not_put_it_right() -> None:
    # Both of its k-sample passes slowed at start-up: all cost per sample, 100 times too much.
    # Its share of one sample is then what the fixed cost makes it, and the steps only scale
    # that: 64 samples are still predicted at 64 times one, never the truth.
    m = meter(Calibration(0.1, 0.0, 100, 7))
    truth = 0.002 + 0.00005  # a fixed 2 ms, 0.05 ms a sample
    start = 1000.0
    m._shaped_at = start
    for _ in range(RECENT_STEPS - 1):
        m.observe(1, 1, truth)
    assert not m.wants_probe(now=start + 60), "a window not full yet"
    m.observe(1, 1, truth)
    cal = m.calibration
    assert cal is not None and cal.overhead_s * 1 + 64 * cal.per_sample_s == pytest.approx(64 * truth)
    assert not m.wants_probe(now=start + 1), "measured again at most every few seconds"
    assert m.wants_probe(now=start + 60)
    assert not m.wants_probe(now=start + 15), "and less often each time (20 s now)"
    m.probed(Calibration(0.00005, 0.002, 100, 7))
    for _ in range(RECENT_STEPS):
        m.observe(1, 1, truth)
    assert not m.wants_probe(now=time.monotonic() + 60)
    # ...and a calibration off by less (everything 1.8x slower) is only scaled by the steps.
    even = meter(Calibration(0.018, 0.36, 100, 7))
    for _ in range(RECENT_STEPS):
        even.observe(12, 1, 0.2 + 12 * 0.01)
    assert not even.wants_probe(now=time.monotonic() + 60)
