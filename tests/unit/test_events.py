"""The job's events: one kind list, one record, one log (`unbroken.events`)."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from unbroken.control import messages as m
from unbroken.errors import ConfigError, ProtocolError
from unbroken.events import ALARMS, ANOMALIES, REPORTED, Entry, Event, Kind, Recorded, read_log
from unbroken.observe import eventlog
from unbroken.observe.eventlog import EventLog


def event(kind: Kind, member: str | None = "a#1", reason: str = "why") -> Event:
    return Event(time.monotonic(), kind, member, 3, 40, reason)


def test_the_log_numbers_counts_keeps_and_writes_every_event(tmp_path) -> None:
    log = EventLog(tmp_path / "events.jsonl", keep=3)
    for kind in (Kind.JOIN, Kind.FAILURE, Kind.EPOCH, Kind.FAILURE):
        log.emit(event(kind), "a")
    log.count(Kind.REFUSED)  # a flood's: counted, not kept
    assert [r.seq for r in log] == [2, 3, 4] and log.seq == 4
    assert log.counts == {Kind.JOIN: 1, Kind.FAILURE: 2, Kind.EPOCH: 1, Kind.REFUSED: 1}
    assert [r.kind for r in log.since(2, [Kind.FAILURE])] == [Kind.FAILURE]
    assert log.since(0, node="b") == []
    on_disk = read_log(tmp_path / "events.jsonl")
    assert [r.seq for r in on_disk] == [1, 2, 3, 4] and on_disk[-1] == log.last(1)[0]
    first = on_disk[0]
    assert first.kind is Kind.JOIN and first.node == "a" and first.member == "a#1"
    assert (first.epoch, first.step, first.reason) == (3, 40, "why")
    assert abs(first.time - time.time()) < 5  # on the wall clock, not the monotonic one


def test_a_record_survives_json_and_a_line_cut_short_is_left_out(tmp_path) -> None:
    rec = Recorded(7, 1.5, Kind.LOSS_SPIKE, None, None, 2, 9, "loss 9.1 against 0.3")
    assert Recorded.from_json(json.loads(json.dumps(rec.to_json()))) == rec
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps(rec.to_json()) + "\n" + json.dumps(rec.to_json())[:20])
    assert read_log(path) == [rec]


def test_a_kind_this_version_does_not_know_is_named() -> None:
    entry = Recorded(1, 0.0, Kind.JOIN, "a", "a#1", 0, 0, "").to_json() | {"kind": "teleported"}
    with pytest.raises(ValueError, match="teleported"):
        Recorded.from_json(entry)


def test_a_node_may_report_what_it_did_and_nothing_the_coordinator_decides() -> None:
    for kind in REPORTED:
        parsed = m.parse_node_message(m.encode(m.Report(kind=kind, step=1, reason="done")))
        assert isinstance(parsed, m.Report) and parsed.kind is kind
    for kind in (Kind.FAILURE, Kind.EPOCH, Kind.QUARANTINE, Kind.LEADER):
        raw = json.dumps({"v": m.PROTOCOL_VERSION, "type": "report", "kind": kind.value, "step": 1, "reason": "x"})
        with pytest.raises(ProtocolError, match=r"report\.kind"):
            m.parse_node_message(raw)
    raw = json.dumps({"v": m.PROTOCOL_VERSION, "type": "fault", "epoch": 1, "reason": "x", "kind": "epoch"})
    with pytest.raises(ProtocolError, match=r"fault\.kind"):
        m.parse_node_message(raw)


def test_every_anomaly_is_an_alarm_and_kinds_are_unique() -> None:
    assert ANOMALIES <= ALARMS
    # An enum member with another's value would be an alias of it, merging two kinds.
    assert len(Kind.__members__) == len(Kind) and len(Entry.__members__) == len(Entry)
    assert f"{Kind.LOSS_SPIKE}" == str(Kind.LOSS_SPIKE) == "loss-spike" and json.dumps([Entry.SYNC]) == '["sync"]'


def test_a_failing_write_never_fails_emit_and_the_lines_wait_for_the_next(tmp_path, monkeypatch) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    real = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    for kind in (Kind.JOIN, Kind.EPOCH):
        log.emit(event(kind), "a")  # a decision's events: no exception out of here
    health = log.health()
    assert health["write_failures"] == 2 and health["unwritten_bytes"] > 0
    assert "No space left on device" in health["last_error"]
    monkeypatch.setattr(os, "write", real)
    log.emit(event(Kind.FAILURE), "a")
    assert [r.seq for r in read_log(tmp_path / "events.jsonl")] == [1, 2, 3]
    assert log.health()["unwritten_bytes"] == 0
    log.close()


def test_a_device_that_is_always_full_keeps_the_newest_events_within_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(eventlog, "UNWRITTEN_MAX", 1000)
    log = EventLog(Path("/dev/full"))
    for _ in range(100):
        log.emit(event(Kind.JOIN), "a")
    health = log.health()
    assert health["write_failures"] == 100 and health["dropped_bytes"] > 0
    assert 0 < health["unwritten_bytes"] <= 1000
    assert len(log) == 100 and log.counts[Kind.JOIN] == 100  # memory, counts and /api/state keep all
    log.close()


def test_an_event_log_that_cannot_be_opened_is_named_at_start(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"cannot write the event log .*missing.*give --event-log a writable file"):
        EventLog(tmp_path / "missing" / "events.jsonl")
