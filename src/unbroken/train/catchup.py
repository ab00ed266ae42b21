"""A member's part in an epoch that starts behind the group (the order's ``group_step``):
every member holding the group's newest state is gone, and the best state here may be older
than a checkpoint in the members' --checkpoint-dir.

In the sync phase, before the states are compared::

    states    each member's step and its state's history: where one holds the group's
              step (the leader had not heard of it), nothing more happens
    claim     the newest checkpoint above the best state and not above the group's step
              whose description reads here (its pickle on the meta device, no tensor
              read: it is a training state of this job, of its step); the others wait
    claims    each member's step claimed (-1: none)
    decide    `unbroken.state.catchup.plan_catch_up`, the same on every member
    read      the claimants of the chosen step read their file whole (abortable)
    digests   each one's digest of what it read (-1: it did not read): those that agree
              with the first restore it (`agreed`); where none read it, they claim again
              without that file
    restore   the readers restore it, on a new history (`TrainState.lineage`), and log
              the restore; the sync phase that follows gives it to the others (theirs
              are of the older history)
    say       every member reports where the group goes on from: the leader's step goes
              back to it once all did (`unbroken.control.roster.Roster.went_back`); where no
              checkpoint is newer, steps are lost, and the members of the newest history
              start a new one too (a member back later from the lost steps is not the group's)

A report out of range (a step beyond the job's, a history that would overflow the sync
exchange) names its rank (`BadRequest`), as a bad request in the sync phase does.

Replicated sync jobs only: a sharded zone's ranges have their own fall-back
(`train.shard_fallback`), and DiLoCo's rounds keep what they keep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.comm.group import EpochGroup, EpochScope, run_abortable
from unbroken.comm.transfer import gather_values
from unbroken.control import messages as m
from unbroken.errors import BadRequest
from unbroken.events import Entry, Kind
from unbroken.state.catchup import CatchUp, agreed, misreported, plan_catch_up
from unbroken.state.ckpt_files import checkpoint_steps, load_checkpoint, unusable
from unbroken.state.snapshot import digest_prefix
from unbroken.state.sync import abandoned

if TYPE_CHECKING:
    from unbroken.train.views import CatchUpNode

log = logging.getLogger(__name__)


def newest_readable(
    directory: Path | None,
    identity: str,
    above: int,
    upto: int,
    scope: EpochScope | None = None,
) -> tuple[int, Path | None, list[str]]:
    """The newest checkpoint of ``directory`` whose step is in ``(above, upto]`` whose
    description reads here: its pickle on the meta device (no tensor is read: the others
    wait for the claim) holds a training state of its step, of the job ``identity``. Its
    step (-1: none) and path, and why each newer one in that range could not be used (a
    directory that cannot be listed too).

    Raises:
        EpochAborted: a new order came (``scope``), checked before each file.
    """
    if directory is None or upto <= above:
        return -1, None, []
    try:
        if not directory.is_dir():
            return -1, None, []
        found = checkpoint_steps(directory)
    except OSError as exc:
        return -1, None, [f"{directory} cannot be listed ({type(exc).__name__}: {exc.strerror or exc})"]
    bad: list[str] = []
    for step, path in reversed(found):
        if step > upto:
            continue
        if step <= above:
            break
        if scope is not None and (aborted := scope.abort()) is not None:
            raise aborted.during("checkpoint claims")
        why = unusable(path, map_location="meta", step=step, job=identity)
        if why is None:
            return step, path, bad
        bad.append(f"{path} cannot be used ({why})")
    return -1, None, bad


def read_whole(
    path: Path, identity: str, step: int, scope: EpochScope, digest_of: Callable[[dict[str, Any]], str]
) -> tuple[dict[str, Any], int] | str:
    """The state in ``path`` (claimed for ``step``) and its digest prefix, read and hashed on
    a helper thread while the epoch's orders are watched; or why it cannot be used (its
    tensors do not read: a description that reads does not prove them).

    Raises:
        EpochAborted: a new order came during the read.
        CollectiveFailed: the read ran past the epoch's collective timeout.
    """

    def read() -> tuple[dict[str, Any], int] | str:
        try:
            snap = load_checkpoint(path)
            if not isinstance(snap, dict) or snap.get("step") != step or snap.get("job", identity) != identity:
                return f"{path} changed since it was claimed: not the training state of step {step} of this job"
            return snap, digest_prefix(digest_of(snap))
        except Exception as exc:  # torch.load raises whatever the unpickler or the reader met
            return f"{path} does not read whole ({type(exc).__name__}: {str(exc)[:200]})"

    return run_abortable(read, scope, "checkpoint read")


def catch_up(node: CatchUpNode, g: EpochGroup, group_step: int) -> None:
    """The members of epoch ``g``, which starts behind the group's ``group_step``, go on
    from the newest checkpoint one of them reads, where it is newer than their best state;
    whatever is lost is said.

    Raises:
        EpochAborted: a new order came during the exchange.
        CollectiveFailed: a member failed during the exchange.
        BadRequest: a member said what no honest member says (names its rank).
    """
    if group_step <= 0 or node.zone is not None or node.diloco is not None:
        return
    assert g.pg is not None
    st, scope, identity = node.state, node.scope(during_step=False), node.job.identity()
    said = gather_values(g.pg, g.size, [st.step, st.lineage], scope, "states held")
    steps, lineages = [x[0] for x in said], [x[1] for x in said]
    _in_range(node.job.num_steps, steps, lineages)
    live = max(abandoned(steps, lineages))
    if live >= group_step:
        return  # the leader had not heard of a member's step yet: the group holds its step
    cap = group_step
    # Ends: each round without a reader lowers every member's cap below the step it chose
    # (shared: one member claiming a step it never reads cannot hold the group here).
    while True:
        # Only now is a file read, and only one that would move the group forward.
        claim, path, bad = newest_readable(node.config.checkpoint_dir, identity, live, cap, scope)
        for why in bad:
            log.warning("%s: %s: not used", node.name, why)
        claims = [x[0] for x in gather_values(g.pg, g.size, [claim], scope, "checkpoint claims")]
        _in_range(node.job.num_steps, steps, lineages, claims)
        plan = plan_catch_up(steps, lineages, claims, group_step, cap)
        if plan.checkpoint < 0:
            _lost(node, plan, lineages)
            return
        got: tuple[dict[str, Any], int] | str = "not claimed here"
        if g.rank in plan.readers:
            assert path is not None
            got = read_whole(path, identity, plan.checkpoint, scope, st.digest_of)
        mine = got[1] if isinstance(got, tuple) else -1
        digests = [x[0] for x in gather_values(g.pg, g.size, [mine], scope, "checkpoint digests")]
        claimed, plan = g.rank in plan.readers, agreed(plan, digests)
        if isinstance(got, str) and claimed:
            log.warning("%s: %s: not used", node.name, got)  # below the next round's cap
        elif isinstance(got, tuple) and g.rank not in plan.readers:
            log.warning("%s: %s holds a state of step %d most claimants do not: not used", node.name, path, claim)
        if plan.readers:
            break
        cap = plan.checkpoint - 1
    if g.rank in plan.readers:
        assert isinstance(got, tuple) and path is not None
        snap = got[0]
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


def _lost(node: CatchUpNode, plan: CatchUp, lineages: list[int]) -> None:
    """No checkpoint is newer than the best state: the group goes on from it. Those of its
    history start a new one (a state of the lost steps, of a member back later, must not be
    taken for the group's), and every member says where the group goes on from."""
    if plan.lost is None:
        return
    newest = max(lineages)
    if node.state.lineage == newest:
        node.state.lineage = newest + 1
    node.client.send(m.Report(kind=Kind.ROLLBACK, step=plan.live, reason=plan.reason))
    log.warning("%s: %s", node.name, plan.reason)


def _in_range(num_steps: int, steps: list[int], lineages: list[int], claims: list[int] | None = None) -> None:
    """Raise `BadRequest` naming the first rank whose report is out of range (`misreported`)."""
    bad = misreported(num_steps, steps, lineages, claims or ())
    if bad is not None:
        raise BadRequest(bad[0], f"catching up with the group: {bad[1]}")
