"""A relay's batches to the leader (`unbroken.control.batches`), without sockets."""

from __future__ import annotations

from unbroken.control import messages as m
from unbroken.control.batches import REPORT_EVERY_S, Batches


def _progress(step: int, seq: int, **kw: object) -> m.Progress:
    return m.Progress(epoch=1, step=step, loss=1.0, wall_time=0.0, samples_per_s=1.0, seq=seq, **kw)  # type: ignore[arg-type]


def test_liveness_goes_up_in_every_batch_and_each_seq_is_acknowledged_once_its_batch_is() -> None:
    b = Batches()
    assert not b.heard("a", m.Heartbeat(seq=1, step=3), 40)
    assert not b.heard("b", _progress(4, seq=7), 90)
    (up,) = b.take(0.0, {"a", "b"})
    assert dict(zip(up.alive, up.steps, strict=True)) == {"a": 3, "b": 4}
    (empty,) = b.take(0.1, {"a", "b"})
    assert empty.alive == [] and empty.seq == up.seq + 1
    assert b.acked(up.seq - 1) == []
    assert sorted(b.acked(empty.seq)) == [("a", 1), ("b", 7)]
    assert b.acked(empty.seq) == [], "told once"


def test_routine_reports_are_coalesced_and_go_up_once_a_report_period() -> None:
    b = Batches()
    b.take(0.0, {"a"})  # the first period starts
    b.heard("a", _progress(1, seq=1), 90)
    b.heard("a", _progress(2, seq=2), 90)
    (up,) = b.take(0.1, {"a"})
    assert up.said == [], "a routine report waits for the report period"
    (up,) = b.take(REPORT_EVERY_S + 0.1, {"a"})
    assert [(s.member, s.msg.step) for s in up.said] == [("a", 2)]  # type: ignore[union-attr]
    assert up.said[0].msg.seq == 0  # type: ignore[union-attr]  # its liveness went up in the list


def test_anything_but_routine_liveness_asks_for_a_batch_now_and_an_ended_session_goes_up() -> None:
    b = Batches()
    assert b.heard("a", _progress(1, seq=1, first_in_epoch=True), 90) is False  # with the next batch
    assert b.heard("a", m.Leave(reason="bye"), 30) is True
    b.ended("c", "its session with the relay ended")
    (up,) = b.take(0.0, {"a"})
    assert [type(s.msg).__name__ for s in up.said] == ["Progress", "Leave"]
    assert [g.member for g in up.gone] == ["c"]
    b.clear()
    (up,) = b.take(0.1, {"a"})
    assert up.said == [] and up.gone == [] and up.alive == []
