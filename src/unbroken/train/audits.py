"""Consistency audits: every N steps the members compare state digests (`train.sync.audit`
decides). A replica that differs from the majority was corrupted since the last audit, and
its contributions since then are suspect: every member goes back to the last audited state
(kept in memory), the culprit one step behind it so that the sync phase repairs it from a
peer, and the steps since are redone with the same samples. The culprit is named."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unbroken.comm.group import EpochGroup
from unbroken.comm.transfer import gather_digests
from unbroken.errors import AuditMismatch
from unbroken.events import Entry
from unbroken.state import layout
from unbroken.train.sync import audit

if TYPE_CHECKING:
    from unbroken.train.runtime import Node


class Audits:
    """One node's audits: the state at the last audit that passed, and the checks."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.every = 0
        """Steps between audits, as the epoch order says (0: none)."""
        self.audited: dict[str, Any] | None = None
        """The state at the last audit that passed (what a failed audit rolls back to)."""

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def synced(self, received: bool, fetched: dict[str, Any] | None = None) -> None:
        """After the sync phase: the state the group agreed on is one a failed audit may come
        back to. ``fetched``: the tree a receiver fetched, in buffers of its own (its state
        took copies), kept as that state instead of a capture."""
        if not self.every or not (self.audited is None or received):
            return
        if fetched is None:
            self.audited = self.node.state.capture(reuse=self.audited)
            return
        mine = self.node.state.local_part()
        self.audited = fetched | ({"local": layout.copy(mine)} if mine is not None else {})

    def rollback_if_ordered(self) -> None:
        """A failed audit's order: back to the state audited at ``rollback_to``, if held and ahead of it."""
        order = self.node.client.latest_order()
        back = order.rollback_to if order is not None else -1
        held = self.audited
        if back < 0 or held is None or int(held["step"]) != back or self.node.state.step <= back:
            return
        self._restore()

    def _restore(self) -> None:
        assert self.audited is not None
        node = self.node
        node.records.settle()
        node.state.restore(self.audited)
        node.applied_step = -1
        node.client.step = node.state.step
        fields = {"step": node.state.step, "digest": node.state.digest(), "why": "failed audit"}
        node.records.log(Entry.RESTORE, fields)

    def check(self, g: EpochGroup) -> None:
        """Compare digests now; raise `AuditMismatch` (after going back) if a replica differs."""
        node = self.node
        assert g.pg is not None
        digest = node.state.digest()
        scope = node.scope(during_step=True)
        verdict = audit(gather_digests(g.pg, g.size, node.state.step, digest, scope, "audit"))
        node.records.log(Entry.AUDIT, {"step": node.state.step, "digest": digest, "ok": verdict is None})
        if verdict is None:
            self.audited = node.state.capture(reuse=self.audited)
            return
        rank, why = verdict
        message = f"audit at step {node.state.step}: {g.members[rank]}'s state {why}"
        back = int(self.audited["step"]) if self.audited is not None else -1
        if self.audited is not None:
            # Back at once, not only when the next order says so: after the job's last step
            # there is no next order to wait for, and the suspect state must not be final.
            # (A member whose wait on this all-gather was cut short by an order never saw
            # the verdict: that order's `rollback_to` takes it back.)
            self._restore()
            if rank == g.rank:
                node.state.step -= 1  # behind the group: the sync phase sends it a peer's state
                node.client.step = node.state.step
        raise AuditMismatch(rank, message, rollback_to=back)
