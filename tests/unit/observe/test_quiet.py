import asyncio
import errno
import logging

from unbroken.control.sessions import Doorman
from unbroken.observe.quiet import Hush, HushFilter, Quiet, Say


def test_a_few_per_source_then_counted_until_the_window_ends():
    q = Quiet(per_source=3, total=5, window_s=10)
    assert [q.allow("x", t) for t in (0, 1, 2, 3)] == [Say.YES, Say.YES, Say.LAST, Say.NO]
    assert q.allow("y", 4) == Say.LAST  # the fifth of the window (counted ones count), from anyone
    assert q.allow("z", 5) == Say.NO
    assert q.allow("x", 10) == Say.YES  # a new window


def test_the_doorman_queues_per_address_and_turns_away_past_its_total():
    async def scenario() -> None:
        d = Doorman(per_address=2, total=4)
        assert await d.enter("a") and await d.enter("a")
        third = asyncio.create_task(d.enter("a"))  # waits for a slot of its address, unread
        await asyncio.sleep(0.01)
        assert not third.done()
        assert await d.enter("b")
        assert not await d.enter("c") and d.turned_away == 1  # four held: no more
        d.leave("a")
        assert await asyncio.wait_for(third, 1)
        for peer in ("a", "a", "b"):
            d.leave(peer)
        assert await d.enter("c")

    asyncio.run(scenario())


def test_hush_says_one_per_kind_and_interval_with_the_count_of_the_rest():
    h = Hush(interval_s=10)
    assert h.allow("emfile", 0) == 0
    assert [h.allow("emfile", t) for t in (1, 2, 3)] == [None, None, None]
    assert h.allow("enospc", 4) == 0  # another kind has its own
    assert h.allow("emfile", 10) == 3  # the next interval's first says how many were counted
    assert h.allow("emfile", 11) is None


def test_hush_forgets_the_oldest_kind_past_its_bound():
    h = Hush(interval_s=10, kinds=2)
    h.allow("a", 0), h.allow("b", 0), h.allow("c", 0)
    assert h.allow("a", 1) == 0  # forgotten: said again
    assert h.allow("c", 1) is None


def test_a_resource_error_is_one_line_per_interval_without_its_traceback(caplog):
    now = [0.0]
    logger = logging.getLogger("test.hush")
    f = HushFilter(Hush(interval_s=10), clock=lambda: now[0])
    logger.addFilter(f)
    try:
        exc = OSError(errno.EMFILE, "Too many open files")
        with caplog.at_level(logging.INFO, logger="test.hush"):
            for _ in range(500):
                try:
                    raise exc
                except OSError:
                    logger.exception("socket.accept() out of system resource")
            logger.info("an ordinary line %d", 1)
            logger.info("an ordinary line %d", 2)  # below warnings: never hushed
            now[0] = 11
            try:
                raise exc
            except OSError:
                logger.exception("socket.accept() out of system resource")
    finally:
        logger.removeFilter(f)
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2
    assert said[0].getMessage() == "socket.accept() out of system resource: [Errno 24] Too many open files"
    assert said[0].exc_info is None
    assert "499 more like it" in said[1].getMessage()
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) == 2
