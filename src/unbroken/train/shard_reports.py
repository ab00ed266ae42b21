"""What the members of a sharded zone say of their ranges at a sync phase, and what the zone
decides from it: the same pure decision on every member (`decide`), from reports exchanged
as bytes (`encode`, `decode`, `exchange`). `unbroken.train.sharding` carries it out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from unbroken.comm.group import EpochScope, ProcessGroup, wait_all
from unbroken.errors import JobHalted, RangesAbsent, TransferError
from unbroken.state.shards import Layout, Plan, Ranges, Shard, layout_for, replan, union

WHERE = " (nodes run with --checkpoint-dir write one; without, from the start)"


@dataclass(frozen=True)
class Report:
    """What a member says of its ranges at a sync phase."""

    weight: int
    """The memory it offers, in MiB (`Layout.weights`)."""
    layout: Layout | None = None
    """The layout it holds ranges of (None: it holds none yet)."""
    epoch: int = -1
    """The epoch that layout was made in."""
    step: int = -1
    """The committed step its ranges are at."""
    summed: int = -1
    """The step whose summed gradient it holds complete, not applied (its commit failed
    here): where that step committed elsewhere, it applies it late (`Decision.late`)."""
    held: Ranges = ()
    """The ranges it holds now (those of ``layout`` unless a re-shard was cut short)."""
    digests: tuple[str, ...] = ()
    """Each held range's digest (values and optimizer state), parallel to ``held``: a range's
    two holders at one step must agree."""
    lineage: int = 0
    """The history its ranges are of (`TrainState.lineage`): ranges of an older one are from
    before a fall-back to a checkpoint, whatever their step."""
    device: str = ""
    """The device it computes on (`unbroken.comm.placement.MemberDevice`, encoded): the zone's
    decide where its shards live and which backend sums them."""


@dataclass(frozen=True)
class Decision:
    """How a sync phase gives every member its ranges."""

    fresh: Layout | None = None
    """No member holds ranges: this layout, from the model as `source` built it (step 0)."""
    source: str = ""
    """The member whose model every member's ranges start from, in every zone (so that an own
    loop's unseeded init is one model, not a mix)."""
    plan: Plan | None = None
    """Otherwise: the re-shard from the ranges held (no transfers where nothing changed)."""
    keep: frozenset[str] = frozenset()
    """Members whose ranges are current: the others' copies, if any, are dropped (behind the
    group, of another layout, or of a member expelled and back under a new name)."""
    restore: bool = False
    """The ``fresh`` layout's ranges come from the shard files of a checkpoint (step > 0)."""
    late: frozenset[str] = frozenset()
    """Members one step behind that hold that step's summed gradient: they apply it now (a
    step is applied by all or none: others committed it while their commit failed)."""

    unchanged: bool = False
    """Every member holds what the new layout gives it, on that layout: nothing moves."""


def decide(
    reports: Mapping[str, Report],
    step: int,
    numel: int,
    align: int,
    outside: Mapping[str, Report] | None = None,
    lineage: int = 0,
) -> Decision:
    """The same decision on every member from the same reports (``reports``: the zone's
    members', in rank order; ``outside``: the other zones' members', each zone holding a
    whole replica of the same state).

    Every range a member holds at the group's ``step`` is current, whatever layout it came
    from (a re-shard cut short leaves members on two layouts at one step); so is the range of
    a member one step behind that holds that step's complete sum from the attempt that
    committed it (it applies it: `Decision.late`). The newest layout's ring order is kept.
    What no member of the zone holds comes from another zone's members, if one holds it.
    Ranges of a history older than the group's ``lineage`` are held by nobody (`current`).

    Raises:
        RangesAbsent: elements no member holds at ``step`` (every holder lost, or the group
            ahead of every member's ranges): the job must restart from a checkpoint.
    """
    reports, outside = current(reports, lineage), current(outside or {}, lineage)
    weights = {m: r.weight for m, r in reports.items()}
    held = {m: r for m, r in reports.items() if r.layout is not None and r.held}
    far = {m: r for m, r in (outside or {}).items() if r.layout is not None and r.held and r.step == step}
    laid = [r for r in (*reports.values(), *outside.values()) if r.layout is not None]
    if not held and not far and laid and step > 0:
        # Members that held ranges were lost and those left hold none (spares after a fall-back
        # to a checkpoint): a loss, which waits for a holder to rejoin, not a restart.
        last = max(laid, key=lambda r: (r.step, r.epoch)).layout
        assert last is not None
        holders = sorted({s.primary for s in last.shards if s.size})
        raise RangesAbsent(
            f"ranges [0, {numel:,}) of the state lost every holder at step {step} ({', '.join(holders)}), in every "
            f"zone: restart the job from its last checkpoint{WHERE}"
        )
    if not held and not far:  # a new job, or one restarted from its checkpoint
        fresh = layout_for(numel, weights, align=align)
        if step > 0:
            return Decision(fresh=fresh, restore=True)
        everyone = {**reports, **(outside or {})}
        # Never sharded: its model is whole. By name: every zone picks the same one.
        intact = sorted(m for m, r in everyone.items() if r.epoch < 0)
        if not intact:
            raise JobHalted("every member that held the new job's ranges was lost before its first step: restart it")
        return Decision(fresh=fresh, source=intact[0])
    newest = max((r.step, r.epoch) for r in held.values()) if held else (step, -1)
    if newest[0] != step:
        raise RangesAbsent(
            f"the group is at step {step} but the newest ranges any member holds are of step {newest[0]}: "
            f"restart the job from its last checkpoint{WHERE}"
        )
    found = next((r.layout for r in held.values() if (r.step, r.epoch) == newest), None)
    base = found if found is not None else layout_for(numel, weights, align=align)  # a zone new to the job
    late = {m for m, r in held.items() if r.epoch == newest[1] and r.summed == r.step == step - 1}
    sources = {m: r.held for m, r in held.items() if r.step == step or m in late}
    _check_copies({m: r for m, r in {**held, **far}.items() if r.step == step})
    p = replan(base, sources, weights, outside={m: r.held for m, r in far.items()})
    if p.missing:
        ranges = ", ".join(f"[{x.start:,}, {x.end:,})" for x in p.missing)
        gone = sorted(m for m in base.members if m not in sources)
        raise RangesAbsent(
            f"ranges {ranges} of the state lost every holder at step {step} ({', '.join(gone)}), in every zone: "
            f"restart the job from its last checkpoint{WHERE}"
        )
    unchanged = (
        not p.transfers
        and all(r.layout == p.new for r in reports.values())
        and all(union(sources.get(m, ())) == p.new.held(m) for m in p.new.members)
    )
    return Decision(plan=p, keep=frozenset(sources), late=frozenset(late), unchanged=unchanged)


def current(reports: Mapping[str, Report], lineage: int) -> dict[str, Report]:
    """``reports`` with the ranges of a history older than ``lineage`` dropped: a member
    expelled before a fall-back to a checkpoint holds ranges the group went back from, and
    one at the group's step again is not a holder of its ranges (two holders of one range
    from two histories would stitch the model together)."""
    return {m: r if r.lineage >= lineage else replace(r, layout=None, held=(), digests=(), summed=-1)
            for m, r in reports.items()}  # fmt: skip


def _check_copies(current: Mapping[str, Report]) -> None:
    """Two members holding one range at one step hold the same bytes, or the job stops.

    Raises:
        JobHalted: naming the range, its holders and their digests (a copy was corrupted, or
            stepped differently: with two copies, which one is right cannot be told).
    """
    seen: dict[tuple[int, int], tuple[str, str]] = {}
    for m, r in current.items():
        for span, digest in zip(r.held, r.digests, strict=True):
            if span not in seen:
                seen[span] = (m, digest)
            elif seen[span][1] != digest:
                other, theirs = seen[span]
                raise JobHalted(
                    f"range [{span[0]:,}, {span[1]:,}) differs between its holders {other} ({theirs[:12]}) and {m} "
                    f"({digest[:12]}) at step {r.step}: one copy was corrupted and which cannot be told; restart "
                    f"the job from its last checkpoint{WHERE}"
                )


def encode(report: Report) -> bytes:
    lay = report.layout
    body: dict[str, Any] = {
        "weight": report.weight,
        "epoch": report.epoch,
        "step": report.step,
        "summed": report.summed,
        "held": [list(r) for r in report.held],
        "digests": list(report.digests),
        "lineage": report.lineage,
        "device": report.device,
    }
    if lay is not None:
        body["layout"] = {
            "numel": lay.numel,
            "align": lay.align,
            "members": list(lay.members),
            "weights": list(lay.weights),
            "shards": [[s.start, s.end, s.primary, s.buddy] for s in lay.shards],
        }
    return json.dumps(body, sort_keys=True).encode()


def decode(data: bytes) -> Report:
    body = json.loads(data)
    lay = body.get("layout")
    layout = None
    if lay is not None:
        shards = tuple(Shard(int(a), int(b), str(p), None if q is None else str(q)) for a, b, p, q in lay["shards"])
        layout = Layout(
            int(lay["numel"]), int(lay["align"]), tuple(lay["members"]), tuple(int(w) for w in lay["weights"]), shards
        )
    held = tuple((int(a), int(b)) for a, b in body["held"])
    digests = tuple(str(d) for d in body["digests"])
    if len(digests) != len(held):
        raise TransferError(f"a member's report gives {len(digests)} digests for {len(held)} ranges")
    return Report(
        int(body["weight"]), layout, int(body["epoch"]), int(body["step"]), int(body["summed"]), held, digests,
        int(body.get("lineage", 0)), str(body.get("device", "")),
    )  # fmt: skip


def exchange(pg: ProcessGroup, mine: bytes, scope: EpochScope) -> list[bytes]:
    """Every member's ``mine``, in rank order (two all-gathers: the lengths, then the bytes)."""
    size = pg.size()
    length = torch.tensor([len(mine)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    wait_all([pg.allgather([lengths], [length])], scope, "exchanging the zone's layouts")
    longest = max(int(x) for x in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    wait_all([pg.allgather([out], [padded])], scope, "exchanging the zone's layouts")
    return [bytes(t[: int(n)].tolist()) for t, n in zip(out, lengths, strict=True)]
