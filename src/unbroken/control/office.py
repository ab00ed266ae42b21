"""Whether a coordinator may act, and for which term: its office.

Without etcd a coordinator is always in office (the embedded default). With etcd it stands
for election (`election.Leadership`) and is in office from the moment its view is reset
for the term it won until it is deposed. Being in office is not enough to *send*: while
its lease awaits a renewal (an etcd member died, an election inside etcd is under way),
messages wait (`Gate.WAIT`) rather than go out on a lease it cannot be sure of, and once
deposed they are dropped (`Gate.STOP`).

Decisions go out through the office's outbox, in order, and an epoch order only after its
record was written to etcd under the term (a transaction that fails once another term
leads): a deposed leader that has not noticed yet cannot publish an epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from unbroken.config import ServiceConfig
from unbroken.control import messages as m
from unbroken.control.election import Leadership
from unbroken.control.etcd import Etcd
from unbroken.control.membership import Decision
from unbroken.errors import EtcdUnavailable

log = logging.getLogger(__name__)


class Gate(enum.Enum):
    """May a message go out now: yes, not yet (the lease awaits its renewal), never (deposed)."""

    SEND = "send"
    WAIT = "wait"
    STOP = "stop"


class Office:
    """One coordinator's standing in its job: single, leader of a term, or standby."""

    def __init__(
        self,
        config: ServiceConfig,
        coordinator_id: str,
        address: Callable[[], tuple[str, int]],
        *,
        job: Callable[[], str | None],
        step: Callable[[], int],
        on_elected: Callable[[int, int, list[m.Refusal]], None],
        on_deposed: Callable[[str], None],
        deliver: Callable[[Decision], None],
    ) -> None:
        """``on_elected(term, epoch_floor, verdicts)`` resets the coordinator's view for a term
        it won (the newest epoch published, and the audit verdicts it carried);
        ``on_deposed(reason)`` drops it; ``deliver`` sends a decision's messages now."""
        self.config = config
        self.coordinator_id = coordinator_id
        self._address = address
        self._job = job
        self._step = step
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._deliver = deliver
        self.term = 0
        """The term this coordinator leads (0 without etcd, or before it ever led)."""
        self.leadership: Leadership | None = None
        self._etcd: Etcd | None = None
        self._took_over = not config.etcd
        self._outbox: asyncio.Queue[tuple[int, Decision]] | None = None
        """Decisions with the term they were made in: one of an older term is never sent."""
        self._tasks: list[asyncio.Task[None]] = []
        self._takeover: asyncio.Task[None] | None = None
        self._host: str | None = None
        self._settling: asyncio.Future[Gate] | None = None

    # ---------------------------------------------------------------- standing

    def in_office(self) -> bool:
        """Elected for the current term and not deposed (always, without etcd)."""
        return self.leadership is None or self._took_over

    def leading(self) -> bool:
        """In office and sure of the lease right now: messages may go out."""
        return self.leadership is None or (self._took_over and self.leadership.leading())

    def gate(self) -> Gate:
        if not self.in_office():
            return Gate.STOP
        return Gate.SEND if self.leading() else Gate.WAIT

    async def settled(self) -> Gate:
        """The gate once it is no longer `Gate.WAIT`. Every session's writer waits here, on
        one shared poll: thousands of sessions must not each wake a hundred times a second
        while a lease renewal is late."""
        gate = self.gate()
        if gate is not Gate.WAIT:
            return gate
        if self._settling is None or self._settling.done():
            self._settling = asyncio.ensure_future(self._poll_gate())
        return await asyncio.shield(self._settling)

    async def _poll_gate(self) -> Gate:
        while (gate := self.gate()) is Gate.WAIT:
            await asyncio.sleep(0.01)
        return gate

    @property
    def advertised(self) -> str:
        """HOST:PORT nodes reach this coordinator at (published in etcd while it leads)."""
        port = self._address()[1]
        advertise = self.config.advertise
        if advertise:
            return advertise if advertise.rpartition(":")[2].isdigit() else f"{advertise}:{port}"
        if self._host is None:  # looked up once: a DNS query must not run on every /api/state
            wildcard = self.config.host in ("0.0.0.0", "::", "")
            self._host = socket.getfqdn() if wildcard else self.config.host
        return f"{self._host}:{port}"

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Stand for election (with etcd); a clear error when etcd cannot be reached.

        Raises:
            EtcdUnavailable: no etcd member answered (names every endpoint and the fix).
        """
        if not self.config.etcd:
            return
        self._etcd = Etcd(self.config.etcd, tls=self.config.etcd_tls)
        try:
            await self._etcd.status()
        except EtcdUnavailable as exc:
            await self._etcd.close()
            raise EtcdUnavailable(f"cannot start the coordinator: {exc}") from None
        self._outbox = asyncio.Queue()
        self.leadership = Leadership(
            self._etcd,
            self.config.etcd_prefix,
            self.config.etcd_ttl_s,
            lambda: {"address": self.advertised, "coordinator_id": self.coordinator_id, "job": self._job()},
            on_elected=self._elected,
            on_deposed=self._deposed,
            token=self.config.token,
        )
        self._tasks = [
            asyncio.create_task(self.leadership.run(), name="coordinator-election"),
            asyncio.create_task(self._send_forever(), name="coordinator-outbox"),
        ]

    async def close(self) -> None:
        """Resign (a standby leads at once instead of after the lease) and stop."""
        if self.leadership is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.leadership.resign(), timeout=1.0)
        for task in self._tasks:
            task.cancel()
        if self._etcd is not None:
            await self._etcd.close()

    def _elected(self, term: int) -> None:
        self._takeover = asyncio.get_running_loop().create_task(self._take_over(term))

    async def _take_over(self, term: int) -> None:
        """A fresh view for the new term, numbered above the newest epoch published."""
        assert self.leadership is not None
        floor, verdicts = 0, []
        try:
            last = await self.leadership.last_epoch()
            floor = int(last.get("epoch", 0)) if last else 0
            verdicts = [m.Refusal.model_validate(r) for r in (last or {}).get("refused", [])][-m.REFUSALS_KEPT :]
        except (EtcdUnavailable, ValueError, TypeError):
            pass  # the nodes' hellos carry the newest epoch they heard of as well
        if self.leadership.term != term or not self.leadership.leading():
            return
        self.term = term
        self._on_elected(term, floor, verdicts)
        self._took_over = True

    def _deposed(self, reason: str) -> None:
        self._took_over = False
        if self._outbox is not None:
            while not self._outbox.empty():  # decisions of the lost term: never to be sent
                self._outbox.get_nowait()
        self._on_deposed(reason)

    # ---------------------------------------------------------------- sending

    def submit(self, d: Decision) -> None:
        """Send a decision's messages: through the outbox with etcd, at once without."""
        if self._outbox is not None:
            self._outbox.put_nowait((self.term, Decision(orders=d.orders, expel=d.expel)))
        elif self.leading():
            self._deliver(d)

    def _current(self, term: int) -> bool:
        return self.in_office() and self.term == term

    async def _send_forever(self) -> None:
        assert self._outbox is not None
        while True:
            term, d = await self._outbox.get()
            try:
                await self._send(term, d)
            except Exception:  # a bug here must not silence the leader for good
                log.exception("delivering a decision failed")

    async def _send(self, term: int, d: Decision) -> None:
        epochs = {o.epoch: o for o in d.orders.values()}
        for epoch, order in sorted(epochs.items()):
            if not await self._publish(term, epoch, order):
                return
        while self._current(term) and self.gate() is Gate.WAIT:
            await asyncio.sleep(0.01)
        if self._current(term) and self.gate() is Gate.SEND:
            self._deliver(d)

    async def _publish(self, term: int, epoch: int, order: m.EpochOrder) -> bool:
        assert self.leadership is not None
        record = {
            "epoch": epoch,
            "term": term,
            "members": len(order.members),
            "step": self._step(),
            "refused": [r.model_dump() for r in order.refused],  # the audits' verdicts outlive this leader
        }
        while self._current(term):
            try:
                if await self.leadership.record_epoch(record, term):
                    return True
                if self._current(term):
                    self.leadership.depose(f"epoch {epoch} could not be published: another coordinator leads")
                return False
            except EtcdUnavailable as exc:
                log.warning("publishing epoch %d: %s", epoch, exc)
                await asyncio.sleep(0.05)
        return False

    # ---------------------------------------------------------------- what others see

    def standby_refusal(self) -> m.Refused:
        """The answer to a node's hello while this coordinator does not lead."""
        leader = (self.leadership.leader if self.leadership else None) or {}
        address = str(leader.get("address", "")) if leader.get("coordinator_id") != self.coordinator_id else ""
        why = f"the leader is {address}" if address else "no coordinator leads yet (an election is under way)"
        return m.Refused(reason=f"this coordinator is a standby: {why}", standby=True, leader=address[:300])

    def state(self) -> dict[str, Any]:
        """``/api/state``'s ``leadership``: role, term, leader, standbys, etcd."""
        if self.leadership is None:
            host, port = self._address()
            return {"role": "single", "term": 0, "leader": f"{host}:{port}", "etcd": None}
        lead = self.leadership
        leader = lead.leader or {}
        mine = self.in_office()
        leader_id = self.coordinator_id if mine else leader.get("coordinator_id")
        return {
            "role": "leader" if mine else "standby",
            "term": self.term if mine else lead.leader_term,
            "leader": self.advertised if mine else leader.get("address"),
            "standbys": sorted(str(c.get("address")) for c in lead.candidates if c.get("coordinator_id") != leader_id),
            "self": self.advertised,
            "pid": os.getpid(),
            "etcd": {"endpoints": list(self.config.etcd), "prefix": self.config.etcd_prefix, "error": lead.error},
        }
