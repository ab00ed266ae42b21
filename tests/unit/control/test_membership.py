"""Membership: the coordinator's pure state machine, driven by an injected clock."""

from __future__ import annotations

import pytest

from unbroken.config import MembershipConfig
from unbroken.control.admissions import BASE_S, FREE_PER_KEY, FREE_PER_SOURCE
from unbroken.control.hearsay import LIMIT as HEARSAY_LIMIT
from unbroken.control.membership import (
    FAULT_GRACE_S,
    JOIN_SETTLE_S,
    OUTAGE_MARGIN_S,
    OUTAGE_TRUST_LEASES,
    PROBE_WAIT_S,
    Decision,
    Membership,
    StepQuorum,
    first_mismatch,
)
from unbroken.control.messages import EpochOrder, Hello, Resume, TensorSpec
from unbroken.control.roster import SETTLE_MEMBERS
from unbroken.events import Kind

BATCH = 12
LEASE = 1.0
FINGERPRINT = [
    TensorSpec(name="layer.weight", shape=[4, 3], dtype="float32"),
    TensorSpec(name="layer.bias", shape=[4], dtype="float32"),
]


def hello(member_id: str, **fields: object) -> Hello:
    values: dict[str, object] = {
        "job": "job",
        "job_identity": "ident-1",
        "fingerprint": FINGERPRINT,
        "member_id": member_id,
        "name": f"node-{member_id}",
        "batch_size": BATCH,
    }
    values.update(fields)
    return Hello(**values)  # type: ignore[arg-type]


def only_order(d: Decision) -> EpochOrder:
    """The single order all recipients of a decision got."""
    orders = {o.model_dump_json() for o in d.orders.values()}
    assert len(orders) == 1, d.orders
    return next(iter(d.orders.values()))


def admit_all(ms: Membership, ids: list[str], now: float, **fields: object) -> None:
    for mid in ids:
        d = ms.admit(hello(mid, **fields), now)
        assert d.refuse is None, d.refuse


def formed(ids: list[str], now: float = 0.0, **kwargs: object) -> Membership:
    """A membership whose first epoch holds ``ids`` (joined at ``now``, formed after settling)."""
    ms = Membership(MembershipConfig(lease_s=LEASE, **kwargs), now=now)  # type: ignore[arg-type]
    admit_all(ms, ids, now)
    order = only_order(ms.tick(now + JOIN_SETTLE_S))
    assert order.members == ids
    return ms


def keep_alive(ms: Membership, now: float, step: int = 0) -> None:
    """Every member heartbeats (at ``step``: 1 and more say the epoch in force committed)."""
    for mid in list(ms.members):
        ms.heartbeat(mid, step, now)


# ---------------------------------------------------------------- forming epochs


def test_joins_into_a_large_group_wait_for_each_other_in_proportion() -> None:
    """Past `SETTLE_MEMBERS` a join's epoch waits longer, so a fleet arriving forms epochs
    (each costing the leader its members) no more often than it can afford."""
    ms = Membership(MembershipConfig(lease_s=3600), now=0.0)
    n = 4 * SETTLE_MEMBERS
    for i in range(n):
        ms.admit(hello(f"m{i}"), 0.0)

    def order(d: Decision) -> EpochOrder:  # one order to all (`only_order` compares 20,000 encodings)
        (o,) = {id(o): o for o in d.orders.values()}.values()
        return o

    assert len(order(ms.tick(JOIN_SETTLE_S)).members) == n, "the first joiner's wait: a group of one"
    ms.admit(hello("late"), 10.0)
    assert not ms.tick(10.0 + JOIN_SETTLE_S * 3.9).orders, "still settling: four times as long at 20,000"
    assert order(ms.tick(10.0 + JOIN_SETTLE_S * 4.1)).members[-1] == "late"


def test_joins_within_the_settle_time_share_one_epoch() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    ms.admit(hello("a"), 0.0)
    ms.admit(hello("b", weight=2.0), JOIN_SETTLE_S * 0.8)
    assert ms.tick(JOIN_SETTLE_S * 0.9).orders == {}  # still settling
    d = ms.tick(JOIN_SETTLE_S)
    order = only_order(d)
    assert set(d.orders) == {"a", "b"}
    assert order.epoch == 1
    assert order.members == ["a", "b"]  # rank = join order
    assert order.shares == [4, 8]  # proportional to weight 1 : 2
    assert order.urgent is False
    assert ms.tick(JOIN_SETTLE_S * 3).orders == {}  # one change, not two


def test_a_join_after_the_first_epoch_makes_a_second_one_with_old_members_first() -> None:
    ms = formed(["a", "b"])
    ms.admit(hello("c"), 1.0)
    keep_alive(ms, 1.0, step=5)
    assert ms.tick(1.0).orders == {}
    keep_alive(ms, 1.0 + JOIN_SETTLE_S, step=5)
    d = ms.tick(1.0 + JOIN_SETTLE_S)
    order = only_order(d)
    assert set(d.orders) == {"a", "b", "c"}
    assert (order.epoch, order.members, order.shares, order.urgent) == (2, ["a", "b", "c"], [4, 4, 4], False)


def test_min_nodes_holds_the_first_epoch_until_enough_have_joined() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, min_nodes=3), now=0.0)
    admit_all(ms, ["a", "b"], 0.0)
    assert ms.tick(JOIN_SETTLE_S).orders == {}
    keep_alive(ms, 0.5)
    assert ms.tick(0.5).orders == {}
    ms.admit(hello("c"), 0.6)
    keep_alive(ms, 0.6)
    order = only_order(ms.tick(0.6 + JOIN_SETTLE_S))
    assert order.members == ["a", "b", "c"]
    assert order.epoch == 1


def test_a_cold_start_from_a_checkpoint_waits_for_min_nodes_and_numbers_above_its_epoch() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, min_nodes=2), now=0.0)
    ms.admit(hello("a", step=20, restored_epoch=9), 0.0)
    keep_alive(ms, JOIN_SETTLE_S)
    assert ms.tick(JOIN_SETTLE_S).orders == {}
    ms.admit(hello("b", step=20, restored_epoch=9), 0.5)
    keep_alive(ms, 0.5)
    order = only_order(ms.tick(0.5 + JOIN_SETTLE_S))
    assert order.members == ["a", "b"] and order.epoch == 10


def test_a_live_node_with_steps_behind_it_does_not_wait_for_min_nodes() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, min_nodes=2), now=0.0)
    ms.admit(hello("a", step=20), 0.0)
    keep_alive(ms, JOIN_SETTLE_S)
    assert only_order(ms.tick(JOIN_SETTLE_S)).members == ["a"]


def test_a_validator_that_joins_first_waits_for_a_node_that_may_train() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    assert ms.admit(hello("v", role="validator"), 0.0).refuse is None
    keep_alive(ms, 1.0)
    assert ms.tick(1.0).orders == {}, "a validator never trains, not even alone"
    admit_all(ms, ["t"], 1.0)
    keep_alive(ms, 1.0 + JOIN_SETTLE_S)
    order = only_order(ms.tick(1.0 + JOIN_SETTLE_S))
    assert sorted(order.members) == ["t", "v"]
    assert order.roles[order.members.index("v")] != "trainer"
    assert order.shares[order.members.index("v")] == 0


def test_min_nodes_does_not_hold_later_epochs() -> None:
    ms = formed(["a", "b", "c"], min_nodes=3)
    keep_alive(ms, 0.5)
    ms.fail("c", 0.5, "control connection dropped")
    order = only_order(ms.tick(0.5))
    assert order.members == ["a", "b"]


# ---------------------------------------------------------------- failures


def test_failure_orders_an_urgent_epoch_of_the_survivors_with_new_ranks_and_shares() -> None:
    ms = formed(["a", "b", "c"])
    keep_alive(ms, 0.5)
    d = ms.fail("a", 0.5, "control connection dropped")
    assert [e.kind for e in d.events] == ["failure"]
    assert "control connection dropped" in d.events[0].reason
    d = ms.tick(0.5)  # no settling for a failure
    order = d.orders["b"]
    assert d.orders["c"] == order
    assert order.urgent is True
    assert order.epoch == 2
    assert order.members == ["b", "c"]  # b is now rank 0
    assert sum(order.shares) == BATCH
    assert order.shares == [6, 6]
    assert "node-a failed" in order.reason
    assert ms.epoch_members == ["b", "c"]


def test_failure_of_a_member_not_in_the_epoch_orders_no_urgent_epoch() -> None:
    ms = formed(["a"])
    ms.admit(hello("b"), 0.5)
    ms.fail("b", 0.55, "control connection dropped")
    keep_alive(ms, 1.0, step=5)
    d = ms.tick(1.0)
    assert all(not o.urgent for o in d.orders.values())
    assert all(o.members == ["a"] for o in d.orders.values())


def test_failure_of_an_unknown_member_is_ignored() -> None:
    ms = formed(["a"])
    d = ms.fail("ghost", 0.5, "x")
    assert d.orders == {} and d.events == []
    keep_alive(ms, 0.5)
    assert ms.tick(0.5).orders == {}


def test_lease_expiry_expels_and_orders_an_urgent_epoch() -> None:
    ms = formed(["a", "b"])
    t = JOIN_SETTLE_S
    keep_alive(ms, t)
    ms.heartbeat("a", 3, t + 0.9)
    d = ms.tick(t + LEASE * 0.99)
    assert d.expel == {} and d.orders == {}  # b is late but within its lease
    assert ms.tick(t + LEASE + 0.05).expel == {}  # leases are checked a tenth of a lease apart
    d = ms.tick(t + LEASE * 1.1)
    assert set(d.expel) == {"b"}
    assert "no heartbeat" in d.expel["b"] and "lease" in d.expel["b"]
    order = d.orders["a"]
    assert order.urgent is True
    assert order.members == ["a"]
    assert order.shares == [BATCH]
    assert "b" not in ms.members
    assert ms.step == 3  # heartbeats carry progress


def test_a_graceful_leave_orders_a_non_urgent_epoch_that_the_leaver_also_hears() -> None:
    ms = formed(["a", "b", "c"])
    keep_alive(ms, 0.4, step=5)
    d = ms.leave("b", 0.5, "SIGTERM")
    order = only_order(d)  # at once, not at the next tick
    assert set(d.orders) == {"a", "b", "c"}  # the leaver learns it may go
    assert order.urgent is False
    assert order.members == ["a", "c"]
    assert sum(order.shares) == BATCH
    assert order.epoch == 2
    assert "b" not in ms.members
    assert [e.kind for e in d.events] == ["leave", "epoch"]
    # Its session closing afterwards is no failure and makes no further epoch.
    assert ms.session_closed("b", 0.6).orders == {}
    keep_alive(ms, 1.0)
    assert ms.tick(1.0).orders == {}


def test_leave_of_a_joining_member_makes_no_epoch_with_it() -> None:
    ms = formed(["a"])
    ms.admit(hello("b"), 0.5)
    assert ms.leave("b", 0.6, "changed my mind").orders == {}
    keep_alive(ms, 1.0)
    assert all("b" not in o.members for o in ms.tick(1.0).orders.values())


def test_an_epoch_ordered_before_the_one_in_force_committed_anything_is_urgent() -> None:
    # Some members may be in its first step while others still sync: the ones syncing would
    # leave for a graceful order while the others wait in that step for them.
    ms = formed(["a", "b"])
    ms.admit(hello("c"), 0.5)
    keep_alive(ms, 0.5)  # still at step 0: nothing committed
    order = only_order(ms.tick(0.5 + JOIN_SETTLE_S))
    assert order.members == ["a", "b", "c"] and order.urgent is True
    keep_alive(ms, 1.0, step=1)
    assert only_order(ms.leave("c", 1.0, "SIGTERM")).urgent is False, "the epoch in force committed a step"


def test_a_failure_still_pending_when_a_member_leaves_keeps_the_order_urgent() -> None:
    # b fails and, before the next tick, c leaves: the epoch formed at once for the leave
    # also replaces the failed member, so the survivors must abandon their step at once.
    ms = formed(["a", "b", "c"])
    keep_alive(ms, 0.5)
    ms.fail("b", 0.5, "lease expired")
    d = ms.leave("c", 0.5, "SIGTERM")
    order = d.orders["a"]
    assert order.members == ["a"]
    assert order.urgent is True


# ---------------------------------------------------------------- fault reports


def test_a_fault_about_a_stale_epoch_is_ignored() -> None:
    ms = formed(["a", "b"])
    keep_alive(ms, 0.5)
    d = ms.fault("a", 0, "old collective failed", 0.5)
    assert d.events == [] and d.orders == {}
    keep_alive(ms, 2.0)
    assert ms.tick(2.0).orders == {}
    assert ms.epoch == 1


def test_a_fault_about_the_current_epoch_reforms_it_after_the_grace_time() -> None:
    ms = formed(["a", "b"])
    t = 0.5
    keep_alive(ms, t)
    d = ms.fault("a", 1, "allreduce: connection reset", t)
    assert [e.kind for e in d.events] == ["fault"]
    assert ms.tick(t + FAULT_GRACE_S / 2).orders == {}  # waiting for b's session to drop
    order = only_order(ms.tick(t + FAULT_GRACE_S))
    assert order.urgent is True
    assert order.epoch == 2
    assert order.members == ["a", "b"]
    assert "connection reset" in order.reason


def test_a_member_most_others_cannot_reach_is_benched_out_of_the_epochs() -> None:
    ms = formed(["a", "b", "c", "d"])
    t = 0.5
    keep_alive(ms, t)
    d = ms.fault("a", 1, "cannot connect to 10.0.0.4:5000", t, culprit="d", kind=Kind.UNREACHABLE)
    assert [e.kind for e in d.events] == ["fault"]
    assert ms.tick(t + PROBE_WAIT_S / 2).orders == {}, "the others are trying d's address meanwhile"
    d = ms.fault("c", 1, "cannot connect to 10.0.0.4:5000", t + 1, culprit="d", kind=Kind.UNREACHABLE)
    assert [e.kind for e in d.events] == ["unreachable"]
    assert "10.0.0.4:5000" in d.events[0].reason
    order = only_order(ms.tick(t + 1))
    assert order.members == ["a", "b", "c"] and order.urgent


def test_one_members_word_benches_nobody_and_the_epoch_forms_again_with_everyone() -> None:
    ms = formed(["a", "b", "c"])
    t = 0.5
    keep_alive(ms, t)
    d = ms.fault("a", 1, "cannot connect to c", t, culprit="c", kind=Kind.UNREACHABLE)
    assert ms.fault("a", 1, "cannot connect to c", t, culprit="c", kind=Kind.UNREACHABLE).events == []
    keep_alive(ms, t + PROBE_WAIT_S - 0.01)
    assert ms.tick(t + PROBE_WAIT_S - 0.01).orders == {}
    order = only_order(ms.tick(t + PROBE_WAIT_S))
    assert order.members == ["a", "b", "c"]
    assert [e.kind for e in d.events] == ["fault"]


def test_in_an_epoch_of_two_one_word_against_another_benches_nobody() -> None:
    ms = formed(["a", "b"])
    t = 0.5
    keep_alive(ms, t)
    ms.fault("a", 1, "cannot connect to b", t, culprit="b", kind=Kind.UNREACHABLE)
    d = ms.fault("b", 1, "cannot connect to a", t, culprit="a", kind=Kind.UNREACHABLE)
    assert "unreachable" not in [e.kind for e in d.events]
    keep_alive(ms, t + PROBE_WAIT_S)
    assert only_order(ms.tick(t + PROBE_WAIT_S)).members == ["a", "b"]


def test_a_receiver_most_of_its_donors_refused_is_kept_out_and_one_donor_alone_keeps_nobody_out() -> None:
    ms = formed(["a", "b", "c", "j"])
    t = 0.5
    keep_alive(ms, t)
    why = "rank 3 asked for 1,099,511,627,776 chunks of a state of 12"
    d = ms.fault("a", 1, why, t, culprit="j", kind=Kind.BAD_REQUEST)
    assert [e.kind for e in d.events] == ["fault"] and "kept out only when most" in d.events[0].reason
    d = ms.fault("b", 1, why, t, culprit="j", kind=Kind.BAD_REQUEST)
    assert [e.kind for e in d.events] == ["bad-request"] and d.events[0].reason.startswith("node-j (offence 1): rank 3")
    keep_alive(ms, t + 0.1)
    order = only_order(ms.tick(t + 0.1))
    assert order.members == ["a", "b", "c"] and ms.members["j"].excluded_until > t + 1
    # One donor of many says so: no verdict, and the epoch forms again with everyone; the same
    # one naming it again in the next epoch keeps nobody out either (it may be the liar).
    ms = formed(["a", "b", "c", "j"])
    keep_alive(ms, t)
    ms.fault("a", 1, why, t, culprit="j", kind=Kind.BAD_REQUEST)
    ms.fault("j", 1, "names itself", t, culprit="j", kind=Kind.BAD_REQUEST)
    keep_alive(ms, t + 5)
    assert only_order(ms.tick(t + 5)).members == ["a", "b", "c", "j"]
    d = ms.fault("a", 2, why, t + 5.1, culprit="j", kind=Kind.BAD_REQUEST)
    assert "bad-request" not in [e.kind for e in d.events]


def test_an_unreachable_report_cannot_narrow_its_witnesses_to_a_zone() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    zones = {"a": "z1", "b": "z1", "f": "z1", "g": "z1", "c": "z2", "d": "z2", "e": "z2"}
    for mid, zone in zones.items():
        assert ms.admit(hello(mid, zone=zone), 0.0).refuse is None
    ms.tick(JOIN_SETTLE_S)
    t = 0.5
    keep_alive(ms, t)
    for accuser in ("a", "f"):  # two of b's zone: most of it, far from most of the epoch
        d = ms.fault(accuser, 1, "cannot connect to b", t, culprit="b", kind=Kind.UNREACHABLE, zone_only=True)
        assert "unreachable" not in [e.kind for e in d.events]


def test_reports_about_the_epoch_before_still_bench_a_member_still_in_the_epochs() -> None:
    """The first report re-forms the epoch (here a join re-formed it first): the others'
    answers about the epoch before still count."""
    ms = formed(["a", "b", "c", "walled"])
    t = 0.5
    keep_alive(ms, t)
    ms.fault("a", 1, "cannot connect to walled", t, culprit="walled", kind=Kind.UNREACHABLE)
    ms.admit(hello("late"), t)
    keep_alive(ms, t + 0.3)
    assert only_order(ms.tick(t + 0.3)).epoch == 2
    d = ms.fault("b", 1, "cannot connect to walled", t + 0.5, culprit="walled", kind=Kind.UNREACHABLE)
    assert [e.kind for e in d.events] == ["unreachable"]
    assert "walled" not in only_order(ms.tick(t + 0.5)).members


def test_a_member_that_reaches_none_of_its_peers_names_itself() -> None:
    ms = formed(["a", "b", "c"])
    t = 0.5
    keep_alive(ms, t)
    d = ms.fault("c", 1, "reaches 0 of its 2 peers' data-plane addresses", t, culprit="c", kind=Kind.UNREACHABLE)
    assert [e.kind for e in d.events] == ["unreachable"]
    assert only_order(ms.tick(t)).members == ["a", "b"]


def test_a_member_whose_reported_failures_nothing_bears_out_is_kept_out() -> None:
    """Each report re-forms the epoch at once; the third that no failure, leave or other
    member's report bore out keeps its reporter out of the epochs."""
    ms = formed(["a", "b", "liar"])
    t = 0.5
    for _ in range(HEARSAY_LIMIT):
        keep_alive(ms, t)
        ms.fault("liar", ms.epoch, "allreduce: connection reset", t)
        assert not ms.fault("liar", ms.epoch, "again", t).orders, "held while the first waits"
        keep_alive(ms, t + FAULT_GRACE_S)
        assert only_order(ms.tick(t + FAULT_GRACE_S)).members == ["a", "b", "liar"]
        t += 2.5
    keep_alive(ms, t)
    d = ms.tick(t)
    assert [e.kind for e in d.events] == ["unfounded", "epoch"], d.events
    assert only_order(d).members == ["a", "b"]
    keep_alive(ms, t + 1)
    ms.fault("liar", ms.epoch, "allreduce: connection reset", t + 1)
    keep_alive(ms, t + 2)
    assert ms.tick(t + 2).orders == {}, "kept out: its word re-forms nothing, not even with a guessed epoch"


def test_lone_accusations_of_a_culprit_are_hearsay_too() -> None:
    """Every member judges the same gathered data: a member that alone, again and again,
    names a culprit (or a sum that did not add up) is not believed, and is kept out."""
    ms = formed(["a", "b", "liar"])
    t = 0.5
    keep_alive(ms, t)
    ms.fault("liar", 1, "refused the contribution of rank 0", t, culprit="a", kind=Kind.BAD_GRADIENT)
    keep_alive(ms, t + FAULT_GRACE_S)
    assert only_order(ms.tick(t + FAULT_GRACE_S)).epoch == 2, "the first re-forms the epoch at once"
    d = ms.fault("liar", 2, "the step's sum did not add up", t + 0.5, kind=Kind.SUSPECT)
    assert "held" in d.events[0].reason
    keep_alive(ms, t + 1)
    assert ms.tick(t + 1).orders == {}
    keep_alive(ms, t + 3)
    d = ms.tick(t + 3)
    assert [e.kind for e in d.events] == ["unfounded", "epoch"], d.events


def test_a_reported_failure_that_a_session_drop_bears_out_does_not_count() -> None:
    ms = formed(["a", "b", "c"])
    t = 0.5
    for _ in range(HEARSAY_LIMIT):
        keep_alive(ms, t)
        ms.fault("a", ms.epoch, "allreduce: connection reset", t)
        t += 2.5
    keep_alive(ms, t)
    ms.session_closed("c", t - 2.4)  # c's crash: a's last report was true
    keep_alive(ms, t)
    assert "unfounded" not in [e.kind for e in ms.tick(t).events]


def test_a_fault_then_the_session_drop_make_one_epoch_change() -> None:
    ms = formed(["a", "b", "c"])
    t = 0.5
    keep_alive(ms, t)
    ms.fault("a", 1, "peer gone", t)
    ms.fault("c", 1, "peer gone", t + 0.01)
    ms.fail("b", t + 0.02, "control connection dropped")
    order = only_order(ms.tick(t + 0.02))
    assert order.members == ["a", "c"]
    assert order.epoch == 2
    keep_alive(ms, t + 1)
    assert ms.tick(t + 1).orders == {}
    assert ms.epoch == 2


def test_a_fault_from_an_unknown_member_is_ignored() -> None:
    ms = formed(["a"])
    assert ms.fault("ghost", 1, "x", 0.5).events == []
    keep_alive(ms, 1.0)
    assert ms.tick(1.0).orders == {}


# ---------------------------------------------------------------- refusals


def test_a_node_of_another_job_is_refused() -> None:
    ms = formed(["a"])
    d = ms.admit(hello("b", job="other"), 0.5)
    assert d.refuse is not None
    assert "'job'" in d.refuse and "'other'" in d.refuse
    assert "b" not in ms.members


def test_a_node_with_other_job_settings_is_refused() -> None:
    ms = formed(["a"])
    d = ms.admit(hello("b", job_identity="ident-2"), 0.5)
    assert d.refuse is not None
    assert "ident-1" in d.refuse and "ident-2" in d.refuse
    assert "b" not in ms.members


@pytest.mark.parametrize(
    ("theirs", "words"),
    [
        (
            [TensorSpec(name="layer.w", shape=[4, 3], dtype="float32"), FINGERPRINT[1]],
            ["parameter #0", "'layer.w'", "'layer.weight'"],
        ),
        (
            [TensorSpec(name="layer.weight", shape=[4, 5], dtype="float32"), FINGERPRINT[1]],
            ["'layer.weight'", "(4, 5)", "(4, 3)"],
        ),
        (
            [FINGERPRINT[0], TensorSpec(name="layer.bias", shape=[4], dtype="float16")],
            ["'layer.bias'", "float16", "float32"],
        ),
        ([FINGERPRINT[0]], ["'layer.bias'", "missing"]),
        ([*FINGERPRINT, TensorSpec(name="extra.scale", shape=[1], dtype="float32")], ["'extra.scale'", "not in"]),
    ],
    ids=["name", "shape", "dtype", "missing", "extra"],
)
def test_a_node_with_another_model_is_refused_naming_the_first_difference(
    theirs: list[TensorSpec], words: list[str]
) -> None:
    ms = formed(["a"])
    d = ms.admit(hello("b", fingerprint=theirs), 0.5)
    assert d.refuse is not None
    assert d.refuse.startswith("model does not match")
    for w in words:
        assert w in d.refuse
    assert "b" not in ms.members
    assert first_mismatch(FINGERPRINT, theirs) is not None


def test_first_mismatch_of_equal_fingerprints_is_none() -> None:
    assert first_mismatch(FINGERPRINT, list(FINGERPRINT)) is None
    assert first_mismatch([], []) is None


def test_first_mismatch_reports_the_first_of_several_differences() -> None:
    ours = [TensorSpec(name=n, shape=[2], dtype="float32") for n in "abc"]
    theirs = [ours[0], TensorSpec(name="b", shape=[3], dtype="float32"), TensorSpec(name="z", shape=[2], dtype="int8")]
    diff = first_mismatch(ours, theirs)
    assert diff == "'b' has shape (3,) here but (2,) in the group"


def test_first_mismatch_says_which_side_lacks_a_tensor() -> None:
    assert first_mismatch(FINGERPRINT[:1], FINGERPRINT) == "'layer.bias' is not in the group's model"
    assert first_mismatch(FINGERPRINT, FINGERPRINT[:1]) == "'layer.bias' is missing from this node's model"
    assert first_mismatch(FINGERPRINT, []) == "'layer.weight' is missing from this node's model"


def test_a_node_returning_from_a_superseded_epoch_is_refused() -> None:
    # b froze in epoch 1; the group went on to epoch 2 without it. It must not resume there.
    ms = formed(["a", "b"])
    keep_alive(ms, 0.5)
    ms.fail("b", 0.5, "lease expired")
    assert only_order(ms.tick(0.5)).epoch == 2
    d = ms.admit(hello("b", resume=Resume(epoch=1, members=["a", "b"], step=5), last_epoch=1), 0.7)
    assert d.refuse is not None
    assert "epoch 1 is over" in d.refuse and "epoch 2" in d.refuse
    assert "b" not in ms.members
    # Without the stale resume it comes back as a new member.
    assert ms.admit(hello("b", last_epoch=1), 0.8).refuse is None


def test_a_node_resuming_the_current_epoch_of_a_running_coordinator_is_admitted() -> None:
    # b's session dropped and it reconnected before the next epoch was formed.
    ms = formed(["a", "b"])
    keep_alive(ms, 0.5)
    ms.fail("b", 0.5, "control connection dropped")
    d = ms.admit(hello("b", resume=Resume(epoch=1, members=["a", "b"], step=5), last_epoch=1), 0.5)
    assert d.refuse is None
    assert "b" in ms.members


def test_a_duplicate_member_id_is_refused_and_the_first_keeps_its_place() -> None:
    ms = formed(["a"])
    d = ms.admit(hello("a", name="impostor"), 0.5)
    assert d.refuse is not None and "'a'" in d.refuse and "already connected" in d.refuse
    assert ms.members["a"].name == "node-a"


def test_a_node_joining_a_finished_job_is_refused() -> None:
    ms = formed(["a"])
    ms.done("a", 40, "digest", {"val_loss": 1.0}, 1.0)
    assert ms.finished
    d = ms.admit(hello("b"), 1.1)
    assert d.refuse is not None and "finished" in d.refuse and "40" in d.refuse


def test_a_refused_node_leaves_the_group_untouched() -> None:
    ms = formed(["a"])
    ms.admit(hello("b", job="other"), 0.5)
    keep_alive(ms, 1.0)
    assert ms.tick(1.0).orders == {}
    assert ms.epoch == 1 and ms.epoch_members == ["a"]


def test_finished_members_outlive_their_lease_and_their_session() -> None:
    ms = formed(["a", "b"])
    ms.done("a", 40, "d1", {}, 0.5)
    ms.done("b", 40, "d1", {}, 0.5)
    d = ms.tick(10.0)
    assert d.expel == {} and d.orders == {}
    assert ms.session_closed("a", 10.0).orders == {}
    assert ms.final_digests == {"a": "d1", "b": "d1"}


def test_one_members_done_finishes_nothing() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    for mid in ("a", "b", "c"):
        ms.admit(hello(mid, steps=40), 0.0)
    ms.tick(JOIN_SETTLE_S)
    ms.done("liar", 40, "forged", {}, 0.5)  # not a member
    ms.done("c", 0, "forged", {}, 0.5)  # step 0 of a 40-step job
    assert not ms.finished
    ms.done("c", 40, "forged", {"val_loss": 9.9}, 0.6)  # the right step, a state nobody else has
    ms.done("a", 40, "true", {"val_loss": 1.0}, 0.7)
    assert not ms.finished, "one honest member and one liar: no majority yet"
    ms.done("b", 40, "true", {}, 0.8)
    assert ms.finished and ms.final_digest == "true" and ms.final_metrics == {"val_loss": 1.0}
    assert ms.beyond(40) is None and "past the job's last step 40" in (ms.beyond(2**53) or "")


def test_done_from_members_outside_the_epoch_finishes_nothing() -> None:
    # One token holder, two sessions, the same made-up digest at the last step: two of them
    # are a majority of three trainers only if they are counted; they are not trainers.
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    for mid in ("a", "b", "c"):
        ms.admit(hello(mid, steps=40), 0.0)
    ms.tick(JOIN_SETTLE_S)
    for mid in ("x", "y"):
        assert ms.admit(hello(mid, steps=40), 0.5).refuse is None
        ms.done(mid, 40, "forged", {}, 0.6)
    assert not ms.finished
    ms.done("a", 40, "true", {}, 0.7)
    ms.session_closed("a", 0.7)  # a finisher's session ends: it still counts, once
    ms.done("a", 40, "true", {}, 0.7)
    assert not ms.finished
    ms.done("b", 40, "true", {}, 0.8)
    assert ms.finished and ms.final_digest == "true"


def test_the_only_trainer_of_an_epoch_cannot_end_the_job_alone() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    for mid in ("a", "b", "c"):
        ms.admit(hello(mid, steps=40, role="validator" if mid != "a" else "auto"), 0.0)
    ms.tick(JOIN_SETTLE_S)
    assert ms.plan is not None and [r.value for r in ms.plan.roles] == ["trainer", "validator", "validator"]
    ms.done("a", 40, "forged", {}, 0.5)
    assert not ms.finished, "the validators applied every step too: they vote"
    ms.done("b", 40, "forged", {}, 0.6)
    assert ms.finished


def test_a_member_that_says_done_and_leaves_while_the_epoch_trains_on_fails_after_a_lease() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    for mid in ("a", "b", "liar"):
        ms.admit(hello(mid, steps=40), 0.0)
    ms.tick(JOIN_SETTLE_S)
    t = JOIN_SETTLE_S + 0.1
    keep_alive(ms, t, step=12)
    ms.done("liar", 40, "forged", {}, t)
    ms.session_closed("liar", t)
    keep_alive(ms, t + LEASE * 0.9, step=14)
    assert ms.tick(t + LEASE * 0.9).orders == {}, "a lease for the others to reach the last step"
    keep_alive(ms, t + LEASE * 1.1, step=15)
    d = ms.tick(t + LEASE * 1.1)
    assert [e.kind for e in d.events] == ["failure", "epoch"] and "never reached it" in d.events[0].reason
    assert only_order(d).members == ["a", "b"]


def test_one_members_word_moves_the_group_step_no_more() -> None:
    # A standby insider's heartbeat had moved the group's step from 112 to 199,999.
    ms = formed(["a", "b", "c"])
    keep_alive(ms, 0.5, step=112)
    ms.heartbeat("c", 199_999, 0.6)
    assert ms.step == 112
    ms.heartbeat("a", 113, 0.7)
    assert ms.step == 113, "two of three reached 113 (c says it is past it)"
    ms.heartbeat("b", 114, 0.7)
    assert ms.step == 114


def test_a_joiners_checkpoint_is_held_against_the_second_highest_report() -> None:
    ms = formed(["a", "b", "c"])
    keep_alive(ms, 0.5, step=10)
    ms.heartbeat("a", 12, 0.6)
    ms.heartbeat("c", 199_999, 0.6)
    assert ms.step == 12 and ms.reported_step() == 12
    ms.heartbeat("b", 13, 0.7)
    assert ms.reported_step() == 13, "the group's step trails it; a checkpoint of 13 is not ahead"


def test_the_step_quorum_takes_the_step_most_members_reached() -> None:
    q = StepQuorum(5, 10)
    assert [q.report(m, s) for m, s in (("a", 20), ("b", 15), ("c", 9), ("d", 12))] == [10, 10, 10, 12]
    assert q.report("a", 19) == 12, "a step never goes back"
    assert q.report("c", 30) == 15 and q.report("e", 16) == 16


def test_a_finisher_leaving_before_the_others_report_is_no_failure() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    for mid in ("a", "b"):
        ms.admit(hello(mid, steps=40), 0.0)
    ms.tick(JOIN_SETTLE_S)
    ms.done("a", 40, "d", {}, 0.5)
    assert not ms.finished
    ms.session_closed("a", 0.6)
    assert ms.tick(0.7).orders == {}, "no epoch for a member that finished"
    ms.done("b", 40, "d", {}, 0.8)
    assert ms.finished


# ---------------------------------------------------------------- epoch numbers


def test_last_epoch_in_a_hello_raises_the_epoch_counter() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    ms.admit(hello("a", last_epoch=41), 0.0)
    ms.admit(hello("b", last_epoch=7), 0.0)
    order = only_order(ms.tick(JOIN_SETTLE_S))
    assert order.epoch == 42


def test_epoch_numbers_only_increase() -> None:
    ms = formed(["a", "b", "c"])
    seen = [ms.epoch]
    t = 1.0
    for action in ("fail-c", "join-d", "leave-d", "fault"):
        keep_alive(ms, t)
        if action == "fail-c":
            ms.fail("c", t, "x")
        elif action == "join-d":
            ms.admit(hello("d", last_epoch=1), t)
        elif action == "leave-d":
            d = ms.leave("d", t, "bye")
            seen.extend(o.epoch for o in d.orders.values())
        else:
            ms.fault("a", ms.epoch, "x", t)
        t += 0.5
        keep_alive(ms, t)
        seen.extend(o.epoch for o in ms.tick(t).orders.values())
        seen.append(ms.epoch)
        t += 0.1
    assert seen == sorted(seen)
    assert ms.epoch == 5


# ---------------------------------------------------------------- recovery after a coordinator restart


def resume_hello(member_id: str, epoch: int = 7, members: tuple[str, ...] = ("a", "b"), step: int = 30) -> Hello:
    return hello(member_id, step=step, last_epoch=epoch, resume=Resume(epoch=epoch, members=list(members), step=step))


def test_recovery_adopts_the_epoch_when_all_its_members_return() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    assert ms.admit(resume_hello("a"), 0.1).orders == {}
    keep_alive(ms, 0.2)
    assert ms.tick(0.2).orders == {}  # b is not back yet
    ms.admit(resume_hello("b"), 0.3)
    keep_alive(ms, 0.4)
    d = ms.tick(0.4)
    assert d.orders == {}  # the running group is left alone
    assert [e.kind for e in d.events] == ["adopt"]
    assert ms.epoch == 7
    assert ms.epoch_members == ["a", "b"]
    assert ms.shares == [6, 6]
    assert ms.step == 30
    keep_alive(ms, 5.0)
    assert ms.tick(5.0).orders == {}  # and nothing later either


def test_a_replaced_session_that_abandoned_its_epoch_is_not_adopted_while_recovering() -> None:
    # b resumed epoch 7 intact, then lost that session with its lease stale during its step
    # (its fence refuses the step) and reconnected before this coordinator saw it close.
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    ms.admit(resume_hello("b"), 0.1)
    gone = hello("b", step=30, last_epoch=7, resume=Resume(epoch=7, members=["a", "b"], step=30, abandoned=True))
    assert ms.admit(gone, 0.15, reconnect=True).refuse is None
    ms.admit(resume_hello("a"), 0.2)
    keep_alive(ms, 0.3)
    d = ms.tick(0.3)
    assert "adopt" not in [e.kind for e in d.events], d.events
    keep_alive(ms, 0.5)
    order = only_order(ms.tick(0.5))
    assert order.urgent and order.epoch > 7 and sorted(order.members) == ["a", "b"]


def test_a_replaced_session_that_abandoned_the_epoch_in_force_re_forms_it() -> None:
    # Back through another path (its relay froze): the others wait in its step otherwise.
    ms = formed(["a", "b"])
    keep_alive(ms, 0.5, step=3)
    back = hello("b", step=3, last_epoch=1, resume=Resume(epoch=1, members=ms.epoch_members, step=3, abandoned=True))
    assert ms.admit(back, 0.6, reconnect=True).refuse is None
    order = only_order(ms.tick(0.6))
    assert order.urgent and order.epoch == 2 and order.members == ["a", "b"], order
    intact = hello("a", step=3, last_epoch=2, resume=Resume(epoch=2, members=["a", "b"], step=3))
    ms.admit(intact, 0.7, reconnect=True)
    assert ms.tick(0.7).orders == {}, "an intact resume changes nothing"


def test_after_adoption_a_failure_makes_an_epoch_above_the_adopted_one() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    ms.admit(resume_hello("a"), 0.1)
    ms.admit(resume_hello("b"), 0.1)
    ms.tick(0.2)
    ms.fail("b", 0.3, "control connection dropped")
    order = only_order(ms.tick(0.3))
    assert (order.epoch, order.members, order.urgent) == (8, ["a"], True)


def test_recovery_without_a_missing_member_ends_in_an_urgent_epoch_a_lease_after_the_first_is_back() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    ms.admit(resume_hello("a"), 0.1)
    for t in (0.5, 1.0, 1.3):
        keep_alive(ms, t)
        assert ms.tick(t).orders == {}
    keep_alive(ms, 1.4)
    d = ms.tick(1.4)
    order = only_order(d)
    assert order.urgent is True
    assert order.members == ["a"]
    assert order.shares == [BATCH]
    assert order.epoch > 7
    assert "did not return" in order.reason


def test_a_hello_without_resume_shortens_recovery_to_a_grace_period() -> None:
    from unbroken.control.membership import FRESH_JOB_GRACE_S

    grace = max(FRESH_JOB_GRACE_S, 2 * LEASE)
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=30.0), now=0.0, recovering=True)
    ms.admit(hello("a"), 0.0)
    keep_alive(ms, grace / 2)
    assert ms.tick(grace / 2).orders == {}  # members of a live group may still come back
    keep_alive(ms, grace + 0.01)
    order = only_order(ms.tick(grace + 0.01))  # not after the 30 s window
    assert order.epoch == 1
    assert order.members == ["a"]


def test_a_new_node_first_after_a_restart_does_not_start_a_second_group() -> None:
    # The coordinator restarted; a fresh node reconnects before the live group does.
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    ms.admit(hello("new"), 0.05)
    ms.admit(resume_hello("a"), 0.2)
    ms.admit(resume_hello("b"), 0.3)
    keep_alive(ms, 0.35)
    d = ms.tick(0.35)
    assert [e.kind for e in d.events].count("adopt") == 1, d  # the live group (epoch 7) is adopted
    order = d.orders[next(iter(d.orders))] if d.orders else only_order(ms.tick(0.4))
    assert order.epoch == 8 and order.members == ["a", "b", "new"], order


def test_a_new_node_during_recovery_joins_right_after_adoption() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    ms.admit(resume_hello("a"), 0.1)
    ms.admit(hello("c"), 0.2)
    keep_alive(ms, 0.3)
    assert ms.tick(0.3).orders == {}
    ms.admit(resume_hello("b"), 0.4)
    keep_alive(ms, 0.5)
    d = ms.tick(0.5)
    assert "adopt" in [e.kind for e in d.events]
    order = only_order(d)
    assert order.epoch == 8
    assert order.members == ["a", "b", "c"]
    assert order.urgent is False


def test_min_nodes_does_not_hold_a_restarted_job_whose_member_is_missing() -> None:
    """After a restart, a job that already ran must go on with fewer nodes than min_nodes."""
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0, min_nodes=3), now=0.0, recovering=True)
    ms.admit(resume_hello("a"), 0.1)
    keep_alive(ms, 3.0)
    order = only_order(ms.tick(3.0))
    assert order.members == ["a"] and order.urgent


def test_min_nodes_holds_a_fresh_job() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE, min_nodes=2), now=0.0)
    ms.admit(hello("a"), 0.0)
    keep_alive(ms, 0.5)
    assert ms.tick(0.5).orders == {}
    ms.admit(hello("b"), 0.5)
    keep_alive(ms, 0.5 + JOIN_SETTLE_S)
    assert only_order(ms.tick(0.5 + JOIN_SETTLE_S)).members == ["a", "b"]


@pytest.mark.parametrize("field", ["last_epoch", "resume"])
def test_absurd_epoch_numbers_are_refused_at_the_boundary(field: str) -> None:
    from unbroken.control.messages import parse_node_message
    from unbroken.errors import ProtocolError

    msg = hello("a").model_dump()
    if field == "last_epoch":
        msg["last_epoch"] = 2**53
    else:
        msg["resume"] = {"epoch": 2**53, "members": ["a"], "step": 0}
    import json

    with pytest.raises(ProtocolError, match="epoch"):
        parse_node_message(json.dumps(msg))


def test_a_late_tick_does_not_expire_leases() -> None:
    """After the coordinator's own loop stalled, unread heartbeats must not cost nodes their lease."""
    ms = formed(["a", "b"])
    late = 10 * LEASE
    assert ms.tick(late, expire=False).expel == {}
    assert set(ms.tick(late).expel) == {"a", "b"}


# ---------------------------------------------------------------- leaders and reconnects


def test_a_reconnect_that_replaces_an_open_session_keeps_the_member_and_its_epoch():
    ms = formed(["a", "b"])
    epoch = ms.epoch
    assert ms.admit(hello("a"), 5.0).refuse is not None  # a second session without replacing the first
    d = ms.admit(hello("a", step=7), 5.0, reconnect=True)
    assert d.refuse is None and not d.orders and not d.events
    assert ms.epoch == epoch and ms.epoch_members == ["a", "b"]
    assert ms.members["a"].last_seen == 5.0 and ms.members["a"].step == 7


def test_orders_carry_the_leaders_term():
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    ms.term = 42
    admit_all(ms, ["a"], 0.0)
    assert only_order(ms.tick(JOIN_SETTLE_S)).term == 42


def test_a_member_that_abandoned_the_newest_epoch_ends_a_new_leaders_wait_early():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b", "c"], "step": 40}
    assert ms.admit(hello("a", resume=Resume(**resume, abandoned=True), last_epoch=5), 0.0).refuse is None
    assert ms.admit(hello("b", resume=Resume(**resume, abandoned=True), last_epoch=5), 0.05).refuse is None
    # a and b cannot go on in epoch 5: no 3 s wait for c. But c may be cut off and training
    # on in an outage that it trusts a lease past its last evidence that no coordinator
    # had started: it is left out no sooner than that (and a margin) after this one started.
    fence = LEASE * OUTAGE_TRUST_LEASES + OUTAGE_MARGIN_S
    keep_alive(ms, fence - 0.05)
    assert not ms.tick(fence - 0.05).orders
    keep_alive(ms, fence)
    order = only_order(ms.tick(fence))
    assert order.members == ["a", "b"] and order.urgent and order.epoch > 5
    assert "abandoned" in order.reason


def test_a_new_leader_does_not_wait_for_a_member_most_of_its_epoch_found_nothing_listening_for():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b", "c"], "step": 40}
    assert ms.admit(hello("a", resume=Resume(**resume, abandoned=True), last_epoch=5), 0.0).refuse is None
    assert ms.admit(hello("b", resume=Resume(**resume, abandoned=True), last_epoch=5), 0.02).refuse is None
    assert ms.awaited(0.1) is None, "the members back still settle: nobody is asked yet"
    awaited = ms.awaited(0.4)  # only the outage fence holds the leader now
    assert awaited is not None and (awaited.epoch, awaited.missing, awaited.back) == (5, ["c"], ["a", "b"])
    assert not ms.vanished("a", 5, ["c"], 0.45).events, "one member's word leaves nobody out"
    assert not ms.vanished("a", 5, ["c"], 0.45).events, "nor twice"
    assert not ms.vanished("x", 5, ["c"], 0.45).events and not ms.vanished("b", 4, ["c"], 0.45).events
    keep_alive(ms, 0.45)
    assert not ms.tick(0.45).orders
    (event,) = ms.vanished("b", 5, ["c"], 0.5).events
    assert event.kind == "failure" and event.member == "c" and "nothing listens" in event.reason
    assert ms.awaited(0.5) is None
    keep_alive(ms, 0.5)
    order = only_order(ms.tick(0.5))  # not the lease's fence
    assert order.members == ["a", "b"] and order.urgent and order.epoch > 5


def test_in_an_epoch_of_two_the_one_back_cannot_end_the_wait_for_the_other_alone():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "c"], "step": 40}
    assert ms.admit(hello("a", resume=Resume(**resume, abandoned=True), last_epoch=5), 0.0).refuse is None
    assert not ms.vanished("a", 5, ["c"], 0.4).events
    fence = LEASE * OUTAGE_TRUST_LEASES + OUTAGE_MARGIN_S
    keep_alive(ms, fence - 0.05)
    assert not ms.tick(fence - 0.05).orders, "c may be alive, cut off, and trusting an outage"
    keep_alive(ms, fence)
    assert only_order(ms.tick(fence)).members == ["a"]


def test_a_verdict_from_the_first_member_back_rolls_nobody_back():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b", "c"], "step": 40}
    assert ms.admit(hello("a", resume=Resume(**resume), last_epoch=5), 0.0).refuse is None
    ms.fault("a", 5, "audit: digest differs", 0.01, kind=Kind.AUDIT, rollback_to=0)
    for mid in ("b", "c"):
        assert ms.admit(hello(mid, resume=Resume(**resume), last_epoch=5), 0.02).refuse is None
    keep_alive(ms, 0.5)
    order = only_order(ms.tick(0.5))
    assert order.rollback_to == -1 and not order.refused, "most of epoch 5 must say so, not most of those back"


def test_a_new_leader_does_not_wait_a_lease_when_every_member_is_back():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b"], "step": 40}
    for mid in ("a", "b"):
        assert ms.admit(hello(mid, resume=Resume(**resume, abandoned=True), last_epoch=5), 0.0).refuse is None
    assert not ms.tick(0.2).orders
    order = only_order(ms.tick(0.5))  # the abandoned epoch's settle, not the lease
    assert order.members == ["a", "b"] and order.epoch > 5


def test_an_intact_epoch_is_still_adopted_when_everyone_is_back():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b"], "step": 40, "shares": [6, 6], "roles": ["trainer", "trainer"]}
    for mid in ("a", "b"):
        assert ms.admit(hello(mid, resume=Resume(**resume), last_epoch=5), 0.0).refuse is None
    d = ms.tick(0.01)
    assert not d.orders and ms.epoch == 5 and ms.epoch_members == ["a", "b"]
    assert any(e.kind == "adopt" for e in d.events)


def test_after_a_restart_members_not_back_within_a_lease_of_the_first_are_not_waited_for():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b", "c"], "step": 40}
    for mid in ("a", "b"):
        assert ms.admit(hello(mid, resume=Resume(**resume), last_epoch=5), 0.1).refuse is None
    keep_alive(ms, 1.0)
    assert not ms.tick(1.0).orders  # c may still be on its way
    keep_alive(ms, 1.3)
    order = only_order(ms.tick(0.1 + LEASE + JOIN_SETTLE_S))
    assert order.members == ["a", "b"] and order.urgent  # not the 3 s window


def test_a_failure_reported_during_a_recovery_ends_it_after_a_settle():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b", "c"], "step": 40}
    for mid in ("a", "b", "c"):
        assert ms.admit(hello(mid, resume=Resume(**resume), last_epoch=5), 0.0).refuse is None
    ms.fail("c", 0.1, "control connection dropped")  # c died right after reconnecting
    order = only_order(ms.tick(0.1 + 0.3))
    assert order.members == ["a", "b"] and order.urgent and "c" in order.reason


def test_a_collective_failure_reported_during_a_recovery_ends_it_after_a_settle():
    ms = Membership(MembershipConfig(lease_s=LEASE, recovery_window_s=3.0), now=0.0, recovering=True)
    resume = {"epoch": 5, "members": ["a", "b", "c"], "step": 40}
    for mid in ("a", "b"):
        assert ms.admit(hello(mid, resume=Resume(**resume), last_epoch=5), 0.0).refuse is None
    ms.fault("a", 5, "all-reduce failed: connection reset", 0.2)
    assert not ms.tick(0.3).orders
    # c is not back: it may be cut off and still trust an outage, so not before that ends.
    fence = LEASE * OUTAGE_TRUST_LEASES + OUTAGE_MARGIN_S
    keep_alive(ms, fence - 0.05)
    assert not ms.tick(fence - 0.05).orders
    order = only_order(ms.tick(fence))
    assert order.members == ["a", "b"] and order.urgent


def test_time_the_coordinator_was_not_listening_counts_against_no_lease():
    ms = formed(["a", "b"])
    keep_alive(ms, 1.0)
    ms.pause(2.0)  # the service's loop stalled for 2 s (its tick saw the lag)
    d = ms.tick(3.5)  # 2.5 s since the last heartbeat, of which 2 s were not listened for
    assert not d.expel and not d.orders
    d = ms.tick(4.1)  # past the lease once the stall is forgiven: a real failure is still seen
    assert set(d.expel) == {"a", "b"}


def test_extended_leases_lapse_only_after_the_time_given() -> None:
    ms = formed(["a", "b"])
    t = JOIN_SETTLE_S
    keep_alive(ms, t)
    ms.extend(["b", "ghost"], t + 2.5 * LEASE)  # b's relay went silent; unknown ids are ignored
    assert set(ms.tick(t + 2 * LEASE).expel) == {"a"}
    assert set(ms.tick(t + 2.6 * LEASE).expel) == {"b"}


# ---------------------------------------------------------------- the leaders' ring


def test_leaders_measure_their_links_and_the_next_epoch_leaves_the_slow_pairs_out_of_the_ring() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    zones = {"a": "A", "b": "B", "c": "C", "d": "D", "a2": "A"}
    for mid, zone in zones.items():
        assert ms.admit(hello(mid, zone=zone), 0.0).refuse is None
    first = only_order(ms.tick(JOIN_SETTLE_S))
    assert first.ring == ["A", "B", "C", "D"] and first.probe_links, "rank order, and measure it"
    slow = {frozenset("AB"), frozenset("CD")}
    t = JOIN_SETTLE_S + 0.1
    keep_alive(ms, t)

    def heard(zone: str) -> dict[str, float]:
        return {z: 2.5 if frozenset((zone, z)) in slow else 100.0 for z in "ABCD" if z != zone}

    assert not ms.links_measured("a2", first.epoch, {"B": 1000.0, "C": 1000.0, "D": 1000.0}, t).events, (
        "a member that leads no zone is not heard"
    )
    assert not ms.links_measured("a", first.epoch - 1, heard("A"), t).events, "nor a report of another epoch"
    for mid in ("a", "b", "c", "d"):
        d = ms.links_measured(mid, first.epoch, heard(zones[mid]) | {"X": 0.0}, t)
        assert [e.kind for e in d.events] == ["links"] and "X" not in d.events[0].reason
    second = only_order(ms.tick(t + 0.01))
    assert second.ring == ["A", "C", "B", "D"] and not second.probe_links
    assert "leaders' ring A > C > B > D: slowest link 2 -> 100 MB/s" in second.reason
    keep_alive(ms, t + 1)
    assert not ms.tick(t + 1).orders, "the ring in force stays: no further epoch"


def test_a_ring_reorder_names_only_the_ring_the_epoch_forms_with() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    zones = {"a": "A", "b": "B", "c": "C", "d": "D"}
    for mid, zone in zones.items():
        assert ms.admit(hello(mid, zone=zone), 0.0).refuse is None
    first = only_order(ms.tick(JOIN_SETTLE_S))
    t = JOIN_SETTLE_S + 0.1
    keep_alive(ms, t)
    for slow in ({frozenset("AB"), frozenset("CD")}, {frozenset("AD"), frozenset("BC")}):
        for mid, zone in zones.items():  # the second round of reports comes before the epoch forms
            rates = {z: 2.5 if frozenset((zone, z)) in slow else 100.0 for z in "ABCD" if z != zone}
            ms.links_measured(mid, first.epoch, rates, t)
    second = only_order(ms.tick(t + 0.01))
    assert second.ring == ["A", "B", "D", "C"], second.ring
    assert second.reason.count("leaders' ring") == 1 and "A > B > D > C" in second.reason, second.reason


# ---------------------------------------------------------------- admissions (churn)


def churn_once(ms: Membership, mid: str, now: float, key: str, source: str) -> Decision:
    """``mid`` says hello; once an epoch takes it (if one does within a settle), it drops
    before the group commits anything with it. Returns the admission's decision."""
    d = ms.admit(hello(mid), now, key=key, source=source)
    assert d.refuse is None, d.refuse
    keep_alive(ms, now + JOIN_SETTLE_S)
    ms.tick(now + JOIN_SETTLE_S)
    ms.session_closed(mid, now + JOIN_SETTLE_S)
    ms.tick(now + JOIN_SETTLE_S)  # the epoch without it
    return d


def test_a_key_that_keeps_leaving_before_training_waits_and_then_joins() -> None:
    ms = formed(["a", "b"])
    t = 1.0
    for i in range(int(FREE_PER_KEY) + 1):  # fresh member ids, one key, a fresh address each time
        d = churn_once(ms, f"c{i}", t, "churner-key", f"10.0.0.{i}")
        assert not [e for e in d.events if e.kind is Kind.CHURN]
        t += 0.3  # strikes fade by a few hundredths meanwhile
    epoch = ms.epoch
    d = ms.admit(hello("c9"), t, key="churner-key", source="10.0.0.9")
    held = [e for e in d.events if e.kind is Kind.CHURN]
    assert held and "node-c9" in held[0].reason and f"waits {BASE_S:.1f} s" in held[0].reason, d.events
    keep_alive(ms, t + JOIN_SETTLE_S)
    assert ms.tick(t + JOIN_SETTLE_S).orders == {}, "its join re-forms nothing while it waits"
    keep_alive(ms, t + BASE_S * 0.9)
    assert ms.tick(t + BASE_S * 0.9).orders == {}
    keep_alive(ms, t + BASE_S)
    order = only_order(ms.tick(t + BASE_S))
    assert order.members == ["a", "b", "c9"] and order.epoch == epoch + 1
    assert order.reason == "node-c9 joined", order.reason
    # An honest node of another key and address is not held meanwhile.
    d = ms.admit(hello("d"), t + 1.5, key="honest-key", source="10.0.1.1")
    assert not [e for e in d.events if e.kind is Kind.CHURN]


def test_a_member_whose_epoch_committed_leaves_without_a_strike_but_its_own_word_proves_nothing() -> None:
    ms = formed(["a", "b"])
    t = 1.0
    for i in range(5):  # the group commits with each before it leaves: no churn
        ms.admit(hello(f"c{i}"), t, key="k", source="10.0.0.1")
        keep_alive(ms, t + JOIN_SETTLE_S)
        only_order(ms.tick(t + JOIN_SETTLE_S))
        ms.progress("a", 5, 1.0, 10.0, t + 0.5, epoch=ms.epoch)
        ms.leave(f"c{i}", t + 0.6, "done for today")
        t += 1.0
    d = ms.admit(hello("c9"), t, key="k", source="10.0.0.1")
    assert not [e for e in d.events if e.kind is Kind.CHURN], d.events
    ms.session_closed("c9", t)
    t += 1.0
    for i in range(int(FREE_PER_KEY) + 1):  # ...but a churner saying it committed is not believed
        ms.admit(hello(f"e{i}"), t, key="liar", source="10.0.2.1")
        keep_alive(ms, t + JOIN_SETTLE_S)
        assert only_order(ms.tick(t + JOIN_SETTLE_S)).members[-1] == f"e{i}"
        ms.progress(f"e{i}", 5, 1.0, 10.0, t + 0.5, epoch=ms.epoch)
        ms.session_closed(f"e{i}", t + 0.6)
        t += 0.7
    d = ms.admit(hello("e9"), t, key="liar", source="10.0.2.1")
    assert [e for e in d.events if e.kind is Kind.CHURN], d.events


def test_a_join_that_drops_before_its_epoch_forms_reforms_nothing() -> None:
    ms = formed(["a", "b"])
    epoch = ms.epoch
    ms.admit(hello("c"), 1.0, key="k", source="10.0.0.1")
    ms.session_closed("c", 1.1)
    keep_alive(ms, 1.0 + JOIN_SETTLE_S)
    assert ms.tick(1.0 + JOIN_SETTLE_S).orders == {} and ms.epoch == epoch
    # Another join pending under the same name still forms its epoch.
    ms.admit(hello("d", name="twin"), 2.0, key="k1", source="10.0.0.2")
    ms.admit(hello("e", name="twin"), 2.0, key="k2", source="10.0.0.2")
    ms.session_closed("d", 2.1)
    keep_alive(ms, 2.0 + JOIN_SETTLE_S)
    assert only_order(ms.tick(2.0 + JOIN_SETTLE_S)).members == ["a", "b", "e"]


def test_many_nodes_joining_together_from_one_address_wait_for_nothing() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    ids = [f"n{i}" for i in range(16)]
    events = []
    for mid in ids:
        events += ms.admit(hello(mid), 0.0, key=f"key-{mid}", source="127.0.0.1").events
    assert not [e for e in events if e.kind is Kind.CHURN]
    assert sorted(only_order(ms.tick(JOIN_SETTLE_S)).members) == sorted(ids)
    # A few of them crash before training, and are restarted (new keys, the same address).
    for mid in ids[: int(FREE_PER_SOURCE)]:
        ms.session_closed(mid, 0.5)
    for i in range(int(FREE_PER_SOURCE)):
        d = ms.admit(hello(f"r{i}"), 1.0, key=f"restarted-{i}", source="127.0.0.1")
        assert not [e for e in d.events if e.kind is Kind.CHURN], d.events


# ---------------------------------------------------------------- finishing at the edges (review)

N = 20


def started(ids: list[str]) -> Membership:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=0.0)
    for mid in ids:
        assert ms.admit(hello(mid, steps=N), 0.0).refuse is None
    ms.tick(JOIN_SETTLE_S)
    return ms


def test_a_pairs_member_that_evaluates_past_a_lease_before_its_done_is_no_failure() -> None:
    ms = started(["a", "b"])
    t = 1.0
    keep_alive(ms, t, N)
    ms.done("b", N, "D", {}, t)
    ms.session_closed("b", t)
    kinds = []
    for k in range(1, 30):
        ms.heartbeat("a", N, t + k * 0.1)
        kinds += [e.kind for e in ms.tick(t + k * 0.1).events]
    ms.done("a", N, "D", {}, t + 3.0)
    assert Kind.FAILURE not in kinds and ms.finished


def test_dones_said_to_a_recovering_leader_finish_the_job() -> None:
    ms = started(["a", "b"])
    assert ms.plan is not None
    r = Resume(epoch=1, members=["a", "b"], step=N, shares=ms.shares, roles=[x.value for x in ms.plan.roles])
    new = Membership(MembershipConfig(lease_s=LEASE), now=10.0)
    new.recovering_until = 15.0
    new.admit(hello("a", steps=N, step=N, resume=r), 10.0)
    new.done("a", N, "D", {}, 10.1)
    new.session_closed("a", 10.1)
    new.admit(hello("b", steps=N, step=N, resume=r), 10.2)
    new.done("b", N, "D", {}, 10.3)
    assert new.finished


def test_dones_of_the_epoch_that_reached_the_end_count_after_another_formed() -> None:
    # a finishes and leaves, c dies, the epoch {b, j} forms; b's done and a's are most of the
    # epoch that committed the last step.
    ms = started(["a", "b", "c"])
    t = 1.0
    keep_alive(ms, t, N)
    assert ms.admit(hello("j", steps=N), t).refuse is None
    ms.done("a", N, "D", {}, t + 0.01)
    ms.session_closed("a", t + 0.01)
    ms.fail("c", t + 0.02, "killed")
    ms.tick(t + 0.02)
    ms.done("b", N, "D", {}, t + 0.03)
    assert ms.finished


def test_the_urgency_of_an_epoch_is_judged_after_its_members_are_counted() -> None:
    ms = formed(["a", "b", "c", "d", "e"])
    t = 0.5
    keep_alive(ms, t, 9)
    ms.heartbeat("a", 10, t)
    ms.heartbeat("b", 10, t)
    for mid in ["c", "d", "e"]:
        ms.fail(mid, t, "killed")
    ms.tick(t + 0.01)
    assert ms.step == 10
    ms.admit(hello("j"), t + 0.02)
    keep_alive(ms, t + 0.02 + JOIN_SETTLE_S, 10)
    assert only_order(ms.tick(t + 0.02 + JOIN_SETTLE_S)).urgent, "the new epoch committed nothing yet"


def test_a_newcomers_step_moves_no_recovering_leader() -> None:
    ms = Membership(MembershipConfig(lease_s=LEASE), now=10.0)
    ms.recovering_until = 15.0
    r = Resume(epoch=7, members=["a", "b"], step=112, shares=[6, 6], roles=["trainer", "trainer"])
    ms.admit(hello("a", steps=200_000, step=112, resume=r), 10.0)
    ms.admit(hello("x", steps=200_000, step=199_999), 10.01)
    ms.heartbeat("x", 199_999, 10.015)
    ms.admit(hello("b", steps=200_000, step=112, resume=r), 10.02)
    ms.tick(10.03)
    assert ms.step == 112


# ---------------------------------------------------------------- the last holder's leave


def lone_holder() -> Membership:
    """``a`` alone in the epoch in force at step 32; ``b``, expelled at step 30, rejoined
    as ``b2`` (what a goodput run found: ``a`` was then sent SIGTERM)."""
    ms = formed(["a", "b"])
    keep_alive(ms, 0.4, step=30)
    ms.heartbeat("a", 31, 0.45)
    ms.fail("b", 0.5, "control connection dropped")
    assert only_order(ms.tick(0.5)).members == ["a"]
    ms.heartbeat("a", 32, 0.6)
    return ms


def test_the_last_member_asking_to_leave_stays_until_a_joiner_took_its_state() -> None:
    ms = lone_holder()
    d = ms.leave("a", 0.7, "SIGTERM")
    assert d.orders == {} and "a" in ms.members, "the only holder of step 32 was let go"
    assert [e.kind for e in d.events] == [Kind.LEAVE] and "stays" in d.events[0].reason
    ms.admit(hello("b2", step=30), 0.72)  # the stale member, back a moment later
    keep_alive(ms, 0.72 + JOIN_SETTLE_S, step=0)
    d = ms.tick(0.72 + JOIN_SETTLE_S)
    assert only_order(d).members == ["a", "b2"], "the joiner's epoch must hold the state's holder to sync from"
    assert not [e for e in d.events if e.kind is Kind.ROLLBACK], d.events
    # Once a step committed with the joiner, the leave goes on as with others present.
    keep_alive(ms, 2.0, step=33)
    d = ms.leave("a", 2.0, "SIGTERM")
    assert only_order(d).members == ["b2"] and "a" not in ms.members


def test_a_last_holder_that_waited_in_vain_goes_and_the_next_epoch_says_it_goes_back() -> None:
    ms = lone_holder()
    d = ms.leave("a", 0.7, "SIGTERM", last=True)
    assert "a" not in ms.members and "leaves with it" in d.events[0].reason
    assert ms.session_closed("a", 0.71).events == [], "a graceful leave is no failure"
    ms.admit(hello("b2", step=30), 0.72)
    d = ms.tick(0.72 + JOIN_SETTLE_S)
    assert only_order(d).members == ["b2"]
    (back,) = [e for e in d.events if e.kind is Kind.ROLLBACK]
    assert "best state here is step 30" in back.reason and "committed step 32" in back.reason, back.reason
    # Its members compare their states with their checkpoints (`unbroken.train.catchup`).
    assert only_order(d).group_step == 32


def test_an_epoch_after_the_last_holder_failed_says_it_goes_back() -> None:
    ms = lone_holder()
    ms.fail("a", 0.7, "control connection dropped")  # SIGKILL: nobody holds step 32 now
    ms.admit(hello("b2", step=30), 0.72)
    d = ms.tick(0.72 + JOIN_SETTLE_S)
    assert only_order(d).members == ["b2"]
    assert [e.kind for e in d.events].count(Kind.ROLLBACK) == 1, d.events
    assert only_order(d).group_step == 32


def test_a_member_kept_from_an_epoch_that_never_synced_holds_no_state_of_the_group() -> None:
    # The stale member joins while the lone holder is dying (a SIGKILLed process outlives
    # the signal on a busy machine): their epoch never syncs, and the next keeps only it.
    ms = lone_holder()
    ms.admit(hello("b2", step=30), 0.72)
    keep_alive(ms, 0.72 + JOIN_SETTLE_S, step=0)
    assert only_order(ms.tick(0.72 + JOIN_SETTLE_S)).members == ["a", "b2"]
    d = ms.fail("a", 0.72 + JOIN_SETTLE_S + 0.05, "control connection dropped")
    d.merge(ms.tick(0.72 + JOIN_SETTLE_S + 0.05))
    assert only_order(d).members == ["b2"] and only_order(d).group_step == 32


def test_an_epoch_that_keeps_a_holder_of_the_groups_step_says_nothing_of_going_back() -> None:
    ms = formed(["a", "b"])
    keep_alive(ms, 0.4, step=12)
    ms.admit(hello("c"), 0.5)  # a newcomer at step 0 syncs from the others
    d = ms.tick(0.5 + JOIN_SETTLE_S)
    assert only_order(d).members == ["a", "b", "c"]
    assert not [e for e in d.events if e.kind is Kind.ROLLBACK], d.events
    assert only_order(d).group_step == 0
