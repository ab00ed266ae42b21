"""The decision of an epoch whose members hold no state at the group's step: the newest
checkpoint a member read, above their best state and not above the group's step, or the
committed steps lost, named."""

from __future__ import annotations

import pytest

from unbroken.events import BACK_TO_CHECKPOINT
from unbroken.state.catchup import plan_catch_up


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


def test_a_checkpoint_of_the_group_step_loses_nothing() -> None:
    got = plan_catch_up(steps=[8], lineages=[0], claims=[25], group_step=25)
    assert (got.checkpoint, got.lost) == (25, None)
    assert "nothing is lost" in got.reason


def test_a_state_of_a_history_the_group_left_is_not_the_best_state() -> None:
    # Step 30 is from before a fall-back (lineage 0): the newest history's best is step 8.
    got = plan_catch_up(steps=[30, 8], lineages=[0, 1], claims=[-1, 20], group_step=25)
    assert (got.live, got.checkpoint, got.readers) == (8, 20, (1,))


def test_one_report_per_rank() -> None:
    with pytest.raises(ValueError, match="one step, lineage and claim per rank"):
        plan_catch_up(steps=[8, 3], lineages=[0], claims=[10, 20], group_step=25)
