"""Shard layout and re-shard plan of a sharded zone: pure decisions, checked against an
independent replay over sets of element indices (small zones, so every element is a number)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

import pytest

from unbroken.errors import ConfigError, TransferError
from unbroken.state.shards import (
    Layout,
    Plan,
    Purpose,
    Shard,
    Transfer,
    check_fits,
    holdings,
    layout_for,
    plan,
    replan,
    simulate,
)


def elements(layout: Layout, member: str) -> set[int]:
    return {i for s, e in layout.held(member) for i in range(s, e)}


def replay(p: Plan) -> dict[str, set[int]]:
    """An oracle apart from `simulate`: element by element, what each new member receives.

    Asserts every source is alive and held what it sends, no destination receives an element
    it held or twice, missing ranges are truly without a live holder, and every member ends
    holding its new primary and buddy ranges."""
    alive = set(p.old.members) - p.lost
    had = {m: elements(p.old, m) if m in alive - p.leaving else set() for m in p.new.members}
    got: dict[str, set[int]] = {m: set() for m in p.new.members}
    for t in p.transfers:
        assert t.source in alive, f"{t} reads from a lost member"
        span = set(range(t.start, t.end))
        assert span <= elements(p.old, t.source), f"{t}: source does not hold it"
        assert not span & (had[t.destination] | got[t.destination]), f"{t}: sent what is held"
        got[t.destination] |= span
    for x in p.missing:
        span = set(range(x.start, x.end))
        assert all(not span & elements(p.old, h) for h in alive), f"{x} has a live holder"
        for d in x.to:
            assert not span & (had[d] | got[d])
            got[d] |= span
    for m in p.new.members:
        assert elements(p.new, m) <= had[m] | got[m], f"{m} is short of {sorted(elements(p.new, m) - had[m] - got[m])}"
        assert got[m] <= elements(p.new, m), f"{m} was sent what it will not keep"
    return got


def check(p: Plan) -> dict[str, set[int]]:
    simulate(p)
    return replay(p)


def equal(n: int) -> dict[str, int]:
    return {f"m{i}": 1 for i in range(n)}


# --- layouts -------------------------------------------------------------------------------


def test_equal_weights_give_equal_ranges_each_buddied_by_the_next_member() -> None:
    lay = layout_for(1000, {"a": 5, "b": 5, "c": 5, "d": 5})
    assert [(s.start, s.end, s.primary, s.buddy) for s in lay.shards] == [
        (0, 250, "a", "b"),
        (250, 500, "b", "c"),
        (500, 750, "c", "d"),
        (750, 1000, "d", "a"),
    ]
    assert lay.redundant and lay.spare == ()
    assert holdings(lay) == {"a": 500, "b": 500, "c": 500, "d": 500}  # twice ZeRO-3's share


def test_uneven_weights_give_proportional_aligned_ranges() -> None:
    weights = {"big": 7, "mid": 3, "small": 2}
    lay = layout_for(10_000, weights, align=64)
    total = sum(weights.values())
    for s in lay.shards:
        assert abs(s.size - 10_000 * weights[s.primary] / total) < 2 * 64
        assert s.end == 10_000 or s.end % 64 == 0
    assert [s.primary for s in lay.shards] == ["big", "mid", "small"]  # ring order kept
    assert lay.redundant


def test_a_member_too_small_for_one_granule_is_a_spare() -> None:
    lay = layout_for(1000, {"a": 100, "tiny": 1, "b": 100, "none": 0}, align=100)
    assert lay.spare == ("tiny", "none")
    assert {s.primary for s in lay.shards} == {"a", "b"}
    assert holdings(lay)["tiny"] == holdings(lay)["none"] == 0  # no room for a 500-element copy either
    assert [s.buddy for s in lay.shards] == ["b", "a"]


def test_buddies_favour_members_with_memory_to_spare() -> None:
    lay = layout_for(900, {"a": 1, "b": 1, "c": 1}, budgets={"a": 1000, "b": 300, "c": 1000})
    assert [s.buddy for s in lay.shards] == ["c", "c", "a"]  # b has room for its own range only
    assert holdings(lay) == {"a": 600, "b": 300, "c": 900}


def test_a_layout_that_does_not_fit_is_refused_naming_member_need_budget_and_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        layout_for(1000, {"a": 1, "b": 1}, budgets={"a": 1000, "b": 800})
    text = str(caught.value)
    assert "member 'b' must hold 1,000 elements (primary 500 + buddy copies 500) but its budget is 800" in text
    assert "more memory" in text and "add members" in text and "'a'" not in text
    lay = layout_for(900, {"a": 1, "b": 1, "c": 1})
    check_fits(lay, {"a": 600, "b": 600, "c": 600})
    with pytest.raises(ConfigError, match="no memory budget for member"):
        check_fits(lay, {"a": 600})


@pytest.mark.parametrize(
    ("numel", "weights", "align", "problem"),
    [
        (0, {"a": 1}, 1, "at least 1"),
        (10, {"a": 1}, 0, "at least 1"),
        (10, {"a": -1, "b": 1}, 1, "integers >= 0"),
        (10, {"a": 0, "b": 0}, 1, "no member offers memory"),
    ],
)
def test_bad_inputs_are_refused(numel: int, weights: dict[str, int], align: int, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        layout_for(numel, weights, align=align)


def test_a_layout_with_a_gap_or_a_self_buddy_is_refused() -> None:
    with pytest.raises(ConfigError, match="contiguous"):
        Layout(10, 1, ("a", "b"), (1, 1), (Shard(0, 4, "a", "b"), Shard(5, 10, "b", "a")))
    with pytest.raises(ConfigError, match="buddy of itself"):
        Layout(10, 1, ("a", "b"), (1, 1), (Shard(0, 10, "a", "a"),))
    with pytest.raises(ConfigError, match="distinct"):
        Layout(10, 1, ("a", "a"), (1, 1), (Shard(0, 10, "a", None),))


# --- re-shard plans ------------------------------------------------------------------------


def test_one_loss_is_served_by_the_buddy() -> None:
    old = layout_for(1200, {"a": 1, "b": 1, "c": 1, "d": 1})  # b holds [300, 600), c buddies it
    p = plan(old, lost=["b"])
    check(p)
    assert p.missing == () and p.redundant and p.warnings == ()
    assert all(t.source != "b" for t in p.transfers)
    assert {t.source for t in p.transfers if t.start < 600 and t.end > 300} == {"c"}
    assert p.moved >= holdings(old)["b"]  # every copy b held is made again somewhere
    assert [s.primary for s in p.new.shards] == ["a", "c", "d"]


def test_a_graceful_leaver_sends_its_range_once() -> None:
    old = layout_for(1200, {"a": 1, "b": 1, "c": 1, "d": 1})
    p = plan(old, leaving=["b"])
    check(p)
    assert "b" not in p.new.members and p.missing == ()
    assert any(t.source == "b" for t in p.transfers)  # it can still send, and shares the load with c
    assert {t.source for t in p.transfers if t.start >= 300 and t.end <= 600} == {"b", "c"}
    assert plan(old, lost=["b"]).moved == p.moved  # the same layout; only the sources differ


def test_a_joiner_receives_only_its_new_ranges_from_the_members_holding_them() -> None:
    old = layout_for(1200, {"a": 1, "b": 1, "c": 1, "d": 1})
    p = plan(old, joining={"e": 1})
    got = check(p)
    assert p.new.members == ("a", "b", "c", "d", "e")  # appended at the end of the ring
    assert got["e"] == elements(p.new, "e")
    assert sum(t.size for t in p.transfers if t.destination == "e") == holdings(p.new)["e"] == 480
    to_e = [t for t in p.transfers if t.destination == "e"]
    assert {t.purpose for t in to_e} == {Purpose.PRIMARY, Purpose.BUDDY}
    assert Transfer("d", "e", 960, 1200, Purpose.PRIMARY) in to_e  # from the old primary, not its buddy
    assert p.moved < 1200  # survivors keep most of what they held


def test_a_join_and_a_loss_together() -> None:
    old = layout_for(1200, {"a": 1, "b": 1, "c": 1, "d": 1})
    p = plan(old, lost=["b"], joining={"e": 1})
    got = check(p)
    assert p.new.members == ("a", "c", "d", "e") and p.missing == ()
    assert got["e"] == elements(p.new, "e")
    assert all(t.source != "b" for t in p.transfers)


def test_two_losses_that_do_not_share_a_range_are_served_from_the_zone() -> None:
    old = layout_for(1200, equal(6))
    p = plan(old, lost=["m1", "m3"])
    check(p)
    assert p.missing == () and p.redundant
    assert not {t.source for t in p.transfers} & {"m1", "m3"}


def test_losing_both_holders_of_a_range_names_it_missing() -> None:
    old = layout_for(1200, equal(6))  # m1 holds [200, 400), m2 is its buddy
    p = plan(old, lost=["m1", "m2"])
    check(p)
    assert [(x.start, x.end) for x in p.missing] == [(200, 300), (300, 400)]
    for x in p.missing:
        new = next(s for s in p.new.shards if s.start <= x.start < s.end)
        assert x.to == (new.primary, new.buddy)
    assert any("200 elements lost both holders" in w for w in p.warnings)
    simulate(p)


def test_a_zone_shrunk_to_one_member_says_it_has_no_redundancy() -> None:
    old = layout_for(1000, {"a": 1, "b": 1})
    p = plan(old, lost=["b"])
    check(p)
    assert p.transfers == () and p.missing == ()  # a held b's range as its buddy
    assert not p.redundant and p.new.shards == (Shard(0, 1000, "a", None),)
    assert any("no buddy" in w for w in p.warnings) and "no buddy" in p.reason
    three = plan(layout_for(900, equal(3)), lost=["m0", "m1"])
    check(three)
    assert not three.redundant and [(x.start, x.end, x.to) for x in three.missing] == [(0, 300, ("m2",))]


def test_a_spare_can_become_a_holder_when_the_zone_shrinks() -> None:
    old = layout_for(100, {"a": 5, "b": 5, "s": 1}, align=10)
    assert old.spare == ("s",)
    p = plan(old, lost=["b"])
    check(p)
    assert p.new.spare == () and p.new.primary("s") is not None


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"lost": ["zz"]}, "not members of the zone"),
        ({"lost": ["a"], "leaving": ["a"]}, "both lost and leaving"),
        ({"joining": {"a": 1}}, "already members"),
        ({"lost": ["a", "b"]}, "restore from another zone or the checkpoint"),
    ],
)
def test_impossible_changes_are_refused(kwargs: Mapping[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        plan(layout_for(100, {"a": 1, "b": 1}), **kwargs)  # type: ignore[arg-type]


def test_the_simulator_refuses_a_read_from_a_lost_member_and_an_incomplete_plan() -> None:
    old = layout_for(1200, {"a": 1, "b": 1, "c": 1, "d": 1})
    p = plan(old, lost=["b"])
    from_b = tuple(dataclasses.replace(t, source="b") if t.start == 400 else t for t in p.transfers)
    with pytest.raises(TransferError, match="lost"):
        simulate(Plan(**{**vars(p), "transfers": from_b}))
    with pytest.raises(TransferError, match="would lack"):
        simulate(Plan(**{**vars(p), "transfers": p.transfers[1:]}))


# --- properties over many scenarios ----------------------------------------------------------


def scenario(rng: random.Random) -> tuple[Layout, dict[str, object]]:
    n = rng.randint(1, 8)
    weights = {f"m{i}": rng.choice([0, 1, 1, 2, 3, 5, 8, 13]) for i in range(n)}
    weights["m0"] = max(1, weights["m0"])
    align = rng.choice([1, 1, 4, 16])
    old = layout_for(rng.randint(1, 600), weights, align=align)
    members = list(old.members)
    rng.shuffle(members)
    n_lost, n_leaving = rng.randint(0, min(2, n)), rng.randint(0, 1)
    changes: dict[str, object] = {
        "lost": members[:n_lost],
        "leaving": members[n_lost : n_lost + n_leaving],
        "joining": {f"j{i}": rng.randint(0, 6) for i in range(rng.choice([0, 0, 1, 2]))},
    }
    return old, changes


def test_every_plan_is_complete_and_never_reads_from_a_lost_member() -> None:
    rng = random.Random(37)
    planned = refused = 0
    for _ in range(400):
        old, changes = scenario(rng)
        try:
            p = plan(old, **changes)  # type: ignore[arg-type]
        except ConfigError as e:
            assert "no member with memory is left" in str(e)
            refused += 1
            continue
        planned += 1
        check(p)
        assert not {t.source for t in p.transfers} & p.lost
        if old.redundant and len(p.lost) <= 1:
            assert p.missing == (), "a single death must lose nothing"
        assert p.redundant == (sum(w > 0 for w in p.new.weights) >= 2)
        assert plan(old, **changes) == p  # type: ignore[arg-type]  # deterministic
    assert planned > 300 and refused > 0


def test_bytes_moved_on_one_loss_stay_within_the_bound() -> None:
    """On one loss, moved = held_lost + dropped: every copy the lost member held is made again,
    and anything else sent replaces a copy some survivor drops (both layouts hold 2·numel).

    Upper bound, element by element: a survivor's new primary range P' needs from outside its
    old primary P at most |P' − P| (summed: D), and so does its buddy if the buddy is unchanged
    (that member held P). A buddy that changed costs |P' ∩ P| more: only where the old buddy
    was the lost member (B: what the lost member was buddy for) or had no room (R, none among
    equal members). So moved ≤ 2·D + B + R."""
    rng = random.Random(1)
    for trial in range(300):
        n = rng.randint(3, 8)
        same = trial % 2 == 0
        weights = {f"m{i}": 4 if same else rng.randint(1, 10) for i in range(n)}
        align = rng.choice([1, 4, 16])
        old = layout_for(rng.randint(n * align, 3000), weights, align=align)
        victim = rng.choice(old.members)
        p = plan(old, lost=[victim])
        check(p)
        held_lost = holdings(old)[victim]
        dropped = sum(len(elements(old, m) - elements(p.new, m)) for m in p.new.members)
        assert p.moved == held_lost + dropped
        d = b = r = 0
        for s in p.new.shards:
            was = old.primary(s.primary)
            kept = len(set(range(s.start, s.end)) & set(range(was.start, was.end))) if was else 0
            d += s.size - kept
            if was and was.buddy == victim:
                b += kept
            elif was and was.buddy != s.buddy:
                r += kept
        assert b <= holdings(old)[victim] - (old.primary(victim) or Shard(0, 0, victim, None)).size
        assert r == 0 or not same, "equal members keep their live buddies"
        assert held_lost <= p.moved <= 2 * d + b + r


def test_a_plan_from_what_members_hold_now_moves_what_the_layout_plan_moves() -> None:
    """`replan` (sources: each live member's current ranges, whatever layout) gives the layout
    and the elements sent that `plan` gives where every member holds one layout."""
    rng = random.Random(41)
    compared = 0
    for _ in range(400):
        old, changes = scenario(rng)
        lost, leaving = set(changes["lost"]), set(changes["leaving"])  # type: ignore[call-overload]
        if leaving:
            continue  # a graceful leaver is a source in `plan`, gone in `replan`
        try:
            p = plan(old, **changes)  # type: ignore[arg-type]
        except ConfigError:
            continue
        holders = {m: old.held(m) for m in old.members if m not in lost}
        weights = {m: old.weight(m) for m in old.members if m not in lost} | dict(changes["joining"])  # type: ignore[call-overload]
        r = replan(old, holders, weights)
        assert r.new == p.new
        assert sorted((t.destination, t.start, t.end) for t in _pieces(r)) == sorted(
            (t.destination, t.start, t.end) for t in _pieces(p)
        )
        assert bool(r.missing) == bool(p.missing)
        if not r.missing:
            check(r)
        compared += 1
    assert compared > 150


def _pieces(p: Plan) -> list[Transfer]:
    """The transfers cut to single elements' destinations (merging may differ by source)."""
    out = []
    for t in p.transfers:
        out += [Transfer(t.source, t.destination, i, i + 1, t.purpose) for i in range(t.start, t.end)]
    return out
