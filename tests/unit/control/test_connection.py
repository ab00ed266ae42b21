"""The control session's state machine (`unbroken.control.connection`) on a fake clock:
connected → suspended → lost → connected, each transition told once, and the commit
fence it feeds (`ControlClient.commit_allowed`)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

import unbroken.control.client as client_module
from unbroken.control import messages as m
from unbroken.control.client import ControlClient, Notice
from unbroken.control.connection import RTT_SAMPLES, Change, Connection, State


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def welcome(coordinator: str = "c1", lease_s: float = 1.0) -> m.Welcome:
    return m.Welcome(lease_s=lease_s, heartbeat_s=lease_s / 4, coordinator_id=coordinator)


def machine() -> tuple[Clock, Connection, list[Change]]:
    clock, told = Clock(), []
    return clock, Connection(told.append, clock), told


def moves(told: list[Change]) -> list[tuple[State, State, bool]]:
    return [(c.old, c.new, c.lapse) for c in told]


def test_it_starts_lost_and_a_welcome_connects() -> None:
    clock, conn, told = machine()
    assert conn.state is State.LOST and not conn.commit_allowed()
    conn.welcomed(welcome(), hello_sent=clock.t)
    assert conn.state is State.CONNECTED and conn.commit_allowed()
    assert moves(told) == [(State.LOST, State.CONNECTED, False)]
    assert told[0].welcome is not None and told[0].new_coordinator


def test_connected_commits_only_while_an_acknowledged_send_is_less_than_a_lease_old() -> None:
    clock, conn, _ = machine()
    conn.welcomed(welcome(lease_s=1.0), hello_sent=clock.t)
    clock.t += 0.9
    assert conn.commit_allowed()
    early = conn.sending()
    clock.t += 0.2
    assert not conn.commit_allowed(), "no acknowledgement for over a lease: it may have been expelled"
    late = conn.sending()
    clock.t += 0.1
    conn.acked(late)
    assert conn.commit_allowed() and abs(conn.unacked_s() - 0.1) < 1e-9, "the lease runs from the send"
    conn.acked(early)  # an acknowledgement of an older send moves nothing back
    conn.acked(999)  # nor one of a send never made
    assert conn.commit_allowed() and abs(conn.unacked_s() - 0.1) < 1e-9


def test_the_rtt_is_the_least_of_recent_round_trips_once_there_are_enough() -> None:
    clock, conn, _ = machine()
    conn.welcomed(welcome(), hello_sent=clock.t)
    for i in range(RTT_SAMPLES):
        seq = conn.sending()
        clock.t += 0.5 if i == 0 else 0.002 + i / 1000  # a busy start answers its first late
        assert conn.rtt_s == 0.0, "says nothing before it has enough samples"
        conn.acked(seq)
    assert abs(conn.rtt_s - 0.003) < 1e-9


def test_connected_suspended_lost_connected_each_told_once() -> None:
    clock, conn, told = machine()
    conn.welcomed(welcome("c1"), hello_sent=clock.t)
    clock.t += 0.4
    assert conn.dropped(expelled=False) is State.SUSPENDED  # lease fresh: an outage
    assert conn.commit_allowed(), "an outage is trusted until the lease it began with runs out"
    clock.t += 0.5
    assert conn.commit_allowed()
    clock.t += 0.2  # 1.1 s after the hello: the trust ran out and no evidence came
    assert not conn.commit_allowed() and conn.state is State.LOST and conn.lapses == 1
    assert not conn.commit_allowed() and conn.lapses == 1, "a lapse is counted once"
    conn.welcomed(welcome("c1"), hello_sent=clock.t)
    assert conn.state is State.CONNECTED
    assert moves(told) == [
        (State.LOST, State.CONNECTED, False),
        (State.CONNECTED, State.SUSPENDED, False),
        (State.SUSPENDED, State.LOST, True),
        (State.LOST, State.CONNECTED, False),
    ]
    assert not told[-1].new_coordinator, "the same coordinator welcomed it back"


def test_evidence_renews_an_outage_but_not_a_lapse() -> None:
    clock, conn, told = machine()
    conn.welcomed(welcome(lease_s=1.0), hello_sent=clock.t)
    conn.dropped(expelled=False)
    for _ in range(4):  # evidence every quarter lease keeps it trusted for many leases
        clock.t += 0.25
        assert conn.vouched(asked=clock.t)
    clock.t += 0.9
    assert conn.commit_allowed()
    clock.t += 0.2
    assert not conn.commit_allowed() and conn.lapses == 1
    assert not conn.vouched(asked=clock.t), "evidence after a lapse does not bring the trust back"
    assert conn.state is State.LOST and [c.new for c in told].count(State.LOST) == 1


def test_a_session_dropped_with_a_stale_lease_is_lost_at_once_and_a_lapse() -> None:
    clock, conn, told = machine()
    conn.welcomed(welcome(), hello_sent=clock.t)
    clock.t += 1.5  # frozen: no acknowledgement for longer than a lease
    assert conn.dropped(expelled=False) is State.LOST
    assert conn.lapses == 1 and not conn.commit_allowed()
    assert moves(told)[-1] == (State.CONNECTED, State.LOST, True)


def test_an_expelled_nodes_session_ends_lost_without_a_lapse() -> None:
    clock, conn, told = machine()
    conn.welcomed(welcome(), hello_sent=clock.t)
    assert conn.dropped(expelled=True) is State.LOST
    assert conn.lapses == 0 and moves(told)[-1] == (State.CONNECTED, State.LOST, False)


def test_a_welcome_from_another_coordinator_says_so() -> None:
    clock, conn, told = machine()
    conn.welcomed(welcome("c1"), hello_sent=clock.t)
    conn.dropped(expelled=False)
    conn.welcomed(welcome("c2"), hello_sent=clock.t)
    assert [c.new_coordinator for c in told if c.new is State.CONNECTED] == [True, True]


def test_a_new_member_starts_with_no_acknowledged_send() -> None:
    clock, conn, _ = machine()
    conn.welcomed(welcome(), hello_sent=clock.t)
    conn.forget_lease()
    assert not conn.commit_allowed()


def client(clock: Clock) -> tuple[ControlClient, list[Notice], threading.Event]:
    """A node's client that is never started, on ``clock``, and what its listener is told."""
    wake, told = threading.Event(), []

    def hello(member_id: str) -> m.Hello:
        return m.Hello(job="j", job_identity="j", fingerprint=[], member_id=member_id, name="n", batch_size=1)

    c = ControlClient([("127.0.0.1", 1)], hello, name="n", connect_timeout_s=1, wake=wake, clock=clock)
    c.add_listener(told.append)
    return c, told, wake


def test_the_clients_fence_follows_its_acknowledgements_on_the_injected_clock() -> None:
    clock = Clock()
    c, told, wake = client(clock)
    c.connection.welcomed(welcome(lease_s=1.0), hello_sent=clock.t)
    assert c.connected and c.commit_allowed() and wake.is_set()
    c.connection.sending()  # a heartbeat goes out at t=100 ...
    clock.t += 0.5
    seq = c.connection.sending()  # ... another at 100.5 ...
    clock.t += 0.7  # ... and the second one's acknowledgement arrives 1.2 s after the hello
    assert not c.commit_allowed()
    c._on_message(m.Ack(seq=seq))
    assert c.commit_allowed(), "the lease runs from when the acknowledged heartbeat was sent"
    clock.t += 0.9
    assert not c.commit_allowed()
    c.expel("lease expired")
    c._on_message(m.Ack(seq=seq))
    assert not c.commit_allowed() and c.expelled == "lease expired"
    assert [type(n) for n in told] == [Change]


def test_the_client_tells_its_listeners_each_transition_once_and_unpolled_orders() -> None:
    clock = Clock()
    c, told, wake = client(clock)
    c.connection.welcomed(welcome(), hello_sent=clock.t)
    wake.clear()
    c.connection.dropped(expelled=False)
    assert c.outage and wake.is_set()
    wake.clear()
    clock.t += 2.0
    assert not c.commit_allowed() and c.lapses == 1 and not c.outage and wake.is_set()
    probe = m.Probe(epoch=1, member="x", group="world", host="127.0.0.1", port=1, term=0)
    wake.clear()
    c._on_message(probe)
    assert not wake.is_set(), "a probe is the listener's: nothing for the step loop to wake for"
    c._on_message(m.Command(action="drain", reason="now", term=0))
    assert wake.is_set()
    changes = [(n.old, n.new) for n in told if isinstance(n, Change)]
    assert changes == [(State.LOST, State.CONNECTED), (State.CONNECTED, State.SUSPENDED), (State.SUSPENDED, State.LOST)]
    assert [type(n) for n in told if not isinstance(n, Change)] == [m.Probe, m.Command]


def test_a_heartbeat_that_woke_over_half_a_lease_late_is_said_once_a_minute(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A process that did not run (a thread holding the GIL, a machine too busy) loses its
    # lease with nothing in its own log to say why: the session says it.
    clock = Clock()
    c, _, _ = client(clock)
    c.connection.welcomed(welcome(lease_s=1.0), hello_sent=clock.t)
    overslept = [0.1, 0.6, 0.6, 0.7]

    async def sleep(s: float) -> None:
        clock.t += s + overslept.pop(0)

    monkeypatch.setattr(client_module.asyncio, "sleep", sleep)
    with caplog.at_level(logging.WARNING, logger=client_module.log.name):
        for _ in range(3):
            asyncio.run(c._nap(0.2))
        clock.t += 60
        asyncio.run(c._nap(0.2))
    late = [r.getMessage() for r in caplog.records if "late" in r.getMessage()]
    said = "s late (lease 1.0 s): a machine this busy needs a longer --lease"
    assert late == [f"heartbeat 0.60 {said}", f"heartbeat 0.70 {said}"]
