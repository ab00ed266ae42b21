"""Reports of failed collectives that nothing bears out (`unbroken.control.hearsay`)."""

from __future__ import annotations

from unbroken.control.hearsay import LIMIT, PERIOD_S, Hearsay


def test_lone_reports_count_against_their_reporter_until_the_limit():
    h = Hearsay(window_s=2.0)
    for i in range(LIMIT):
        assert h.due(10.0 * i + 1) == []
        h.reported("liar", epoch=i, now=10.0 * i)
    assert h.due(10.0 * (LIMIT - 1) + 1.9) == [], "still within its window"
    assert h.due(10.0 * (LIMIT - 1) + 2.1) == ["liar"]
    assert h.due(100.0) == [], "counted again from zero"


def test_a_failure_or_a_leave_near_a_report_bears_it_out():
    h = Hearsay(window_s=2.0)
    h.reported("a", epoch=1, now=0.0)
    h.borne_out(now=1.5)  # a peer's session dropped
    h.borne_out(now=3.0)
    h.reported("a", epoch=2, now=4.0)  # within the window after a failure: borne out at once
    h.reported("a", epoch=3, now=7.0)  # nothing near it
    assert h.due(9.5) == []
    for epoch in range(4, 4 + LIMIT - 2):
        h.reported("a", epoch=epoch, now=10.0 + epoch)
    assert h.due(30.0) == [], "only the lone ones count: one short of the limit"
    h.reported("a", epoch=50, now=31.0)
    assert h.due(34.0) == ["a"]


def test_two_members_reporting_one_epoch_bear_each_other_out_but_not_themselves():
    h = Hearsay(window_s=2.0)
    h.reported("a", epoch=5, now=0.0)
    h.reported("a", epoch=5, now=0.1)
    h.borne_out(now=0.2, by="a")  # a's own accusation of someone: not evidence for a's report
    h.reported("b", epoch=5, now=0.3)
    assert h.due(10.0) == []
    for epoch in range(LIMIT - 1):  # a and b: each alone from here on
        h.reported("a", epoch=10 + epoch, now=20.0 + epoch)
    assert h.due(30.0) == [], "the borne-out report of epoch 5 does not count"


def test_reports_older_than_the_period_are_forgotten():
    h = Hearsay(window_s=1.0)
    for i in range(LIMIT - 1):
        h.reported("x", epoch=i, now=float(i))
    h.due(LIMIT + 1.0)
    h.reported("x", epoch=99, now=PERIOD_S + 10)
    assert h.due(PERIOD_S + 12) == []


def test_while_a_report_waits_to_be_borne_out_the_same_members_next_ones_are_held():
    h = Hearsay(window_s=2.0)
    assert h.reported("a", epoch=1, now=0.0)
    assert not h.reported("a", epoch=2, now=0.3), "held: re-forms nothing"
    assert h.reported("b", epoch=2, now=0.4), "b bears a's report of epoch 2 out, and is not held"
    assert h.reported("a", epoch=3, now=2.5), "a's first report has lapsed"
