"""Where the plan puts members that accept no connection (`unbroken.sched.nat`)."""

from __future__ import annotations

from unbroken.config import MembershipConfig
from unbroken.control.membership import JOIN_SETTLE_S, Membership
from unbroken.control.messages import Capabilities, Hello, TensorSpec
from unbroken.sched.nat import MAX_FORWARDERS, forwarders, reachable_first
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
