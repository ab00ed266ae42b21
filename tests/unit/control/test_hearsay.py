"""Reports that nothing bears out (`unbroken.control.hearsay`)."""

from __future__ import annotations

from unbroken.control.hearsay import LIMIT, PERIOD_S, Hearsay


def test_lone_reports_count_against_their_reporter_until_the_limit():
    h = Hearsay(window_s=2.0)
    for i in range(LIMIT):
        assert h.due(10.0 * i) == []
        assert h.reported("liar", epoch=i, now=10.0 * i) == (True, [])
    assert h.due(10.0 * (LIMIT - 1) + 1.9) == [], "still within its window"
    assert h.due(10.0 * (LIMIT - 1) + 2.1) == ["liar"]
    assert h.due(100.0) == [], "counted again from zero"


def test_while_a_report_waits_the_same_members_next_ones_are_held_until_borne_out():
    h = Hearsay(window_s=2.0)
    assert h.reported("a", epoch=1, now=0.0) == (True, [])
    act, _ = h.reported("a", epoch=2, now=0.3)
    assert not act, "held: re-forms nothing yet"
    act, released = h.reported("b", epoch=2, now=0.5)
    assert act and [(r.member_id, r.epoch) for r in released] == [("a", 2)], "b bears it out: it acts now"
    assert h.reported("a", epoch=3, now=2.5)[0], "a's first report has lapsed"


def test_every_member_reporting_one_epoch_bears_the_others_out():
    """Three members see one collective break: none of them is counted."""
    h = Hearsay(window_s=2.0)
    for member in ("a", "b", "c"):
        assert h.reported(member, epoch=5, now=0.1)[0]
    for member in ("a", "b", "c"):  # again, ten seconds later
        assert h.reported(member, epoch=6, now=10.1)[0]
    assert h.due(30.0) == []


def test_a_report_that_arrives_after_the_next_epoch_formed_still_bears_the_first_out():
    h = Hearsay(window_s=2.0)
    h.reported("a", epoch=5, now=0.0)
    h.reported("b", epoch=5, now=0.4)  # about the epoch before: the leader re-formed at 0.1
    h.reported("a", epoch=9, now=10.0)
    assert h.due(30.0) == [], "one lone report is under the limit"


def test_a_failure_bears_out_only_reports_of_its_epochs_and_never_its_own():
    h = Hearsay(window_s=2.0)
    h.reported("x", epoch=1, now=0.0)
    h.borne_out({1}, now=1.0, by="x")  # x itself leaves: its own report is not borne out by that
    h.reported("a", epoch=2, now=10.0)
    h.borne_out({7}, now=10.5, by="y")  # a member of another epoch: proves nothing about epoch 2
    h.reported("x", epoch=3, now=12.0)
    assert h.due(20.0) == ["x"], "a: one lone report; x: two"


def test_a_trace_just_before_a_report_bears_it_out():
    h = Hearsay(window_s=2.0)
    h.borne_out({4}, now=0.0, by="dead")  # its session dropped; the others' collectives fail after
    assert h.reported("a", epoch=4, now=0.5) == (True, [])
    h.reported("a", epoch=5, now=10.0)
    assert h.due(30.0) == []


def test_reports_further_apart_than_the_period_never_add_up():
    h = Hearsay(window_s=1.0)
    for i in range(LIMIT + 2):
        h.reported("x", epoch=i, now=i * (PERIOD_S + 1))
        assert h.due(i * (PERIOD_S + 1) + 2) == []
