"""Consistency audits: every N steps the members compare state digests (`train.sync.audit`
decides). A replica that differs from the majority was corrupted since the last audit, and
its contributions since then are suspect: every member goes back to the last audited state
(kept in memory), the culprit one step behind it so that the sync phase repairs it from a
peer, and the steps since are redone with the same samples. The culprit is named.

A member holds the audited state from its first epoch (a cold start's state) or from the
first audit it passed: a joiner keeps no copy of what it received (the copy of a 50M
model's state was 400 MB of fresh memory, seconds on its first step and the group's on a
busy machine). A failed audit that goes back to a step a member holds no copy of puts it
behind that step instead, and the sync phase sends it a peer's state of it."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from unbroken.comm.group import EpochGroup
from unbroken.comm.transfer import gather_digests
from unbroken.errors import AuditMismatch
from unbroken.events import Entry
from unbroken.state import layout
from unbroken.train.sync import audit

if TYPE_CHECKING:
    from unbroken.train.runtime import Node

log = logging.getLogger(__name__)

LAY_OUT_AHEAD = 3
"""Commits before its first audit at which a member lays out the buffers of its copy, on a
thread: the audit's step only copies, as later ones do."""


class Audits:
    """One node's audits: the state at the last audit that passed, and the checks."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.every = 0
        """Steps between audits, as the epoch order says (0: none)."""
        self.audited: dict[str, Any] | None = None
        """The state at the last audit that passed (what a failed audit rolls back to)."""
        self._synced = False
        self._blank: dict[str, Any] | None = None
        self._laying: threading.Thread | None = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def synced(self, received: bool) -> None:
        """After the sync phase. In this node's first epoch, a state it did not receive is
        the group's starting state: the one a failed audit comes back to. A receiver that
        holds a copy (an audit's culprit, repaired) takes the state it received into it;
        one that holds none (a joiner) keeps none until it passes an audit."""
        first, self._synced = not self._synced, True
        if self.every and ((first and not received) or (received and self.audited is not None)):
            self.audited = self.node.state.capture(reuse=self.audited)

    def ahead(self, step: int) -> None:
        """After a commit: where this node holds no copy and its first audit is near, the
        copy's buffers are laid out on a thread (a fresh 400 MB one stalled the group's
        audit step by a second or more on a busy machine)."""
        if not self.every or self.audited is not None or self._laying is not None or self._blank is not None:
            return
        if self.every - step % self.every > LAY_OUT_AHEAD:
            return
        header, tensors = layout.split(self.node.state.tree(local=True), as_they_are=True)
        shapes = [(t.shape, t.dtype) for t in tensors]

        def run() -> None:
            self._blank = layout.join(header, [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes])

        self._laying = threading.Thread(target=run, name="audit-buffers", daemon=True)
        self._laying.start()

    def _buffers(self) -> dict[str, Any] | None:
        """The copy to capture into: the audited state's, or those laid out ahead."""
        if self.audited is not None:
            return self.audited
        if self._laying is not None:
            self._laying.join()
            self._laying = None
        blank, self._blank = self._blank, None
        return blank

    def rollback_if_ordered(self) -> None:
        """A failed audit's order: back to the state audited at ``rollback_to`` where this
        node holds it; a node ahead of that step that holds no copy of it goes behind it, so
        that the sync phase sends it a peer's (it must not lead the group from the suspect
        state: the highest step is the sync's source)."""
        order = self.node.client.latest_order()
        back = order.rollback_to if order is not None else -1
        node = self.node
        if back < 0 or node.state.step <= back:
            return
        held = self.audited
        if held is not None and int(held["step"]) == back:
            self._restore()
            return
        node.records.settle()
        node.state.step = back - 1
        node.applied_step = -1
        node.client.step = node.state.step
        why = f"failed audit: no copy of step {back} held here"
        node.records.log(Entry.RESTORE, {"step": node.state.step, "digest": node.state.digest(), "why": why})

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
            self.audited = node.state.capture(reuse=self._buffers())
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
