"""DataPlan: which samples each step consumes, whoever is up."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.sched.shares import offsets, split_batch
from unbroken.train.data import DataPlan


def test_slices_of_a_step_partition_the_step() -> None:
    plan = DataPlan(num_samples=100, batch_size=12, seed=3)
    whole = plan.indices(5, 0, 12)
    shares = split_batch(12, [1, 2, 0.5])
    parts = [plan.indices(5, off, n) for off, n in zip(offsets(shares), shares, strict=True)]
    assert [i for p in parts for i in p] == whole
    assert len(set(whole)) == 12


def test_any_split_of_a_step_gives_the_same_samples() -> None:
    plan = DataPlan(num_samples=50, batch_size=10, seed=0)
    whole = plan.indices(2, 0, 10)
    for weights in ([1], [1, 1], [3, 1, 1], [1, 0, 9], [1] * 10):
        shares = split_batch(10, weights)
        got = [i for off, n in zip(offsets(shares), shares, strict=True) for i in plan.indices(2, off, n)]
        assert got == whole


def test_step_s_takes_positions_s_times_b_to_s_plus_one_times_b_of_the_stream() -> None:
    plan = DataPlan(num_samples=40, batch_size=8, seed=1)
    stream = [i for s in range(20) for i in plan.indices(s, 0, 8)]
    for s in range(20):
        assert plan.indices(s, 2, 3) == stream[s * 8 + 2 : s * 8 + 5]


def test_every_sample_is_used_exactly_once_per_pass_including_straddling_steps() -> None:
    n, b = 23, 5  # 23 is not a multiple of 5, so most passes end inside a step
    plan = DataPlan(num_samples=n, batch_size=b, seed=9)
    stream = [i for s in range(n * 4) for i in plan.indices(s, 0, b)]  # exactly 4*5 = 20 passes
    assert len(stream) == 20 * n
    for p in range(20):
        assert sorted(stream[p * n : (p + 1) * n]) == list(range(n)), f"pass {p}"
    assert Counter(stream) == {i: 20 for i in range(n)}


def test_passes_are_different_permutations() -> None:
    plan = DataPlan(num_samples=30, batch_size=30, seed=4)
    assert plan.indices(0, 0, 30) != plan.indices(1, 0, 30)


def test_a_step_straddling_a_pass_boundary_reads_the_end_of_one_and_the_start_of_the_next() -> None:
    plan = DataPlan(num_samples=10, batch_size=4, seed=2)
    p0 = plan.indices(0, 0, 4) + plan.indices(1, 0, 4) + plan.indices(2, 0, 2)
    step2 = plan.indices(2, 0, 4)
    assert sorted(p0) == list(range(10))
    assert step2[:2] == p0[8:]
    p1_start = DataPlan(10, 10, 2).indices(1, 0, 2)  # the second pass, read by a plan with B = N
    assert step2[2:] == p1_start


def test_a_retried_step_takes_the_same_samples_even_after_other_passes_were_read() -> None:
    plan = DataPlan(num_samples=10, batch_size=4, seed=2)
    first = plan.indices(2, 1, 3)
    plan.indices(40, 0, 4)  # another pass in between
    assert plan.indices(2, 1, 3) == first


def test_plans_are_deterministic_across_instances() -> None:
    a = DataPlan(num_samples=64, batch_size=16, seed=11)
    b = DataPlan(num_samples=64, batch_size=16, seed=11)
    assert [a.indices(s, 0, 16) for s in (0, 3, 4, 17)] == [b.indices(s, 0, 16) for s in (0, 3, 4, 17)]


def test_different_seeds_give_different_orders() -> None:
    a = DataPlan(num_samples=64, batch_size=64, seed=0)
    b = DataPlan(num_samples=64, batch_size=64, seed=1)
    assert a.indices(0, 0, 64) != b.indices(0, 0, 64)
    assert sorted(a.indices(0, 0, 64)) == sorted(b.indices(0, 0, 64))


def test_empty_slice_is_empty() -> None:
    assert DataPlan(10, 4, 0).indices(3, 4, 0) == []


@pytest.mark.parametrize(("offset", "count"), [(-1, 2), (0, 5), (3, 2), (5, 0), (0, -1)])
def test_a_slice_outside_the_batch_is_refused(offset: int, count: int) -> None:
    with pytest.raises(ValueError, match="outside a batch of 4"):
        DataPlan(10, 4, 0).indices(0, offset, count)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=40),
    b=st.integers(min_value=1, max_value=40),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_property_each_pass_is_a_permutation(n: int, b: int, seed: int) -> None:
    plan = DataPlan(num_samples=n, batch_size=b, seed=seed)
    steps = n * 2  # 2*b passes, any n and b
    stream = [i for s in range(steps) for i in plan.indices(s, 0, b)]
    for p in range(len(stream) // n):
        assert sorted(stream[p * n : (p + 1) * n]) == list(range(n))
