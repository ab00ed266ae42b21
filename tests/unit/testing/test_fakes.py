"""The fake side of bench/scale.py tells its own stalls from the control plane's."""

from __future__ import annotations

import asyncio
import time

from unbroken.testing.fakes import FakeNode, FakeNodes


def test_an_expulsion_after_the_fakes_own_silence_is_told_apart() -> None:
    steady, stalled = FakeNode("a", 0), FakeNode("b", 0)
    for t in [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]:
        steady.sent_now(t, 0.2)
    for t in [0.0, 0.2, 1.3]:  # its loop stalled 1.1 s between two heartbeats
        stalled.sent_now(t, 0.2)
    assert not steady.was_silent(1.1, 1.0), "it kept talking: its expulsion would be the control plane's"
    assert stalled.was_silent(1.4, 1.0), "the 1.1 s gap that just ended counts"
    assert stalled.was_silent(2.0, 1.0), "0.7 s since its last message, but the 1.1 s gap just before counts"
    fakes = FakeNodes(("127.0.0.1", 1), 0)
    fakes.nodes = [steady, stalled]
    steady.expulsions, stalled.expulsions, stalled.silent_expulsions = 1, 1, 1
    assert fakes.expelled() == 2 and fakes.expelled_while_silent() == 1


def test_the_watch_records_a_blocked_loop() -> None:
    fakes = FakeNodes(("127.0.0.1", 1), 0)

    async def run() -> None:
        watch = asyncio.create_task(fakes._watch(0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # the loop is blocked: what a busy machine does to the fake side
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(run())
    assert 0.25 <= fakes.longest_stall_s < 1.0, fakes.longest_stall_s
