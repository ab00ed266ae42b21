"""The leader's step after a sharded job went back to a checkpoint in process: it follows
once every member of the epoch said so, never on one member's word (promise 8)."""

from __future__ import annotations

from tests.unit.control.test_membership import JOIN_SETTLE_S, formed, keep_alive


def test_the_groups_step_goes_back_once_every_member_of_the_epoch_said_the_same_step() -> None:
    ms = formed(["a", "b", "c"])
    t = JOIN_SETTLE_S + 0.1
    keep_alive(ms, t, step=40)
    assert ms.step == 40
    assert ms.roster.went_back("a", 30), "the first to say it: the job's one event"
    assert not ms.roster.went_back("a", 30), "its word counts once"
    assert not ms.roster.went_back("b", 30)
    assert ms.step == 40, "two of three: the group's step stays"
    assert not ms.roster.went_back("outsider", 30)
    assert not ms.roster.went_back("c", 30)
    assert ms.step == 30 and {x.step for x in ms.members.values()} == {30}
    keep_alive(ms, t + 0.2, step=31)
    assert ms.step == 31, "and rises again with the steps trained anew"


def test_members_that_disagree_move_nothing() -> None:
    ms = formed(["a", "b"])
    keep_alive(ms, JOIN_SETTLE_S + 0.1, step=40)
    ms.roster.went_back("a", 30)
    ms.roster.went_back("b", 20)
    assert ms.step == 40 and {x.step for x in ms.members.values()} == {40}
