"""A relay's batches to the leader (`unbroken.control.batches`), without sockets."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import pytest

from unbroken.control import messages as m
from unbroken.control.batches import HEARD_WITHIN, REPORT_EVERY_S, Batches
from unbroken.control.relaying import ROUTINE_REPORTS_PER_S, Relays

if TYPE_CHECKING:
    from unbroken.control.coordinator import Coordinator

LEASE_S = 1.0
NOW = 0.0


def _progress(step: int, seq: int, **kw: object) -> m.Progress:
    return m.Progress(epoch=1, step=step, loss=1.0, wall_time=0.0, samples_per_s=1.0, seq=seq, **kw)  # type: ignore[arg-type]


def test_liveness_goes_up_in_every_batch_and_each_seq_is_acknowledged_once_its_batch_is() -> None:
    b = Batches()
    assert not b.heard("a", m.Heartbeat(seq=1, step=3), 40, NOW)
    assert not b.heard("b", _progress(4, seq=7), 90, NOW)
    (up,) = b.take(0.0, {"a", "b"}, LEASE_S)
    assert dict(zip(up.alive, up.steps, strict=True)) == {"a": 3, "b": 4}
    (empty,) = b.take(0.1, {"a", "b"}, LEASE_S)
    assert empty.alive == [] and empty.seq == up.seq + 1
    assert b.acked(up.seq - 1) == []
    assert sorted(b.acked(empty.seq)) == [("a", 1), ("b", 7)]
    assert b.acked(empty.seq) == [], "told once"


def test_routine_reports_are_coalesced_and_go_up_once_a_report_period() -> None:
    b = Batches()
    b.take(0.0, {"a"}, LEASE_S)  # the first period starts
    b.heard("a", _progress(1, seq=1), 90, NOW)
    b.heard("a", _progress(2, seq=2), 90, NOW)
    (up,) = b.take(0.1, {"a"}, LEASE_S)
    assert up.said == [], "a routine report waits for the report period"
    (up,) = b.take(REPORT_EVERY_S + 0.1, {"a"}, LEASE_S)
    assert [(s.member, s.msg.step) for s in up.said] == [("a", 2)]  # type: ignore[union-attr]
    assert up.said[0].msg.seq == 0  # type: ignore[union-attr]  # its liveness went up in the list


def test_anything_but_routine_liveness_asks_for_a_batch_now_and_an_ended_session_goes_up() -> None:
    b = Batches()
    assert b.heard("a", _progress(1, seq=1, first_in_epoch=True), 90, NOW) is False  # with the next batch
    assert b.heard("a", m.Leave(reason="bye"), 30, NOW) is True
    b.ended("c", "its session with the relay ended")
    (up,) = b.take(0.0, {"a"}, LEASE_S)
    assert [type(s.msg).__name__ for s in up.said] == ["Progress", "Leave"]
    assert [g.member for g in up.gone] == ["c"]
    b.clear()
    (up,) = b.take(0.1, {"a"}, LEASE_S)
    assert up.said == [] and up.gone == [] and up.alive == []


def test_a_batch_names_only_changed_steps_and_vouches_for_the_rest_except_the_unheard() -> None:
    b = Batches()
    period = LEASE_S / 10
    held = {"a", "b", "c"}
    t = period
    for who in "abc":
        b.heard(who, m.Heartbeat(seq=1, step=5), 40, t - 0.02)
    (up,) = b.take(t, held, LEASE_S)
    assert dict(zip(up.alive, up.steps, strict=True)) == {"a": 5, "b": 5, "c": 5}
    assert up.heard_within == pytest.approx(0.02) and up.unheard == [], "the oldest age vouched for, measured"
    # "a" says the same step, "b" a newer one, "c" falls silent.
    while t < 2 * HEARD_WITHIN * LEASE_S:
        t += period
        b.heard("a", m.Heartbeat(seq=2, step=5), 40, t - 0.01)
        b.heard("b", m.Heartbeat(seq=2, step=6), 40, t - 0.01)
        (up,) = b.take(t, held, LEASE_S)
        assert dict(zip(up.alive, up.steps, strict=True)) in ({"b": 6}, {}), "only a change is named"
        assert up.heard_within <= HEARD_WITHIN * LEASE_S
    assert up.unheard == ["c"], "a member not heard within the summary's window is named, the others vouched for"
    assert up.unheard_s == [pytest.approx(t - (period - 0.02))], "with how long ago it was heard, exactly"
    assert up.heard_within == pytest.approx(0.01)
    (up,) = b.take(t + period, {"a", "b"}, LEASE_S)
    assert "c" not in up.unheard, "only the members whose sessions it holds are summed up"
    b.ended("b", "its session with the relay ended")
    b.heard("b", m.Heartbeat(seq=1, step=6), 40, t + period)  # its new session, back at the same step
    (up,) = b.take(t + 2 * period, {"a", "b"}, LEASE_S)
    assert up.alive == ["b"], "a new session's step is named again"


def test_a_summary_survives_the_wire() -> None:
    b = Batches()
    b.heard("a", m.Heartbeat(seq=1, step=2), 40, 0.0)
    b.take(0.0, {"a"}, LEASE_S)
    (up,) = b.take(1.0, {"a", "z"}, LEASE_S)  # "z": held, never heard: counted from when first seen
    back = m.parse_relay_message(m.encode(up))
    assert isinstance(back, m.Up) and back.unheard == ["a"] and back.unheard_s == [1.0]
    assert back.heard_within == 0.0


def test_the_leader_sets_how_often_routine_reports_go_up_but_commitments_never_wait_longer() -> None:
    b = Batches()
    (up,) = b.take(0.0, {"a", "b"}, LEASE_S)
    b.acked(up.seq, report_s=5.0)  # a leader of a large group
    committed = m.Commitment(epoch=1, step=1, digest="ab" * 16, microbatch=1)
    b.heard("a", _progress(1, seq=1), 90, 0.2)
    b.heard("b", _progress(1, seq=1, commitments=[committed]), 160, 0.2)
    went = [(t, s.member) for t in (0.5, 1.1, 2.2, 3.3, 4.4) for u in b.take(t, {"a", "b"}, LEASE_S) for s in u.said]
    assert went == [(1.1, "b")], "within the leader's period only the report carrying commitments went up"
    (up,) = b.take(5.5, {"a", "b"}, LEASE_S)
    assert [s.member for s in up.said] == ["a"], "the routine one went up once the leader's period passed"
    b.acked(up.seq)  # a leader that says nothing of it: the relay's own period again
    b.heard("a", _progress(2, seq=2), 90, 5.6)
    (up,) = b.take(6.6, {"a", "b"}, LEASE_S)
    assert [s.member for s in up.said] == ["a"]
    b.heard("a", _progress(3, seq=3), 90, 6.7)
    b.ended("a", "its session with the relay ended")
    (up,) = b.take(7.7, {"a", "b"}, LEASE_S)  # "a" back on a new session
    assert up.said == [], "a report kept for the period is not sent for the session after"


def test_the_leader_asks_for_routine_reports_less_often_as_the_group_grows() -> None:
    def period(members: int) -> float:
        coord = SimpleNamespace(membership=SimpleNamespace(members=dict.fromkeys(range(members))))
        return Relays(cast("Coordinator", coord)).report_s()

    assert period(10) == period(ROUTINE_REPORTS_PER_S) == REPORT_EVERY_S
    assert period(100_000) == pytest.approx(100_000 / ROUTINE_REPORTS_PER_S)
