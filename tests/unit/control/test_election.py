"""The leader's lease and term, against an in-memory etcd with a clock the test moves."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from unbroken.control import election
from unbroken.control import messages as m
from unbroken.control.client import ControlClient
from unbroken.control.election import Leadership, Role
from unbroken.control.etcd import KeyValue
from unbroken.errors import EtcdUnavailable


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeEtcd:
    """Keys with leases and a cluster-wide revision, as etcd keeps them; ``down`` makes every call fail."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.revision = 1
        self.keys: dict[bytes, KeyValue] = {}
        self.leases: dict[int, tuple[int, float]] = {}
        self.down = False
        self._next_lease = 7

    def _check(self) -> None:
        if self.down:
            raise EtcdUnavailable("no etcd member answered")
        now = self.clock()
        for lease, (_, expires) in list(self.leases.items()):
            if now >= expires:
                del self.leases[lease]
                self.keys = {k: v for k, v in self.keys.items() if v.lease != lease}

    async def grant(self, ttl_s: int) -> int:
        self._check()
        self._next_lease += 1
        self.leases[self._next_lease] = (ttl_s, self.clock() + ttl_s)
        return self._next_lease

    async def keepalive(self, lease: int, timeout_s: float | None = None) -> int:
        self._check()
        if lease not in self.leases:
            return 0
        ttl, _ = self.leases[lease]
        self.leases[lease] = (ttl, self.clock() + ttl)
        return ttl

    async def revoke(self, lease: int) -> None:
        self._check()
        self.leases.pop(lease, None)
        self.keys = {k: v for k, v in self.keys.items() if v.lease != lease}

    async def get(self, key: bytes) -> KeyValue | None:
        self._check()
        return self.keys.get(key)

    async def create(self, key: bytes, value: bytes, lease: int) -> tuple[bool, KeyValue | None]:
        self._check()
        if key in self.keys:
            return False, self.keys[key]
        self.revision += 1
        self.keys[key] = KeyValue(key, value, self.revision, self.revision, lease)
        return True, self.keys[key]

    def _put(self, key: bytes, value: bytes, lease: int) -> None:
        self.revision += 1
        held = self.keys.get(key)
        created = held.create_revision if held is not None else self.revision
        self.keys[key] = KeyValue(key, value, created, self.revision, lease)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        self._check()
        self._put(key, value, lease)
        return self.revision

    async def put_if_held(self, guard: bytes, create_revision: int, key: bytes, value: bytes, lease: int = 0) -> bool:
        self._check()
        held = self.keys.get(guard)
        if held is None or held.create_revision != create_revision:
            return False
        self._put(key, value, lease)
        return True

    async def delete_if_unchanged(self, key: bytes, mod_revision: int) -> bool:
        self._check()
        held = self.keys.get(key)
        if held is None or held.mod_revision != mod_revision:
            return False
        self.revision += 1
        del self.keys[key]
        return True


TOKEN = "election-test-token-0123456789"


def candidate(etcd: FakeEtcd, clock: Clock, name: str, log: list[str], token: str | None = TOKEN) -> Leadership:
    return Leadership(
        etcd,  # type: ignore[arg-type]
        "/job",
        1,
        lambda: {"address": f"{name}:1", "coordinator_id": name},
        on_elected=lambda term: log.append(f"{name} elected {term}"),
        on_deposed=lambda why: log.append(f"{name} deposed: {why}"),
        clock=clock,
        token=token,
    )


def two_candidates() -> tuple[Clock, list[str], FakeEtcd, Leadership, Leadership]:
    """A clock, the election log, an in-memory etcd and candidates "a" and "b" on it."""
    clock, log = Clock(), []
    etcd = FakeEtcd(clock)
    return clock, log, etcd, candidate(etcd, clock, "a", log), candidate(etcd, clock, "b", log)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_one_leader_the_other_stands_by_and_knows_it():
    _clock, log, _etcd, a, b = two_candidates()
    run(a._campaign())
    run(b._campaign())
    assert a.role is Role.LEADING and a.leading()
    assert b.role is Role.STANDBY and not b.leading()
    assert b.leader == {"address": "a:1", "coordinator_id": "a", "lease": str(a.lease)} and b.leader_term == a.term
    assert log == [f"a elected {a.term}"]


def test_validity_runs_from_the_renewal_send_time_and_a_frozen_leader_is_deposed_before_a_standby_wins():
    clock, log, _etcd, a, b = two_candidates()
    run(a._campaign())
    assert a.valid_until == pytest.approx(100.0 + 1 - election.MARGIN_S)
    clock.t += 0.9
    assert a.leading()  # inside its lease
    clock.t += 0.2  # a frozen leader: it renewed nothing
    assert not a.leading()  # it stops acting on its own, before etcd lets the lease go
    run(b._campaign())
    assert b.role is Role.LEADING and b.term > a.term
    run(a._renew())  # awake again: the lease is gone
    assert a.role is Role.STANDBY
    assert log[-1].startswith("a deposed")


def test_renewal_extends_validity_and_an_etcd_outage_past_the_lease_deposes():
    clock, log = Clock(), []
    etcd = FakeEtcd(clock)
    a = candidate(etcd, clock, "a", log)
    run(a._campaign())
    clock.t += 0.5
    before = clock.t

    async def renew_now() -> None:
        a.ttl_s = 0  # no wait before the renewal in this test
        await a._renew()
        a.ttl_s = 1

    run(renew_now())
    assert a.valid_until == pytest.approx(before + 1 - election.MARGIN_S)
    etcd.down = True
    clock.t += 0.5

    async def one_round() -> None:
        task = asyncio.create_task(a.run())
        await asyncio.sleep(0.3)
        task.cancel()

    run(one_round())
    assert a.role is Role.LEADING  # etcd down inside the lease: it still leads
    clock.t += 0.6
    run(one_round())
    assert a.role is Role.STANDBY and "deposed" in log[-1]


def test_epoch_records_are_fenced_by_the_term():
    clock, _log, etcd, a, b = two_candidates()
    run(a._campaign())
    assert run(a.record_epoch({"epoch": 3, "term": a.term}, a.term))
    clock.t += 2  # a's lease lapses; b wins
    run(b._campaign())
    assert not run(a.record_epoch({"epoch": 4, "term": a.term}, a.term))  # a deposed leader cannot publish
    assert run(b.record_epoch({"epoch": 4, "term": b.term}, b.term))
    assert json.loads(etcd.keys[b"/job/epoch"].value)["epoch"] == 4
    assert run(b.last_epoch()) == {"epoch": 4, "term": b.term}


def test_resign_hands_over_at_once():
    _clock, _log, _etcd, a, b = two_candidates()
    run(a._campaign())
    run(a.resign())
    assert a.role is Role.STANDBY
    run(b._campaign())
    assert b.role is Role.LEADING  # no lease to wait out


def node_client() -> ControlClient:
    """A node's control client that is never started: its message handling alone."""
    return ControlClient([("127.0.0.1", 1)], lambda mid: None, name="n", connect_timeout_s=1, wake=threading.Event())  # type: ignore[arg-type,return-value]


def test_a_node_refuses_orders_and_commands_of_an_older_term():
    commands: list[m.Command] = []
    client = node_client()
    client.add_listener(lambda notice: isinstance(notice, m.Command) and commands.append(notice))
    client.term = 5

    def order(epoch: int, term: int) -> m.EpochOrder:
        return m.EpochOrder(epoch=epoch, term=term, members=["n"], shares=[4], urgent=False, reason="test")

    client._on_message(order(10, 4))
    assert client.latest_order() is None  # deposed leader's order: refused
    client._on_message(order(10, 5))
    assert client.latest_order() is not None and client.latest_order().epoch == 10
    client._on_message(m.Command(action="kill", reason="old", term=4))
    assert commands == []
    client._on_message(m.Command(action="drain", reason="now", term=5))
    assert [c.reason for c in commands] == ["now"]


def test_a_node_refuses_expulsions_and_job_ends_of_an_older_term():
    client = node_client()
    client.term = 5
    client._on_message(m.Expel(reason="from a deposed leader", term=4))
    client._on_message(m.Finished(step=3, term=4))
    assert client.expelled is None and client.finished is None
    client._on_message(m.Expel(reason="lease expired", term=5))
    assert client.expelled == "lease expired"


def forge(etcd: FakeEtcd, key: bytes, record: dict[str, Any], lease: int = 0) -> None:
    """A write by someone with access to the job's prefix but not its token."""
    run(etcd.put(key, json.dumps(record).encode(), lease))


def test_a_lease_less_forged_leader_key_is_cleared_by_a_standby_once_its_leader_is_gone():
    clock, log, etcd, a, b = two_candidates()
    run(a._campaign())
    forge(etcd, a.key, {"address": "evil:1", "coordinator_id": "evil"})  # drops a's lease too
    run(b._campaign())
    assert b.leader is None and b.role is Role.STANDBY  # a record nobody may follow is not a leader
    clock.t += 0.5
    run(b._campaign())
    assert b.role is Role.STANDBY  # its leader may still write it back
    clock.t += 0.6  # a died meanwhile: nobody did
    run(b._campaign())
    assert b.role is Role.LEADING and b.term > a.term
    assert log[-1] == f"b elected {b.term}"


def test_a_live_leader_writes_its_overwritten_key_back_and_keeps_leading():
    clock, _log, etcd, a, b = two_candidates()
    run(a._campaign())
    written = etcd.keys[a.key]
    forge(etcd, a.key, {"address": "evil:1", "coordinator_id": "evil", "lease": str(a.lease)}, a.lease)
    run(b._campaign())
    assert b.leader is None
    run(a._keep_key())
    assert etcd.keys[a.key].value == written.value and etcd.keys[a.key].lease == a.lease
    assert etcd.keys[a.key].create_revision == a.term
    clock.t += 0.5
    run(a._keep_key())
    for _ in range(3):
        run(b._campaign())
    assert a.role is Role.LEADING and b.role is Role.STANDBY
    assert b.leader is not None and b.leader["address"] == "a:1"


def test_a_leader_whose_key_was_deleted_steps_down():
    _clock, log, etcd, a, _b = two_candidates()
    run(a._campaign())
    del etcd.keys[a.key]
    run(a._keep_key())
    assert a.role is Role.STANDBY and "deleted or replaced" in log[-1]


def test_a_forged_epoch_record_gives_a_new_leader_no_floor():
    _clock, _log, etcd, a, _b = two_candidates()
    run(a._campaign())
    forge(etcd, election.epoch_key("/job"), {"epoch": 2**31, "term": a.term})
    assert run(a.last_epoch()) is None
    run(a.record_epoch({"epoch": 7, "term": a.term}, a.term))
    assert run(a.last_epoch()) == {"epoch": 7, "term": a.term}


def test_without_a_token_an_epoch_above_the_ceiling_is_still_ignored():
    clock, log = Clock(), []
    etcd = FakeEtcd(clock)
    a = candidate(etcd, clock, "a", log, token=None)
    run(a._campaign())
    forge(etcd, election.epoch_key("/job"), {"epoch": 2**31, "term": a.term})
    assert run(a.last_epoch()) is None
    forge(etcd, election.epoch_key("/job"), {"epoch": 12, "term": a.term})
    assert run(a.last_epoch()) == {"epoch": 12, "term": a.term}
