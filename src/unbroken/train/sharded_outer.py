"""DiLoCo between sharded zones: the outer step, range by range (`train.diloco`).

Each zone trains its inner steps sharded, as in sync mode inside a zone (`train.sharding`,
``inner_scale``: the zone's sum is its samples' mean, and nothing crosses zones). The
state of the outer loop is kept per held range, by both of its holders alike:

    anchor     the range's values and inner optimizer state at the round's start (what a
               failed round rolls back to; the values are what the outer optimizer steps)
    momentum   the outer optimizer's (Nesterov) momentum of the range: committed state,
               moved with the range when the zone re-shards (the sync phase's transfers)
    residual   the codec's error feedback for the range (`comm.outer_ranges.RangeCodecs`):
               forgotten when the zone's ranges move (a new holder has none to agree on)

At the round's end each member's pseudo-gradient of every range it holds (anchor minus
values, times its zone's share of the batch) is exchanged with the other zones' holders of
the same elements (`comm.outer_ranges.exchange`), then the members vote (votes and sample
counts, exact, over the epoch's group, as an unsharded DiLoCo round's), and each member
steps the outer optimizer on its own ranges: holders of a range apply the same sum to the
same anchor and momentum, so they agree, and so do the zones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from unbroken.comm.blocks import as_flat
from unbroken.comm.group import EpochScope, run_abortable
from unbroken.comm.outer_ranges import RangeCodecs, Span, exchange, overlap
from unbroken.errors import TransferError
from unbroken.specs import CodecSpec
from unbroken.train.sharding import ShardedZone

log = logging.getLogger(__name__)

MOMENTUM_TAG = 1 << 20
"""Tags of the momentum's transfers (apart from the re-shard's, on the same group)."""


class ShardedOuter:
    """One member's outer loop over the ranges it holds (see the module's docstring)."""

    def __init__(self, zone: ShardedZone, settings: Mapping[str, Any], spec: CodecSpec) -> None:
        """``settings``: the outer SGD's (lr, momentum, nesterov); ``spec``: the job's codec."""
        self.zone = zone
        self.lr = float(settings["lr"])
        self.mu = float(settings["momentum"])
        self.nesterov = bool(settings["nesterov"])
        self.codecs = RangeCodecs(spec)
        self.anchor: dict[Span, dict[str, torch.Tensor]] = {}
        """Each held range at the round's start: its values and per-element inner state."""
        self.counts: dict[str, Any] | None = None
        """The inner optimizer's shared state at the round's start (None: never stepped)."""
        self.residuals: dict[Span, dict[str, Any]] = {}
        """The codecs' residuals at the round's start (a retried round encodes from them)."""
        self.round_step = -1
        self.momentum: dict[Span, torch.Tensor] = {}
        self.momentum_step = 0
        """The committed step the momentum is of (stale on a member that missed an outer step)."""
        self._sums: dict[Span, torch.Tensor] = {}
        """The round's summed pseudo-gradient of each held range (`exchange`, then `apply`)."""
        zone.momentum_of = self.saved  # the shard files carry it: a checkpoint restores it

    def saved(self, step: int, start: int, end: int) -> torch.Tensor | None:
        """The momentum of ``[start, end)`` at committed ``step``, for its shard file (None:
        this member's is of another step, or lacks part of the range)."""
        if self.momentum_step != step:
            return None
        return cut(self.momentum, start, end)

    def spans(self) -> list[Span]:
        return [(h.start, h.end) for h in self.zone.ready.holdings]

    def begin_round(self, step: int) -> None:
        """Remember the held ranges' committed state: a failure rolls back to it."""
        engine = self.zone.ready
        elements, _ = engine.state_layout()
        self.anchor = {}
        for start, end in self.spans():
            part = engine.export(start, end)
            state = part["state"]
            self.anchor[(start, end)] = {
                "values": part["values"],
                **{k: as_flat(state.get(k), end - start).clone() for k in elements},
            }
        self.counts = engine.shared_state() if engine.stepped() else None
        self.codecs.keep_only(self.spans())
        self.residuals = self.codecs.state_dict()
        self.round_step = step

    def rollback(self, moved: bool) -> None:
        """The round failed: its sums are dropped and, where the ranges moved (``moved``),
        they go back to the round's start, residuals too."""
        zone = self.zone
        zone.pending = None  # an inner step's complete sum is never applied late: the round is retried
        if zone.engine is None:
            return
        zone.engine.abandon()
        if not moved or not self.anchor:
            return
        engine = zone.engine
        pieces = [(s, e, dict(bufs)) for (s, e), bufs in self.anchor.items()]
        engine.load(engine.layout, engine.me, pieces, self.counts)
        self.codecs.load_state_dict(self.residuals)
        zone.step = self.round_step

    def after_sync(self, scope: EpochScope) -> None:
        """After the sync phase gave this member its ranges: their momentum, from their
        holders where they moved (on the same transfers), and residuals forgotten where this
        zone's ranges moved."""
        moved = self.zone.moved
        assert moved is not None
        me, spans = self.zone.ready.me, self.spans()
        if moved.fresh:  # made afresh, in every zone at once: from a checkpoint's files, or none yet
            read, self.zone.read_momentum = self.zone.read_momentum, {}
            # Element by element, 0 where the files had none: every holder of an element, in
            # every zone, starts from the same momentum whatever its ranges' bounds.
            self.momentum = {s: filled(read, *s) for s in spans}
            if read and any(cut(read, *s) is None for s in spans):
                log.warning("%s: the shard files read lack the outer momentum of some elements: 0 there", me)
            if any(c.state_dict().get("residual") is not None for c in self.codecs.codecs.values()):  # not in the files
                log.warning("%s: ranges made afresh at step %d: the codec's residuals start at 0", me, self.zone.step)
            self.codecs.reset()
            self.momentum_step = self.zone.step
            # The round's start was on the old layout and perhaps of another step (a fall-back
            # to a checkpoint): rolling back to it would load spans this layout lacks, or undo
            # the fall-back. The ranges are committed state now; the next round anchors anew.
            self.anchor, self.residuals, self.counts, self.round_step = {}, {}, None, -1
            return
        valid = self.momentum if self.momentum_step == self.zone.step else {}
        if not moved.unchanged:  # the zone's ranges moved: a holder may have none to agree on
            self.codecs.reset()
        if not moved.transfers and all(s in valid for s in spans):
            self.momentum = {s: valid[s] for s in spans}
            return
        works, incoming = [], []
        for tag, t in enumerate(moved.transfers):
            if t.source == me:
                part = cut(valid, t.start, t.end)
                if part is None:
                    raise TransferError(f"{me} is to send the outer momentum of [{t.start}, {t.end}) and lacks it")
                works.append(moved.pg.send([part], moved.world[t.destination], MOMENTUM_TAG + tag))
            if t.destination == me:
                buf = torch.empty(t.end - t.start)
                works.append(moved.pg.recv([buf], moved.world[t.source], MOMENTUM_TAG + tag))
                incoming.append(((t.start, t.end), buf))
        if works:
            run_abortable(lambda: [w.wait() for w in works], scope, "moving the outer momentum with the ranges")
        have = {**valid, **dict(incoming)}  # received last: what it kept of its own is older or equal
        out = {}
        for span in spans:
            got = cut(have, *span)
            if got is None:
                raise TransferError(f"{me}: no outer momentum for its range [{span[0]}, {span[1]})")
            out[span] = got
        self.momentum, self.momentum_step = out, self.zone.step

    def exchange(self, weight: float, silent: bool, scope: EpochScope, what: str) -> tuple[float, int]:
        """The zones' pseudo-gradients summed over each held range (kept for `apply`); returns
        the sum of squares over this member's primary range and the bytes it sent."""
        engine, moved = self.zone.ready, self.zone.moved
        assert moved is not None
        own = {}
        for span in self.spans():
            now = engine.export(*span, with_state=False)["values"]
            own[span] = (self.anchor[span]["values"] - now) * weight
        self._sums, sent = exchange(
            own, silent, moved.layouts, moved.zone, engine.me, moved.world, moved.pg, scope, self.codecs, what
        )
        primary = engine.layout.primary(engine.me)
        squares = 0.0
        if primary is not None:
            squares = float(torch.linalg.vector_norm(self._sums[(primary.start, primary.end)])) ** 2
        return squares, sent

    def apply(self, step: int) -> None:
        """The outer optimizer (SGD, Nesterov as torch's) on each held range: its anchor
        stepped by the summed pseudo-gradient; the range's values take the result."""
        engine = self.zone.ready
        with torch.no_grad():
            for span, g in self._sums.items():
                buf = self.momentum.get(span)
                if buf is None:
                    buf = self.momentum[span] = torch.zeros_like(g)
                update = g
                if self.mu:
                    buf.mul_(self.mu).add_(g)
                    update = g.add(buf, alpha=self.mu) if self.nesterov else buf
                values = self.anchor[span]["values"].add(update, alpha=-self.lr)
                for h in engine.holdings:
                    if (h.start, h.end) == span:
                        for piece in h.pieces:
                            piece.tensor.copy_(values[piece.start - h.start : piece.end - h.start])
        self._sums = {}
        self.momentum_step = step


def cut(store: Mapping[Span, torch.Tensor], start: int, end: int, fill: float | None = None) -> torch.Tensor | None:
    """Elements ``[start, end)`` from the spans of ``store`` (None where they leave a gap,
    unless ``fill``: its value there)."""
    out = torch.full((end - start,), fill) if fill is not None else torch.empty(end - start)
    covered = torch.zeros(end - start, dtype=torch.bool)
    for (a, b), values in store.items():
        part = overlap((a, b), (start, end))
        if part is not None:
            lo, hi = part
            out[lo - start : hi - start] = values[lo - a : hi - a]
            covered[lo - start : hi - start] = True
    return out if fill is not None or bool(covered.all()) else None


def filled(store: Mapping[Span, torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` from the spans of ``store``, 0 where they leave a gap."""
    got = cut(store, start, end, fill=0.0)
    assert got is not None
    return got
