"""The simulator's clock, network model and servers (`unbroken.testing.virtual`)."""

from __future__ import annotations

import gc
import random
import time

import pytest

from unbroken.testing.virtual import RTO_MIN_S, LinkSpec, Network, Process, VirtualClock


def test_callbacks_run_in_time_order_ties_as_scheduled_and_read_their_own_time() -> None:
    clock = VirtualClock()
    seen: list[tuple[str, float]] = []
    clock.at(0.3, lambda: seen.append(("c", clock())))
    clock.at(0.1, lambda: seen.append(("a", clock())))
    clock.at(0.1, lambda: seen.append(("b", clock())))
    dropped = clock.at(0.2, lambda: seen.append(("dropped", clock())))
    dropped.cancel()
    clock.run_until(0.25)
    assert seen == [("a", 0.1), ("b", 0.1)] and clock.now == 0.25
    clock.after(0.0, lambda: clock.after(0.5, lambda: seen.append(("d", clock()))))  # scheduled from a callback
    clock.run_until(10.0)
    assert seen[2:] == [("c", 0.3), ("d", 0.75)]


def test_a_message_arrives_after_its_latency_and_its_time_on_the_wire_and_in_order() -> None:
    clock = VirtualClock()
    net = Network(clock, random.Random(0))
    link = net.link(LinkSpec(latency_s=0.025, bandwidth_Bps=1e6))
    arrived: list[tuple[str, float]] = []
    net.send(link, 100_000, lambda: arrived.append(("big", clock())))  # 0.1 s on the wire
    net.send(link, 10, lambda: arrived.append(("small", clock())))  # queued behind it
    clock.run_until(1.0)
    assert [a for a, _ in arrived] == ["big", "small"]
    assert arrived[0][1] == pytest.approx(0.1 + 0.025)
    assert arrived[1][1] == pytest.approx(0.1 + 10 / 1e6 + 0.025)
    assert (link.messages, link.bytes) == (2, 100_010)


def test_lost_messages_are_sent_again_after_a_doubling_timeout_and_the_stream_stays_in_order() -> None:
    clock = VirtualClock()
    net = Network(clock, random.Random(1))
    spec = LinkSpec(latency_s=0.025, bandwidth_Bps=1e9, loss=0.2)
    link = net.link(spec)
    arrived: list[tuple[int, float]] = []
    # Every 0.1 s: a loss holds up the messages sent in its timeout (a TCP stream's order).
    for i in range(400):
        clock.at(i * 0.1, lambda i=i: net.send(link, 100, lambda: arrived.append((i, clock()))))
    clock.run_until(100.0)
    assert [i for i, _ in arrived] == list(range(400)), "every message arrives, in the order sent"
    assert 40 < link.lost < 130, link.lost
    late = [t - i * 0.1 for i, t in arrived]
    assert min(late) == pytest.approx(0.025, abs=1e-6)
    # A loss costs at least one retransmission timeout; what follows it waits behind it.
    assert sum(x >= RTO_MIN_S for x in late) >= link.lost // 2
    assert any(RTO_MIN_S - 0.1 < x < RTO_MIN_S for x in late), "one sent 0.1 s after a loss waited behind it"
    assert max(late) >= RTO_MIN_S * 3  # a message lost twice waited 0.2 + 0.4 s


def test_a_link_refuses_settings_that_mean_nothing() -> None:
    with pytest.raises(ValueError, match="loss"):
        LinkSpec(latency_s=0.01, loss=1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkSpec(latency_s=0.01, bandwidth_Bps=0)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_process_is_busy_for_the_cpu_its_handler_took_and_sends_when_done() -> None:
    clock = VirtualClock()
    net = Network(clock, random.Random(0))
    link = net.link(LinkSpec(latency_s=0.001, bandwidth_Bps=1e9))
    server = Process(clock, "server")
    started: list[float] = []
    arrived: list[float] = []

    def slow() -> None:
        started.append(clock())
        _spin(0.02)
        server.send(net, link, 10, lambda: arrived.append(clock()))

    clock.at(1.0, lambda: server.submit(slow))
    clock.at(1.0, lambda: server.submit(lambda: started.append(clock())))
    clock.run_until(5.0)
    assert started[0] == 1.0
    assert started[1] >= 1.0 + 0.02, "the second message waited for the first handler's CPU"
    assert arrived[0] >= 1.0 + 0.02 + 0.001, "what the handler sent left when it was done"
    assert server.cpu_s >= 0.02 and server.handled == 2
    assert server.longest_wait_s >= 0.02


def test_a_garbage_collection_inside_a_handler_is_not_charged_to_it() -> None:
    """In one process a collection walks the whole simulated world, not the server's heap."""
    clock = VirtualClock()
    server = Process(clock, "server")
    world = [[i] for i in range(300_000)]  # the simulated nodes' objects, which a collection walks
    server.submit(gc.collect)
    clock.run_until(1.0)
    assert server.handled == 1 and len(world) == 300_000
    assert server.gc_s > 0 and server.cpu_s < server.gc_s / 5, (server.cpu_s, server.gc_s)
