"""DiLoCo's outer exchange between sharded zones, range by range (`train.sharded_outer`).

Each zone holds a whole replica, sharded by its own layout, so two zones' ranges generally
cut the flat space at different places. A zone's contribution to a range is its
pseudo-gradient there, encoded by its primary, one payload for the whole range (with that
range's own error-feedback residual: `RangeCodecs`). Every member of another zone that
holds elements of the range (primary or buddy) receives the payload, point to point on the
epoch's group, decodes it and keeps the elements it holds. A member's own zone's part is
its own encoding: a primary and its buddy hold the same values, anchor and residual, so
they encode the same bytes, and nothing moves inside a zone::

    zone A  [0 ........ 60)[60 ............ 100)     a1 primary of [0, 60), a2 of [60, 100)
    zone B  [0 .... 45)[45 ............... 100)      b1 primary of [0, 45), b2 of [45, 100)

    a1 receives B's [0, 45) from b1 and [45, 100) from b2 (and keeps [45, 60) of the latter);
    b1 receives A's [0, 60) from a1 (keeps [0, 45)); and so on for the buddies.

Every holder of an element, in every zone, adds the zones' decoded parts in zone order
(float32, from zeros): the same bytes, the same order, the same sum, so the holders of a
range agree and so do the zones.

Each member posts its sends and receives in one order all members share (`posts`): the
epoch's group connects a pair of ranks on its first use, and that first use blocks, so two
members that each first reach a connection the other reaches later would wait for good.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from unbroken.comm.codecs import Codec, make_codec
from unbroken.comm.group import EpochScope, ProcessGroup, posted, run_abortable
from unbroken.comm.robust import all_finite
from unbroken.errors import BadContribution
from unbroken.specs import CodecSpec
from unbroken.state.shards import Layout

if TYPE_CHECKING:
    from unbroken.comm.sharded import ShardedModel

Span = tuple[int, int]


@dataclass(frozen=True)
class Source:
    """One zone's primary range: the payload its primary sends to other zones' holders."""

    zone: str
    start: int
    end: int
    primary: str
    tag: int
    """Its index over every zone's ranges in zone order: the message tag, the same everywhere."""


def sources(layouts: Mapping[str, Layout]) -> list[Source]:
    """Every zone's ranges, zone by zone in the order of ``layouts``, range by range."""
    out: list[Source] = []
    for zone, layout in layouts.items():
        for s in layout.shards:
            out.append(Source(zone, s.start, s.end, s.primary, len(out)))
    return out


def overlap(a: Span, b: Span) -> Span | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def held_by(layout: Layout, member: str) -> list[Span]:
    """The ranges ``member`` holds in ``layout``, each as its own span (primary first)."""
    own = [(s.start, s.end) for s in layout.shards if s.primary == member]
    return own + [(s.start, s.end) for s in layout.shards if s.buddy == member]


def tiles(layouts: Mapping[str, Layout], span: Span) -> list[tuple[Source, Span]]:
    """What ``span`` (a range of one zone) is summed from: every zone's ranges that cut it,
    each with the part of ``span`` it covers, zone by zone in order. Each zone covers every
    element of ``span`` exactly once (its layout tiles the flat space)."""
    return [(src, part) for src in sources(layouts) if (part := overlap((src.start, src.end), span)) is not None]


@dataclass(frozen=True)
class Routes:
    """What one member sends and receives in the exchange."""

    sends: tuple[tuple[Source, tuple[str, ...]], ...]
    """Its primary ranges, each with the members of other zones that hold any of it."""
    receives: tuple[Source, ...]
    """Other zones' ranges that cut a range it holds."""


def routes(layouts: Mapping[str, Layout], zone: str, me: str) -> Routes:
    """``me``'s sends and receives, ``me`` a member of ``zone`` (pure: every member computes
    every other's from the same layouts)."""
    mine = held_by(layouts[zone], me)
    sends = []
    receives = []
    for src in sources(layouts):
        if src.zone == zone:
            if src.primary != me:
                continue
            to = [
                m
                for z, layout in layouts.items()
                if z != zone
                for m in layout.members
                if any(overlap((src.start, src.end), h) for h in held_by(layout, m))
            ]
            if to:
                sends.append((src, tuple(to)))
        elif any(overlap((src.start, src.end), h) for h in mine):
            receives.append(src)
    return Routes(tuple(sends), tuple(receives))


@dataclass(frozen=True)
class Post:
    """One send or receive of the exchange, as one member posts it."""

    source: Source
    """The range whose payload it carries (its tag)."""
    peer: str
    """The member at the other end: the receiver of a send, the range's primary for a receive."""
    send: bool


def posts(layouts: Mapping[str, Layout], zone: str, me: str, ranks: Mapping[str, int]) -> list[Post]:
    """``me``'s sends and receives (`routes`) in the order it posts them: by tag, then by
    the peer's rank.

    Why an order: across zones the epoch's group is built lazily (`Meeting.devices`): a pair
    of ranks connects on its first send or receive, once per stream (the tag picks the
    stream), and that first use blocks the posting thread until the peer's first use of the
    same connection (gloo's listening side waits for the connecting side, and which side
    listens depends on the ports). In `routes` order (its sends, then its receives) two
    members could each block on a connection the other reaches only later: a hang of the
    whole exchange, first seen after a member was benched, but open to any epoch whose
    pairs were not yet connected. Posted in this order, every member meets its connections in
    one global order, the first use of each ranked by (tag, lower rank, higher rank): both
    ends post the same operations on a connection, so they agree which is first, and a
    member waiting at one connection waits for a peer that is at an earlier one or gets there,
    so the waits cannot form a cycle. For one member, that global order is (tag, peer's rank).
    """
    r = routes(layouts, zone, me)
    out = [Post(src, m, True) for src, to in r.sends for m in to]
    out += [Post(src, src.primary, False) for src in r.receives]
    return sorted(out, key=lambda p: (p.source.tag, ranks[p.peer]))


def receivers(layouts: Mapping[str, Layout], zone: str, sender: str) -> list[str]:
    """The members of other zones that receive ``sender``'s primary ranges (``sender`` a
    member of ``zone``; pure, as `routes`)."""
    return sorted({m for _, to in routes(layouts, zone, sender).sends for m in to})


def named(
    accused: Sequence[int], layouts: Mapping[str, Layout], zone_of: Mapping[str, str], ranks: Mapping[str, int]
) -> int | None:
    """The sender that the exchange's receivers name together, or None: ``accused[r]`` is the
    rank whose range rank ``r`` found not finite (-1: none; gathered, so each rank's entry is
    its own word). A sender is named once most of the members that received its range did,
    never on one word alone: a receiver that lies cannot have everyone name an honest
    sender; or once it named itself (its own part not finite: its word costs it alone).
    Every member gets the same answer from the same gathered entries."""
    by_rank = {r: member for member, r in ranks.items()}
    for sender in sorted({r for r in accused if r in by_rank}):
        if accused[sender] == sender:
            return sender
        member = by_rank[sender]
        heard = {ranks[m] for m in receivers(layouts, zone_of[member], member)}
        said = sum(1 for r, a in enumerate(accused) if a == sender and r in heard)
        if said >= max(2, len(heard) // 2 + 1):
            return sender
    return None


class RangeCodecs:
    """The job's codec, one per held range: error feedback is kept per range (a range's
    residual is what its payloads left out), equal on its two holders, which encode alike."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self.codecs: dict[Span, Codec] = {}
        self._sizer = make_codec(spec)
        self.poison: float | None = None
        """Testing aid (`testing.faults`, ``nan@outer``): what this member sends is its part
        times this, a broken or hostile sender (its own part as it holds it is unchanged)."""

    def of(self, span: Span) -> Codec:
        if span not in self.codecs:
            self.codecs[span] = make_codec(self.spec)
        return self.codecs[span]

    def payload_bytes(self, span: Span) -> int:
        return self._sizer.payload_bytes(span[1] - span[0])

    def keep_only(self, spans: Sequence[Span]) -> None:
        """Forget the residuals of ranges no longer held."""
        held = set(spans)
        self.codecs = {s: c for s, c in self.codecs.items() if s in held}

    def reset(self) -> None:
        """Forget every residual (the zone's ranges moved: a new holder has none to agree on)."""
        self.codecs = {}

    def state_dict(self) -> dict[Span, dict[str, Any]]:
        return {
            s: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.state_dict().items()}
            for s, c in self.codecs.items()
        }

    def load_state_dict(self, state: Mapping[Span, dict[str, Any]]) -> None:
        self.codecs = {}
        for span, codec_state in state.items():
            self.of(span).load_state_dict(dict(codec_state))


def exchange(
    own: Mapping[Span, torch.Tensor],
    silent: bool,
    layouts: Mapping[str, Layout],
    zone: str,
    me: str,
    ranks: Mapping[str, int],
    group: ProcessGroup,
    scope: EpochScope,
    codecs: RangeCodecs,
    what: str,
    judge: bool = True,
) -> tuple[dict[Span, torch.Tensor], int]:
    """Each held range's sum over the zones of their parts: ``own`` is this zone's part of
    every range ``me`` holds (``silent``: the zone had no samples; zeros go out, residuals
    kept). Returns the sums and the bytes this member sent.

    ``judge``: a part is its sender's own word (DiLoCo's pseudo-gradient of the zone's
    state), refused where it is not finite; not so a step's gradient, a sum over the
    zone's members that their own norms judge at the step's vote (`CodedSum`).

    Raises:
        BadContribution: a payload that does not decode or decodes to values that are not
            finite (its sender's rank named: every receiver of the range names the same
            one), or this member's own part is not finite (its own rank named: zeros went
            out in its place, so that its receivers finish the exchange and hear it say so).
        CollectiveFailed, EpochAborted: a transfer failed or the epoch was abandoned.
    """
    me_rank = ranks[me]
    broken = None if silent or not judge else next((span for span, x in own.items() if not all_finite(x)), None)
    payloads: dict[Span, torch.Tensor] = {}
    for span, x in own.items():
        codec = codecs.of(span)
        nothing = silent or broken is not None
        going = x if codecs.poison is None else x * codecs.poison
        payloads[span] = codec.encode_nothing(span[1] - span[0]) if nothing else codec.encode(going)
    r = routes(layouts, zone, me)
    received = {
        src.tag: torch.empty(codecs.payload_bytes((src.start, src.end)), dtype=torch.uint8) for src in r.receives
    }
    works, sent = [], 0
    between = f"{what} (ranges between zones)"
    for post in posts(layouts, zone, me, ranks):  # in the one order every member agrees with
        src, peer = post.source, ranks[post.peer]
        if post.send:
            payload = payloads[(src.start, src.end)]
            works.append(posted(functools.partial(group.send, [payload], peer, src.tag), scope, between))
            sent += payload.numel()
        else:
            works.append(posted(functools.partial(group.recv, [received[src.tag]], peer, src.tag), scope, between))
    if works:  # gloo's point-to-point works have no future: waited on a thread
        run_abortable(lambda: [w.wait() for w in works], scope, between)
    if broken is not None:
        raise BadContribution(
            me_rank, f"{what}: rank {me_rank}'s own pseudo-gradient of [{broken[0]}, {broken[1]}) is not finite"
        )
    decoded: dict[int, torch.Tensor] = {}
    for src in r.receives:
        culprit = ranks[src.primary]
        try:
            decoded[src.tag] = codecs.of((src.start, src.end)).decode(received[src.tag], src.end - src.start)
        except ValueError as exc:
            raise BadContribution(culprit, f"{what}: rank {culprit} sent [{src.start}, {src.end}): {exc}") from None
        # Half-precision decoding checks nothing (and NaN passes fp16's clamp): the values
        # themselves are judged, the same payload giving the same verdict at every receiver.
        if judge and not all_finite(decoded[src.tag]):
            raise BadContribution(
                culprit, f"{what}: rank {culprit} sent [{src.start}, {src.end}) with values that are not finite"
            )
    out = {}
    for span in own:
        total = torch.zeros(span[1] - span[0], dtype=torch.float32)
        for src, (a, b) in tiles(layouts, span):
            if src.zone == zone:
                row = codecs.of(span).decode(payloads[span], span[1] - span[0])
                total += row
            else:
                total[a - span[0] : b - span[0]] += decoded[src.tag][a - src.start : b - src.start]
        out[span] = total
    return out, sent


class CodedSum:
    """Synchronous mode's sum of a sharded step's gradient over the zones through a lossy
    codec (``--codec``): `exchange` of each held range's zone sum, with its residual per
    range. A step not applied puts the residuals back (its retry encodes from them); one
    applied late takes them as they were after its exchange (as its range's other holders)."""

    def __init__(self, spec: CodecSpec) -> None:
        self.codecs = RangeCodecs(spec)
        self._states: tuple[dict[Span, dict[str, Any]], dict[Span, dict[str, Any]]] | None = None
        """The residuals before and after the exchange of the step not yet committed."""
        self.sent = 0
        """Bytes this member sent in the last exchange."""

    def sum(
        self,
        engine: ShardedModel,
        layouts: Mapping[str, Layout],
        zone: str,
        ranks: Mapping[str, int],
        group: ProcessGroup,
        what: str,
    ) -> None:
        """Each held range's gradient (its zone's sum) replaced by the zones' sum.

        Raises:
            BadContribution, CollectiveFailed, EpochAborted: as `exchange`."""
        own = {}
        for h in engine.holdings:
            grads = [p.tensor.grad if p.tensor.grad is not None else torch.zeros_like(p.tensor) for p in h.pieces]
            own[(h.start, h.end)] = torch.cat(grads) if grads else torch.zeros(0)
        self.codecs.keep_only(list(own))
        before = self.codecs.state_dict()
        sums, self.sent = exchange(
            own, False, layouts, zone, engine.me, ranks, group, engine.scope, self.codecs, what, judge=False
        )
        self._states = (before, self.codecs.state_dict())
        for h in engine.holdings:
            total = sums[(h.start, h.end)]
            for p in h.pieces:
                p.tensor.grad = total[p.start - h.start : p.end - h.start].clone()

    def committed(self) -> None:
        self._states = None

    def undo(self) -> None:
        """The step is not applied here: the residuals as before its exchange."""
        if self._states is not None:
            self.codecs.load_state_dict(self._states[0])

    def redo(self) -> None:
        """The step is applied late: the residuals as after its exchange."""
        if self._states is not None:
            self.codecs.load_state_dict(self._states[1])
            self._states = None
