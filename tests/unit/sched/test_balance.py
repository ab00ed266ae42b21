"""plan / rebalance / Profile.time_for: who trains, with which share, in which micro-batches."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.sched.balance import (
    REBALANCE_MARGIN,
    Plan,
    Preference,
    Profile,
    Role,
    _capacities,
    _capacity,
    plan,
    rebalance,
)
from unbroken.sched.shares import split_batch

T, V, S = Role.TRAINER, Role.VALIDATOR, Role.STANDBY


def node(name: str, per_sample_s: float = 0.01, **kw: object) -> Profile:
    return Profile(name, per_sample_s, **kw)  # type: ignore[arg-type]


def assert_consistent(p: Plan, batch_size: int, n: int) -> None:
    assert len(p.shares) == len(p.microbatches) == len(p.roles) == len(p.reasons) == n
    assert sum(p.shares) == batch_size
    for share, mb, role in zip(p.shares, p.microbatches, p.roles, strict=True):
        assert (role is Role.TRAINER) == (share > 0)
        assert 0 <= mb <= share
        assert (mb > 0) == (share > 0)
    # Validators: the nodes that asked for it (not checked here: `test_property_plan_is_consistent`)
    # or one.
    assert all(p.reasons), p.reasons
    assert p.trainers() == [i for i, r in enumerate(p.roles) if r is Role.TRAINER]


# ---------------------------------------------------------------- Profile.time_for


def test_time_for_zero_or_negative_share_is_zero() -> None:
    p = node("a", 0.01, overhead_s=1.0, max_microbatch=4)
    assert p.time_for(0) == 0.0
    assert p.time_for(-3) == 0.0


def test_time_for_without_cap_is_one_micro_batch() -> None:
    p = node("a", 0.01, overhead_s=0.5)
    assert p.time_for(1) == pytest.approx(0.5 + 0.01)
    assert p.time_for(100) == pytest.approx(0.5 + 1.0)


@pytest.mark.parametrize(
    ("share", "micro_batches"),
    [(1, 1), (3, 1), (4, 2), (6, 2), (7, 3), (10, 4)],
)
def test_time_for_with_cap_counts_overhead_per_micro_batch(share: int, micro_batches: int) -> None:
    p = node("a", 0.01, overhead_s=0.1, max_microbatch=3)
    assert p.time_for(share) == pytest.approx(0.1 * micro_batches + 0.01 * share)


def test_time_for_with_cap_and_no_overhead_is_linear() -> None:
    p = node("a", 0.02, max_microbatch=2)
    assert p.time_for(9) == pytest.approx(0.18)


def test_time_for_with_no_memory_does_not_divide_by_zero() -> None:
    # max_microbatch = -1 is treated like "no cap" by the model (the plan never gives it samples).
    assert node("a", 0.01, overhead_s=0.1, max_microbatch=-1).time_for(5) == pytest.approx(0.15)


# ---------------------------------------------------------------- shares


def test_equal_nodes_split_evenly_and_all_train() -> None:
    p = plan(12, [node("a"), node("b"), node("c")])
    assert p.shares == (4, 4, 4)
    assert p.microbatches == (4, 4, 4)
    assert p.roles == (T, T, T)
    assert p.trainers() == [0, 1, 2]
    assert p.step_s == pytest.approx(0.04)
    assert p.reasons[0] == "4 of 12 samples, predicted 40.0 ms"
    assert_consistent(p, 12, 3)


def test_an_unmeasured_newcomer_is_taken_for_the_median_node_fixed_cost_and_all() -> None:
    # Two measured nodes whose step is mostly a fixed 29 ms; a newcomer that reported nothing
    # (a hostile session, or a node whose calibration ran out of memory). Taken for free of the
    # fixed cost it looked ten times faster: the plan made it the only trainer.
    measured = [node("a", 0.00013, overhead_s=0.029), node("b", 0.00013, overhead_s=0.029)]
    p = plan(12, [*measured, node("new", 0.0, settled=False)])
    assert p.roles == (T, T, T) and p.shares == (4, 4, 4), p


def test_shares_are_proportional_to_throughput() -> None:
    # Throughputs 100, 50, 25 samples/s: shares 4:2:1 and equal predicted times.
    p = plan(70, [node("a", 0.01), node("b", 0.02), node("c", 0.04)])
    assert p.shares == (40, 20, 10)
    assert p.roles == (T, T, T)
    assert p.step_s == pytest.approx(0.4)
    assert_consistent(p, 70, 3)


def test_shares_sum_to_batch_when_division_is_inexact_ties_to_lower_rank() -> None:
    p = plan(10, [node("a"), node("b"), node("c")])
    assert p.shares == (4, 3, 3)
    assert p.step_s == pytest.approx(0.04)
    p = plan(11, [node("a"), node("b"), node("c")])
    assert p.shares == (4, 4, 3)


def test_rounding_is_largest_remainder() -> None:
    # Throughputs 1.4 and 1.6: exact shares of 3 are 1.4 and 1.6; the spare sample goes to b.
    p = plan(3, [node("a", 1 / 1.4), node("b", 1 / 1.6)])
    assert p.shares == (1, 2)
    assert p.roles == (T, T)


def test_plan_is_deterministic() -> None:
    profiles = [
        node("a", 0.013, overhead_s=0.002, max_microbatch=16),
        node("b", 0.007),
        node("c", 0.0),
        node("d", 0.031, evaluates=True),
        node("e", 0.011, preference=Preference.STANDBY),
    ]
    first = plan(97, profiles, spares_wanted=1)
    for _ in range(5):
        assert plan(97, list(profiles), spares_wanted=1) == first
    assert_consistent(first, 97, 5)


def test_single_node_takes_everything() -> None:
    p = plan(33, [node("a", 0.01, overhead_s=0.1)])
    assert p.shares == (33,)
    assert p.roles == (T,)
    assert p.step_s == pytest.approx(0.1 + 0.33)


def test_zero_members_is_refused() -> None:
    with pytest.raises(ValueError, match="zero members"):
        plan(8, [])


# ---------------------------------------------------------------- micro-batch caps


def test_cap_limits_micro_batches_not_shares() -> None:
    p = plan(20, [node("a", max_microbatch=4), node("b")])
    assert p.shares == (10, 10)
    assert p.microbatches == (4, 10)
    assert p.roles == (T, T)


def test_cap_larger_than_share_gives_share_as_micro_batch() -> None:
    p = plan(20, [node("a", max_microbatch=64), node("b", max_microbatch=3)])
    assert p.microbatches == (10, 3)


def test_step_time_counts_overhead_per_capped_micro_batch() -> None:
    p = plan(20, [node("a", overhead_s=0.01, max_microbatch=4), node("b", overhead_s=0.01)])
    assert p.shares == (10, 10)
    # a: 3 micro-batches (4 + 4 + 2) -> 0.03 + 0.10; b: one micro-batch -> 0.01 + 0.10.
    assert p.step_s == pytest.approx(0.13)
    assert p.reasons[0] == "10 of 20 samples, predicted 130.0 ms"
    assert p.reasons[1] == "10 of 20 samples, predicted 110.0 ms"


# ---------------------------------------------------------------- no memory, unmeasured


@pytest.mark.parametrize(("evaluates", "role"), [(True, V), (False, S)])
def test_node_without_memory_for_one_sample_gets_nothing(evaluates: bool, role: Role) -> None:
    p = plan(16, [node("a"), node("b", 0.001, max_microbatch=-1, evaluates=evaluates), node("c")])
    assert p.shares == (8, 0, 8)
    assert p.microbatches == (8, 0, 8)
    assert p.roles == (T, role, T)
    assert p.reasons[1] == "not even one sample fits in its memory"
    assert_consistent(p, 16, 3)


def test_node_without_memory_does_not_train_even_if_asked() -> None:
    p = plan(16, [node("a"), node("b", max_microbatch=-1, preference=Preference.TRAINER)])
    assert p.shares == (16, 0)
    assert p.roles == (T, S)
    assert p.reasons[1] == "not even one sample fits in its memory"


def test_unmeasured_node_is_treated_as_the_median_measured_node() -> None:
    # Measured: 10, 20, 40 ms/sample -> median 20 ms: d gets the same share as b.
    p = plan(225, [node("a", 0.01), node("b", 0.02), node("c", 0.04), node("d", 0.0)])
    assert p.shares == (100, 50, 25, 50)
    assert p.roles == (T, T, T, T)
    assert p.step_s == pytest.approx(1.0)


def test_unmeasured_node_among_equal_nodes_gets_an_equal_share() -> None:
    p = plan(30, [node("a", 0.0), node("b", 0.01), node("c", 0.01)])
    assert p.shares == (10, 10, 10)
    assert p.roles == (T, T, T)


def test_all_unmeasured_split_by_weight() -> None:
    p = plan(64, [node("a", 0.0, weight=1.0), node("b", 0.0, weight=3.0)])
    assert p.shares == (16, 48)
    assert p.roles == (T, T)


def test_unmeasured_node_weight_means_a_larger_share_as_when_none_is_measured() -> None:
    # --weight is "relative share of the global batch": with nothing measured a weight-2 node
    # gets twice the share of a weight-1 node (test above). Among measured weight-1 nodes,
    # an unmeasured weight-2 node should likewise be assumed to get twice their share, not half.
    p = plan(40, [node("a", 0.01), node("b", 0.01), node("c", 0.0, weight=2.0)])
    assert p.shares == (10, 10, 20)


# ---------------------------------------------------------------- speed: 100x faster / slower


def test_a_node_100x_faster_gets_almost_all_of_a_small_batch() -> None:
    p = plan(64, [node("a", 0.0001), node("b", 0.01), node("c", 0.01)])
    assert p.shares == (64, 0, 0)
    assert p.roles == (T, V, S), "one checks the trainer's work (it has memory for a sample)"
    assert p.step_s == pytest.approx(0.0064)
    # One sample takes b or c 10 ms, longer than a's whole step: they would only lengthen it.
    assert p.reasons[1] == p.reasons[2] == "predicted step 6.4 ms without it; one sample takes it 10.0 ms"
    assert_consistent(p, 64, 3)


def test_a_node_100x_faster_gets_its_proportion_of_a_large_batch() -> None:
    p = plan(10200, [node("a", 0.0001), node("b", 0.01), node("c", 0.01)])
    assert p.shares == (10000, 100, 100)
    assert p.roles == (T, T, T)
    assert p.step_s == pytest.approx(1.0)


@pytest.mark.parametrize(("evaluates", "role"), [(True, V), (False, V)])
def test_a_node_100x_slower_is_demoted(evaluates: bool, role: Role) -> None:
    # A validator whether or not the job can evaluate: it checks the trainers' work anyway.
    p = plan(64, [node("a", 0.01), node("b", 0.01), node("c", 1.0, evaluates=evaluates)])
    assert p.shares == (32, 32, 0)
    assert p.roles == (T, T, role)
    assert p.step_s == pytest.approx(0.32)
    # One sample takes it a second, three times the step of the others.
    assert p.reasons[2] == "predicted step 320.0 ms without it; one sample takes it 1000.0 ms"
    assert_consistent(p, 64, 3)


def test_fixed_costs_per_micro_batch_are_part_of_the_split() -> None:
    # c's capped micro-batches of one sample each cost 100 ms of overhead: it gets the two
    # samples it finishes within the others' step, not the third of B speed alone would give.
    slow = node("c", 0.01, overhead_s=0.1, max_microbatch=1, evaluates=True)
    p = plan(64, [node("a"), node("b"), slow])
    assert p.shares == (31, 31, 2)
    assert p.roles == (T, T, T)
    assert p.step_s == pytest.approx(0.31)


def test_a_node_whose_one_sample_outlasts_the_step_is_demoted_with_the_figures() -> None:
    slow = node("c", 0.01, overhead_s=0.5, evaluates=True)
    p = plan(64, [node("a"), node("b"), slow])
    assert p.shares == (32, 32, 0)
    assert p.roles == (T, T, V)
    assert p.reasons[2] == "predicted step 320.0 ms without it; one sample takes it 510.0 ms"


def test_only_one_validator() -> None:
    p = plan(
        64,
        [
            node("a", 0.01),
            node("b", 1.0, evaluates=True),
            node("c", 1.0, evaluates=True),
            node("d", 0.01, max_microbatch=-1, evaluates=True),
        ],
    )
    assert p.shares == (64, 0, 0, 0)
    assert p.roles == (T, V, S, S)
    assert_consistent(p, 64, 4)


def test_a_node_that_helps_by_one_sample_trains() -> None:
    # b finishes one sample (99 ms) within a's step of 100 samples (100 ms): it takes one.
    p = plan(101, [node("a", 0.001), node("b", 0.099)])
    assert p.shares == (100, 1)
    assert p.roles == (T, T)
    # At 101 ms its sample would end the step no sooner than a alone: it does not train.
    p = plan(101, [node("a", 0.001), node("b", 0.101)])
    assert p.shares == (101, 0)


# ---------------------------------------------------------------- balance=False


def test_unbalanced_splits_by_weight() -> None:
    p = plan(64, [node("a", 0.01, weight=1.0), node("b", 1.0, weight=3.0)], balance=False)
    assert p.shares == (16, 48)
    assert p.roles == (T, T)
    assert p.step_s == pytest.approx(48.0)


def test_unbalanced_never_demotes_for_speed() -> None:
    profiles = [node("a", 0.01), node("b", 0.01), node("c", 1.0, evaluates=True)]
    p = plan(64, profiles, balance=False)
    assert p.shares == (22, 21, 21)
    assert p.roles == (T, T, T)
    assert p.step_s == pytest.approx(21.0)
    overhead = [node("a"), node("b"), node("c", 0.01, overhead_s=0.1, max_microbatch=1)]
    assert plan(64, overhead, balance=False).roles == (T, T, T)


def test_unbalanced_still_respects_memory_and_preferences() -> None:
    p = plan(
        30,
        [
            node("a"),
            node("b", max_microbatch=-1),
            node("c", preference=Preference.VALIDATOR, evaluates=True),
            node("d", preference=Preference.STANDBY),
            node("e", weight=2.0),
        ],
        balance=False,
    )
    assert p.shares == (10, 0, 0, 0, 20)
    assert p.roles == (T, S, V, S, T)


# ---------------------------------------------------------------- preferences


def test_preferred_trainer_is_not_demoted_for_speed() -> None:
    slow = node("c", 1.0, preference=Preference.TRAINER)
    p = plan(64, [node("a"), node("b"), slow])
    assert p.roles == (T, T, T) and p.shares[2] == 1 and sum(p.shares) == 64


def test_preferred_trainer_keeps_training_when_its_share_would_round_to_zero() -> None:
    # Preference.TRAINER: "Always train (unless it cannot: no memory for one sample)".
    p = plan(64, [node("a", 0.01), node("b", 0.01), node("c", 1.0, preference=Preference.TRAINER)])
    assert p.roles[2] is Role.TRAINER
    assert p.shares[2] >= 1
    assert sum(p.shares) == 64


def test_preferred_validator_never_trains() -> None:
    p = plan(64, [node("a", 0.01), node("b", 0.0001, preference=Preference.VALIDATOR, evaluates=True)])
    assert p.shares == (64, 0)
    assert p.roles == (T, V)
    assert p.reasons[1] == "asked to validate (--role validator)"


def test_preferred_validator_gets_the_validator_role_before_a_hot_spare() -> None:
    p = plan(
        12,
        [
            node("a"),
            node("b", preference=Preference.STANDBY, evaluates=True),
            node("c", preference=Preference.VALIDATOR, evaluates=True),
        ],
    )
    assert p.shares == (12, 0, 0)
    assert p.roles == (T, S, V)


def test_hot_spares_stay_out_until_wanted() -> None:
    profiles = [node("a"), node("b", preference=Preference.STANDBY), node("c", preference=Preference.STANDBY)]
    p = plan(12, profiles)
    assert p.shares == (12, 0, 0)
    assert p.roles == (T, S, S)
    assert p.reasons[1] == p.reasons[2] == "hot spare (--role standby)"


@pytest.mark.parametrize(
    ("wanted", "shares", "roles"),
    [(1, (6, 6, 0), (T, T, S)), (2, (4, 4, 4), (T, T, T)), (5, (4, 4, 4), (T, T, T))],
)
def test_hot_spares_are_promoted_earliest_rank_first(
    wanted: int, shares: tuple[int, ...], roles: tuple[Role, ...]
) -> None:
    profiles = [node("a"), node("b", preference=Preference.STANDBY), node("c", preference=Preference.STANDBY)]
    p = plan(12, profiles, spares_wanted=wanted)
    assert p.shares == shares
    assert p.roles == roles
    assert p.reasons[1] == "hot spare promoted: a trainer failed or left"
    assert_consistent(p, 12, 3)


def test_spare_without_memory_is_not_promoted() -> None:
    profiles = [
        node("a"),
        node("b", preference=Preference.STANDBY, max_microbatch=-1),
        node("c", preference=Preference.STANDBY),
    ]
    p = plan(12, profiles, spares_wanted=1)
    assert p.shares == (6, 0, 6)
    assert p.roles == (T, S, T)


def test_promoted_spare_is_not_demoted_for_speed() -> None:
    spare = node("b", 0.01, overhead_s=0.1, max_microbatch=1, preference=Preference.STANDBY)
    p = plan(64, [node("a"), spare], spares_wanted=1)
    assert p.shares == (59, 5)
    assert p.roles == (T, T)


@pytest.mark.parametrize("preference", [Preference.VALIDATOR, Preference.STANDBY])
def test_one_node_trains_when_nobody_may(preference: Preference) -> None:
    # b is the fastest: it trains the whole batch although it asked not to.
    profiles = [node("a", 0.02, preference=preference), node("b", 0.01, preference=preference)]
    p = plan(10, profiles)
    assert p.shares == (0, 10)
    assert p.roles == (V if preference is Preference.VALIDATOR else S, T)
    assert p.reasons[1] == "the only node able to train"


def test_validators_are_those_asked_or_one_that_can_evaluate_or_check() -> None:
    asked = [node(x, 1.0, preference=Preference.VALIDATOR) for x in "bc"]
    p = plan(12, [node("a", 0.01), *asked, node("d", 1.0)])
    assert p.roles == (T, V, V, S), "every node that asked, and no other"
    p = plan(12, [node("a", 0.01), node("b", 1.0), node("c", 1.0, evaluates=True)])
    assert p.roles == (T, S, V), "one that evaluates before one that only checks"
    memoryless = node("b", 1.0, max_microbatch=-1, preference=Preference.VALIDATOR)
    p = plan(12, [node("a", 0.01), memoryless, node("c", 1.0, preference=Preference.STANDBY)])
    assert p.roles == (T, S, S), "nothing to check with, and a hot spare stands by"
    p = plan(12, [node("a", 0.01), node("b", 1.0, benched=True), node("c", 1.0, benched=True, evaluates=True)])
    assert p.roles == (T, S, S), "a benched node checks nobody's work"


def test_one_node_trains_when_only_validators_and_memoryless_nodes_remain() -> None:
    profiles = [node("a", 0.001, max_microbatch=-1), node("b", 0.05, preference=Preference.VALIDATOR)]
    p = plan(10, profiles)
    assert p.shares == (0, 10)
    assert p.roles[1] is Role.TRAINER


def test_one_node_trains_even_when_none_has_memory() -> None:
    p = plan(10, [node("a", 0.02, max_microbatch=-1), node("b", 0.01, max_microbatch=-1)])
    assert p.shares == (0, 10)
    assert p.roles == (S, T)
    assert p.reasons[1] == "the only node able to train"


# ---------------------------------------------------------------- rebalance


def test_rebalance_none_when_current_is_the_plan() -> None:
    profiles = [node("a"), node("b")]
    assert rebalance(64, [32, 32], profiles) is None
    uneven = [node("a", 0.01), node("b", 0.02), node("c", 0.04)]
    assert rebalance(70, list(plan(70, uneven).shares), uneven) is None


def test_rebalance_none_when_gain_is_below_margin() -> None:
    # b 5% slower: proportional [33, 31] (330 ms) is within the margin of [32, 32] (336 ms),
    # so the plan keeps the weights' split and nothing is rebalanced.
    profiles = [node("a", 0.01), node("b", 0.0105)]
    assert plan(64, profiles).shares == (32, 32)
    assert rebalance(64, [32, 32], profiles) is None
    # b 20% slower: [35, 29] predicts 350 ms vs 384 ms, a gain of 9% < REBALANCE_MARGIN.
    profiles = [node("a", 0.01), node("b", 0.012)]
    assert plan(64, profiles).shares == (32, 32)
    assert REBALANCE_MARGIN > 1 - 0.35 / 0.384
    assert rebalance(64, [32, 32], profiles) is None
    # From [40, 24] (400 ms) the plan's 384 ms is less than the margin better: no change.
    assert rebalance(64, [40, 24], profiles) is None
    assert plan(64, profiles).step_s == pytest.approx(0.384)


def test_rebalance_just_above_margin() -> None:
    # b 30% slower: [36, 28] predicts 364 ms vs 416 ms, a gain of 12.5%.
    out = rebalance(64, [32, 32], [node("a", 0.01), node("b", 0.013)])
    assert out is not None
    new, reason = out
    assert new.shares == (36, 28)
    assert new.step_s == pytest.approx(0.364)
    assert "416.0 ms -> 364.0 ms" in reason


def test_rebalance_after_a_node_slowed_4x() -> None:
    out = rebalance(64, [32, 32], [node("a", 0.01), node("b", 0.04)])
    assert out is not None
    new, reason = out
    assert new.shares == (52, 12)
    assert new.roles == (T, T)
    assert new.step_s == pytest.approx(0.52)
    assert reason == (
        "rebalance: predicted step 1280.0 ms -> 520.0 ms (b at 40.00 ms/sample held the step); "
        "shares [32, 32] -> [52, 12]"
    )


def test_rebalance_matches_plan() -> None:
    profiles = [node("a", 0.01), node("b", 0.04), node("c", 0.0), node("d", 0.02, max_microbatch=4, overhead_s=0.01)]
    out = rebalance(100, [25, 25, 25, 25], profiles)
    assert out is not None
    assert out[0] == plan(100, profiles)
    assert_consistent(out[0], 100, 4)


def test_rebalance_promotes_a_wanted_spare() -> None:
    profiles = [node("a"), node("b", preference=Preference.STANDBY)]
    assert rebalance(64, [64, 0], profiles) is None
    out = rebalance(64, [64, 0], profiles, spares_wanted=1)
    assert out is not None
    assert out[0].shares == (32, 32)
    assert "640.0 ms -> 320.0 ms" in out[1]


def test_rebalance_accepts_any_sequence_for_current() -> None:
    profiles = [node("a"), node("b")]
    assert rebalance(64, (32, 32), profiles) is None


# ---------------------------------------------------------------- properties

preferences = st.sampled_from(list(Preference))
profile_strategy = st.builds(
    Profile,
    name=st.sampled_from("abcdefgh"),
    per_sample_s=st.one_of(st.just(0.0), st.floats(min_value=1e-5, max_value=1.0)),
    overhead_s=st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=0.1)),
    max_microbatch=st.integers(min_value=-1, max_value=64),
    weight=st.floats(min_value=0.1, max_value=10.0),
    preference=preferences,
    evaluates=st.booleans(),
)


@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(min_value=1, max_value=2000),
    profiles=st.lists(profile_strategy, min_size=1, max_size=8),
    balance=st.booleans(),
    spares_wanted=st.integers(min_value=0, max_value=3),
)
def test_property_plan_is_consistent(batch: int, profiles: list[Profile], balance: bool, spares_wanted: int) -> None:
    p = plan(batch, profiles, balance=balance, spares_wanted=spares_wanted)
    assert_consistent(p, batch, len(profiles))
    assert p.trainers(), "someone always trains"
    assert p.step_s >= 0 and math.isfinite(p.step_s)
    assert plan(batch, profiles, balance=balance, spares_wanted=spares_wanted) == p

    spares = [i for i, q in enumerate(profiles) if q.preference is Preference.STANDBY and q.max_microbatch >= 0]
    promoted = set(spares[:spares_wanted])
    may = [
        i
        for i, q in enumerate(profiles)
        if q.max_microbatch >= 0 and (q.preference in (Preference.AUTO, Preference.TRAINER) or i in promoted)
    ]
    if may:
        assert set(p.trainers()) <= set(may)
    else:
        assert len(p.trainers()) == 1
    if any(q.max_microbatch >= 0 for q in profiles):
        assert all(profiles[i].max_microbatch >= 0 for i in p.trainers())
    validators = [i for i, r in enumerate(p.roles) if r is Role.VALIDATOR]
    assert len([i for i in validators if profiles[i].preference is not Preference.VALIDATOR]) <= 1
    assert not any(profiles[i].benched for i in validators)
    assert all(profiles[i].evaluates or profiles[i].max_microbatch >= 0 for i in validators)
    for i, q in enumerate(profiles):
        if q.max_microbatch > 0:
            assert p.microbatches[i] <= q.max_microbatch
    if all(q.per_sample_s > 0 for q in profiles):
        assert p.step_s == pytest.approx(max(q.time_for(s) for q, s in zip(profiles, p.shares, strict=True)))
        if balance:
            # The levelled split is at least as good as the proportional one; the weights'
            # split replaces it only within the margin.
            trainers = p.trainers()
            prop = [0] * len(profiles)
            weights = [1 / profiles[i].per_sample_s for i in trainers]
            for i, share in zip(trainers, split_batch(batch, weights), strict=True):
                prop[i] = share
            proportional = max(q.time_for(s) for q, s in zip(profiles, prop, strict=True))
            forced = any(q.preference is Preference.TRAINER or not q.settled for q in profiles)
            assert forced or p.step_s <= proportional * (1 + REBALANCE_MARGIN) + 1e-12


@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(min_value=1, max_value=2000),
    speeds=st.lists(st.floats(min_value=1e-4, max_value=1.0), min_size=1, max_size=6),
)
def test_property_unbalanced_plan_uses_every_auto_node(batch: int, speeds: list[float]) -> None:
    profiles = [node(str(i), s, weight=1.0) for i, s in enumerate(speeds)]
    p = plan(batch, profiles, balance=False)
    expected = [batch // len(speeds) + (i < batch % len(speeds)) for i in range(len(speeds))]
    assert list(p.shares) == expected
    assert_consistent(p, batch, len(speeds))


@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(min_value=1, max_value=2000),
    profiles=st.lists(profile_strategy, min_size=1, max_size=6),
)
def test_property_rebalance_of_the_plan_is_none(batch: int, profiles: list[Profile]) -> None:
    p = plan(batch, profiles)
    assert rebalance(batch, list(p.shares), profiles) is None
    out = rebalance(batch, [batch] + [0] * (len(profiles) - 1), profiles)
    if out is not None:
        assert out[0] == p
        assert out[1].startswith("rebalance: predicted step ")


def test_a_gain_small_against_the_whole_step_is_not_worth_a_new_plan() -> None:
    # b is 30% slower: 12.5% better compute alone, but the all-reduce (200 ms) dominates the step.
    profiles = [node("a", 0.01), node("b", 0.013)]
    assert rebalance(64, [32, 32], profiles) is not None
    assert rebalance(64, [32, 32], profiles, overhead_s=0.2) is None


@given(
    st.lists(st.tuples(st.floats(1e-5, 0.1), st.floats(0, 0.05), st.integers(0, 64)), min_size=1, max_size=30),
    st.floats(0, 5),
)
def test_capacities_at_once_equal_each_node_alone(nodes, t):
    profiles = [Profile(f"n{i}", c, o, mb) for i, (c, o, mb) in enumerate(nodes)]
    assert list(_capacities(profiles)(t)) == [_capacity(p, t) for p in profiles]


# ---------------------------------------------------------------- noise


def test_nodes_apart_by_less_than_their_noise_keep_equal_shares() -> None:
    # Measured 0.05 vs 0.065 ms/sample, each figure good to 10 %: a 30 % gap is noise.
    noisy = [node("a", 5e-5, noise=0.1), node("b", 6.5e-5, noise=0.1), node("c", 5e-5, noise=0.1)]
    assert plan(192, noisy).shares == (64, 64, 64)
    assert rebalance(192, [64, 64, 64], noisy) is None
    # The same figures known exactly are a real difference.
    exact = [node("a", 5e-5), node("b", 6.5e-5), node("c", 5e-5)]
    assert plan(192, exact).shares != (64, 64, 64)
    assert rebalance(192, [64, 64, 64], exact) is not None


def test_a_slowdown_well_beyond_the_noise_still_moves_shares() -> None:
    profiles = [node("a", 0.01, noise=0.05), node("b", 0.04, noise=0.05)]
    out = rebalance(64, [32, 32], profiles)
    assert out is not None and out[0].shares == (52, 12), out


def test_noise_never_demotes_a_node_it_could_explain() -> None:
    # A fixed cost per micro-batch measured 3x its peers' with a 50 % error: the levelled
    # split would drop it; the difference may be noise, so it keeps training.
    noisy = [
        node("a", 1e-4, overhead_s=0.002, noise=0.5),
        node("b", 1e-4, overhead_s=0.0007),
        node("c", 1e-4, overhead_s=0.0007),
    ]
    assert plan(6, noisy).roles == (T, T, T)
    exact = [node("a", 1e-4, overhead_s=0.002), node("b", 1e-4, overhead_s=0.0007), node("c", 1e-4, overhead_s=0.0007)]
    assert plan(6, exact).roles[0] is not T


def test_a_start_up_estimate_counts_only_when_far_apart() -> None:
    # A joiner that only calibrated: its probes put 5x less on each sample and more on each
    # micro-batch than its peers' steps do, but for a share it takes 0.8x their time.
    settled = [node("a", 3e-5, overhead_s=1e-3, noise=0.05), node("b", 3e-5, overhead_s=1e-3, noise=0.05)]
    joiner = node("j", 6e-6, overhead_s=1.8e-3, settled=False)
    assert plan(192, [*settled, joiner]).shares == (64, 64, 64)
    # A node much faster (a GPU joining CPUs) gets its share at once.
    gpu = node("j", 3e-7, overhead_s=1e-4, settled=False)
    assert plan(192, [*settled, gpu]).shares[2] > 150


def test_a_node_twice_as_slow_is_rebalanced_despite_some_noise() -> None:
    profiles = [node("a", 0.01, noise=0.07), node("b", 0.02, noise=0.07)]
    assert plan(64, profiles).shares == (43, 21)
    out = rebalance(64, [32, 32], profiles)
    assert out is not None and out[0].shares == (43, 21), out


def test_more_noise_never_moves_shares_to_a_slower_plan() -> None:
    # Levelled shares in force; the nodes' figures grow noisier: nothing moves, least of all
    # to equal shares the measured speeds say are slower.
    for noise in (0.0, 0.1, 0.3):
        profiles = [node("a", 0.01, noise=noise), node("b", 0.02, noise=noise)]
        assert rebalance(64, [43, 21], profiles) is None
