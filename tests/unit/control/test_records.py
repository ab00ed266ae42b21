"""What is read from etcd is checked before it is used (`unbroken.control.records`)."""

from __future__ import annotations

import json

from unbroken.control import records
from unbroken.control.etcd import KeyValue

TOKEN = "records-test-token-0123456789"
LEADER = b"/job/leader"
EPOCH = b"/job/epoch"


def kv(key: bytes, value: bytes, *, lease: int = 0, created: int = 5, modified: int = 5) -> KeyValue:
    return KeyValue(key, value, created, modified, lease)


def leader_record(lease: int = 42) -> dict[str, object]:
    return {"address": "10.0.0.5:29400", "coordinator_id": "c1", "job": "j", "lease": str(lease)}


def test_a_sealed_leader_record_under_its_lease_is_followed():
    value = records.seal(TOKEN, LEADER, leader_record())
    assert records.leader_problem(kv(LEADER, value, lease=42), TOKEN) is None
    assert records.leader(kv(LEADER, value, lease=42), TOKEN) == leader_record()


def test_a_leader_record_without_the_tokens_seal_is_not_followed():
    unsealed = records.seal(None, LEADER, leader_record())
    assert "not sealed with the job token" in str(records.leader_problem(kv(LEADER, unsealed, lease=42), TOKEN))
    other_job = records.seal("another-jobs-token-0123456789", LEADER, leader_record())
    assert "not sealed" in str(records.leader_problem(kv(LEADER, other_job, lease=42), TOKEN))
    tampered = json.loads(records.seal(TOKEN, LEADER, leader_record()))
    tampered["address"] = "evil:1"
    assert "not sealed" in str(records.leader_problem(kv(LEADER, json.dumps(tampered).encode(), lease=42), TOKEN))


def test_a_record_sealed_for_another_key_is_not_followed_there():
    moved = records.seal(TOKEN, b"/other-job/leader", leader_record())
    assert "not sealed" in str(records.leader_problem(kv(LEADER, moved, lease=42), TOKEN))


def test_a_leader_key_without_a_lease_is_no_leader_even_with_a_valid_seal():
    value = records.seal(TOKEN, LEADER, leader_record())
    assert "no lease" in str(records.leader_problem(kv(LEADER, value, lease=0), TOKEN))
    assert "no lease" in str(records.leader_problem(kv(LEADER, records.seal(None, LEADER, leader_record())), None))


def test_an_old_record_written_back_under_another_lease_is_a_replay():
    old = records.seal(TOKEN, LEADER, leader_record(lease=41))
    assert "replayed" in str(records.leader_problem(kv(LEADER, old, lease=42), TOKEN))


def test_a_leader_record_needs_an_address_and_an_id():
    for bad in ({"address": "nowhere"}, {"address": 5}, {"coordinator_id": 7}):
        value = records.seal(TOKEN, LEADER, {**leader_record(), **bad})
        assert records.leader_problem(kv(LEADER, value, lease=42), TOKEN) is not None, bad
    assert "not JSON" in str(records.leader_problem(kv(LEADER, b"\xff", lease=42), None))
    assert "not a JSON object" in str(records.leader_problem(kv(LEADER, b"[1]", lease=42), None))


def test_epoch_records_are_bounded_and_name_a_term_held_before_them():
    def problem(record: dict[str, object], modified: int = 100, token: str | None = TOKEN) -> str | None:
        return records.epoch_problem(kv(EPOCH, records.seal(token, EPOCH, record), modified=modified), token)

    assert problem({"epoch": 12, "term": 40}) is None
    assert problem({"epoch": records.EPOCH_CEILING, "term": 40}) is None
    assert "outside" in str(problem({"epoch": 2**31, "term": 40}))
    assert "outside" in str(problem({"epoch": 2**31, "term": 40}, token=None))  # bounded without a token too
    assert "outside" in str(problem({"epoch": -1, "term": 40}))
    assert "outside" in str(problem({"epoch": True, "term": 40}))
    assert "outside" in str(problem({"epoch": "12", "term": 40}))
    assert "term" in str(problem({"epoch": 12, "term": 100}))  # not held before revision 100
    assert "term" in str(problem({"epoch": 12, "term": 0}))
    assert "term" in str(problem({"epoch": 12}))
    forged = records.seal(None, EPOCH, {"epoch": 12, "term": 40})
    assert "not sealed" in str(records.epoch_problem(kv(EPOCH, forged, modified=100), TOKEN))


def test_an_ignored_record_is_warned_of_once_per_version(caplog):
    value = b'{"epoch": 2147483648, "term": 3}'
    for _ in range(5):
        assert records.epoch(kv(EPOCH, value, modified=77), None) is None
    warned = [r for r in caplog.records if "ignoring the etcd record /job/epoch" in r.getMessage()]
    assert len(warned) == 1 and "revision 77" in warned[0].getMessage()
