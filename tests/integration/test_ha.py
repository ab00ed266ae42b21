"""No single point of failure: coordinators elected through a real 3-member etcd cluster.

Every test asserts the promises of docs/design.md on the nodes' logs, and that what the
nodes followed came from the leader of the newest term they had seen.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
import urllib.request

import pytest

from integration.helpers import assert_promises, events_of, settled_step
from unbroken.testing import EtcdCluster

pytestmark = pytest.mark.timeout(240)

if shutil.which("etcd") is None and os.environ.get("CI") != "true":
    pytest.skip("etcd is not installed (scripts/setup installs Debian's etcd-server as root)", allow_module_level=True)


@pytest.fixture
def etcd(tmp_path):
    with EtcdCluster(tmp_path / "etcd") as cluster:
        yield cluster


def start(make_cluster, etcd, env, n=3, coordinators=2):
    c = make_cluster(env=env, min_nodes=n, node_args=["--digest-every", "1"], etcd=etcd.endpoints)
    for _ in range(coordinators):
        c.start_coordinator()
    c.wait_for(lambda: c.leader() is not None, 20, "a leader")
    return c


def training_under_a_leader(make_cluster, etcd, env):
    """Three nodes past step 15 under an elected leader: (cluster, nodes, leader index, its term)."""
    c = start(make_cluster, etcd, env, n=3)
    nodes = [c.start_node(f"n{i}") for i in (1, 2, 3)]
    c.wait_step(15)
    leader = led_by(c, None, 20)
    return c, nodes, leader, c.coordinator_state(leader)["leadership"]["term"]


def led_by(c, other_than: int | None, timeout: float, what: str = "a leader") -> int:
    """The index of the coordinator that leads, once one other than ``other_than`` does
    (waited for as a list: coordinator 0 is a leader too)."""
    (index,) = c.wait_for(lambda: [i for i in [c.leader()] if i is not None and i != other_than], timeout, what)
    return index


def terms_followed(node) -> list[tuple[int, int]]:
    """(epoch, term) of every epoch the node formed, in order."""
    return [(e["epoch"], e["term"]) for e in node.entries() if e["kind"] == "epoch"]


def assert_terms_never_go_back(c) -> None:
    for node in c.nodes.values():
        seen = terms_followed(node)
        terms = [t for _, t in seen]
        epochs = [e for e, _ in seen]
        assert terms == sorted(terms), f"{node.name} followed an older term after a newer one: {seen}"
        assert epochs == sorted(set(epochs)), f"{node.name} formed an epoch twice or out of order: {seen}"


def test_standby_names_the_leader_and_serves_its_state(make_cluster, etcd):
    c = start(make_cluster, etcd, {"UB_TEST_STEPS": "30", "UB_TEST_DELAY_MS": "10"}, n=2)
    leader = c.leader()
    standby = 1 - leader
    s = c.coordinator_state(standby)["leadership"]
    assert s["role"] == "standby"
    assert s["leader"] == "{}:{}".format(*c.coordinators[leader][1])
    # Given only the standby's address and no etcd, the nodes follow its answer to the leader.
    for name in ("a", "b"):
        c.start_node(name, via=[c.coordinators[standby][1]])
    c.wait_step(5)
    lead = c.coordinator_state(leader)
    assert lead["leadership"]["role"] == "leader" and lead["leadership"]["term"] > 0
    assert {m["name"] for m in lead["members"]} == {"a", "b"}
    assert c.wait_exit(timeout=120) == {"a": 0, "b": 0}, c.diagnostics()
    assert_promises(c, {"UB_TEST_STEPS": "30", "UB_TEST_DELAY_MS": "10"}, finishers=2)


def test_leader_killed_then_a_node_killed_training_goes_on(make_cluster, etcd):
    env = {"UB_TEST_STEPS": "400", "UB_TEST_DELAY_MS": "20"}
    c, nodes, old, old_term = training_under_a_leader(make_cluster, etcd, env)
    killed_at = time.monotonic()
    c.kill_coordinator(old)
    before = c.max_committed()
    time.sleep(0.1)
    nodes[2].kill()
    new = led_by(c, old, 10, "a standby to lead")
    took_over_s = time.monotonic() - killed_at
    assert new != old
    state = c.coordinator_state(new)
    assert state["leadership"]["term"] > old_term
    # The survivors form an epoch under the new leader and commit in it.
    c.wait_for(
        lambda: all(any(t > old_term for _, t in terms_followed(nodes[i])) for i in (0, 1)), 30, "epoch of the new term"
    )
    c.wait_step(before + 10, timeout=60)
    codes = c.wait_exit(["n1", "n2"], timeout=180)
    assert codes == {"n1": 0, "n2": 0}, c.diagnostics()
    assert_promises(c, env, finishers=2)
    assert_terms_never_go_back(c)
    assert took_over_s < 10, took_over_s
    assert any("leads (term" in e["reason"] for e in events_of(c, "leader"))
    # n1 and n2 found nothing listening at n3's data-plane address: the new leader did not
    # wait a lease for n3 to come back (an outage it might still trust).
    gone = [e for e in events_of(c, "failure") if "nothing listens" in e["reason"]]
    assert gone and gone[0]["member"].startswith("n3#"), events_of(c, "failure")


def test_frozen_leader_is_fenced_after_it_wakes(make_cluster, etcd):
    env = {"UB_TEST_STEPS": "300", "UB_TEST_DELAY_MS": "20"}
    c, nodes, old, old_term = training_under_a_leader(make_cluster, etcd, env)
    old_proc, old_addr = c.coordinators[old]
    old_proc.send_signal(signal.SIGSTOP)
    try:
        new = led_by(c, old, 15, "a standby to lead")
        assert new != old
        new_term = c.coordinator_state(new)["leadership"]["term"]
        assert new_term > old_term
        # The new leader forms epochs: a node joins while the old leader is frozen.
        nodes.append(c.start_node("n4"))
        # A later term too: the new leader may lose its lease under load and be elected again.
        c.wait_for(lambda: any(t >= new_term for _, t in terms_followed(nodes[3])), 60, "n4 in the new term")
    finally:
        old_proc.send_signal(signal.SIGCONT)
    # Awake again, the old leader knows it lost its lease: it says so and leads nothing.
    c.wait_for(
        lambda: (
            json.load(urllib.request.urlopen("http://{}:{}/api/state".format(*old_addr), timeout=2))["leadership"][
                "role"
            ]
            == "standby"
        ),
        10,
        "the old leader to stand down",
    )
    nodes[0].kill()  # a failure after the wake-up is handled by the new leader alone
    codes = c.wait_exit(["n2", "n3", "n4"], timeout=180)
    assert codes == {"n2": 0, "n3": 0, "n4": 0}, c.diagnostics()
    assert_promises(c, env, finishers=3)
    assert_terms_never_go_back(c)
    # Nothing of the old term was followed once the new one led: n4 joined after the freeze.
    assert all(t >= new_term for _, t in terms_followed(nodes[3])), terms_followed(nodes[3])
    assert any("stops leading" in e["reason"] for e in events_of(c, "deposed")), c.diagnostics()


def test_nodes_coordinate_themselves_and_survive_the_leading_nodes_death(make_cluster, etcd, tmp_path):
    env = {"UB_TEST_STEPS": "300", "UB_TEST_DELAY_MS": "20"}
    events = tmp_path / "events.jsonl"
    c = make_cluster(
        env=env,
        etcd=etcd.endpoints,
        node_args=[
            "--digest-every", "1", "--coordinate", "--gloo-host", "127.0.0.1",
            "--coordinator-args", f"--min-nodes 3 --event-log {events}",
        ],
    )  # fmt: skip
    nodes = {name: c.start_node(name) for name in ("n1", "n2", "n3")}
    c.wait_step(15, timeout=90)

    def leading_node() -> str | None:
        from unbroken.control.election import find_leader
        from unbroken.control.etcd import Etcd

        async def ask():
            async with Etcd(etcd.endpoints) as e:
                return await find_leader(e, "/unbroken/job", None)

        found = asyncio.run(ask())
        if found is None:
            return None
        with urllib.request.urlopen(f"http://{found[0]['address']}/api/state", timeout=2) as r:
            pid = json.load(r)["leadership"]["pid"]
        for name, node in nodes.items():
            if any(e["kind"] == "candidate" and e["pid"] == pid for e in node.entries()):
                return name
        return None

    first = c.wait_for(leading_node, 30, "a node's candidate to lead")
    nodes[first].kill()  # the node and, with it, the coordinator of the job
    second = c.wait_for(
        lambda: (n := leading_node()) not in (None, first) and n, 20, "another node's candidate to lead"
    )
    assert second != first
    survivors = [n for n in nodes if n != first]
    codes = c.wait_exit(survivors, timeout=180)
    assert codes == dict.fromkeys(survivors, 0), c.diagnostics()
    assert_promises(c, env, finishers=2)
    assert_terms_never_go_back(c)


def test_etcd_faults_one_member_down_changes_nothing_no_majority_pauses_only_membership(make_cluster, etcd):
    env = {"UB_TEST_STEPS": "500", "UB_TEST_DELAY_MS": "20"}
    c, nodes, leader, _ = training_under_a_leader(make_cluster, etcd, env)
    epochs_before = len(events_of(c, "epoch"))
    # One member down: the leader keeps its lease, nothing changes, training goes on.
    etcd.kill(0)
    at = c.max_committed()
    c.wait_step(at + 20)
    assert c.leader() == leader
    assert len(events_of(c, "epoch")) == epochs_before, "one etcd member down must not change the epoch"
    # No majority: nobody can lead, the group trains on in its epoch.
    etcd.kill(1)
    c.wait_for(lambda: c.leader() is None, 10, "the leader to step down without an etcd majority")
    at = c.max_committed()
    c.wait_step(at + 30, timeout=30)
    assert c.leader() is None
    # A membership change waits: n3 dies, the survivors cannot commit in a new epoch yet.
    nodes[2].kill()
    stuck_at = settled_step(c, quiet_s=1.0, timeout=30)  # the step in flight failed; no epoch forms
    time.sleep(2.0)  # (a window for what must not happen: a fixed wait)
    assert c.max_committed() == stuck_at, "no epoch may form while etcd has no majority"
    # etcd back: a leader is elected, the survivors form an epoch without n3 and finish.
    etcd.restart(0)
    etcd.restart(1)
    c.wait_for(lambda: c.leader() is not None, 20, "a leader once etcd has its majority back")
    c.wait_step(stuck_at + 10, timeout=60)
    codes = c.wait_exit(["n1", "n2"], timeout=180)
    assert codes == {"n1": 0, "n2": 0}, c.diagnostics()
    assert_promises(c, env, finishers=2)
    assert_terms_never_go_back(c)


def test_bad_etcd_input_gets_errors_that_name_the_fix(make_cluster, etcd, tmp_path):
    import subprocess
    import sys

    from conftest import JOB
    from unbroken.testing.cluster import READY_PREFIX

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "unbroken", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **(env or {})},
        )

    # etcd unreachable: the coordinator does not start, and says why.
    dead = "http://127.0.0.1:1"
    r = run("coordinator", "--port", "0", "--etcd", dead)
    assert r.returncode == 2 and "cannot start the coordinator" in r.stderr and "--etcd" in r.stderr, r.stderr
    assert READY_PREFIX not in r.stdout
    # A node under a prefix where no coordinator stands: a clear error after its connect timeout.
    r = run("node", JOB, "--etcd", ",".join(etcd.endpoints), "--etcd-prefix", "/nobody/here", "--connect-timeout", "2")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "found no coordinator leading under '/nobody/here'" in r.stderr and "--etcd-prefix" in r.stderr
    # Two jobs under one prefix: the second job's node is refused with the job named and the fix.
    # A job that outlasts the refused node's start-up (200 steps of 20 ms ended before it in CI).
    c = start(make_cluster, etcd, {"UB_TEST_STEPS": "100000", "UB_TEST_DELAY_MS": "20"}, n=1, coordinators=1)
    c.start_node("a")
    c.wait_step(5)
    r = run(
        "node", JOB, "--etcd", ",".join(etcd.endpoints), "--connect-timeout", "5",
        env={"UB_TEST_NAME": "other-job", "UB_TEST_STEPS": "200"},
    )  # fmt: skip
    assert r.returncode == 2 and "separate --etcd-prefix" in r.stderr, r.stderr[-2000:]
    at = c.max_committed()
    c.wait_step(at + 5)  # the running job lost nothing


def test_relays_follow_a_new_leader_after_the_old_one_is_killed(make_cluster, etcd):
    """Nodes behind a relay; the leader is SIGKILLed: the relay links to the new leader
    (found through etcd), its members come back through it (not around it to the new leader),
    and the job ends with every promise kept and terms never going back."""
    env = {"UB_TEST_STEPS": "120", "UB_TEST_DELAY_MS": "20"}
    c = start(make_cluster, etcd, env, n=3)
    relay = c.start_relay(zone="R")
    for i in (1, 2, 3):
        c.start_node(f"n{i}", relays=[relay])
    c.wait_step(20)
    old = c.leader()
    assert old is not None
    c.kill_coordinator(old)
    c.wait_for(lambda: c.leader() not in (None, old), 20, "a new leader")
    new = c.coordinators[c.leader()][1]  # type: ignore[index]

    def relinked() -> bool:
        with urllib.request.urlopen(f"http://{relay[0]}:{relay[1]}/api/state", timeout=2) as r:
            return json.load(r)["leader"] == f"{new[0]}:{new[1]}"

    c.wait_for(relinked, 30, "the relay to link to the new leader")

    def members_behind_the_relay() -> list[str]:
        with urllib.request.urlopen(f"http://{relay[0]}:{relay[1]}/api/state", timeout=2) as r:
            return sorted(json.load(r)["members"])

    # A member id is its node's name, its key's and a session's few characters.
    c.wait_for(
        lambda: sorted(mid.split("#")[0] for mid in members_behind_the_relay()) == ["n1", "n2", "n3"],
        20,
        "every node behind the relay again, not around it at the new leader",
    )
    codes = c.wait_exit(timeout=150)
    assert codes == {"n1": 0, "n2": 0, "n3": 0}, c.diagnostics()
    assert_terms_never_go_back(c)
    assert_promises(c, env, finishers=3)
