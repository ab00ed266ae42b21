"""The step's sum over all members: one all-reduce, or two levels across zones.

Nodes carry a zone (a building, a city, a cloud region). With more than one zone the sum
takes three hops, only the middle one over the slow links::

    zone all-reduce (float32, fast links)
      → zone leaders all-gather their zone sums, compressed by the inter-zone codec,
        and each decodes and sums them in zone order (float32: no overflow, and the same
        result on every leader)
      → each leader broadcasts the total inside its zone

The tail of the flat tensor (buffer deltas, votes, sample counts) always travels in
float32: votes must be exact. Every hop is an abortable c10d work item; any failure raises
and the coordinator's next epoch chooses new leaders. Bytes are counted per link class from
the message sizes of gloo's ring algorithms (what each node sends).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken.comm.codecs import Codec
from unbroken.comm.group import EpochScope, ProcessGroup, wait_all, wait_until, wait_work
from unbroken.comm.robust import combine, lie
from unbroken.errors import BadContribution
from unbroken.sched.zones import Zones
from unbroken.specs import Rule

VOTE_SLOTS = 5
"""Before the norm slots: each member's vote, its sample count, its switch flag, its loss and
its overflow flag (the step's layout: `unbroken.train.step`)."""


@dataclass(frozen=True)
class LinkEmulation:
    """In-process emulation of a slow inter-zone link (``tc netem`` is not in every kernel):
    each inter-zone hop waits ``latency_s`` plus the payload's time at ``mbit_s``."""

    latency_s: float = 0.0
    """One-way latency of an inter-zone hop (half the round trip)."""
    mbit_s: float = 0.0
    """Inter-zone bandwidth in Mbit/s (0: unlimited)..."""
    mbit_from: dict[str, float] = field(default_factory=dict)
    """...and from these zones (what this node receives from each; 0: unlimited)."""

    @property
    def active(self) -> bool:
        return self.latency_s > 0 or self.mbit_s > 0 or any(v > 0 for v in self.mbit_from.values())

    def delay(self, payload_bytes: int, hops: int, source: str | None = None) -> float:
        """How long ``hops`` hops of ``payload_bytes`` take, each received from ``source``'s zone."""
        mbit = self.mbit_from.get(source, self.mbit_s) if source is not None else self.mbit_s
        per_hop = self.latency_s + (payload_bytes * 8 / (mbit * 1e6) if mbit > 0 else 0.0)
        return per_hop * hops


@dataclass
class Wire:
    """Bytes this node sent, per link class."""

    intra: int = 0
    inter: int = 0
    steps: int = 0
    last_intra: int = 0
    last_inter: int = 0

    def add(self, intra: int, inter: int) -> None:
        self.intra += intra
        self.inter += inter
        self.last_intra, self.last_inter = intra, inter
        self.steps += 1


@dataclass
class _Exchange:
    """The leaders' all-gathers in flight, a piece per stream."""

    works: list[Any]
    outs: list[list[torch.Tensor]]
    head: int
    """Bytes of the codec's payload at the head of each leader's (the rest: the float32 tail)."""
    compressed: int
    sent: int


@dataclass(frozen=True)
class Early:
    """Sums of a flat tensor's head posted on `Reducer.first_hop` while it was being written."""

    works: list[Any]
    end: int
    """The head's length (the rest goes out in one piece)."""


@dataclass
class Posted:
    """An all-reduce across zones in flight (`Reducer.post`)."""

    flat: torch.Tensor
    exchange: _Exchange | None
    """None where this node does not lead its zone."""
    ready_at: float
    """When the emulated link delivers (0: no emulation)."""
    intra: int
    """Bytes already sent inside the zone."""
    own_head: bool = False
    """Each leader's head was its own (`Reducer.post`): its true norm goes in its norm slot."""


@dataclass
class Reducer:
    """Sums the step's flat tensor over the epoch, as `Zones` and the codec say."""

    rank: int
    zones: Zones
    pg: ProcessGroup
    """The epoch's group of all members."""
    zone_pg: ProcessGroup | None = None
    """This node's zone (None when zones are not used or the zone has one member)."""
    leaders_pg: ProcessGroup | None = None
    """The zone leaders (None unless this node leads its zone and there are several zones)."""
    streams: int = 1
    """Connections ``leaders_pg`` has per pair: the exchange is cut in as many pieces, in flight together."""
    codec: Codec | None = None
    compressed: int = 0
    """How many leading elements of the flat tensor the codec compresses (the gradient)."""
    link: LinkEmulation = field(default_factory=LinkEmulation)
    wire: Wire = field(default_factory=Wire)
    rule: Rule = field(default_factory=lambda: Rule("mean"))
    """How the gradient is combined; a robust rule all-gathers every member's contribution."""
    weights: tuple[float, ...] = ()
    """Each member's share of the batch (as a fraction), for robust rules."""
    shares: tuple[int, ...] = ()
    """Each member's share of the batch in samples (what its row must say it computed)."""
    norms_at: int = 0
    """Where the members' gradient-norm slots start in the flat tensor (one per rank)."""
    overflow_allowed: Callable[[], bool] = lambda: False
    """Whether a member's overflow slot is believed now (the job's loss scale says)."""
    bucket_bytes: int = 0
    """The epoch's gradient buckets, summed on `first_hop` while backward runs (0: none)."""

    @property
    def first_hop(self) -> Any:
        """The group a step's gradient is summed in first, where its buckets go while backward
        still runs (`train.buckets`): the zone's, or all members' with one zone. None where
        the rows are gathered whole (robust rules) or this node is alone in its zone."""
        if self.rule.robust:
            return None
        return self.zone_pg if self.zones.multi else self.pg

    def allreduce(
        self,
        flat: torch.Tensor,
        scope: EpochScope,
        what: str,
        after_post: Callable[[], None] = lambda: None,
        after_exchange_post: Callable[[], None] = lambda: None,
        early: Early | None = None,
        own_head: bool = False,
        silent: bool = False,
    ) -> None:
        """Replace ``flat`` by its sum over all members (abortable; raises on any failure).

        ``after_post`` runs once the first collective is posted, ``after_exchange_post`` once
        this zone leader's inter-zone exchange is (fault injection hooks). ``early``: the
        sums of ``flat``'s head already posted on `first_hop` (the gradient's buckets).
        ``own_head``: across zones, each zone's head is its leader's alone (`post`);
        ``silent``: this leader's zone has nothing to send in it (no share this round).
        """
        n = flat.numel()
        if self.rule.robust:
            self._gather(flat, scope, what, after_post)
            return
        if not self.zones.multi:
            self._first_hop(self.pg, flat, early, scope, what, after_post)
            size = self.pg.size()
            self.wire.add(_ring_allreduce_bytes(4 * n, size), 0)
            return
        # Across zones: the exchange posted and completed at once (DiLoCo's rounds applied
        # late call the two halves a round apart).
        posted = self.post(flat, scope, what, after_post, after_exchange_post, early, own_head, silent)
        self.finish(posted, scope, what)

    def _emulate_link_for(self, flat: torch.Tensor) -> float:
        """When the emulated link would have delivered this leader's payload (0: no emulation)."""
        if not self.link.active or self.leaders_pg is None or self.leaders_pg.size() <= 1:
            return 0.0
        k = self.compressed if self.codec is not None else 0
        payload = (self.codec.payload_bytes(k) if self.codec is not None and k else 0) + 4 * (flat.numel() - k)
        # A ring all-gather: every payload reaches this leader from the one before it in the ring.
        names = self.zones.names
        before = names[(names.index(self.zones.of_rank[self.rank]) - 1) % len(names)]
        assert self.leaders_pg is not None, "only a zone leader exchanges between zones"
        return time.monotonic() + self.link.delay(payload, self.leaders_pg.size() - 1, before)

    def _post_exchange(self, flat: torch.Tensor, silent: bool = False) -> _Exchange:
        k = self.compressed if self.codec is not None else 0
        if self.codec is None or not k:
            head = torch.empty(0, dtype=torch.uint8)
        else:  # silent: zeros, whatever the codec's error feedback holds (it waits for a round with a share)
            head = self.codec.encode_nothing(k) if silent else self.codec.encode(flat[:k])
        tail = flat[k:].contiguous().view(torch.uint8)
        mine = torch.cat([head, tail])
        leaders = self.leaders_pg
        assert leaders is not None, "only a zone leader exchanges between zones"
        count = leaders.size()
        # Every leader's payload has the same size, so its pieces do: piece i of every leader
        # travels in the i-th all-gather, which takes the group's i-th stream.
        pieces = torch.tensor_split(mine, min(self.streams, max(1, mine.numel())))
        outs = [[torch.empty_like(piece) for _ in range(count)] for piece in pieces]
        works = [leaders.allgather([o], [piece]) for o, piece in zip(outs, pieces, strict=True)]
        return _Exchange(works, outs, head.numel(), k, int(mine.numel()) * (int(count) - 1))

    def _finish_exchange(
        self,
        ex: _Exchange,
        flat: torch.Tensor,
        scope: EpochScope,
        what: str,
        own_head: bool = False,
    ) -> int:
        wait_all(ex.works, scope, f"{what} (between zones)")
        count = len(ex.outs[0])
        out = [torch.cat([o[r] for o in ex.outs]) for r in range(count)]
        h, k = ex.head, ex.compressed
        total_tail = torch.zeros(flat.numel() - k, dtype=torch.float32)
        total_head = torch.zeros(k, dtype=torch.float32)
        norms: dict[int, float] = {}
        for r, payload in enumerate(out):  # zone order: the same sum on every leader
            if k:
                assert self.codec is not None
                try:
                    row = self.codec.decode(payload[:h], k)
                except ValueError as exc:  # the same payload, the same verdict, on every leader
                    culprit = self.zones.leaders[r]
                    raise BadContribution(culprit, f"{what}: zone leader rank {culprit} sent {exc}") from None
                if own_head:
                    norms[self.zones.leaders[r]] = float(torch.linalg.vector_norm(row).item())
                total_head += row
            total_tail += payload[h:].view(torch.float32)
        flat[:k] = total_head
        flat[k:] = total_tail
        if own_head:  # each leader's row is its own: what it sent, measured (slots are anyone's word)
            flat[self.norms_at :] = 0.0
            for rank, norm in norms.items():
                flat[self.norms_at + rank] = norm
        return ex.sent

    def post(
        self,
        flat: torch.Tensor,
        scope: EpochScope,
        what: str,
        after_post: Callable[[], None] = lambda: None,
        after_exchange_post: Callable[[], None] = lambda: None,
        early: Early | None = None,
        own_head: bool = False,
        silent: bool = False,
    ) -> Posted:
        """The first half of `allreduce` across zones, for an exchange that runs while the
        caller computes on: the zone's sum now (fast links), the leaders' exchange posted and
        left in flight. `finish` completes it into ``flat`` (which must not change meanwhile).
        Only with several zones: one zone has no slow link to hide.

        ``own_head``: the head (the codec's part) is the zone leader's alone, as a DiLoCo
        pseudo-gradient is (every member of a zone holds the same parameters): the zone's sum
        leaves it out, so each leader's row in the exchange is its own word, and `finish`
        writes each row's true norm into its leader's norm slot for `check_sum` to judge.
        ``silent``: this leader's zone had no share (its row must be zero: `judge`)."""
        assert self.zones.multi and not self.rule.robust, "an exchange in flight needs zones and the mean"
        zone = self.zones.of_rank[self.rank]
        zone_size = len(self.zones.members(zone))
        intra = 0
        if self.zone_pg is not None:
            summed = flat[self.compressed :] if own_head else flat
            hop = f"{what} (zone {zone})"
            self._first_hop(self.zone_pg, summed, None if own_head else early, scope, hop, after_post)
            intra += _ring_allreduce_bytes(4 * summed.numel(), zone_size)
        ex, ready_at = None, 0.0
        if self.leaders_pg is not None:
            ready_at = self._emulate_link_for(flat)
            ex = self._post_exchange(flat, silent)
            if self.zone_pg is None:  # alone in its zone: the exchange is its first collective
                after_post()
            after_exchange_post()
        return Posted(flat, ex, ready_at, intra, own_head)

    def finish(self, posted: Posted, scope: EpochScope, what: str) -> None:
        """Complete a `post`: the zones' total in ``posted.flat`` on every member."""
        flat, inter, intra = posted.flat, 0, posted.intra
        zone = self.zones.of_rank[self.rank]
        if posted.exchange is not None:
            self._emulate_link(posted.ready_at, scope, what)
            inter = self._finish_exchange(posted.exchange, flat, scope, what, posted.own_head)
        if self.zone_pg is not None:
            work = self.zone_pg.broadcast(flat, 0)
            wait_work(work, scope, f"{what} (zone {zone} broadcast)")
            if self.leaders_pg is not None:
                intra += 4 * flat.numel() * (len(self.zones.members(zone)) - 1)
        self.wire.add(intra, inter)

    def zone_allreduce(
        self,
        flat: torch.Tensor,
        scope: EpochScope,
        what: str,
        after_post: Callable[[], None] = lambda: None,
        early: Early | None = None,
    ) -> None:
        """Sum over this node's zone only (DiLoCo's inner steps: nothing crosses zones)."""
        pg = self.zone_pg if self.zones.multi else self.pg
        if pg is None:  # alone in its zone
            after_post()
            self.wire.add(0, 0)
            return
        self._first_hop(pg, flat, early, scope, what, after_post)
        self.wire.add(_ring_allreduce_bytes(4 * flat.numel(), pg.size()), 0)

    def _first_hop(
        self,
        pg: ProcessGroup,
        flat: torch.Tensor,
        early: Early | None,
        scope: EpochScope,
        what: str,
        after_post: Callable[[], None],
    ) -> None:
        """``flat`` summed over ``pg``: what ``early`` did not post goes out in one piece
        (the tail, after the buckets: the same order on every member), then all is waited for."""
        start = early.end if early is not None else 0
        works = [*(early.works if early is not None else ()), pg.allreduce([flat[start:]])]
        after_post()
        wait_all(works, scope, what)

    def _gather(
        self,
        flat: torch.Tensor,
        scope: EpochScope,
        what: str,
        after_post: Callable[[], None],
    ) -> None:
        """Robust rules see every contribution: all-gather over the whole group (zones are
        not used), sum the exact tail, combine the gradients by the rule."""
        size = self.pg.size()
        rows = [torch.empty_like(flat) for _ in range(size)]
        work = self.pg.allgather([rows], [flat])
        after_post()
        wait_work(work, scope, f"{what} (all-gather)")
        k = self.compressed
        for r, row in enumerate(rows):  # the same rows, the same verdict, on every member
            share = self.shares[r] if self.shares else None
            why = lie(row, r, k, self.norms_at - VOTE_SLOTS, self.norms_at, share, self.overflow_allowed())
            if why is not None:
                raise BadContribution(r, f"{what}: refused the contribution of rank {r}: it {why}")
        tail = torch.zeros(flat.numel() - k, dtype=torch.float32)
        for row in rows:  # rank order: the same sum on every member
            tail += row[k:]
        norms = tail[self.norms_at - k :].tolist()
        flat[:k] = combine([row[:k] for row in rows], self.weights, norms, self.rule)
        flat[k:] = tail
        # A ring all-gather: each rank sends (size - 1) payloads to its successor.
        sent = 4 * flat.numel() * (size - 1)
        successor = self.zones.of_rank[(self.rank + 1) % size] if self.zones.of_rank else ""
        across = self.zones.multi and successor != self.zones.of_rank[self.rank]
        self.wire.add(0 if across else sent, sent if across else 0)

    def _emulate_link(self, until: float, scope: EpochScope, what: str) -> None:
        if until:
            wait_until(lambda: time.monotonic() >= until, scope, f"{what} (emulated link)", 0.01)


def _ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """What one rank sends in a ring all-reduce (reduce-scatter + all-gather)."""
    return 0 if size <= 1 else 2 * nbytes * (size - 1) // size
