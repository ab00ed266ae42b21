from unbroken.control.sessions import Doorman
from unbroken.observe.quiet import Quiet, Say


def test_a_few_per_source_then_counted_until_the_window_ends():
    q = Quiet(per_source=3, total=5, window_s=10)
    assert [q.allow("x", t) for t in (0, 1, 2, 3)] == [Say.YES, Say.YES, Say.LAST, Say.NO]
    assert q.allow("y", 4) == Say.LAST  # the fifth of the window (counted ones count), from anyone
    assert q.allow("z", 5) == Say.NO
    assert q.allow("x", 10) == Say.YES  # a new window


def test_the_doorman_limits_unproven_sessions_per_address_and_in_all():
    d = Doorman(per_address=2, total=3)
    assert d.enter("a") and d.enter("a") and not d.enter("a")
    assert d.enter("b") and not d.enter("c")
    d.leave("a")
    assert d.enter("c") and d.turned_away == 2
