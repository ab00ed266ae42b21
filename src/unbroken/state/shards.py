"""The shard layout of a sharded zone, and the re-shard plan when members are lost, leave or join.

A zone's replicated state is one flat index space ``[0, numel)``: the elements of its
parameters concatenated in a fixed order (the optimizer state follows the same indices). A
`Layout` cuts it into contiguous ranges, one per member, sized in proportion to the memory
each member offers, and gives every range a second holder, its *buddy*, so that one death
loses nothing::

    index    0 ──────────── 400 ──────── 600 ──────── 800 ──────── 1000
    primary  │      a        │     b      │     c      │     d      │
    buddy    │      b        │     c      │     d      │     a      │

A range's buddy is the next member in ring order (after its primary) with room for it; a
member's room is its budget where budgets are given, else its share of the zone's two copies,
``2·numel·w/W`` for weight ``w`` of total ``W``, plus two granules of rounding. A spare with
room may thus hold copies (a standby holding redundancy); a member offering weight 0 holds none.

Memory cost (redundancy factor 2): the zone holds ``2·numel`` elements, and a member holds its
primary range plus every range it is buddy for: ``2·numel/n`` for n equal members (twice
ZeRO-3's share; full replication costs ``numel``), near ``2·numel·w/W`` for uneven ones. A range
larger than every other member's room (one dominant member) still needs a buddy: it goes where
the most room is left, and `check_fits` refuses the layout if that exceeds a budget.

`plan` turns (old layout; members lost, leaving, joining) into the new layout and the
transfers that give every member what the new layout asks of it; `simulate` replays a plan
over sets of held ranges and refuses one that is incomplete, wasteful, or reads from a lost
member. Everything here is pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from unbroken.errors import ConfigError, TransferError

Ranges = tuple[tuple[int, int], ...]
"""Disjoint half-open ``(start, end)`` ranges of the index space, in order."""


@dataclass(frozen=True)
class Shard:
    """One contiguous range ``[start, end)`` and the two members that hold it."""

    start: int
    end: int
    primary: str
    """Steps the optimizer on this range, and is the first source asked for it."""
    buddy: str | None
    """Holds a copy current at every committed step; None only where no other member could."""

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout:
    """Who holds which range of a zone's state. Build one with `layout_for` or `plan`."""

    numel: int
    """Elements in the zone's index space."""
    align: int
    """Range boundaries fall on multiples of this (the last range ends at ``numel``)."""
    members: tuple[str, ...]
    """Every member in ring order, spares included: the order a re-shard keeps."""
    weights: tuple[int, ...]
    """The memory each member offers (any integer unit: bytes, GB), parallel to ``members``."""
    shards: tuple[Shard, ...]
    """In index order, covering ``[0, numel)`` without gap, one per member that has a range."""

    def __post_init__(self) -> None:
        if self.numel < 1 or self.align < 1:
            raise ConfigError(f"a layout needs numel >= 1 and align >= 1, got {self.numel} and {self.align}")
        if not len(set(self.members)) == len(self.members) == len(self.weights) or any(w < 0 for w in self.weights):
            raise ConfigError(f"layout members must be distinct, one weight >= 0 each: {self.members} / {self.weights}")
        at, seen = 0, set()
        for s in self.shards:
            where = f"layout shard [{s.start}, {s.end}) of {s.primary!r}"
            if s.start != at or s.end <= s.start or (s.end != self.numel and s.end % self.align):
                raise ConfigError(f"{where}: ranges must be contiguous from 0, non-empty, on multiples of {self.align}")
            if s.primary not in self.members or s.primary in seen or s.buddy not in (*self.members, None):
                raise ConfigError(f"{where}: primary unknown or repeated, or buddy unknown")
            if s.buddy == s.primary:
                raise ConfigError(f"{where}: a member cannot be buddy of itself")
            at = s.end
            seen.add(s.primary)
        if at != self.numel:
            raise ConfigError(f"layout shards end at {at}, not at numel {self.numel}")

    @property
    def spare(self) -> tuple[str, ...]:
        """Members too small for one ``align`` granule: validators or standbys, in ring order."""
        holders = {s.primary for s in self.shards}
        return tuple(m for m in self.members if m not in holders)

    @property
    def redundant(self) -> bool:
        """Every range has a buddy: one loss of any member loses nothing."""
        return all(s.buddy is not None for s in self.shards)

    def weight(self, member: str) -> int:
        return self.weights[self.members.index(member)]

    def primary(self, member: str) -> Shard | None:
        """The member's own range (None for a spare)."""
        return next((s for s in self.shards if s.primary == member), None)

    def buddy_for(self, member: str) -> tuple[Shard, ...]:
        """The ranges the member keeps a copy of."""
        return tuple(s for s in self.shards if s.buddy == member)

    def held(self, member: str) -> Ranges:
        """Everything the member holds: its primary range and the ranges it is buddy for."""
        return _union((s.start, s.end) for s in self.shards if member in (s.primary, s.buddy))


class Purpose(str, enum.Enum):
    """What the destination of a transfer will hold the range as."""

    PRIMARY = "primary"
    BUDDY = "buddy"


@dataclass(frozen=True)
class Transfer:
    """Send elements ``[start, end)`` from ``source`` to ``destination``."""

    source: str
    destination: str
    start: int
    end: int
    purpose: Purpose

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Missing:
    """A range whose every old holder was lost: it cannot come from the zone."""

    start: int
    end: int
    to: tuple[str, ...]
    """The members that hold it in the new layout (primary first); where its values come
    from is `unbroken.state.fallback`'s choice."""


@dataclass(frozen=True)
class Plan:
    """A re-shard: the new layout, the transfers within the zone, and what must come from outside."""

    old: Layout
    new: Layout
    lost: frozenset[str]
    """Killed members: their memory is gone, nothing is read from them."""
    leaving: frozenset[str]
    """Graceful leavers: they send what is asked of them once, and are then out of the zone."""
    joining: tuple[str, ...]
    transfers: tuple[Transfer, ...]
    missing: tuple[Missing, ...]
    warnings: tuple[str, ...]
    """Degraded redundancy or missing ranges, said in words for events and logs."""

    @property
    def redundant(self) -> bool:
        """The new layout has a buddy for every range (False: a zone left with one member)."""
        return self.new.redundant

    @property
    def moved(self) -> int:
        """Elements sent inside the zone (each destination counted)."""
        return sum(t.size for t in self.transfers)

    @property
    def reason(self) -> str:
        changes = (("lost", self.lost), ("leaving", self.leaving), ("joining", self.joining))
        parts = [f"{what} {', '.join(sorted(who))}" for what, who in changes if who]
        parts.append(f"{len(self.transfers)} transfers moving {self.moved:,} elements")
        return "; ".join([*parts, *self.warnings])


def layout_for(
    numel: int, weights: Mapping[str, int], *, align: int = 1, budgets: Mapping[str, int] | None = None
) -> Layout:
    """The layout of a zone whose members offer ``weights`` (ring order: the mapping's order).

    Each member with room for at least one granule of ``align`` elements gets a contiguous range
    in proportion to its weight (largest remainders, ties to the earlier member); the others
    are spares. ``budgets``: elements each member can hold; given, buddies are chosen against
    them instead of against the weights, and a layout that does not fit is refused.

    Raises:
        ConfigError: bad weights, or a member's holdings exceed its budget (`check_fits`).
    """
    if numel < 1 or align < 1:
        raise ConfigError(f"numel and align must be at least 1, got {numel} and {align}")
    if bad := [m for m, w in weights.items() if isinstance(w, bool) or not isinstance(w, int) or w < 0]:
        raise ConfigError(f"weights must be integers >= 0 (the memory offered); bad for {bad}")
    names = list(weights)
    pos = {m: i for i, m in enumerate(names)}
    granules = -(-numel // align)
    # Holders: the heaviest members, as many as each still get a whole granule among themselves
    # (monotone: if the k-th heaviest gets one among k, every heavier one does among fewer).
    heaviest = sorted(names, key=lambda m: (-weights[m], pos[m]))
    k = total = 0
    for m in heaviest:
        if weights[m] == 0 or granules * weights[m] < total + weights[m]:
            break
        k, total = k + 1, total + weights[m]
    if k == 0:
        raise ConfigError(f"no member offers memory: weights {dict(weights)}")
    top = set(heaviest[:k])
    holders = [m for m in names if m in top]
    count = {m: granules * weights[m] // total for m in holders}
    by_remainder = sorted(holders, key=lambda m: (-(granules * weights[m] % total), pos[m]))
    for m in by_remainder[: granules - sum(count.values())]:
        count[m] += 1
    cuts, at = [], 0
    for m in holders:
        cuts.append((at, min(numel, at + count[m] * align), m))
        at += count[m] * align
    if budgets is None:
        # A member's share of the zone's two copies, plus the two granules its two ranges may
        # be rounded up by: equal members then always fit their ring neighbour's range.
        room = {m: align * (Fraction(2 * granules * weights[m], sum(weights.values())) + 2) for m in names}
    else:
        room = {m: Fraction(budgets.get(m, 0)) for m in names}
    for start, end, m in cuts:
        room[m] -= end - start
    shards = []
    for start, end, m in cuts:
        after = names[pos[m] + 1 :] + names[: pos[m]]
        candidates = [c for c in after if weights[c] > 0]
        # The next member in ring order with room for the range; where none has (a dominant
        # member's range), the one with the most room left.
        fits = [c for c in candidates if room[c] >= end - start]
        buddy = fits[0] if fits else max(candidates, key=lambda c: room[c], default=None)
        if buddy is not None:
            room[buddy] -= end - start
        shards.append(Shard(start, end, m, buddy))
    result = Layout(numel, align, tuple(names), tuple(weights[m] for m in names), tuple(shards))
    if budgets is not None:
        check_fits(result, budgets)
    return result


def holdings(layout: Layout) -> dict[str, int]:
    """Elements each member holds, primary and buddy copies together: what a budget must cover."""
    return {m: sum(e - s for s, e in layout.held(m)) for m in layout.members}


def check_fits(layout: Layout, budgets: Mapping[str, int]) -> None:
    """Refuse a layout where some member must hold more elements than its budget.

    Raises:
        ConfigError: naming each such member, its need, its budget, and the ways out.
    """
    need = holdings(layout)
    if absent := [m for m in layout.members if m not in budgets]:
        raise ConfigError(f"no memory budget for member(s) {', '.join(map(repr, absent))}: give every member one")
    over = []
    for m in layout.members:
        if need[m] > budgets[m]:
            own = p.size if (p := layout.primary(m)) else 0
            over.append(
                f"member {m!r} must hold {need[m]:,} elements (primary {own:,} + buddy copies "
                f"{need[m] - own:,}) but its budget is {budgets[m]:,}"
            )
    if over:
        offered = sum(budgets[m] for m in layout.members)
        raise ConfigError(
            "; ".join(over) + f". The zone needs {2 * layout.numel:,} elements in all (2 copies) and offers "
            f"{offered:,}: give each member named more memory, lower its weight so its range shrinks, or add members"
        )


def plan(
    old: Layout,
    *,
    lost: Iterable[str] = (),
    leaving: Iterable[str] = (),
    joining: Mapping[str, int] | None = None,
    budgets: Mapping[str, int] | None = None,
) -> Plan:
    """Re-shard ``old`` after losses, graceful leaves and joins; survivors keep their weights.

    The new layout keeps the old ring order and appends joiners (in the mapping's order), so a
    survivor's new range overlaps its old one as far as proportional sizes allow, and a range
    keeps its buddy unless that buddy is gone, out of room, or a joiner now follows the range's
    primary in the ring (`layout_for`'s ring rule). A
    destination is sent only what it does not hold already (as old primary or buddy), and
    each element it lacks comes exactly once, from a live old holder: the least loaded so far,
    the primary on a tie (largest pieces placed first, to spread the load).

    Minimised: bytes moved *given* the new layout (nothing sent twice, nothing sent that is
    held). Not minimised: the layout itself, which stays proportional rather than cheapest to
    reach (a loss in the middle shifts the ranges after it, and a dominant range's buddy may
    move for room): a lopsided layout that moved less once would cost memory balance at every
    later step. On one loss the elements moved are at least what the lost member held (each of
    its copies is made again) and at most ``2·D + B + R``: D the elements survivors newly hold
    as primary (their ranges' shift), each sent to its primary and its buddy; B the ranges the
    lost member was buddy for; R those whose live buddy changed for room (none among equal
    members). Ranges both of whose holders were lost are
    listed in ``missing``; a zone left without a second member says so in ``warnings``.

    Raises:
        ConfigError: unknown, repeated or conflicting members, no member left, or no fit.
    """
    joining = dict(joining or {})
    lost_set, leaving_set = frozenset(lost), frozenset(leaving)
    known = set(old.members)
    if bad := sorted((lost_set | leaving_set) - known):
        raise ConfigError(f"cannot lose or leave {bad}: not members of the zone {sorted(known)}")
    if both := sorted(lost_set & leaving_set):
        raise ConfigError(f"members {both} are both lost and leaving: a member is one or the other")
    if again := sorted(set(joining) & known):
        raise ConfigError(f"joiners {again} are already members of the zone: a rejoin uses a new member name")
    gone = lost_set | leaving_set
    weights = {m: old.weight(m) for m in old.members if m not in gone} | joining
    if not any(w > 0 for w in weights.values()):
        raise ConfigError("no member with memory is left in the zone: restore from another zone or the checkpoint")
    kept = {m: old.held(m) for m in old.members if m not in gone}
    new = layout_for(old.numel, weights, align=old.align, budgets=budgets)

    def alive_holders(s: Shard) -> list[str]:
        return [h for h in (s.primary, s.buddy) if h is not None and h not in lost_set]

    missing: list[Missing] = []
    for n in new.shards:
        for o in old.shards:
            lo, hi = max(n.start, o.start), min(n.end, o.end)
            if lo < hi and not alive_holders(o):
                to = (n.primary,) if n.buddy is None else (n.primary, n.buddy)
                if missing and (missing[-1].end, missing[-1].to) == (lo, to):
                    lo = missing.pop().start
                missing.append(Missing(lo, hi, to))
    pieces = []  # (size, start, end, destination, purpose, sources)
    for m in new.members:
        own = [(p, Purpose.PRIMARY)] if (p := new.primary(m)) else []
        for shard, purpose in own + [(s, Purpose.BUDDY) for s in new.buddy_for(m)]:
            for lo, hi in _minus(((shard.start, shard.end),), kept.get(m, ())):
                for o in old.shards:
                    a, b = max(lo, o.start), min(hi, o.end)
                    if a < b and (sources := alive_holders(o)):
                        pieces.append((b - a, a, b, m, purpose, sources))
    load: dict[str, int] = {}
    transfers = []
    for size, a, b, m, purpose, sources in sorted(pieces, key=lambda p: (-p[0], p[1], p[3])):
        src = min(sources, key=lambda h: load.get(h, 0))  # min() keeps the first (the primary) on a tie
        load[src] = load.get(src, 0) + size
        transfers.append(Transfer(src, m, a, b, purpose))
    alone = sorted(s.primary for s in new.shards if s.buddy is None)
    lacking = sum(x.end - x.start for x in missing)
    warnings = []
    if alone:
        warnings.append(f"no buddy for the ranges of {alone} (no other member): a loss now needs another zone")
    if lacking:
        warnings.append(f"{lacking:,} elements lost both holders: from another zone, else the last checkpoint")
    return Plan(old, new, lost_set, leaving_set, tuple(joining), _merged(transfers), tuple(missing), tuple(warnings))


def replan(
    base: Layout,
    holders: Mapping[str, Ranges],
    weights: Mapping[str, int],
    *,
    outside: Mapping[str, Ranges] | None = None,
    budgets: Mapping[str, int] | None = None,
) -> Plan:
    """Re-shard to the members of ``weights`` from what each live member holds now.

    ``holders``: each live member's current ranges, whatever layout they came from (a
    re-shard cut short by a death leaves some members on the new layout and some on the old
    one, at the same step: all of their ranges are current). ``base``: the newest layout held,
    whose ring order the new one keeps (members of ``weights`` not in it follow, in the
    mapping's order). A destination is sent only what it does not hold, each element once,
    from the least loaded live holder; elements no live member holds come from ``outside``
    (another zone's members: what each holds of the same state), else they are ``missing``.
    `plan` is the same for a zone whose members all hold one layout.

    Raises:
        ConfigError: no member with memory, or no fit (`layout_for`).
    """
    order = [m for m in base.members if m in weights] + [m for m in weights if m not in base.members]
    new = layout_for(base.numel, {m: weights[m] for m in order}, align=base.align, budgets=budgets)
    held = {h: _union(r) for h, r in holders.items()}
    far = {h: _union(r) for h, r in (outside or {}).items()}
    points = sorted({x for r in [*held.values(), *far.values()] for s, e in r for x in (s, e)})
    pieces, lacking = [], []
    for m in new.members:
        own = [(p, Purpose.PRIMARY)] if (p := new.primary(m)) else []
        for shard, purpose in own + [(s, Purpose.BUDDY) for s in new.buddy_for(m)]:
            for lo, hi in _minus(((shard.start, shard.end),), held.get(m, ())):
                cuts = [lo, *(x for x in points if lo < x < hi), hi]  # one set of holders per segment
                for a, b in itertools.pairwise(cuts):
                    sources = [h for h, r in held.items() if h != m and not _minus(((a, b),), r)]
                    sources = sources or [h for h, r in far.items() if not _minus(((a, b),), r)]
                    if sources:
                        pieces.append((b - a, a, b, m, purpose, sources))
                    else:
                        lacking.append((a, b, m))
    load: dict[str, int] = {}
    transfers = []
    for size, a, b, m, purpose, sources in sorted(pieces, key=lambda p: (-p[0], p[1], p[3])):
        src = min(sources, key=lambda h: load.get(h, 0))
        load[src] = load.get(src, 0) + size
        transfers.append(Transfer(src, m, a, b, purpose))
    missing: list[Missing] = []
    for a, b, m in sorted(lacking):
        if missing and (missing[-1].start, missing[-1].end) == (a, b):
            missing[-1] = dataclasses.replace(missing[-1], to=(*missing[-1].to, m))
        else:
            missing.append(Missing(a, b, (m,)))
    lost = frozenset(m for m in base.members if m not in holders)
    joining = tuple(m for m in order if m not in base.members)
    warnings = []
    if alone := sorted(s.primary for s in new.shards if s.buddy is None):
        warnings.append(f"no buddy for the ranges of {alone} (no other member): a loss now needs another zone")
    if lost_elements := sum(e - s for s, e in _union((x.start, x.end) for x in missing)):
        warnings.append(f"{lost_elements:,} elements lost every holder: from another zone, else the last checkpoint")
    return Plan(base, new, lost, frozenset(), joining, _merged(transfers), tuple(missing), tuple(warnings))


def simulate(plan: Plan) -> dict[str, Ranges]:
    """Replay ``plan`` over sets of held ranges; what each new member holds at the end.

    Missing ranges count as delivered by their fallback. Checks that every source is alive and
    held what it sends in the old layout, that no destination is sent what it held or will not
    keep, or anything twice, and that every member ends with exactly its new primary and buddy
    ranges (what it held beyond them it drops).

    Raises:
        TransferError: the first rule the plan breaks.
    """
    old, new = plan.old, plan.new
    had = {m: old.held(m) if m in old.members and m not in plan.lost | plan.leaving else () for m in new.members}
    got: dict[str, Ranges] = {m: () for m in new.members}

    def deliver(dest: str, start: int, end: int, what: str) -> None:
        if dest not in got:
            raise TransferError(f"{what} goes to {dest!r}, not a member of the new layout")
        if _inter(had[dest], start, end) or _inter(got[dest], start, end):
            raise TransferError(f"{what} sends {dest!r} elements it already holds or was sent")
        if _minus(((start, end),), new.held(dest)):
            raise TransferError(f"{what} sends {dest!r} elements the new layout does not give it")
        got[dest] = _union([*got[dest], (start, end)])

    for t in plan.transfers:
        what = f"transfer [{t.start}, {t.end}) {t.source!r} -> {t.destination!r}"
        if t.source in plan.lost or t.source not in old.members:
            raise TransferError(f"{what} reads from a lost or unknown member")
        if _minus(((t.start, t.end),), old.held(t.source)):
            raise TransferError(f"{what}: the source did not hold all of it")
        deliver(t.destination, t.start, t.end, what)
    for x in plan.missing:
        if any(h not in plan.lost for h in old.members if _inter(old.held(h), x.start, x.end)):
            raise TransferError(f"missing range [{x.start}, {x.end}) has a live holder in the zone")
        for dest in x.to:
            deliver(dest, x.start, x.end, f"missing range [{x.start}, {x.end}) from outside the zone")
    for m in new.members:
        if short := _minus(new.held(m), _union([*had[m], *got[m]])):
            raise TransferError(f"member {m!r} would lack {list(short)} of its new ranges")
    return {m: new.held(m) for m in new.members}


def union(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """The ranges merged: sorted, adjacent and overlapping ones as one (`Layout.held`'s form)."""
    return _union(ranges)


def _union(ranges: Iterable[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for s, e in sorted(r for r in ranges if r[0] < r[1]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return tuple(out)


def _inter(ranges: Ranges, start: int, end: int) -> Ranges:
    return tuple((max(s, start), min(e, end)) for s, e in ranges if max(s, start) < min(e, end))


def _minus(ranges: Ranges, taken: Ranges) -> Ranges:
    out = []
    for s, e in ranges:
        for ts, te in taken:
            if ts > s:
                out.append((s, min(e, ts)))
            s = max(s, te)
        if s < e:
            out.append((s, e))
    return _union(out)


def _merged(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    """In index order, adjacent pieces between the same pair for the same purpose as one."""
    out: list[Transfer] = []
    for t in sorted(transfers, key=lambda t: (t.destination, t.purpose.value, t.source, t.start)):
        if out and dataclasses.replace(out[-1], start=t.start, end=t.end) == t and out[-1].end == t.start:
            t = dataclasses.replace(out.pop(), end=t.end)
        out.append(t)
    return tuple(sorted(out, key=lambda t: (t.start, t.destination)))
