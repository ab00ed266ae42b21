"""The fall-back of a sharded zone that lost members: buddy, another zone, a checkpoint, or a halt."""

from __future__ import annotations

from unbroken.state.fallback import Source, choose
from unbroken.state.shards import layout_for

# a: [0, 250) buddy b; b: [250, 500) buddy c; c: [500, 750) buddy d; d: [750, 1000) buddy a
FOUR = layout_for(1000, {"a": 1, "b": 1, "c": 1, "d": 1})


def test_nothing_lost_needs_no_fallback() -> None:
    got = choose(FOUR, {"a", "b", "c", "d"}, 40, checkpoints=[30])
    assert got.source is None and got.reason == ""


def test_one_loss_is_served_by_the_buddy() -> None:
    got = choose(FOUR, {"a", "c", "d"}, 40, checkpoints=[30])
    assert got.source is Source.BUDDY and got.buddy == ((250, 500),) and got.checkpoint == -1
    assert "[250, 500)" in got.reason and "lost b" in got.reason and "buddy" in got.reason


def test_both_holders_lost_come_from_another_zone_that_holds_them() -> None:
    got = choose(FOUR, {"a", "d"}, 40, elsewhere=[(0, 600), (600, 1000)], checkpoints=[30])
    # b's range lost b and its buddy c; c's range has its buddy d.
    assert got.source is Source.OTHER_ZONE
    assert got.other_zone == ((250, 500),) and got.buddy == ((500, 750),) and got.lost == ()
    assert "another zone" in got.reason and "[500, 750)" in got.reason


def test_lost_in_every_zone_goes_back_to_the_newest_checkpoint_not_after_the_step() -> None:
    got = choose(FOUR, {"a", "d"}, 40, elsewhere=[(0, 300)], checkpoints=[10, 30, 50])
    assert got.source is Source.CHECKPOINT and got.checkpoint == 30
    assert got.other_zone == ((250, 300),) and got.lost == ((300, 500),)
    assert got.reason == "ranges [300, 500) lost in every zone at step 40: rolled back to checkpoint step 30"


def test_without_a_checkpoint_holding_them_the_job_stops_naming_the_ranges_and_the_fix() -> None:
    got = choose(FOUR, {"a", "d"}, 40, checkpoints=[50])
    assert got.source is Source.HALT and got.checkpoint == -1 and got.lost == ((250, 500),)
    assert "[250, 500)" in got.reason and "--checkpoint-dir" in got.reason and "unbroken restore" in got.reason


def test_a_zone_with_every_member_lost_loses_everything_not_held_elsewhere() -> None:
    got = choose(FOUR, set(), 7, checkpoints=[0])
    assert got.source is Source.CHECKPOINT and got.checkpoint == 0 and got.lost == ((0, 1000),)
