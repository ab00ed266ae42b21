"""Epoch orders as sent: runs and changes against the previous order, rebuilt exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken.control import messages as m
from unbroken.control.orders import compact, complete
from unbroken.errors import ProtocolError


def order(epoch: int, members: list[str], shares: list[int] | None = None, **kw: object) -> m.EpochOrder:
    n = len(members)
    return m.EpochOrder(
        epoch=epoch,
        members=members,
        shares=shares if shares is not None else [4] * n,
        urgent=False,
        reason="test",
        roles=kw.pop("roles", ["trainer"] * n),  # type: ignore[arg-type]
        microbatches=[4] * n,
        **kw,  # type: ignore[arg-type]
    )


def test_ten_thousand_members_one_leaves_a_change_of_a_few_hundred_bytes():
    ids = [f"node{i}#{i:08x}" for i in range(10_000)]
    e1 = order(1, ids)
    e2 = order(2, ids[:17] + ids[18:] + ["late#00000001"])
    sent = compact(e2, e1)
    assert len(m.encode(sent)) < 600 < 100 * 1000 < len(m.encode(e2))  # the fields of every order: ~520 B
    assert complete(m.parse_coordinator_message(m.encode(sent)), e1) == e2  # type: ignore[arg-type]
    first = compact(e1)  # a joiner gets the members in full, the lists as runs
    assert len(m.encode(first)) < len(m.encode(e1)) * 0.6
    assert complete(first, None) == e1


def test_a_change_to_an_order_the_node_does_not_hold_is_refused():
    e1, e2, e3 = order(1, ["a", "b"]), order(2, ["a", "b", "c"]), order(3, ["a", "c"])
    with pytest.raises(ProtocolError, match="change to epoch 2; this node has 1"):
        complete(compact(e3, e2), e1)
    with pytest.raises(ProtocolError, match="removes a rank"):
        complete(compact(e3, e2).model_copy(update={"removed": [7]}), e2)
    with pytest.raises(ProtocolError, match="3 members but 2 shares"):
        complete(e2.model_copy(update={"shares": [1, 2]}), None)


def test_an_order_that_reorders_members_goes_in_full():
    e1, e2 = order(1, ["a", "b", "c"]), order(2, ["c", "a", "b"])
    assert compact(e2, e1).base == 0 and complete(compact(e2, e1), e1) == e2


@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=40, unique=True),
    st.lists(st.integers(0, 30), max_size=40, unique=True),
    st.lists(st.integers(0, 3), min_size=80, max_size=80),
    st.lists(st.sampled_from(["trainer", "validator", "standby"]), min_size=80, max_size=80),
)
def test_any_change_round_trips_exactly(before, joined, shares, roles):
    old = order(1, [f"m{i}" for i in before])
    kept = [f"m{i}" for i in before if i % 3]
    new_ids = kept + [f"n{i}" for i in joined]
    if not new_ids:
        return
    n = len(new_ids)
    new = order(2, new_ids, shares[:n], roles=roles[:n], zones=["z"] * n)
    for base in (old, None):
        sent = m.parse_coordinator_message(m.encode(compact(new, base)))
        assert complete(sent, old) == new  # type: ignore[arg-type]


def test_a_relays_burst_is_split_into_batches_under_the_limit_in_order():
    from unbroken.control.batches import chunks as _chunks

    said = [(m.Said(member=f"n{i}", msg=m.Leave()), size) for i, size in enumerate([100, 200, 300, 900, 50, 60])]
    parts = _chunks(said, 500)
    assert [[s.member for s in p] for p in parts] == [["n0", "n1"], ["n2"], ["n3"], ["n4", "n5"]]
    assert _chunks([], 500) == [[]]
