"""judge: which contribution of a step is refused, the same verdict on every member."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from unbroken.train.guard import OUTLIER_RATIO, judge


def test_healthy_contributions_pass() -> None:
    assert judge([1.0, 1.1, 0.9, 0.0], [10, 10, 10, 0], 30) is None


def test_a_non_finite_norm_is_refused_whoever_sent_it() -> None:
    assert judge([1.0, math.nan, 1.0], [10, 10, 10], 30) == (1, "its gradient is not finite (norm nan)")
    rank, why = judge([math.inf, 1.0], [15, 15], 30)  # type: ignore[misc]
    assert rank == 0 and "not finite" in why


def test_a_member_without_a_share_must_send_nothing() -> None:
    rank, why = judge([1.0, 1.0, 0.5], [15, 15, 0], 30)  # type: ignore[misc]
    assert rank == 2 and "without a share" in why


def test_an_outlier_is_judged_against_the_others_normalised_by_share() -> None:
    # rank 2 computes a third of the samples of the others: its smaller norm is no outlier.
    assert judge([1.0, 1.0, 0.34], [30, 30, 10], 70) is None
    rank, why = judge([1.0, 1.0, 1e6], [10, 10, 10], 30)  # type: ignore[misc]
    assert rank == 2 and "x the largest of the other trainers'" in why


def test_a_one_sample_share_late_in_training_is_no_outlier() -> None:
    # Near convergence 14 per-sample gradients nearly cancel (contributions of norm 0.002),
    # while one sample's gradient alone is 0.5: divided by the share it looks 117x larger
    # (refused by a per-sample rule), divided by sqrt(share) 31x (accepted).
    assert judge([0.002, 0.002, 0.5 / 30], [14, 15, 1], 30) is None


def test_outliers_need_enough_peers_to_judge() -> None:
    assert judge([1.0, 1e6], [15, 15], 30) is None  # two trainers: which one is wrong?


@given(st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=3, max_size=8))
def test_norms_within_the_ratio_are_never_refused(norms: list[float]) -> None:
    if max(norms) <= OUTLIER_RATIO * min(norms):
        assert judge(norms, [5] * len(norms), 5 * len(norms)) is None


def test_honest_slices_late_in_training_are_not_refused() -> None:
    # Four honest 8-sample slices of one late step (measured in a soak): most are fitted,
    # one holds a hard example. Its norm is 3000x the others' median, 18x their largest.
    assert judge([0.00015, 0.0249, 0.00012, 0.459], [8, 8, 8, 8], 32) is None
