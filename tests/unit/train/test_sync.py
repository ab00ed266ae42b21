"""plan_sync: after an epoch forms, who holds the state everyone must have; diverged: whether
the states compared there convict a replica; floored: who missed a verdict."""

from __future__ import annotations

import pytest

from unbroken.train.sync import Standing, SyncPlan, diverged, floored, plan_sync


def test_the_highest_step_wins_even_against_a_majority_behind() -> None:
    plan = plan_sync([(4, 1), (4, 1), (5, 2), (4, 1)])
    assert plan == SyncPlan(source=2, step=5, receivers=(0, 1, 3), digest=2, donors=(2,))


def test_the_majority_digest_wins_among_ranks_at_the_top_step() -> None:
    plan = plan_sync([(9, 66), (9, 20), (9, 20), (8, 3)])
    assert plan.source == 1
    assert plan.step == 9
    assert plan.receivers == (0, 3)
    assert plan.donors == (1, 2) and plan.digest == 20


def test_a_single_corrupted_replica_on_rank_zero_cannot_win() -> None:
    plan = plan_sync([(3, "corrupt"), (3, "ok"), (3, "ok")])
    assert plan.source == 1
    assert plan.receivers == (0,)


def test_a_tie_between_digests_goes_to_the_lowest_rank() -> None:
    assert plan_sync([(3, 2), (3, 1)]) == SyncPlan(source=0, step=3, receivers=(1,), digest=2, donors=(0,))
    assert plan_sync([(2, "z"), (3, "b"), (3, "a"), (3, "a"), (3, "b")]).source == 1


def test_receivers_are_those_behind_or_different() -> None:
    plan = plan_sync([(7, "d"), (6, "d"), (7, "e"), (7, "d"), (0, "init")])
    assert plan.source == 0
    assert plan.receivers == (1, 2, 4)


def test_nobody_receives_when_all_agree() -> None:
    assert plan_sync([(5, 4)] * 4) == SyncPlan(source=0, step=5, receivers=(), digest=4, donors=(0, 1, 2, 3))
    assert plan_sync([(0, 4)]) == SyncPlan(source=0, step=0, receivers=(), digest=4, donors=(0,))


def test_no_reports_is_an_error() -> None:
    with pytest.raises(ValueError, match="no reports"):
        plan_sync([])


def test_a_replica_that_differs_from_those_that_committed_the_same_step_in_the_same_epoch_is_named() -> None:
    reports = [(26, 1), (26, 1), (26, 9), (3, 4)]
    why = "state at step 26 as committed in epoch 4 differs from the others' (2 of 3 agree)"
    assert diverged(reports, [4, 4, 4, -1]) == (2, why)
    assert diverged(reports, [4, 4, -1, -1]) is None, "a state from elsewhere (a checkpoint) is just repaired"


def test_states_committed_in_different_epochs_or_taken_from_elsewhere_convict_nobody() -> None:
    # A committed step 31 in epoch 5 before it was expelled; b and c redid it without it.
    assert diverged([(31, 9), (31, 2), (31, 2)], [5, 7, 7]) is None
    # Two joiners restored from another run's checkpoint at the group's step do not outvote it.
    assert diverged([(30, 1), (30, 2), (30, 2)], [5, -1, -1]) is None


def test_nobody_is_named_where_the_members_of_one_epoch_have_no_majority() -> None:
    verdict = diverged([(8, 1), (8, 2), (7, 5)], [3, 3, 3])
    assert verdict is not None and verdict[0] == -1 and "none a majority" in verdict[1]


def test_a_replica_below_the_top_step_is_compared_with_those_at_its_step() -> None:
    # d and e were cut off one step before a, b and c committed step 26; e was corrupted.
    reports = [(26, 1), (26, 1), (26, 1), (25, 7), (25, 8), (25, 7)]
    verdict = diverged(reports, [4] * 6)
    assert verdict == (4, "state at step 25 as committed in epoch 4 differs from the others' (2 of 3 agree)")
    assert diverged([(26, 1), (26, 2), (26, 1), (25, 7), (25, 8)], [4] * 5) == (
        1, "state at step 26 as committed in epoch 4 differs from the others' (2 of 3 agree)",
    ), "the highest step is judged first"  # fmt: skip
    assert diverged([(26, 1), (26, 1), (25, 7)], [4] * 3) is None, "alone at its step: only repaired"


def test_states_that_agree_at_the_top_step_convict_nobody() -> None:
    assert diverged([(5, 4), (5, 4), (2, 7), (-1, 3)], [2] * 4) is None
    assert diverged([(0, 4)], [1]) is None
    assert diverged([(-1, 4), (-1, 5)], [3, 3]) is None, "states all set aside are not compared"


def test_a_member_that_missed_a_verdict_is_planned_as_behind_the_step_the_others_went_back_to() -> None:
    seen = Standing(floor=100, floor_epoch=5, synced_epoch=4)
    missed = Standing(committed_epoch=5, synced_epoch=4)
    steps = floored([100, 100, 150], [seen, seen, missed])
    assert steps == [100, 100, -1]
    assert plan_sync([(s, 7) for s in steps]).receivers == (2,)
    # A verdict of an audit during training: in the epoch whose sync phase they all completed.
    seen, missed = Standing(floor=100, floor_epoch=5, synced_epoch=5), Standing(committed_epoch=5, synced_epoch=5)
    assert floored([100, 200], [seen, missed]) == [100, -1]


def test_a_floor_counts_only_until_the_group_settled_and_only_where_it_is_held() -> None:
    old = Standing(floor=100, floor_epoch=5, synced_epoch=4)  # back after a long absence
    settled = Standing(committed_epoch=9, synced_epoch=9)
    assert floored([100, 5000, 5000], [old, settled, settled]) == [100, 5000, 5000]
    fresh = Standing(floor=100, floor_epoch=5, synced_epoch=4)
    assert floored([-1, 150], [fresh, Standing(synced_epoch=4)]) == [-1, 150], "nobody holds step 100"


def test_a_state_from_before_a_fall_back_to_a_checkpoint_is_never_the_source() -> None:
    from unbroken.state.sync import abandoned

    # x (rank 2) was expelled at step 130 before the group went back to 100; the group is at
    # 120 now, and at 130 later: x's step is higher, or equal, and its history an older one.
    for group_step in (120, 130):
        steps = abandoned([group_step, group_step, 130], [1, 1, 0])
        assert steps == [group_step, group_step, -1]
        plan = plan_sync([(s, d) for s, d in zip(steps, [7, 7, 9], strict=True)])
        assert (plan.source, plan.step, plan.receivers) == (0, group_step, (2,))
    assert abandoned([5, 6], [0, 0]) == [5, 6], "one history: the steps as they are"
