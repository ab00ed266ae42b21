"""Where a sharded zone's lost ranges come from: the pure choice, with its reason.

After members of a zone are lost, each range of the zone's layout is served, in order of
preference, by::

    its buddy        the other holder in the zone (current: nothing lost)
    another zone     the same range in another zone's replica (current: nothing lost)
    the checkpoint   the newest checkpoint step whose files every live member can read: the
                     whole job goes back to that step (promise 1 allows it: no replica of
                     those ranges survives), and the steps since are trained again
    nothing          no checkpoint holds them all: the job stops, naming the ranges

`choose` decides for a whole zone: the worst source any range needs is the zone's, and
every range is named in the reason (what the event of the fall-back says). No torch, no
I/O, no clock: `unbroken.train.shard_fallback` carries it out.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from unbroken.events import BACK_TO_CHECKPOINT
from unbroken.state.shards import Layout, Ranges, union


class Source(str, enum.Enum):
    """What served the ranges a zone lost, from the best to the worst."""

    BUDDY = "buddy"
    OTHER_ZONE = "other-zone"
    CHECKPOINT = "checkpoint"
    HALT = "halt"
    """Nothing did: the job stops."""

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Recovery:
    """How a zone gets back the ranges its lost members held."""

    source: Source | None
    """The worst source a range needs (None: no range lost its primary)."""
    buddy: Ranges = ()
    """Ranges whose primary was lost and whose buddy lives."""
    other_zone: Ranges = ()
    """Ranges both of whose holders were lost, held by another zone."""
    lost: Ranges = ()
    """Ranges no live member of any zone holds."""
    checkpoint: int = -1
    """The step the job goes back to (``source`` CHECKPOINT), else -1."""
    reason: str = ""
    """What the fall-back's event says."""


def choose(
    layout: Layout,
    live: Collection[str],
    step: int,
    *,
    elsewhere: Iterable[tuple[int, int]] = (),
    checkpoints: Iterable[int] = (),
) -> Recovery:
    """The zone's fall-back at committed ``step``: ``layout`` the one its members held,
    ``live`` those of its members whose ranges are current, ``elsewhere`` the ranges other
    zones' members hold current, ``checkpoints`` the checkpoint steps whose files every live
    member can read (a step after ``step`` is not one to go back to)."""
    far = union(elsewhere)
    buddy: list[tuple[int, int]] = []
    other: list[tuple[int, int]] = []
    lost: list[tuple[int, int]] = []
    for s in layout.shards:
        if s.primary in live:
            continue
        if s.buddy is not None and s.buddy in live:
            buddy.append((s.start, s.end))
            continue
        at = s.start
        for a, b in far:  # the parts another zone holds; the rest is lost everywhere
            lo, hi = max(a, at), min(b, s.end)
            if lo < hi:
                if lo > at:
                    lost.append((at, lo))
                other.append((lo, hi))
                at = hi
        if at < s.end:
            lost.append((at, s.end))
    gone = sorted(m for m in layout.members if m not in live)
    parts = [
        f"ranges {_said(union(buddy))} of lost {', '.join(gone)}: from their buddy copies" if buddy else "",
        f"ranges {_said(union(other))} lost both holders in the zone: from another zone" if other else "",
    ]
    if lost:
        usable = [c for c in checkpoints if 0 <= c <= step]
        what = f"ranges {_said(union(lost))} lost in every zone at step {step}"
        if usable:
            back = max(usable)
            reason = f"{what}: {BACK_TO_CHECKPOINT} {back}"
            return Recovery(Source.CHECKPOINT, union(buddy), union(other), union(lost), back, reason)
        reason = (
            f"{what}, and no checkpoint that every live member can read holds them all: restart the job from "
            "its last checkpoint once every range's shard files are in one --checkpoint-dir (`unbroken restore` "
            "gathers them from the members' disks), or run with --checkpoint-dir and --checkpoint-every"
        )
        return Recovery(Source.HALT, union(buddy), union(other), union(lost), -1, reason)
    source = Source.OTHER_ZONE if other else Source.BUDDY if buddy else None
    return Recovery(source, union(buddy), union(other), (), -1, "; ".join(p for p in parts if p))


def _said(ranges: Ranges) -> str:
    return ", ".join(f"[{a:,}, {b:,})" for a, b in ranges)
