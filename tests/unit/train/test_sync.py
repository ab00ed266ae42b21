"""plan_sync: after an epoch forms, who holds the state everyone must have; diverged: whether
the states compared there convict a replica that trained with the group."""

from __future__ import annotations

import pytest

from unbroken.train.sync import SyncPlan, diverged, plan_sync


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


def test_a_replica_that_trained_and_differs_at_the_top_step_is_named() -> None:
    reports = [(26, 1), (26, 1), (26, 9), (3, 4)]
    why = "digest at step 26 differs from the majority's (2 of 3 agree)"
    assert diverged(reports, [True, True, True, False]) == (2, why)
    assert diverged(reports, [True, True, False, False]) is None, "a state that never trained is just repaired"


def test_nobody_is_named_where_the_top_step_has_no_majority() -> None:
    verdict = diverged([(8, 1), (8, 2), (7, 5)], [True, False, True])
    assert verdict is not None and verdict[0] == -1 and "none a majority" in verdict[1]
    assert diverged([(8, 1), (8, 2)], [False, False]) is None


def test_states_that_agree_at_the_top_step_convict_nobody() -> None:
    assert diverged([(5, 4), (5, 4), (2, 7), (-1, 3)], [True] * 4) is None
    assert diverged([(0, 4)], [True]) is None
