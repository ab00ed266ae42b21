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

The leader key is acted on only once its record passes `records.leader_problem` (sealed
with the job token, under the lease it names). A key that fails (overwritten by a hand
that is not a coordinator's, or left without a lease, which would never expire) is
vacant to the standbys once it has stayed so for a lease: they delete it, if nobody wrote
it since they read it, and campaign. A live leader repairs its key within a renewal, well
inside that time, so a forgery costs no election while the leader lives, and cannot
keep one from happening once it is gone.
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

from unbroken.control import records
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
        token: str | None = None,
    ) -> None:
        """``token``: the job's, which seals what this candidate writes and checks what it reads
        (`unbroken.control.records`)."""
        self.etcd = etcd
        self.token = token
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
        self._value = b""
        """The leader record this candidate wrote for its term, as written (to repair it)."""
        self._vacant_since: float | None = None
        """Since when the leader key has held a record nobody may follow (None: it does not)."""
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
            if self.leader is not None or not await self._clear(current):
                return
        sent = self.clock()
        lease = await self.etcd.grant(self.ttl_s)
        value = records.seal(self.token, self.key, {**self._record(), "lease": str(lease)})
        won, holder = await self.etcd.create(self.key, value, lease)
        if not won or holder is None:
            await self._revoke(lease)
            if holder is not None:
                self._saw(holder)
            return
        self._value = value
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
            return
        await self._keep_key()

    async def _keep_key(self) -> None:
        """Put this leader's record back if someone overwrote it (a standby would clear a key
        it cannot follow after a lease); step down if the key is gone or another's."""
        kv = await self.etcd.get(self.key)
        if self.role is not Role.LEADING:
            return
        if kv is None or kv.create_revision != self.term:
            self.depose("the leader key was deleted or replaced in etcd")
            return
        if kv.value == self._value and kv.lease == self.lease:
            return
        records.warn_ignored(kv, "is not the record this leader wrote: writing it back")
        if not await self.etcd.put_if_held(self.key, self.term, self.key, self._value, self.lease):
            self.depose("the leader key was replaced in etcd")

    def _saw(self, kv: KeyValue) -> None:
        self.leader, self.leader_term = records.leader(kv, self.token), kv.create_revision
        if self.leader is not None:
            self._vacant_since = None
        elif self._vacant_since is None:
            self._vacant_since = self.clock()

    async def _clear(self, kv: KeyValue) -> bool:
        """Delete a leader key nobody may follow once it has stayed so for a lease (its leader,
        if alive, had time to write it back); True once it is gone."""
        if self._vacant_since is None or self.clock() - self._vacant_since < self.ttl_s:
            return False
        if not await self.etcd.delete_if_unchanged(self.key, kv.mod_revision):
            return False  # written since it was read: looked at again on the next poll
        log.warning("deleted the leader key of %s: it %s", self.prefix, records.leader_problem(kv, self.token))
        self._vacant_since = None
        return True

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
        key = epoch_key(self.prefix)
        return await self.etcd.put_if_held(self.key, term, key, records.seal(self.token, key, record))

    async def last_epoch(self) -> dict[str, Any] | None:
        """The newest epoch published, when its record may be believed (`records.epoch_problem`)."""
        return records.epoch(await self.etcd.get(epoch_key(self.prefix)), self.token)


async def find_leader(etcd: Etcd, prefix: str, token: str | None) -> tuple[dict[str, Any], int] | None:
    """The current leader's record and term, or None while nobody leads or its key's record
    may not be followed (warned of: `records.leader_problem`)."""
    kv = await etcd.get(leader_key(prefix))
    record = records.leader(kv, token)
    return (record, kv.create_revision) if record is not None and kv is not None else None
