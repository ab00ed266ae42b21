"""When a member asked to leave may go (`unbroken.train.leaving`): a pure decision."""

from __future__ import annotations

from unbroken.train.leaving import LONE_GRACE_S, Leaving, leave_now


def decide(members: int, committed_here: bool = False, waited_s: float = 0.0, **kw: bool) -> Leaving:
    args = {"requested": True, "announced": False} | kw
    return leave_now(members=members, committed_here=committed_here, waited_s=waited_s, step=32, **args).action


def test_a_lone_member_trains_on_for_a_joiner_to_take_its_state_then_goes() -> None:
    assert decide(1) is Leaving.STAY, "the only holder of the group's state must not go at once"
    assert decide(1, committed_here=True, waited_s=LONE_GRACE_S / 2) is Leaving.STAY
    d = leave_now(requested=True, announced=False, members=1, committed_here=True, waited_s=LONE_GRACE_S, step=32)
    assert d.action is Leaving.GO and "step 32" in d.reason and "alone" in d.reason


def test_with_others_it_announces_once_a_step_committed_with_them() -> None:
    assert decide(2) is Leaving.STAY, "a joiner may still be syncing from it"
    assert decide(2, committed_here=True) is Leaving.ANNOUNCE
    assert decide(2, waited_s=LONE_GRACE_S) is Leaving.ANNOUNCE, "bounded: the others sync from the epoch's holders"


def test_nothing_to_decide_unless_asked_and_not_yet_announced() -> None:
    assert decide(1, waited_s=1e9, requested=False) is Leaving.STAY
    assert decide(1, waited_s=1e9, announced=True) is Leaving.STAY
    assert decide(3, committed_here=True, announced=True) is Leaving.STAY
