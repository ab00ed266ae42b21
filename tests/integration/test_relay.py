"""Relays: zones' sub-coordinators between the nodes and the leader.

The leader sees one session per relay; a relay's death is one more fault the group
survives (its members reconnect to the leader within their lease: nobody is failed, no
epoch changes), and a member behind a relay that dies is found out as fast as one
connected directly.
"""

from __future__ import annotations

import contextlib
import json
import signal
import ssl
import time
import urllib.request
from collections.abc import Iterator

import pytest

from integration.helpers import assert_promises, events_of, slowdown, tls_files
from unbroken.testing import LocalCluster
from unbroken.testing.fakes import FakeNodes

pytestmark = pytest.mark.timeout(240)

ENV = {"UB_TEST_STEPS": "120", "UB_TEST_DELAY_MS": "20"}
TOKEN = "relay-test-token-0123456789"
BUSY_TIMEOUT = 420
"""The 150 fake members' tests: their admission's waits (90 s, up to four times that on a
busy machine) and what follows."""


def relay_state(address: tuple[str, int]) -> dict:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/api/state", timeout=5) as r:
        return json.load(r)


def test_nodes_behind_relays_train_and_survive_a_relay_and_a_node_dying(make_cluster):
    """Two zones of two nodes, each zone behind its relay. Relay A is SIGKILLed at step 30:
    a1 and a2 reconnect to the leader and train on without failing or changing the epoch.
    b2 dies at step 60 behind relay B: its failure is seen at once. Every promise holds."""
    # The lease stretches with the machine's load (2 s at least): what is judged is that relay
    # A's death fails nobody, not whether a busy machine's heartbeats keep a 1 s lease (CI: a2
    # lapsed at 1.06 s, after the leader said step 50).
    lease = round(max(2.0, min(slowdown(), 4.0)), 2)
    c = make_cluster(env=ENV, min_nodes=4, node_args=["--digest-every", "1"], lease_s=lease)
    root = c.start_coordinator()
    relay_a = c.start_relay(zone="A")
    relay_b = c.start_relay(zone="B")
    for name, relay in (("a1", relay_a), ("b1", relay_b), ("a2", relay_a), ("b2", relay_b)):
        fault = "kill@compute:60" if name == "b2" else ""
        c.start_node(name, extra=["--zone", name[0].upper()], via=[relay, root], fault=fault)
    c.wait_for(lambda: c.state()["step"] >= 30, 90, "step 30")
    assert sorted(relay_state(relay_a)["members"]) == sorted(
        m["id"] for m in c.state()["members"] if m["name"].startswith("a")
    )
    killed_at = max(e["seq"] for e in c.events())
    c.relays[0][0].send_signal(signal.SIGKILL)
    c.wait_for(lambda: c.state()["step"] >= 50, 60, "step 50 after relay A died")
    # Nobody failed, nothing re-formed but for b2's death at step 60: the leader's step lags
    # the nodes' (relayed reports), so by the time it says 50 the nodes may be past 60.
    after = [e["reason"] for e in c.events() if e["kind"] == "epoch" and e["seq"] > killed_at]
    assert all("b2 failed" in r for r in after), after
    codes = c.wait_exit(timeout=150)
    assert codes["a1"] == codes["a2"] == codes["b1"] == 0, c.diagnostics()
    failures = [e["reason"] for e in events_of(c, "failure")]
    assert len(failures) == 1 and failures[0].startswith("b2:"), failures
    assert_promises(c, ENV, finishers=3)


@contextlib.contextmanager
def fakes_behind_three_relays(make_cluster) -> Iterator[tuple[LocalCluster, FakeNodes]]:
    """150 fake nodes spread over three relays (the leader as their fallback), in an epoch.

    On a busy machine their handshakes take longer (at a load of 30 on 2 cores, 61 had joined
    after a minute), and so does the dead relay's members' return to the leader (50 sessions
    again, 101 of 150 back after three 1 s leases at a load of 12 to 22): the lease and the
    waits stretch with the measured slowdown (within `BUSY_TIMEOUT`), so what is judged, a
    return within the lease, stays what it is on an idle machine."""
    slow = min(slowdown(), 4.0)
    c = make_cluster(lease_s=round(1.0 * slow, 2))
    root = c.start_coordinator()
    relays = [c.start_relay(zone=f"z{i}") for i in range(3)]
    # From addresses of their own, as a fleet: a relay reads a few unproven sessions of one
    # address at a time, and their strikes for leaving before training are their own.
    with FakeNodes(relays, 150, fallback=[root], sources=150) as fakes:
        fakes.wait_joined(60 * slow)
        c.wait_for(lambda: fakes.all_reached(1) is not None, 30 * slow, "an epoch with every fake node")
        time.sleep(c.lease_s)
        yield c, fakes


@pytest.mark.timeout(BUSY_TIMEOUT)
def test_a_relay_killed_under_150_members_expels_none_of_them(make_cluster):
    with fakes_behind_three_relays(make_cluster) as (c, fakes):
        epoch = c.state()["epoch"]
        c.relays[1][0].send_signal(signal.SIGKILL)
        time.sleep(3 * c.lease_s)
        state = c.state()
        assert len(state["members"]) == 150 and fakes.expelled() == 0, events_of(c, "failure")[:3]
        assert state["epoch"] == epoch, [(e["reason"], e["member"]) for e in c.events()][-12:]
        assert sum(n.reconnects for n in fakes.nodes) >= 50  # the dead relay's third came back directly
        # A member behind a live relay that dies is failed at once, through its relay.
        slow = slowdown()  # the bound stretches with the machine's load
        killed_at = fakes.kill(1)
        c.wait_for(lambda: fakes.all_reached(epoch + 1) is not None, 10 * slow, "the next epoch at every node")
        assert (fakes.all_reached(epoch + 1) or 0) - killed_at < 5.0 * slow, slow


@pytest.mark.timeout(BUSY_TIMEOUT)
def test_a_frozen_relays_members_come_back_through_the_leader_none_expelled(make_cluster):
    """SIGSTOP, as a host that dies without closing its connections: the leader finds the
    relay silent and keeps its members' leases while they leave it and come back directly."""
    with fakes_behind_three_relays(make_cluster) as (c, fakes):
        c.relays[2][0].send_signal(signal.SIGSTOP)
        try:
            c.wait_for(lambda: len(c.state()["relays"]) == 2, 10 * c.lease_s, "the frozen relay to be found silent")
            time.sleep(4 * c.lease_s)  # its members' leave, reconnect, and a few leases more
            state = c.state()
            assert len(state["members"]) == 150 and fakes.expelled() == 0, events_of(c, "failure")[:3]
            assert not events_of(c, "failure")
        finally:
            c.relays[2][0].send_signal(signal.SIGCONT)


def test_a_relay_without_the_token_never_links_and_nodes_refuse_it(make_cluster):
    c = make_cluster(env={"UB_TEST_STEPS": "30", "UB_TEST_DELAY_MS": "5"}, coordinator_args=["--token", TOKEN])
    c.start_coordinator()
    impostor = c.start_relay(zone="X")  # no token: the leader refuses its link
    good = c.start_relay(zone="Y", extra=["--token", TOKEN])
    c.wait_for(lambda: relay_state(good)["leader"] is not None, 30, "the relay with the token to link")
    assert relay_state(impostor)["leader"] is None
    # A node with the token will not train under a relay that cannot prove it; one with the
    # wrong token is refused by the relay that checks it; the right one trains through it.
    fooled = c.start_node("fooled", via=[impostor], extra=["--token", TOKEN])
    wrong = c.start_node("wrong", via=[good], extra=["--token", "not-the-job-token-at-all"])
    c.start_node("y", via=[good], extra=["--token", TOKEN])
    assert fooled.proc.wait(60) != 0 and wrong.proc.wait(60) != 0
    assert "does not ask for a token but this node has one" in fooled.stderr()
    assert "the job token does not match" in wrong.stderr()
    codes = c.wait_exit(timeout=90, names=["y"])
    assert codes == {"y": 0}, c.diagnostics()
    assert relay_state(impostor)["members"] == []


def test_a_relay_serves_its_nodes_over_tls_and_links_to_a_leader_over_tls(make_cluster, tmp_path):
    """Coordinator and relay both serve TLS; the relay links to the leader over TLS and its
    nodes reach it over TLS alone (no address of the leader given). A relay that does not
    trust the leader's certificate never links; a node that does not trust the relay's is
    told it could not reach it. The job trains through the relay and keeps every promise."""
    cert_pem, key_pem, ca_pem = tls_files(tmp_path)
    tls = ["--tls-cert", str(cert_pem), "--tls-key", str(key_pem)]
    env = {"UB_TEST_STEPS": "400", "UB_TEST_DELAY_MS": "10"}  # long enough to see both at the relay
    c = make_cluster(env=env, min_nodes=2, coordinator_args=["--token", TOKEN, *tls])
    c.start_coordinator()
    relay = c.start_relay(zone="Z", extra=["--token", TOKEN, *tls, "--tls-ca", str(ca_pem)])
    blind = c.start_relay(zone="B", extra=["--token", TOKEN])  # plain http to a TLS leader
    context = ssl.create_default_context(cafile=str(ca_pem))

    def state(address: tuple[str, int]) -> dict:
        with urllib.request.urlopen(f"https://{address[0]}:{address[1]}/api/state", timeout=5, context=context) as r:
            return json.load(r)

    c.wait_for(lambda: state(relay)["leader"] is not None, 30, "the relay to link to the leader over TLS")
    for name in ("a", "b"):
        c.start_node(name, via=[relay], extra=["--token", TOKEN, "--tls-ca", str(ca_pem)])
    plain = c.start_node("plain", via=[relay], extra=["--token", TOKEN, "--connect-timeout", "3"])
    assert plain.wait(60) == 2 and "could not reach a coordinator" in plain.stderr(), plain.stderr()[-2000:]
    del c.nodes["plain"]
    c.wait_for(lambda: len(state(relay)["members"]) == 2, 120, "both nodes through the relay")
    assert relay_state(blind)["leader"] is None
    assert c.wait_exit(timeout=120) == {"a": 0, "b": 0}, c.diagnostics()
    assert_promises(c, env, finishers=2)
