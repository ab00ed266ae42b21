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
from typing import TYPE_CHECKING, Any

from unbroken.comm.group import EpochGroup
from unbroken.comm.transfer import gather_digests
from unbroken.errors import AuditMismatch
from unbroken.events import Entry
from unbroken.state import layout
from unbroken.train.sync import audit

if TYPE_CHECKING:
    from unbroken.train.runtime import Node

log = logging.getLogger(__name__)


class Audits:
    """One node's audits: the state at the last audit that passed, and the checks."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.every = 0
        """Steps between audits, as the epoch order says (0: none)."""
        self.audited: dict[str, Any] | None = None
        """The state at the last audit that passed (what a failed audit rolls back to)."""
        self.behind = False
        """This node's state is not one the group may go on from (it refused it, or holds no
        copy of the state ordered back to): the next sync phase replaces it."""
        self.trained = False
        """It committed steps since its state was last compared with the group's."""

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def synced(self, received: bool, fetched: dict[str, Any] | None = None) -> None:
        """After the sync phase: the state the group agreed on is one a failed audit may come
        back to. ``fetched``: the tree a receiver fetched, in buffers of its own (its state
        took copies), kept as that state instead of a capture."""
        self.behind = self.trained = False
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
        node.applied_step = -1
        node.client.step = node.state.step
        self.trained = False
        fields = {"step": node.state.step, "digest": node.state.digest(), "why": "failed audit"}
        node.records.log(Entry.RESTORE, fields)

    def _put_behind(self, why: str) -> None:
        self.behind = True
        log.info("%s: state of step %d set aside: %s", self.node.name, self.node.state.step, why)

    def check(self, g: EpochGroup) -> None:
        """Compare digests now; raise `AuditMismatch` (after going back) if a replica differs."""
        node = self.node
        assert g.pg is not None
        digest = node.state.digest()
        scope = node.scope(during_step=True)
        reports = gather_digests(g.pg, g.size, node.state.step, digest, scope, "audit")
        verdict = audit(reports)
        node.records.log(Entry.AUDIT, {"step": node.state.step, "digest": digest, "ok": verdict is None})
        if verdict is None:
            if len(set(reports)) == 1:  # not where no state had a majority: none passed
                self.audited = node.state.capture(reuse=self.audited)
                self.trained = False
            return
        rank, why = verdict
        self.failed(g, rank, f"audit at step {node.state.step}: {g.members[rank]}'s state {why}")

    def failed(self, g: EpochGroup, rank: int, message: str) -> None:
        """A verdict against ``rank`` (-1: nobody can be named): back to the audited state
        at once, not only when the next order says so (after the job's last step there is
        no next order to wait for, and the suspect state must not be final). A member whose
        wait for the verdict was cut short by an order never saw it: that order's
        `rollback_to` takes it back."""
        back = int(self.audited["step"]) if self.audited is not None else -1
        if self.audited is not None:
            self._restore()
        else:
            self._put_behind("no audited state to go back to")
        if rank == g.rank:
            self._put_behind("its replica was refused")
        raise AuditMismatch(rank, message, rollback_to=back)
