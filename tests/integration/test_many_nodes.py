"""Thirty-two real node processes in four zones, each zone behind its relay: five are
killed and two join while they train, and every promise of docs/design.md holds."""

from __future__ import annotations

import signal

import pytest

from integration.helpers import assert_promises, established, events_of

pytestmark = pytest.mark.timeout(600)

ENV = {"UB_TEST_STEPS": "120", "UB_TEST_DELAY_MS": "10", "UB_TEST_BATCH": "64"}
ZONES = "abcd"
KILLS = {"a3": 12, "b5": 20, "c2": 28, "d7": 36, "a6": 44}
"""Node -> the step at which it SIGKILLs itself (mid-compute)."""


@pytest.mark.serial  # 37 processes: with another test beside them on 2 cores, leases lapse
def test_32_nodes_in_4_zones_with_5_kills_and_2_joins_keep_every_promise(make_cluster):
    # 37 processes on CI's 2 cores: a lease of 2 s (default 1 s) for margin, and shares by
    # weight: speeds measured on cores this oversubscribed swing tenfold from one second to
    # the next, and each rebalance is one more epoch for 32 members to build (a run with the
    # planner on formed 25 epochs, 11 of them rebalances).
    c = make_cluster(
        env=ENV, min_nodes=32, node_args=["--digest-every", "1"], lease_s=2.0, coordinator_args=["--balance", "weights"]
    )
    c.start_coordinator()
    relays = {z: c.start_relay(zone=z.upper()) for z in ZONES}
    for i in range(8):
        for z in ZONES:
            name = f"{z}{i}"
            fault = f"kill@compute:{KILLS[name]}" if name in KILLS else ""
            c.start_node(name, extra=["--zone", z.upper()], relays=[relays[z]], fault=fault)
    c.wait_for(lambda: c.state()["step"] >= 1, 300, "the first step of 32 nodes")
    # The world group connects only the pairs that exchange data (a full mesh alone would
    # hold 31 connections per node, 124 over the coordinator's 4 streams). A node holds its
    # zone's 7 peers, a connection per stream (4 by default) to each of its 2 world ring
    # neighbours (the world's transfers cross zones), and its relay: 16, 17 seen in CI with a
    # transfer's. A leader adds a connection per stream to each of its 3 fellow leaders.
    connections = {n: established(p.proc.pid) for n, p in c.nodes.items()}
    alive = {n: k for n, k in connections.items() if k is not None}
    streams = 4
    assert len(alive) >= 27 and max(alive.values()) < 31 + (streams - 1) * (len(ZONES) + 1), connections
    typical = 7 + 2 * streams + 1
    assert sorted(alive.values())[len(alive) // 2] <= typical + 2, connections
    for name in ("b8", "d8"):  # they take seconds to start: they join a group in training
        c.start_node(name, extra=["--zone", name[0].upper()], relays=[relays[name[0]]])
    codes = c.wait_exit(timeout=400)
    killed = {n for n, code in codes.items() if code == -signal.SIGKILL}
    assert killed == set(KILLS), c.diagnostics()
    assert all(code == 0 for n, code in codes.items() if n not in KILLS), codes
    for joiner in ("b8", "d8"):  # joined mid-run and trained to the end
        assert any(e["kind"] == "commit" for e in c.nodes[joiner].entries()), c.diagnostics()
    # Every kill is found. With the planner on, the 37 processes on 2 cores let live members'
    # heartbeats lapse for over 2 s in an epoch change (3 zone leaders in a CI run; 5 in one
    # of 25 epochs here, all building the leaders' group); by weight, 8 epochs and none in
    # two runs. Those may be expelled, but each must come back and train to the end (their
    # exit codes above); no more than a few.
    reasons = [e["reason"] for e in events_of(c, "failure")]
    killed_found = {r.partition(":")[0] for r in reasons if r.endswith("control connection dropped")}
    assert set(KILLS) <= killed_found, reasons
    lapsed = [r for r in reasons if r.partition(":")[0] not in KILLS]
    assert len(lapsed) <= 4, reasons
    assert_promises(c, ENV, finishers=29)
