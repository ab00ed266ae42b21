"""The decision of an epoch whose members hold no state at the group's step: the newest
checkpoint a member read, above their best state and not above the group's step, or the
committed steps lost, named."""

from __future__ import annotations

import pytest

from unbroken.events import BACK_TO_CHECKPOINT
from unbroken.state.catchup import agreed, misreported, plan_catch_up


def test_a_checkpoint_newer_than_every_state_is_restored_by_those_that_read_it() -> None:
    got = plan_catch_up(steps=[8, 0, 8], lineages=[0, 0, 0], claims=[20, -1, 20], group_step=25)
    assert (got.live, got.checkpoint, got.readers, got.lost) == (8, 20, (0, 2), (21, 25))
    assert f"{BACK_TO_CHECKPOINT} 20" in got.reason and "steps 21..25 (5 committed, or more" in got.reason


def test_the_newest_claim_wins_whoever_claims_it() -> None:
    got = plan_catch_up(steps=[8, 3], lineages=[0, 0], claims=[10, 20], group_step=25)
    assert (got.checkpoint, got.readers) == (20, (1,))


def test_a_checkpoint_ahead_of_the_group_is_another_runs_and_passed_over() -> None:
    got = plan_catch_up(steps=[8, 3], lineages=[0, 0], claims=[30, 10], group_step=25)
    assert (got.checkpoint, got.readers, got.lost) == (10, (1,), (11, 25))
    none = plan_catch_up(steps=[8], lineages=[0], claims=[30], group_step=25)
    assert (none.checkpoint, none.lost) == (-1, (9, 25))


def test_with_no_newer_checkpoint_the_steps_lost_are_counted() -> None:
    # A claim at or below the best state would throw committed steps away.
    got = plan_catch_up(steps=[8, 12], lineages=[0, 0], claims=[5, 12], group_step=25)
    assert (got.live, got.checkpoint, got.readers, got.lost) == (12, -1, (), (13, 25))
    assert "steps 13..25 (13 committed, or more: as last reported) are lost" in got.reason
    assert "no member can read a newer checkpoint" in got.reason


def test_a_group_that_holds_its_step_goes_on_as_it_is() -> None:
    # The leader's view lags its members' reports: the exchange shows the step is held.
    got = plan_catch_up(steps=[25, 8], lineages=[0, 0], claims=[-1, 20], group_step=25)
    assert (got.checkpoint, got.lost, got.reason) == (-1, None, "")


def test_a_checkpoint_of_the_group_step_as_last_reported_says_what_may_be_lost_after_it() -> None:
    # The lone holder may have committed steps the leader had not heard of yet (CI: a
    # checkpoint of step 20 read as "nothing is lost" while steps 21..26 were gone).
    got = plan_catch_up(steps=[8], lineages=[0], claims=[25], group_step=25)
    assert (got.checkpoint, got.lost) == (25, None)
    assert "as last reported; steps 26.. committed since, if any, are lost" in got.reason


def test_a_state_of_a_history_the_group_left_is_not_the_best_state() -> None:
    # Step 30 is from before a fall-back (lineage 0): the newest history's best is step 8.
    got = plan_catch_up(steps=[30, 8], lineages=[0, 1], claims=[-1, 20], group_step=25)
    assert (got.live, got.checkpoint, got.readers) == (8, 20, (1,))


def test_one_report_per_rank() -> None:
    with pytest.raises(ValueError, match="one step, lineage and claim per rank"):
        plan_catch_up(steps=[8, 3], lineages=[0], claims=[10, 20], group_step=25)


def test_the_claimants_that_read_the_state_most_of_them_hold_restore_it() -> None:
    # Per-node checkpoint dirs: ranks 0 and 2 hold step 20 of different histories, rank 3
    # the same as rank 0; rank 1 claimed less.
    plan = plan_catch_up(steps=[8, 8, 8, 8], lineages=[0] * 4, claims=[20, 10, 20, 20], group_step=25)
    assert plan.readers == (0, 2, 3)
    assert agreed(plan, [7, -1, 9, 7]).readers == (0, 3)
    # One rank saying another state is outvoted, whatever its rank (it may lie).
    assert agreed(plan, [5, -1, 9, 9]).readers == (2, 3)
    # The first claimant's file did not read whole and the other two disagree: no state is
    # taken on one word against another's; they claim an older step.
    assert agreed(plan, [-1, -1, 9, 7]).readers == ()
    assert agreed(plan, [-1, -1, -1, 7]).readers == (3,), "a lone reader is taken as any donor is"
    assert agreed(plan, [-1, 5, -1, -1]).readers == (), "none read it: they claim again"


def test_reports_no_honest_member_makes_are_named_by_rank() -> None:
    assert misreported(40, [8, 3], [0, 1], [20, -1]) is None
    got = misreported(40, [8, 3], [0, 2**62], [20, -1])
    assert got == (1, f"rank 1 said its state's history is {2**62}, outside 0..{2**62 - 1}"), got
    assert (misreported(40, [8, 41], [0, 0]) or (-1,))[0] == 1
    assert (misreported(40, [-1, 3], [0, 0]) or (-1,))[0] == 0
    got = misreported(40, [8, 3], [0, 0], [20, 2**63 - 1])
    assert got is not None and got[0] == 1 and "claimed a checkpoint of step" in got[1]
