"""Consistency audits: every N steps the members compare state digests (`train.sync.audit`
decides), and each sync phase compares those of the members at the highest step
(`train.sync.diverged`). A replica that differs from the majority was corrupted since it was
last compared, and its contributions since then are suspect: every member goes back to the
last audited state (kept in memory), the culprit behind it so that the sync phase repairs
it from a peer, and the steps since are redone with the same samples. The culprit is named.

A member that holds no copy of the state the leader orders back to (a joiner holds the one
it fetched, a member cut short of an audit's verdict an older one) is put behind too: it
fetches that state from a member that holds it instead of offering its own."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, NoReturn

from unbroken.comm.group import EpochGroup
from unbroken.comm.transfer import gather_digests, gather_values
from unbroken.errors import AuditMismatch, CollectiveFailed
from unbroken.events import Entry
from unbroken.state import layout
from unbroken.state.snapshot import part_digests
from unbroken.train.sync import Standing, audit

if TYPE_CHECKING:
    from unbroken.train.views import AuditsNode

log = logging.getLogger(__name__)

PARTS_NAMED = 6
"""Parts of the state an audit's verdict names where replicas differ (then a count)."""
MAX_TIES = 3
"""Rollbacks for a step whose states differ without a majority, before the audits take the
difference for the members' arithmetic and let the sync phase settle it."""


class Audits:
    """One node's audits: the state at the last audit that passed, and the checks."""

    def __init__(self, node: AuditsNode) -> None:
        self.node = node
        self.every = 0
        """Steps between audits, as the epoch order says (0: none)."""
        self.audited: dict[str, Any] | None = None
        """The state at the last audit that passed (what a failed audit rolls back to)."""
        self.behind = False
        """This node's state is not one the group may go on from (it refused it, or holds no
        copy of the state ordered back to): the next sync phase replaces it."""
        self.committed_epoch = -1
        """The epoch in which this node committed the step it holds (-1: the state came
        from a peer, a copy or a checkpoint)."""
        self.checkpoint_epoch = -1
        """While this node holds the state it restored from a checkpoint, that state's epoch
        (a verdict of that epoch or later refuses it like a state committed then)."""
        self.floor = self.floor_epoch = -1
        """The step this node went back to at a verdict since its last completed sync phase,
        and the verdict's epoch (`train.sync.floored`)."""
        self.synced_epoch = -1
        """The epoch of this node's last completed sync phase."""
        self._ties: dict[int, int] = {}
        """Verdicts without a majority, by step (`MAX_TIES`)."""
        self.arithmetic_differs: frozenset[str] = frozenset()
        """The members whose arithmetic was found to differ: while they are the epoch's,
        a difference without a majority is settled at once."""
        self.unsettled = False
        """An audit began here and its verdict was not seen (its wait was cut short): a node
        at the job's last step does not finish on that state before a sync phase settles it."""

    def due(self, step: int) -> bool:
        """Every ``every`` steps, and at the job's last step (the state people keep)."""
        return bool(self.every) and (step % self.every == 0 or step == self.node.job.num_steps)

    def standing(self) -> Standing | None:
        """What this node says of its state in the sync phase (None: audits are off)."""
        if not self.every:
            return None
        # A process restarted from a checkpoint settled everything before that state's epoch.
        restored = self.node.records.restored_epoch
        synced = max(self.synced_epoch, restored if restored is not None else -1)
        return Standing(self.behind, self.committed_epoch, self.floor, self.floor_epoch, synced)

    def synced(self, epoch: int, received: bool, fetched: dict[str, Any] | None = None) -> None:
        """After the sync phase of ``epoch``: the state the group agreed on is one a failed
        audit may come back to. ``fetched``: the tree a receiver fetched, in buffers of its
        own (its state took copies), kept as that state instead of a capture."""
        self.behind = self.unsettled = False
        self.floor = self.floor_epoch = self.checkpoint_epoch = -1
        self.synced_epoch = epoch
        if received:
            self.committed_epoch = -1
        if not self.every or not (self.audited is None or received):
            return
        if fetched is None:
            self.audited = self.node.state.capture(reuse=self.audited)
            return
        mine = self.node.state.local_part()
        self.audited = fetched | ({"local": layout.copy(mine)} if mine is not None else {})

    def rollback_if_ordered(self) -> None:
        """A failed audit's order: back to the state audited at ``rollback_to``, if this node
        is ahead of it; behind it where it holds no copy of that state."""
        order = self.node.client.latest_order()
        back = order.rollback_to if order is not None else -1
        if back < 0 or self.node.state.step <= back:
            return
        if self.audited is not None and int(self.audited["step"]) == back:
            self._restore()
            return
        self._put_behind(f"no copy of the state of step {back} that a failed audit goes back to")

    def _restore(self) -> None:
        assert self.audited is not None
        node = self.node
        node.records.settle()
        node.state.restore(self.audited)
        node.restored()
        self.committed_epoch = self.checkpoint_epoch = -1
        fields = {"step": node.state.step, "digest": node.state.digest(), "why": "failed audit"}
        node.records.log(Entry.RESTORE, fields)

    def refuse_if_recorded(self) -> None:
        """A state this node committed in a verdict's epoch or before, above the step that
        verdict went back to, is refused (the node was away: the floors that would have said
        so are gone), and so is a checkpoint's written then (the node restarted from one):
        behind, it fetches the group's state instead of offering its own."""
        order = self.node.client.latest_order()
        epoch = self.committed_epoch if self.committed_epoch >= 0 else self.checkpoint_epoch
        if order is None or epoch < 0:
            return
        step = self.node.state.step
        what = f"committed in epoch {epoch}" if self.committed_epoch >= 0 else f"a checkpoint of epoch {epoch}"
        for r in order.refused:
            if epoch <= r.epoch and step > r.step:
                if self.audited is not None and int(self.audited["step"]) <= r.step:
                    self._restore()  # an audited state before the verdict's step: offered again
                    return
                self._put_behind(f"{what}: refused by epoch {r.epoch}'s verdict")
                return

    def missed_verdict(self) -> None:
        """The sync phase found this node above the step the others went back to at a
        verdict it never saw: behind until a sync phase completes, even if this one fails."""
        self._put_behind("a verdict it missed refused its state")

    def _give_up(self, g: EpochGroup, step: int, message: str) -> NoReturn:
        """The same step differed again and again with no majority to name anyone: not a
        flipped bit but arithmetic that differs between these members (a GPU beside a CPU,
        a nondeterministic kernel). Rolling back again would loop forever: this node's state
        is marked as taken from elsewhere, so the next sync phase only repairs it (the tie
        goes to the lowest rank's state), and training goes on, loudly; while the same
        members train, such a difference is settled so at once."""
        self.committed_epoch = -1
        self.unsettled = True  # not final before the sync phase settled it (the job's last step)
        self._ties.pop(step, None)
        members = frozenset(g.members)
        if self.arithmetic_differs == members:
            log.warning("%s: %s; settled by the sync phase (the members' arithmetic differs)", self.node.name, message)
            raise AuditMismatch(-1, message, rollback_to=-1)
        self.arithmetic_differs = members
        why = (
            f"{message}; the {MAX_TIES + 1}th time at step {step} without a majority: the members' "
            "arithmetic differs (mixed device kinds, nondeterministic kernels?). Going on from the "
            "lowest rank's state; add a member so a majority can name the odd one, or turn audits "
            "off (--audit-every 0)"
        )
        log.error("%s: %s", self.node.name, why)
        raise AuditMismatch(-1, why, rollback_to=-1)

    def _put_behind(self, why: str) -> None:
        self.behind = True
        log.info("%s: state of step %d set aside: %s", self.node.name, self.node.state.step, why)

    def check(self, g: EpochGroup) -> None:
        """Compare digests now; raise `AuditMismatch` (after going back) if a replica differs."""
        node = self.node
        assert g.pg is not None
        digest = node.state.digest()
        scope = node.scope(during_step=True)
        self.unsettled = True
        verdict = audit(gather_digests(g.pg, g.size, node.state.step, digest, scope, "audit"))
        self.unsettled = False
        node.records.log(Entry.AUDIT, {"step": node.state.step, "digest": digest, "ok": verdict is None})
        if verdict is None:
            if node.state.step < node.job.num_steps:  # after the last step nothing comes back to it
                self.audited = node.state.capture(reuse=self.audited)
            return
        rank, why = verdict
        who = f"{g.members[rank]}'s state " if rank >= 0 else ""
        where = self._where_states_differ(g)
        self.failed(g, rank, f"audit at step {node.state.step}: {who}{why}{where}")

    def _where_states_differ(self, g: EpochGroup) -> str:
        """Which parts of the state differ, on which members (every member of the audit
        calls this after the same verdict: one more small all-gather); empty if that fails."""
        node = self.node
        assert g.pg is not None
        parts = part_digests(node.state.tree(), node.state.optimizer_in_digest)
        scope = node.scope(during_step=True)
        try:
            counts = gather_values(g.pg, g.size, [len(parts)], scope, "audit: the state's parts")
            width = max(c[0] for c in counts)
            mine = [d for _, d in parts] + [-1] * (width - len(parts))
            rows = gather_values(g.pg, g.size, mine, scope, "audit: the state's parts")
        except CollectiveFailed:
            return ""
        found = []
        for i, (name, _) in enumerate(parts):
            column = [row[i] for row in rows]
            usual = Counter(column).most_common(1)[0][0]
            odd = [g.members[r] for r, d in enumerate(column) if d != usual]
            if odd:
                found.append(f"{name} (on {', '.join(odd)})")
        if not found:
            return ""
        more = f" and {len(found) - PARTS_NAMED} more" if len(found) > PARTS_NAMED else ""
        return f"; it differs in {'; '.join(found[:PARTS_NAMED])}{more}"

    def failed(self, g: EpochGroup, rank: int, message: str, below_top: bool = False) -> NoReturn:
        """A verdict against ``rank`` (-1: nobody can be named): back to the audited state
        at once, not only when the next order says so (after the job's last step there is
        no next order to wait for, and the suspect state must not be final). A member whose
        wait for the verdict was cut short never saw it: the order's `rollback_to`, or the
        floor this node reports at the next sync phase, takes it back. ``below_top``: a
        sync phase's verdict, this node below the step compared: it receives anyway, and
        its older copy must not pull the group further back."""
        step = self.node.state.step
        if rank < 0:
            self._ties[step] = self._ties.get(step, 0) + 1
            if self._ties[step] > MAX_TIES or self.arithmetic_differs == frozenset(g.members):
                self._give_up(g, step, message)
        back = -1
        if below_top:
            self._put_behind("below the step a sync phase's verdict was about")
        elif self.audited is not None:
            self._restore()
            back = self.floor = self.node.state.step
            self.floor_epoch = g.epoch
        else:
            self._put_behind("no audited state to go back to")
        if rank == g.rank:
            self._put_behind("its replica was refused")
        raise AuditMismatch(rank, message, rollback_to=back)
