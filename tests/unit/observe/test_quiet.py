import asyncio

from unbroken.control.sessions import Doorman
from unbroken.observe.quiet import Quiet, Say


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
