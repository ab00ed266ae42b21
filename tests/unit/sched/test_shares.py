"""split_batch: the global batch B split among trainers, exactly and deterministically."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from unbroken.sched.shares import offsets, split_batch


def test_equal_weights_split_evenly() -> None:
    assert split_batch(12, [1, 1, 1]) == [4, 4, 4]


def test_split_is_proportional_to_weights() -> None:
    assert split_batch(12, [1, 2, 3]) == [2, 4, 6]
    assert split_batch(100, [0.25, 0.75]) == [25, 75]


def test_shares_sum_to_batch_size_when_division_is_inexact() -> None:
    shares = split_batch(10, [1, 1, 1])
    assert sum(shares) == 10
    assert sorted(shares) == [3, 3, 4]


def test_rounding_ties_go_to_the_lower_index() -> None:
    # Every remainder is 1/3: the one spare sample goes to index 0, two spares to 0 and 1.
    assert split_batch(10, [1, 1, 1]) == [4, 3, 3]
    assert split_batch(11, [1, 1, 1]) == [4, 4, 3]
    assert split_batch(1, [5, 5, 5, 5]) == [1, 0, 0, 0]


def test_largest_remainder_wins_over_lower_index() -> None:
    # exact = [1.4, 1.6]: the spare sample goes to index 1, whose remainder is larger.
    assert split_batch(3, [1.4, 1.6]) == [1, 2]


def test_split_is_deterministic_across_calls() -> None:
    weights = [0.3, 1.7, 2.2, 0.9, 1.1]
    first = split_batch(97, weights)
    assert all(split_batch(97, list(weights)) == first for _ in range(5))


def test_zero_weight_gets_nothing() -> None:
    assert split_batch(10, [1, 0, 1]) == [5, 0, 5]
    assert split_batch(7, [0, 3]) == [0, 7]


def test_all_zero_weights_split_equally() -> None:
    assert split_batch(10, [0, 0]) == [5, 5]
    assert split_batch(9, [0, 0, 0]) == [3, 3, 3]


def test_a_node_100x_faster_gets_almost_everything_and_the_slow_one_is_not_starved() -> None:
    shares = split_batch(1010, [100, 1])
    assert shares == [1000, 10]
    slow = split_batch(50, [100, 1])
    assert sum(slow) == 50
    assert slow[0] == 50 and slow[1] == 0  # 50/101 rounds down to zero for the slow node


def test_zero_batch_gives_zero_shares() -> None:
    assert split_batch(0, [1, 2]) == [0, 0]


def test_negative_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        split_batch(10, [1, -1])


def test_empty_weight_list_is_refused() -> None:
    with pytest.raises(ValueError, match="zero trainers"):
        split_batch(10, [])


def test_negative_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        split_batch(-1, [1])


def test_offsets_are_running_sums() -> None:
    assert offsets([3, 0, 4, 2]) == [0, 3, 3, 7]
    assert offsets([]) == []


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(min_value=0, max_value=100_000),
    weights=st.lists(
        st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=32
    ),
)
@example(batch=10, weights=[0.0, 0.0])
@example(batch=7, weights=[1e-300, 1.0, 0.0])
def test_property_sum_is_exact_and_each_share_within_one_of_its_proportion(batch: int, weights: list[float]) -> None:
    shares = split_batch(batch, weights)
    assert len(shares) == len(weights)
    assert sum(shares) == batch
    assert all(s >= 0 for s in shares)
    total = sum(weights)
    exact = [batch * w / total for w in weights] if total > 0 else [batch / len(weights)] * len(weights)
    for share, want in zip(shares, exact, strict=True):
        assert abs(share - want) < 1 + 1e-6
    for share, w in zip(shares, weights, strict=True):
        if w == 0 and total > 0:
            assert share == 0
