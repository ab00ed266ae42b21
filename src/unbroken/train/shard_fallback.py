"""A sharded job's fall-back when ranges lost every holder in every zone while members live.

The job goes back to a checkpoint, in process, with no restart::

    exchange   every member of the epoch says how long it has waited for a holder to rejoin
               and the checkpoint steps it can read whole from its --checkpoint-dir: the
               replicated state's file and shard files covering the whole flat space
               (`readable_steps`)
    wait       within the epoch, until ``--absent-wait`` (`ABSENT_WAIT_S`) has passed for the
               member that has waited longest: one expelled while its machine was busy comes
               back with its ranges current (its rejoin re-forms the group, which ends the
               wait, and the next sync phase finds the ranges held)
    choose     the newest step a member of every zone can read (`everywhere`;
               `unbroken.state.fallback.choose`, the same on every member); none: the job
               stops, naming the ranges, the members that cannot read, and the fix
    restore    every member that can read it puts its replicated state (step, data cursor,
               scheduler) back to that step's, and the others take it from them, on a new
               lineage (`TrainState.lineage`: a state or ranges from before, of a member
               expelled then, never count as the group's again); each logs the restore (the
               promises checker accepts the steps after it committed again: they are redone
               with the samples planned for them), and the zone's sync phase reads each
               reader's ranges of a fresh layout from the shard files (digests checked); the
               others hold none until the next epoch's re-shard moves them their share

Promise 1 allows this rollback: no replica of those ranges survives anywhere. Every member
reports it (``fallback``, one event in the job's log): "ranges X lost in every zone at step
s: rolled back to checkpoint step c"; once all of the epoch's members did, the leader's step
for the group goes back to c too (`unbroken.control.roster.Roster.went_back`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.comm.group import EpochGroup, EpochScope, wait_until
from unbroken.comm.shard_files import complete_steps
from unbroken.comm.transfer import sync_state
from unbroken.errors import JobHalted, RangesAbsent
from unbroken.events import Entry, Kind
from unbroken.state.ckpt_files import checkpoint_steps, load_checkpoint
from unbroken.state.fallback import Recovery, Source, choose
from unbroken.state.shards import layout_for
from unbroken.train.shard_reports import Decision, Report, exchange

if TYPE_CHECKING:
    from unbroken.train.runtime import Node

log = logging.getLogger(__name__)

ABSENT_WAIT_S = 30.0
"""How long members wait for a holder of ranges no member holds to rejoin before they fall
back to a checkpoint (or stop the job): the default of ``--absent-wait``."""


def remaining_wait(waited: Sequence[float], wait: float) -> float:
    """How long the members still wait for a holder of lost ranges to rejoin (one expelled
    while its machine was busy comes back with its ranges current): ``wait`` counted from
    the member that has waited longest (``waited``: each member's time so far), so that a
    member that joined during the wait does not start it over. The same on every member."""
    return max(0.0, wait - max(waited, default=0.0))


def _sleep(seconds: float, scope: EpochScope) -> None:
    """Sleep ``seconds`` within the epoch: a new order (a holder rejoined, a member lost)
    ends it early, as it ends a collective (`EpochAborted`). In pieces, each within the
    scope's deadline for one wait."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        piece = _past(time.monotonic() + min(left, scope.timeout_s / 2))
        wait_until(piece, scope, "waiting for a holder of lost ranges to rejoin", 0.2)


def _past(when: float) -> Callable[[], bool]:
    return lambda: time.monotonic() >= when


def readable_steps(directory: Path | None, numel: int) -> list[int]:
    """The checkpoint steps ``directory`` holds whole for a sharded job of ``numel``
    elements: the replicated state's file and shard files covering ``[0, numel)``, newest
    first (what `unbroken restore` gathers into one directory, or a shared one holds)."""
    if directory is None or not directory.is_dir():
        return []
    replicated = {step for step, _ in checkpoint_steps(directory)}
    return [s for s in complete_steps(directory, numel) if s in replicated]


def recovery_of(
    reports: Mapping[str, Report], zone_of: Mapping[str, str], step: int, checkpoints: set[int]
) -> Recovery:
    """The fall-back of the first zone (in the members' order) that lost ranges in every
    zone: every zone that did lost the same ones, and goes back to the same step. Where no
    zone's layout shows the loss (the group is ahead of every member's ranges, or the ranges
    held are not their layout's after a re-shard cut short), all of the state counts as lost."""
    for z in dict.fromkeys(zone_of.values()):
        mine = {m: r for m, r in reports.items() if zone_of[m] == z and r.layout is not None}
        current = {m for m, r in mine.items() if r.step == step and r.held}
        far = [span for m, r in reports.items() if zone_of[m] != z and r.step == step for span in r.held]
        if not mine:
            continue
        newest = max(mine.values(), key=lambda r: (r.step, r.epoch))
        assert newest.layout is not None
        got = choose(newest.layout, current, step, elsewhere=far, checkpoints=checkpoints)
        if got.source in (Source.CHECKPOINT, Source.HALT):
            return got
    numel = next((r.layout.numel for r in reports.values() if r.layout is not None), 1)
    return choose(layout_for(numel, {"": 1}), (), step, checkpoints=checkpoints)


def everywhere(readable: Mapping[str, set[int]], zone_of: Mapping[str, str]) -> set[int]:
    """The checkpoint steps a member of every zone can read whole: the readers restore from
    them, and give the replicated state to the others (their ranges come at the next
    re-shard, as a newcomer's do)."""
    zones: dict[str, set[int]] = {}
    for m, got in readable.items():
        zones.setdefault(zone_of[m], set()).update(got)
    return set.intersection(*zones.values()) if zones else set()


def _read(node: Node, path: Path, reason: str) -> dict[str, Any]:
    """The replicated checkpoint at ``path``, checked to be this job's.

    Raises:
        JobHalted: it cannot be read here, or is another job's."""
    try:
        snap = load_checkpoint(path)
    except Exception as error:  # torch.load raises what the bytes lead it to
        raise JobHalted(f"{reason}, but {path} cannot be read here ({type(error).__name__}: {error})") from error
    identity = node.job.identity()
    if snap.get("job", identity) != identity:
        raise JobHalted(f"{reason}, but {path} is another job's (job identity {snap['job']}, not {identity})")
    return snap


def unreadable(readable: Mapping[str, set[int]], step: int) -> str:
    """Why no checkpoint every member can read holds the state, where some members can read
    one: the newest step (not after ``step``) any member can read, and the members that
    cannot (no --checkpoint-dir, or a directory of their own). Empty where none can."""
    steps = {s for got in readable.values() for s in got if s <= step}
    if not steps:
        return ""
    newest = max(steps)
    lacking = sorted(m for m, got in readable.items() if newest not in got)
    return (
        f" (the checkpoint of step {newest} is readable on {len(readable) - len(lacking)} of {len(readable)} members; "
        f"not on {', '.join(lacking)}: give every node one --checkpoint-dir, shared or gathered)"
    )


def fall_back(
    node: Node,
    g: EpochGroup,
    step: int,
    numel: int,
    align: int,
    reports: Mapping[str, Report],
    zone_of: Mapping[str, str],
    exc: RangesAbsent,
    waited_s: float,
) -> tuple[dict[str, Decision], int]:
    """Ranges lost in every zone at ``step`` (``exc``), this member having waited
    ``waited_s`` for a holder: the zones' decisions to read fresh layouts from the checkpoint
    chosen, and its step (the replicated state is put back to it here).

    First the members wait for a holder to rejoin (`remaining_wait`), within the epoch: the
    group re-forms when one does, and its sync phase finds the ranges held.

    Raises:
        EpochAborted: a new order came during the wait.
        RangesAbsent: no checkpoint step a member of every zone can read holds every range.
        JobHalted: the chosen checkpoint cannot be read here, or is another job's.
    """
    assert g.pg is not None
    directory = node.config.checkpoint_dir
    mine = {"waited": waited_s, "steps": readable_steps(directory, numel)}
    scope = node.scope(during_step=False)
    said = [json.loads(b) for b in exchange(g.pg, json.dumps(mine).encode(), scope)]
    left = remaining_wait([float(x["waited"]) for x in said], node.config.absent_wait_s)
    if left > 0:
        log.warning("%s: %s; waiting %.0f s for a holder to rejoin", node.name, exc, left)
        _sleep(left, scope)
    readable = {m: {int(s) for s in x["steps"]} for m, x in zip(g.members, said, strict=True)}
    recovery = recovery_of(reports, zone_of, step, everywhere(readable, zone_of))
    if recovery.source is not Source.CHECKPOINT:
        raise RangesAbsent(recovery.reason + unreadable(readable, step)) from exc
    back = recovery.checkpoint
    me = node.client.member_id
    readers = {m for m, got in readable.items() if back in got}
    node.records.settle()
    lineage = node.state.lineage  # the group's: its sync phase gave every member one state
    if me in readers:
        assert directory is not None  # the step was read from it
        path = str(dict(checkpoint_steps(directory))[back])
        node.state.restore(_read(node, Path(path), recovery.reason))
        node.state.lineage = max(lineage, node.state.lineage) + 1  # a history none had: see TrainState.lineage
    # The others take the replicated state from the readers (theirs is of the older lineage).
    got = sync_state(g.pg, g.rank, g.size, node.state, scope, lineage=node.state.lineage)
    if me not in readers:
        path = f"received from {', '.join(g.members[r] for r in got.peers)}"
    node.restored()
    fields = {"step": back, "path": path, "digest": node.state.digest(), "why": recovery.reason}
    node.records.log(Entry.RESTORE, fields)
    node.report(Kind.FALLBACK, recovery.reason)  # from every member: the leader's step goes back once all said it
    log.warning("%s: %s", node.name, recovery.reason)
    if len(readers) < len(g.members):
        log.warning("%s: %s cannot read the checkpoint: no ranges until the next re-shard", node.name,
                    ", ".join(sorted(set(g.members) - readers)))  # fmt: skip
    # The readers hold the ranges; the others are spares until the next epoch's re-shard gives
    # them their share (moved from the readers, as to a newcomer).
    weights = {m: r.weight if m in readers else 0 for m, r in reports.items()}
    decisions = {
        z: Decision(
            fresh=layout_for(numel, {m: weights[m] for m in g.members if zone_of[m] == z}, align=align), restore=True
        )
        for z in dict.fromkeys(zone_of.values())
    }
    return decisions, back


def report_recovery(
    node: Node, g: EpochGroup, decision: Decision, reports: Mapping[str, Report], zone_of: Mapping[str, str], step: int
) -> None:
    """After a re-shard that took the ranges of lost members from their buddies or from
    another zone: one event per zone (from its first member) saying which served."""
    p = decision.plan
    me = node.client.member_id
    if p is None or not p.lost or next(m for m in g.members if zone_of[m] == zone_of[me]) != me:
        return
    far = [span for m, r in reports.items() if zone_of[m] != zone_of[me] and r.step == step for span in r.held]
    got = choose(p.old, decision.keep, step, elsewhere=far)
    if got.source is not None:
        zone = f"zone {zone_of[me]}: " if zone_of[me] else ""
        node.report(Kind.FALLBACK, f"{zone}{got.reason} (step {step})")
