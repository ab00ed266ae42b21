"""The noise a node reports with its speed: the standard error of its median step cost."""

from __future__ import annotations

import random
import statistics

import pytest

from unbroken.train.measure import RECENT_STEPS, relative_error


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
