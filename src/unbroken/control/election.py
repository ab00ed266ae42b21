"""Who leads a job: coordinators elected through an etcd lease, with a term for fencing.

Every coordinator of a job campaigns for one key, ``<prefix>/leader``, created under its
own lease only if the key does not exist. The winner's term is that key's create revision
(etcd numbers revisions cluster-wide, so a later leader always has a larger term); the
others are standbys that read the key and campaign again once it is gone (the leader's
lease lapsed: it died, froze or lost etcd).

A leader may act only while it is *sure* its lease has not lapsed::

    standby ──(key absent; create under my lease succeeds)──▶ leading(term)
    leading ──(keepalive ok at t_sent)──▶ leading, valid until t_sent + TTL − margin
    leading ──(now ≥ valid-until, or keepalive says expired)──▶ standby   (deposed)
    leading ──(resign: revoke the lease)──▶ standby                       (hand-over)

etcd expires a lease no earlier than TTL after it processed the last renewal, which is
after we *sent* it, so "valid until" is never later than the real expiry: by the time any
standby can win, this leader has stopped issuing orders. Its epoch records are also
written in a transaction guarded by its term (`record_epoch`), so a deposed leader that
has not yet noticed cannot publish an epoch either. Nodes refuse orders of an older term.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from unbroken.control.etcd import Etcd, KeyValue
from unbroken.errors import EtcdUnavailable

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often a standby looks at the leader key (a lapsed lease is seen this much later)."""
RETRY_S = 0.03
"""How soon a leader tries again after a renewal that etcd did not answer."""
MARGIN_S = 0.05
"""Validity is cut this much short of the lease (message delay to etcd, clock rate)."""
PRESENCE_TTL_S = 5
"""Every candidate, leading or not, is listed under ``<prefix>/candidates/`` on a lease this
long (renewed every second): what the dashboard and ``unbroken status`` show as standbys."""


class Role(str, enum.Enum):
    STANDBY = "standby"
    LEADING = "leading"


def leader_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/leader".encode()


def candidates_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/candidates/".encode()


def epoch_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/epoch".encode()


class Leadership:
    """One coordinator's candidacy. ``run()`` campaigns and keeps the lease until cancelled."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        ttl_s: int,
        record: Callable[[], dict[str, Any]],
        *,
        on_elected: Callable[[int], None],
        on_deposed: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._record = record
        """What this coordinator publishes as leader (its address, id, job)."""
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.clock = clock
        self.role = Role.STANDBY
        self.term = 0
        self.lease = 0
        self.valid_until = 0.0
        self.leader: dict[str, Any] | None = None
        """The current leader's record as last read (None: nobody leads)."""
        self.leader_term = 0
        self.error: str | None = None
        """Why etcd could not be used on the last attempt (None: it answered)."""
        self.candidates: list[dict[str, Any]] = []
        """Every coordinator standing for this job, as last listed in etcd (this one included)."""
        self.name = ""
        """This candidate's key under ``<prefix>/candidates/`` (set by `run`)."""
        self._resigning = False
        self._retrying = False
        self._revoking: asyncio.Task[None] | None = None

    @property
    def key(self) -> bytes:
        return leader_key(self.prefix)

    def leading(self, now: float | None = None) -> bool:
        """True while this coordinator may issue orders (see the module docstring)."""
        return self.role is Role.LEADING and (self.clock() if now is None else now) < self.valid_until

    async def run(self) -> None:
        presence = asyncio.create_task(self._present(), name="candidate-presence")
        try:
            await self._campaign_forever()
        finally:
            presence.cancel()

    async def _present(self) -> None:
        """Keep this candidate listed, and the list of every candidate fresh."""
        lease = 0
        record = self._record()
        self.name = str(record.get("coordinator_id") or id(self))
        key = candidates_key(self.prefix) + self.name.encode()
        while True:
            with contextlib.suppress(EtcdUnavailable):
                if lease == 0 or await self.etcd.keepalive(lease) <= 0:
                    lease = await self.etcd.grant(PRESENCE_TTL_S)
                    await self.etcd.put(key, json.dumps(self._record()).encode(), lease)
                self.candidates = [kv.json() for kv in await self.etcd.get_prefix(candidates_key(self.prefix))]
            await asyncio.sleep(1.0)

    async def _campaign_forever(self) -> None:
        while not self._resigning:
            try:
                if self.role is Role.STANDBY:
                    await self._campaign()
                    await asyncio.sleep(POLL_S)
                else:
                    await self._renew()
                self.error = None
            except Exception as exc:  # EtcdUnavailable, or a bug: never let the candidacy die silently
                if not isinstance(exc, EtcdUnavailable):
                    log.exception("election step failed")
                self.error = str(exc)
                if self.role is Role.LEADING and not self.leading():
                    self.depose(f"etcd unreachable past the lease: {exc}")
                # A leader retries at once: an etcd election (a member died) must not outlast its lease.
                await asyncio.sleep(RETRY_S if self.role is Role.LEADING else POLL_S)
                self._retrying = self.role is Role.LEADING

    async def _campaign(self) -> None:
        current = await self.etcd.get(self.key)
        if current is not None:
            self._saw(current)
            return
        sent = self.clock()
        lease = await self.etcd.grant(self.ttl_s)
        won, holder = await self.etcd.create(self.key, json.dumps(self._record()).encode(), lease)
        if not won or holder is None:
            await self._revoke(lease)
            if holder is not None:
                self._saw(holder)
            return
        self.lease, self.term, self.role = lease, holder.create_revision, Role.LEADING
        self.valid_until = sent + self.ttl_s - MARGIN_S
        self._saw(holder)
        log.info("elected leader of %s (term %d)", self.prefix, self.term)
        self.on_elected(self.term)

    async def _renew(self) -> None:
        if not self._retrying:
            await asyncio.sleep(max(0.01, min(self.ttl_s / 4, self.valid_until - self.clock())))
        self._retrying = False
        if self.role is not Role.LEADING:
            return
        if not self.leading():
            self.depose("the lease lapsed before it could be renewed (this process was frozen or starved)")
            return
        sent = self.clock()
        ttl = await self.etcd.keepalive(self.lease, timeout_s=max(0.1, self.ttl_s / 4))
        if ttl <= 0:
            self.depose("the leader's etcd lease expired")
            return
        self.valid_until = max(self.valid_until, sent + ttl - MARGIN_S)
        if not self.leading():
            self.depose("the lease was renewed too late")

    def _saw(self, kv: KeyValue) -> None:
        self.leader, self.leader_term = kv.json(), kv.create_revision

    def depose(self, reason: str) -> None:
        """Step down now: the lease lapsed, or a fenced write failed (another leader exists)."""
        if self.role is not Role.LEADING:
            return
        log.warning("no longer the leader of %s (term %d): %s", self.prefix, self.term, reason)
        lease = self.lease
        self.role, self.valid_until, self.lease = Role.STANDBY, 0.0, 0
        self.leader, self.leader_term = None, 0
        # Let the key go now: a standby (or this one) leads at once, not after the TTL.
        self._revoking = asyncio.get_running_loop().create_task(self._revoke(lease))
        self.on_deposed(reason)

    async def _revoke(self, lease: int) -> None:
        with contextlib.suppress(EtcdUnavailable):  # else it lapses on its own
            await self.etcd.revoke(lease)

    async def resign(self) -> None:
        """Hand leadership over at once (a graceful stop): revoke the lease."""
        self._resigning = True
        if self.role is Role.LEADING:
            self.depose("resigned")
            if self._revoking is not None:
                await self._revoking

    # ---------------------------------------------------------------- epoch records

    async def record_epoch(self, record: dict[str, Any], term: int) -> bool:
        """Publish the epoch about to be ordered, only while ``term`` still leads."""
        return await self.etcd.put_if_held(self.key, term, epoch_key(self.prefix), json.dumps(record).encode())

    async def last_epoch(self) -> dict[str, Any] | None:
        kv = await self.etcd.get(epoch_key(self.prefix))
        return kv.json() if kv is not None else None


async def find_leader(etcd: Etcd, prefix: str) -> tuple[dict[str, Any], int] | None:
    """The current leader's record and term, or None while nobody leads."""
    kv = await etcd.get(leader_key(prefix))
    return (kv.json(), kv.create_revision) if kv is not None else None
