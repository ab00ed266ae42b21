"""A member's part in an epoch that starts behind the group (the order's ``group_step``):
every member holding the group's newest state is gone, and the best state here may be older
than a checkpoint in the members' --checkpoint-dir.

In the sync phase, before the states are compared::

    states    each member's step and its state's history: where one holds the group's
              step (the leader had not heard of it), nothing more happens
    read      the newest checkpoint above the best state and not above the group's step,
              read whole here (it loads, holds this job's training state of its step); a
              member whose file does not read claims the next one down
    claims    each member's step read (-1: none)
    decide    `unbroken.state.catchup.plan_catch_up`, the same on every member
    restore   the members that read the chosen checkpoint restore it, on a new history
              (`TrainState.lineage`), and log the restore; the sync phase that follows
              gives it to the others (theirs are of the older history)
    say       every member reports the fall-back (the leader's step goes back to the
              checkpoint's once all did); where no checkpoint is newer, the epoch's first
              member reports the committed steps lost

Replicated sync jobs only: a sharded zone's ranges have their own fall-back
(`train.shard_fallback`), and DiLoCo's rounds keep what they keep.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.comm.group import EpochGroup
from unbroken.comm.transfer import gather_values
from unbroken.control import messages as m
from unbroken.events import Entry, Kind
from unbroken.state.catchup import plan_catch_up
from unbroken.state.ckpt_files import checkpoint_steps, load_checkpoint
from unbroken.state.sync import abandoned

if TYPE_CHECKING:
    from unbroken.train.views import CatchUpNode

log = logging.getLogger(__name__)


def newest_readable(
    directory: Path | None, identity: str, above: int, upto: int
) -> tuple[int, Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint of ``directory`` whose step is in ``(above, upto]`` and that
    this node reads whole: its step (-1: none), path and state, and why each newer one in
    that range could not be used (it does not load, holds no training state or another
    step's, or is another job's: ``identity``)."""
    if directory is None or not directory.is_dir() or upto <= above:
        return -1, None, None, []
    bad: list[str] = []
    for step, path in reversed(checkpoint_steps(directory)):
        if step > upto:
            continue
        if step <= above:
            break
        try:
            snap = load_checkpoint(path)
        except Exception as exc:  # torch.load raises whatever the unpickler met
            bad.append(f"{path} does not load ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        if not isinstance(snap, dict) or not {"step", "cursor", "model"} <= snap.keys() or snap["step"] != step:
            bad.append(f"{path} holds no training state of step {step}")
        elif snap.get("job", identity) != identity:
            bad.append(f"{path} is another job's (job identity {snap['job']}, not {identity})")
        else:
            return step, path, snap, bad
    return -1, None, None, bad


def catch_up(node: CatchUpNode, g: EpochGroup, group_step: int) -> None:
    """The members of epoch ``g``, which starts behind the group's ``group_step``, go on
    from the newest checkpoint one of them reads, where it is newer than their best state;
    whatever is lost is said.

    Raises:
        EpochAborted: a new order came during the exchange.
        CollectiveFailed: a member failed during the exchange.
    """
    if group_step <= 0 or node.zone is not None or node.diloco is not None:
        return
    assert g.pg is not None
    st, scope = node.state, node.scope(during_step=False)
    said = gather_values(g.pg, g.size, [st.step, st.lineage], scope, "states held")
    steps, lineages = [x[0] for x in said], [x[1] for x in said]
    live = max(abandoned(steps, lineages))
    if live >= group_step:
        return  # the leader had not heard of a member's step yet: the group holds its step
    # Only now is a file read, and only one that would move the group forward.
    claim, path, snap, bad = newest_readable(node.config.checkpoint_dir, node.job.identity(), live, group_step)
    for why in bad:
        log.warning("%s: %s: not used", node.name, why)
    claims = [x[0] for x in gather_values(g.pg, g.size, [claim], scope, "checkpoint claims")]
    plan = plan_catch_up(steps, lineages, claims, group_step)
    if plan.checkpoint < 0:
        if plan.lost is not None and g.rank == 0:  # one event for the group: every member decided the same
            node.client.send(m.Report(kind=Kind.ROLLBACK, step=plan.live, reason=plan.reason))
        if plan.lost is not None:
            log.warning("%s: %s", node.name, plan.reason)
        return
    if g.rank in plan.readers:
        assert snap is not None and path is not None
        node.records.settle()
        st.restore(snap, own=True)
        # A history none had: a state from before (this epoch's others', or one of a member
        # back later from the lost steps) is never taken for the group's at its step.
        st.lineage = max(lineages) + 1
        node.restored()
        # No verdict refused this state (one that refused the state held before does not
        # reach it), and the sync phase keeps it as the one a failed audit comes back to.
        node.audits.committed_epoch = node.audits.checkpoint_epoch = -1
        node.audits.behind, node.audits.audited = False, None
        node.records.log(Entry.RESTORE, {"step": st.step, "path": str(path), "digest": st.digest(), "why": plan.reason})
    # Every member says it: the leader's step for the group goes back once all did.
    node.client.send(m.Report(kind=Kind.FALLBACK, step=plan.checkpoint, reason=plan.reason))
    log.warning("%s: %s", node.name, plan.reason)
