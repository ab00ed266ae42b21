"""The fake side of bench/scale.py tells its own stalls from the control plane's."""

from __future__ import annotations

import asyncio
import time

from unbroken.testing.fakes import FakeNode, FakeNodes


def test_expulsions_after_the_fake_sides_own_stall_are_told_apart() -> None:
    fakes = FakeNodes(("127.0.0.1", 1), 0)
    fakes.nodes = [FakeNode("a", 0, expelled_at=[10.5, 30.0]), FakeNode("b", 0, expelled_at=[11.9])]
    fakes.nodes[0].expulsions, fakes.nodes[1].expulsions = 2, 1
    fakes.stalls = [(10.0, 0.8), (29.0, 0.1)]  # one long stall, one too short to matter
    assert fakes.expelled() == 3
    assert fakes.expelled_after_stalls(2.0, 0.5) == 2  # 10.5 and 11.9 follow the 0.8 s stall
    assert fakes.max_stall() == 0.8


def test_the_watch_records_a_blocked_loop() -> None:
    fakes = FakeNodes(("127.0.0.1", 1), 0)

    async def run() -> None:
        watch = asyncio.create_task(fakes._watch(0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # the loop is blocked: what a busy machine does to the fake side
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(run())
    assert 0.25 <= fakes.max_stall() < 1.0, fakes.stalls
