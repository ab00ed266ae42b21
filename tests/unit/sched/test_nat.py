"""Where the plan puts members that accept no connection (`unbroken.sched.nat`)."""

from __future__ import annotations

from unbroken.config import MembershipConfig
from unbroken.control.membership import JOIN_SETTLE_S, Membership
from unbroken.control.messages import Capabilities, Hello, TensorSpec
from unbroken.events import Kind
from unbroken.sched.nat import MAX_FORWARDERS, forwarders, reachable_first, unreachable
from unbroken.sched.zones import Zones


def test_members_behind_nat_go_behind_the_others_each_part_in_its_order():
    nat = {"b", "d"}
    assert reachable_first(["a", "b", "c", "d", "e"], nat.__contains__) == ["a", "c", "e", "b", "d"]
    assert reachable_first(["b", "d"], nat.__contains__) == ["b", "d"], "an all-NAT zone keeps a leader"


def test_an_epoch_names_the_forwarders_its_reachable_members_offer():
    members = [("10.0.0.2:7800", False), ("", False), ("10.0.0.4:7800", True), ("10.0.0.2:7800", False)]
    assert forwarders(members) == ["10.0.0.2:7800"], "a NAT'd member's offer reaches nobody; each named once"
    many = [(f"10.0.{i // 250}.{i % 250}:7800", False) for i in range(100)]
    assert len(forwarders(many)) == MAX_FORWARDERS
    assert forwarders(members, ["203.0.113.9:7800"]) == ["10.0.0.2:7800", "203.0.113.9:7800"], "relays' after"


def hello(member_id: str, zone: str, no_inbound: bool, forwarding: str = "") -> Hello:
    return Hello(
        job="job", job_identity="ident", fingerprint=[TensorSpec(name="w", shape=[4], dtype="float32")],
        member_id=member_id, name=member_id, batch_size=8, zone=zone, no_inbound=no_inbound, forwarding=forwarding,
        capabilities=Capabilities(per_sample_s=0.001, measurements=3),
    )  # fmt: skip


def test_a_member_behind_nat_leads_no_zone_that_has_a_reachable_member():
    ms = Membership(MembershipConfig(lease_s=100.0), now=0.0)
    # Each zone's NAT'd member joins first, and its id sorts first: else it would lead its zone.
    joins = [("a0", "A", True), ("a1", "A", False), ("b0", "B", True), ("b1", "B", False), ("c0", "C", True)]
    for mid, zone, no_inbound in joins:
        assert ms.admit(hello(mid, zone, no_inbound, forwarding=f"{mid}.example:7800"), 0.0).refuse is None
    d = ms.tick(JOIN_SETTLE_S)
    order = next(iter(d.orders.values()))
    zones = Zones(tuple(order.zones), tuple(order.ring))
    leaders = {order.zones[r]: order.members[r] for r in zones.leaders}
    assert leaders == {"A": "a1", "B": "b1", "C": "c0"}, order.members
    assert order.forwarders == ["a1.example:7800", "b1.example:7800"], "the reachable members' offers"


def test_a_member_found_unreachable_moves_behind_the_first_forwarder_offered():
    v = unreachable("n3", ["n1", "n2"], ["10.0.0.2:7800", "10.0.0.5:7800"], behind=False)
    assert v.forwarder == "10.0.0.2:7800"
    assert v.reason == "n3 unreachable from n1, n2: now behind forwarder 10.0.0.2:7800"


def test_a_member_found_unreachable_with_no_forwarder_or_behind_one_already_is_benched_and_told_the_fix():
    v = unreachable("n3", ["n1", "n2"], [], behind=False)
    assert v.forwarder is None
    assert "--offer-forwarding PORT" in v.reason and "open its gloo port" in v.reason and v.reason.endswith("benched")
    v = unreachable("n3", ["n1", "n2"], ["10.0.0.2:7800"], behind=True)
    assert v.forwarder is None and "through its forwarder too" in v.reason


def keep_alive(ms: Membership, now: float) -> None:
    for mid in list(ms.members):
        ms.heartbeat(mid, 0, now)


def formed(offers: dict[str, str]) -> Membership:
    """A first epoch of a, b, c and d (none behind NAT); ``offers``: who offers forwarding where."""
    ms = Membership(MembershipConfig(lease_s=100.0), now=0.0)
    for mid in "abcd":
        assert ms.admit(hello(mid, "", False, forwarding=offers.get(mid, "")), 0.0).refuse is None
    assert next(iter(ms.tick(JOIN_SETTLE_S).orders.values())).members == ["a", "b", "c", "d"]
    return ms


def test_a_member_most_others_cannot_reach_goes_behind_a_forwarder_and_stays_in_the_epochs():
    ms = formed({"a": "10.0.0.2:7800"})
    t = 1.0
    keep_alive(ms, t)
    d = ms.fault("c", 1, "cannot connect to 10.0.0.3:5000", t, culprit="b", kind=Kind.UNREACHABLE)
    assert [e.kind for e in d.events] == ["fault"], "one member's word moves nobody"
    d = ms.fault("d", 1, "cannot connect to 10.0.0.3:5000", t, culprit="b", kind=Kind.UNREACHABLE)
    assert [(e.kind, e.reason) for e in d.events] == [
        ("forwarded", "b unreachable from c, d: now behind forwarder 10.0.0.2:7800")
    ]
    order = next(iter(ms.tick(t).orders.values()))
    assert order.members == ["a", "c", "d", "b"], "in the epoch, placed as a member behind NAT"
    assert order.behind == ["b"] and order.forwarders == ["10.0.0.2:7800"]
    assert ms.members["b"].flags == 0 and ms.members["b"].excluded_until == 0.0, "not benched"
    # The last word about the epoch before the move changes nothing; unreachable through its
    # forwarder as well, it is benched.
    assert ms.fault("a", 1, "cannot connect to 10.0.0.3:5000", t, culprit="b", kind=Kind.UNREACHABLE).events == []
    keep_alive(ms, t + 1)
    for accuser in "cd":
        d = ms.fault(accuser, 2, "cannot connect to 10.0.0.2:40000", t + 1, culprit="b", kind=Kind.UNREACHABLE)
    assert [e.kind for e in d.events] == ["unreachable"] and "through its forwarder too" in d.events[0].reason
    assert "b" not in next(iter(ms.tick(t + 1).orders.values())).members


def test_a_member_found_unreachable_goes_behind_a_relays_forwarder_where_no_member_offers_one():
    ms = formed({})
    ms.roster.relay_forwarders["relay-1"] = "203.0.113.9:7800"  # as its link's hello said
    t = 1.0
    keep_alive(ms, t)
    for accuser in "cd":
        d = ms.fault(accuser, 1, "cannot connect to 10.0.0.3:5000", t, culprit="b", kind=Kind.UNREACHABLE)
    assert [e.reason for e in d.events] == ["b unreachable from c, d: now behind forwarder 203.0.113.9:7800"]
    order = next(iter(ms.tick(t).orders.values()))
    assert order.behind == ["b"] and order.forwarders == ["203.0.113.9:7800"]


def test_a_member_most_others_cannot_reach_is_benched_with_the_fix_where_no_member_forwards():
    ms = formed({})
    t = 1.0
    keep_alive(ms, t)
    for accuser in "cd":
        d = ms.fault(accuser, 1, "cannot connect to 10.0.0.3:5000", t, culprit="b", kind=Kind.UNREACHABLE)
    assert [e.kind for e in d.events] == ["unreachable"]
    assert "no forwarder to move it behind (to fix: --offer-forwarding PORT" in d.events[0].reason
    order = next(iter(ms.tick(t).orders.values()))
    assert order.members == ["a", "c", "d"] and order.behind == []
