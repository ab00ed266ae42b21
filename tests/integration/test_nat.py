"""Nodes behind NAT (root only): every node in its own network namespace, and one whose
namespace drops every inbound connection (nftables). It trains through a forwarder a
reachable member offers (`unbroken.comm.forward`), joins mid-run (told it is behind NAT,
not where a forwarder is: epoch orders name the members that offer one), is killed and
comes back (given a forwarder, not told it is behind NAT: the forwarder's probe finds it),
and the promises of DESIGN.md §1 hold throughout; a forwarder's death is one more fault; a
node given neither flag, that its peers cannot connect to, is moved behind a forwarder."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator

import pytest

from integration.helpers import Pace, assert_promises, events_of
from unbroken.testing import netns

pytestmark = pytest.mark.timeout(240)

TOKEN = "nat-job-secret-0123456789abcdef"
FORWARD_PORT = 7800
"""Where a member offers forwarding (its own namespace: the port is free there)."""
HIGH = 250
"""The last number of an address above every other node's (they take 2, 3, ... in turn)."""


@pytest.fixture
def network() -> Iterator[netns.Network]:
    reason = netns.inbound_probe()
    if reason is not None:
        pytest.skip(f"nodes behind NAT need network namespaces and nftables here: {reason}")
    net = netns.Network()
    try:
        yield net
    finally:
        net.close()
        left = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert net.bridge not in left, "the network's links outlived close()"


def commits_after(node, epoch: int) -> list[dict]:
    return [e for e in node.entries() if e["kind"] == "commit" and e["epoch"] > epoch]


def refused_or_dropped(host: str, port: int) -> str:
    try:
        socket.create_connection((host, port), timeout=1.5).close()
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "dropped"
    return "accepted"


def test_node_behind_nat_trains_through_a_forwarder_joins_is_killed_and_rejoins(network, make_cluster, tmp_path):
    # Paced until n3 trains again after its restart (1,500 steps of 20 ms leave it 30 s or
    # more), then the rest at full speed: the steps were only the clock.
    pace = Pace(tmp_path)
    env = {"UB_TEST_STEPS": "1500", "UB_TEST_DELAY_MS": "20", "UNBROKEN_TOKEN": TOKEN, **pace.env}
    c = make_cluster(env=env, min_nodes=2, node_args=["--digest-every", "1"], network=network)
    c.start_coordinator()
    n1 = c.start_node("n1", extra=["--offer-forwarding", str(FORWARD_PORT)])
    # gloo has the member of the greater address dial: n2's is greater than every n3's, so
    # n2 must connect to n3, which only the forwarder lets it do (n3 dials n1 itself).
    network.add("n2", host=HIGH)
    c.start_node("n2")
    forwarder = f"{network.address('n1')}:{FORWARD_PORT}"
    c.wait_step(20)

    # Joins mid-run from behind a firewall that drops every connection into it, told so
    # but given no forwarder: the epoch order names n1's.
    n3 = c.start_node("n3", extra=["--no-inbound"], no_inbound=True)
    assert refused_or_dropped(network.address("n3"), 9) == "dropped", "n3's namespace must drop inbound connections"
    c.wait_for(lambda: commits_after(n3, 0), 90, "n3 committing from behind its firewall")

    # Killed: the others go on without it, then it comes back, still behind its firewall and
    # not told so: its forwarder finds that it cannot connect to it.
    n3.kill()
    failure = c.wait_for(
        lambda: next((e for e in events_of(c, "failure") if e["node"] == "n3"), None), 15, "n3's death seen"
    )
    c.wait_for(lambda: commits_after(n1, failure["epoch"]), 30, "n1 and n2 committing without n3")
    n3 = c.start_node("n3", extra=["--forwarder", forwarder], no_inbound=True)
    c.wait_for(lambda: commits_after(n3, failure["epoch"]), 90, "n3 committing again after its restart")
    pace.release()
    assert "its forwarder cannot connect to its data-plane address" in n3.stderr()

    codes = c.wait_exit(timeout=150)
    assert codes == {"n1": 0, "n2": 0, "n3": 0}, c.diagnostics()
    assert_promises(c, env, finishers=3)
    # n2's connections to n3 went through the forwarder: nothing else gets into n3.
    sessions = re.findall(r"n3's session ended: (\d+) connections, (\d+) bytes forwarded", n1.stderr())
    assert sessions and all(int(conns) > 0 and int(sent) > 0 for conns, sent in sessions), n1.stderr()[-3000:]


def free_port(host: str) -> int:
    with socket.create_server((host, 0)) as s:
        return s.getsockname()[1]


def test_a_forwarders_death_is_one_more_fault_the_nat_node_moves_to_a_relays(network, make_cluster, tmp_path):
    pace = Pace(tmp_path)  # paced until n3 trains through the relay's forwarder, as above
    env = {"UB_TEST_STEPS": "1200", "UB_TEST_DELAY_MS": "20", "UNBROKEN_TOKEN": TOKEN, **pace.env}
    c = make_cluster(env=env, min_nodes=3, node_args=["--digest-every", "1"], network=network)
    c.start_coordinator()
    relay_forwarder = (network.gateway, free_port(network.gateway))
    c.start_relay(extra=["--offer-forwarding", f"{relay_forwarder[1]}"])
    n1 = c.start_node("n1", extra=["--offer-forwarding", str(FORWARD_PORT)])
    network.add("n2", host=HIGH)  # above n3: n2 must dial n3, through a forwarder
    c.start_node("n2")
    forwarders = f"{network.address('n1')}:{FORWARD_PORT},{relay_forwarder[0]}:{relay_forwarder[1]}"
    n3 = c.start_node("n3", extra=["--no-inbound", "--forwarder", forwarders], no_inbound=True)
    c.wait_for(lambda: commits_after(n3, 0), 120, "n3 committing through n1's forwarder")

    n1.kill()  # the forwarder n3 holds its ports at, and a member
    failure = c.wait_for(
        lambda: next((e for e in events_of(c, "failure") if e["node"] == "n1"), None), 15, "n1's death seen"
    )
    c.wait_for(lambda: commits_after(n3, failure["epoch"]), 60, "n3 committing through the relay's forwarder")
    pace.release()

    codes = c.wait_exit(["n2", "n3"], timeout=150)
    assert codes == {"n2": 0, "n3": 0}, c.diagnostics()
    assert_promises(c, env, finishers=2)
    # The relay forwarded n2's connections to n3.
    relay_log = c.workdir / "relay0.err"
    sessions = c.wait_for(
        lambda: re.findall(r"n3's session ended: (\d+) connections, (\d+) bytes", relay_log.read_text()),
        10,
        "n3's session at the relay ending",
    )
    assert int(sessions[-1][0]) > 0 and int(sessions[-1][1]) > 0, relay_log.read_text()[-3000:]
    # The relay told the leader where it forwards: epoch orders name it to members behind NAT.
    said = f"forwarding at {relay_forwarder[0]}:{relay_forwarder[1]}"
    assert said in (c.workdir / "coordinator.err").read_text(), "the relay's hello names its forwarder"


def test_a_node_its_peers_cannot_reach_goes_behind_a_forwarder_by_itself(network, make_cluster):
    """n3 is given neither --no-inbound nor --forwarder: n2 cannot connect to it, n1 (asked)
    neither, so the leader moves it behind n1's forwarder (before: benched, again and again)."""
    env = {"UB_TEST_STEPS": "200", "UB_TEST_DELAY_MS": "20", "UNBROKEN_TOKEN": TOKEN}
    c = make_cluster(env=env, min_nodes=3, node_args=["--digest-every", "1"], network=network)
    c.start_coordinator()
    n1 = c.start_node("n1", extra=["--offer-forwarding", str(FORWARD_PORT)])
    network.add("n2", host=HIGH)  # above n3: n2 must dial n3
    c.start_node("n2")
    n3 = c.start_node("n3", no_inbound=True)
    c.wait_for(lambda: commits_after(n3, 0), 90, "n3 committing from behind its firewall")

    moved = [e for e in events_of(c, "forwarded") if e["node"] == "n3"]
    forwarder = f"{network.address('n1')}:{FORWARD_PORT}"
    assert [e["reason"] for e in moved] == [f"n3 unreachable from n1, n2: now behind forwarder {forwarder}"]
    assert not [e for e in events_of(c, "unreachable") if e["node"] == "n3"], "moved, never benched"
    codes = c.wait_exit(timeout=150)
    assert codes == {"n1": 0, "n2": 0, "n3": 0}, c.diagnostics()
    assert_promises(c, env, finishers=3)
    sessions = re.findall(r"n3's session ended: (\d+) connections, (\d+) bytes forwarded", n1.stderr())
    assert sessions and all(int(conns) > 0 and int(sent) > 0 for conns, sent in sessions), n1.stderr()[-3000:]
