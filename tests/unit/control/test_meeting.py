"""The leader's check of rendezvous entries (`unbroken.control.meeting`)."""

from __future__ import annotations

import base64

import pytest

from integration.helpers import gloo_entry
from unbroken.control import messages as m
from unbroken.control.meeting import PROBES_PER_ACCUSER, Rendezvous, data_address, with_port
from unbroken.errors import ProtocolError


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


ADDR = b64(gloo_entry())


def order(epoch: int, members: list[str], zones: list[str] | None = None, streams: int = 1) -> m.EpochOrder:
    return m.EpochOrder(
        epoch=epoch,
        members=members,
        shares=[1] * len(members),
        urgent=False,
        reason="t",
        zones=zones or [],
        policy=m.PolicyMsg(streams=streams),
    )


def meet(epoch: int, key: str, value: str = ADDR) -> m.Meet:
    return m.Meet(epoch=epoch, key=key, value=value)


def test_entries_reach_the_epochs_members_once():
    r = Rendezvous(deadline_s=5)
    r.order(order(3, ["a", "b", "c"]))
    r.put("a", meet(3, "world/0/0"), now=0)
    r.put("c", meet(3, "world/0/2"), now=0.1)
    members, entries = r.take()[3]
    assert members == ["a", "b", "c"] and entries == {"world/0/0": ADDR, "world/0/2": ADDR}
    assert r.take() == {}
    r.put("a", meet(3, "world/0/0"), now=0.2)  # the same entry again (a new session): nothing new
    assert r.take() == {}
    assert r.entries(3) == {"world/0/0": ADDR, "world/0/2": ADDR}


@pytest.mark.parametrize(
    ("member", "key", "value", "why"),
    [
        ("a", "world/0/1", ADDR, "not this member's"),  # b's rank
        ("a", "zone0/0/0", ADDR, "names no group"),  # one zone: no zone groups
        ("a", "world/0/x", ADDR, "names no group"),
        ("a", "world/0/0", "not base64!", "not base64"),
        ("a", "world", ADDR, "names no group"),
        ("a", "world/0/0/0", ADDR, "names no group"),
        ("a", "world/1/0", ADDR, "names no stream"),  # one zone: one stream
        ("a", "world/x/0", ADDR, "names no stream"),
        ("a", "world/0/\u00b2", ADDR, "names no group"),  # a digit to str.isdigit, not to int()
        ("a", "world/0/0", "\u00e9t\u00e9", "not base64"),
        # gloo reads these without bounds checks: every peer would crash on them
        ("a", "world/0/0", b64(b"\xff" * 8 + gloo_entry()[8:]), "host name of"),
        ("a", "world/0/0", b64(gloo_entry()[:-40]), "an address of"),
        ("a", "world/0/0", b64(gloo_entry()[:12]), "too few"),
        ("a", "world/0/0", b64(gloo_entry().replace(b"\x02\x00\x10\x92", b"\x01\x00\x10\x92")), "family 1"),
        ("a", "world/0/0", b64(gloo_entry(port=0)), "port 0"),
        ("a", "world/0/0", b64(gloo_entry(peers=2)), "not naming peers by rank"),
        ("a", "world/0/0", b64(gloo_entry() + b"\x01"), "peer sequence numbers"),
    ],
)
def test_an_entry_no_honest_node_writes_is_refused(member, key, value, why):
    r = Rendezvous(deadline_s=5)
    r.order(order(1, ["a", "b"]))
    with pytest.raises(ProtocolError, match=why):
        r.put(member, meet(1, key, value), now=0)
    assert r.take() == {}


def test_an_entry_never_changes():
    r = Rendezvous(deadline_s=5)
    r.order(order(1, ["a", "b"]))
    r.put("a", meet(1, "world/0/0"), now=0)
    other = b64(gloo_entry(port=4343))
    with pytest.raises(ProtocolError, match="written twice"):
        r.put("a", meet(1, "world/0/0", other), now=0)
    assert r.entries(1)["world/0/0"] == ADDR


def test_zone_and_leader_groups_are_checked_by_rank_in_group():
    r = Rendezvous(deadline_s=5)
    r.order(order(2, ["a", "b", "c", "d"], zones=["x", "y", "x", "y"]))
    r.put("c", meet(2, "zone0/0/1"), now=0)  # c is the second of zone x
    r.put("b", meet(2, "leaders/0/1"), now=0)  # b leads zone y
    with pytest.raises(ProtocolError):
        r.put("c", meet(2, "leaders/0/0"), now=0)  # a leads zone x, not c
    with pytest.raises(ProtocolError):
        r.put("d", meet(2, "zone0/0/1"), now=0)  # d is in zone y


def test_late_and_foreign_entries_are_ignored():
    r = Rendezvous(deadline_s=5)
    r.order(order(1, ["a", "b"]))
    r.order(order(2, ["a", "b"]))
    r.order(order(3, ["a", "c"]))
    r.put("a", meet(1, "world/0/0"), now=0)  # epoch 1 is over
    r.put("b", meet(3, "world/0/1"), now=0)  # b is not in epoch 3
    r.put("a", meet(9, "world/0/0"), now=0)  # no such epoch
    assert r.take() == {}
    r.put("b", meet(2, "world/0/1"), now=0)  # the previous epoch still meets (a slow member)
    assert list(r.take()) == [2]


def test_members_missing_entries_past_the_deadline_are_named_once():
    r = Rendezvous(deadline_s=2)
    r.order(order(4, ["b", "c", "d"]))
    r.order(order(5, ["a", "b", "c", "d"], zones=["x", "x", "y", "y"]))  # a joined
    assert r.absent(5, now=100) == {}, "nobody started: no one to blame"
    r.put("a", meet(5, "world/0/0"), now=10)  # a newcomer builds at once...
    assert r.absent(5, now=30) == {}, "...while the others finish their step: no clock yet"
    r.put("a", meet(5, "zone0/0/0"), now=40)
    r.put("a", meet(5, "leaders/0/0"), now=40)
    r.put("b", meet(5, "world/0/1"), now=40.5)  # b never builds its zone group
    r.put("c", meet(5, "world/0/2"), now=40.5)  # most of the world: its clock starts
    r.put("c", meet(5, "zone1/0/0"), now=40.5)
    r.put("c", meet(5, "leaders/0/1"), now=40.5)
    assert r.absent(5, now=41.9) == {}
    assert r.absent(5, now=42.0) == {"b": ["zone0"]}
    assert r.absent(5, now=42.5) == {"d": ["world", "zone1"]}
    assert r.absent(5, now=50) == {}


def test_newcomers_do_not_start_the_worlds_clock():
    r = Rendezvous(deadline_s=2)
    r.order(order(1, ["a", "b"]))
    r.order(order(2, ["a", "b", "c", "d", "e"]))  # three join a group of two
    for i, mid in enumerate(("c", "d", "e")):
        r.put(mid, meet(2, f"world/0/{i + 2}"), now=0)
    assert r.absent(2, now=60) == {}, "a and b are still finishing their step"
    r.put("a", meet(2, "world/0/0"), now=61)
    r.put("b", meet(2, "world/0/1"), now=61)
    assert r.absent(2, now=70) == {}


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "10.1.2.3", "fe80::1%3"])
def test_a_data_address_is_read_from_gloos_entry(host):
    raw = gloo_entry(port=51234, host=host)
    assert data_address(raw) == (host, 51234)
    assert data_address(with_port(raw, 9)) == (host, 9)


def test_the_others_are_asked_to_try_an_address_once():
    r = Rendezvous(deadline_s=5)
    r.order(order(4, ["a", "b", "c"]))
    assert r.probe(4, "c", "world", "a") is None  # no entry of c yet: no address to try
    r.put("c", meet(4, "world/0/2", b64(gloo_entry(port=7070))), now=0)
    assert r.probe(4, "c", "world", "outsider") is None, "only a member of the epoch may ask"
    assert r.probe(4, "c", "world", "a") == (["a", "b"], "127.0.0.1", 7070)
    assert r.probe(4, "c", "world", "b") is None
    assert r.probe(5, "c", "world", "a") is None


def test_the_address_tried_is_the_one_of_the_group_that_could_not_connect():
    r = Rendezvous(deadline_s=5)
    r.order(order(4, ["a", "b", "c", "d"], zones=["x", "x", "y", "y"]))
    r.put("c", meet(4, "world/0/2", b64(gloo_entry(port=7070))), now=0)
    r.put("c", meet(4, "zone1/0/0", b64(gloo_entry(port=8080))), now=0)
    assert r.probe(4, "c", "zone1", "d") == (["a", "b", "d"], "127.0.0.1", 8080)
    assert r.probe(4, "c", "world", "d") == (["a", "b", "d"], "127.0.0.1", 7070)


def test_one_member_has_few_addresses_tried_per_epoch():
    """A member naming everyone would have every member try every address (N² messages)."""
    members = [f"m{i}" for i in range(PROBES_PER_ACCUSER + 4)]
    r = Rendezvous(deadline_s=5)
    r.order(order(2, members))
    for rank, mid in enumerate(members):
        r.put(mid, meet(2, f"world/0/{rank}"), now=0)
    asked = [r.probe(2, mid, "world", "m0") for mid in members[1:]]
    assert sum(a is not None for a in asked) == PROBES_PER_ACCUSER
    assert r.probe(2, "m1", "world", "m2") is None, "asked already"
    assert r.probe(2, members[-1], "world", "m2") is not None, "another accuser has its own budget"


def test_groups_across_zones_have_an_entry_per_stream_and_the_first_says_who_came():
    r = Rendezvous(deadline_s=2)
    r.order(order(6, ["a", "b", "c", "d"], zones=["x", "y", "x", "y"], streams=2))
    for mid, rank in (("a", 0), ("b", 1), ("c", 2), ("d", 3)):
        r.put(mid, meet(6, f"world/0/{rank}"), now=0)
        r.put(mid, meet(6, f"world/1/{rank}"), now=0)
    r.put("a", meet(6, "zone0/0/0"), now=0)
    r.put("c", meet(6, "zone0/0/1"), now=0)
    r.put("b", meet(6, "zone1/0/0"), now=0)
    r.put("d", meet(6, "zone1/0/1"), now=0)
    with pytest.raises(ProtocolError, match="names no stream"):
        r.put("a", meet(6, "zone0/1/0"), now=0)  # a zone's group stays on one stream
    with pytest.raises(ProtocolError, match="names no stream"):
        r.put("a", meet(6, "leaders/2/0"), now=0)
    for padded in ("leaders/00/0", "leaders/0/00", "leaders/+0/0"):  # one spelling per entry
        with pytest.raises(ProtocolError, match="names no"):
            r.put("a", meet(6, padded), now=0)
    # a leads zone x, b zone y. a's second stream comes only once its first connected
    # (gloo connects them in turn): its first entry says it came. b never writes one.
    r.put("a", meet(6, "leaders/0/0"), now=0)
    assert r.absent(6, now=1.9) == {}
    assert r.absent(6, now=2.0) == {"b": ["leaders"]}
    r.put("a", meet(6, "leaders/1/0"), now=2.1)
    assert list(r.take()[6][1])[-1] == "leaders/1/0"
