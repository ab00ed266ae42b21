"""Zones: two-level reduction across sites, compressed between zone leaders.

Nodes a1, a2 sit in zone A and b1, b2 in zone B; the first member of a zone in rank order
leads it (a1 and b1 here: ranks follow join order).
"""

from __future__ import annotations

import signal

import torch

from integration.helpers import assert_promises, events_of, fired, job_for, slowdown
from unbroken.testing import check_promises, reference_state

ENV = {"UB_TEST_STEPS": "60", "UB_TEST_DELAY_MS": "5", "UB_TEST_EVAL": "1"}


def start_zones(make_cluster, env, codec="none", faults=None, link=("2", "0"), coordinator=()):
    faults = faults or {}
    c = make_cluster(
        env=env,
        min_nodes=4,
        coordinator_args=["--codec", codec, *coordinator],
        node_args=["--digest-every", "1", "--link-latency-ms", link[0], "--link-mbit", link[1]],
    )
    c.start_coordinator()

    def joined(names):
        return lambda: {m["name"] for m in c.state()["members"]} >= set(names)

    for first in ("a1", "b1"):  # join order makes a1 and b1 the leaders
        c.start_node(first, extra=["--zone", first[0].upper()], fault=faults.get(first, ""))
        c.wait_for(joined([first]), 60, f"{first} to join")
    for second in ("a2", "b2"):
        c.start_node(second, extra=["--zone", second[0].upper()], fault=faults.get(second, ""))
    return c


def leaders_sent_between_zones(c) -> dict[str, int]:
    return {
        name: sum(e.get("wire", {}).get("inter", 0) for e in node.entries() if e["kind"] == "commit")
        for name, node in c.nodes.items()
    }


def test_two_zones_uncompressed_match_the_reference(make_cluster):
    # Tiny buckets: each zone sums its gradient in pieces while backward runs, then the
    # leaders exchange the zone's whole sum.
    c = start_zones(make_cluster, ENV, coordinator=["--bucket-mb", "0.0002"])
    codes = c.wait_exit(timeout=120)
    assert codes == {"a1": 0, "b1": 0, "a2": 0, "b2": 0}, c.diagnostics()
    buckets = [e["buckets"] for n in c.nodes.values() for e in n.entries() if e["kind"] == "contrib"]
    assert buckets and all(b[0] == b[1] > 1 for b in buckets), buckets[:8]
    sent = leaders_sent_between_zones(c)
    assert sent["a1"] > 0 and sent["b1"] > 0 and sent["a2"] == 0 and sent["b2"] == 0, sent
    assert_promises(c, ENV, finishers=4)


def test_two_zones_with_int8_train_to_the_expected_loss(make_cluster):
    c = start_zones(make_cluster, ENV, codec="int8")
    codes = c.wait_exit(timeout=120)
    assert codes == {"a1": 0, "b1": 0, "a2": 0, "b2": 0}, c.diagnostics()
    job = job_for(ENV)
    report = check_promises({n: p.entries() for n, p in c.nodes.items()}, job, finishers=4)
    assert report.ok, "\n".join(report.problems)  # replicas equal, exactly-once data: lossy only in value
    got, ref = job.model(), job.model()
    got.load_state_dict(torch.load(c.nodes["a1"].final_state, weights_only=True)["model"])
    ref.load_state_dict(reference_state(job))
    with torch.no_grad():
        ours, exact = job.evaluate(got)["heldout_loss"], job.evaluate(ref)["heldout_loss"]
    assert abs(ours - exact) <= 0.03 * exact, (ours, exact)
    float32_bytes = 4 * sum(p.numel() for p in ref.parameters())
    inter = [e["wire"]["inter"] for e in c.nodes["a1"].entries() if e["kind"] == "commit" and "wire" in e]
    assert inter and max(inter) < float32_bytes / 2, (inter[:3], float32_bytes)


def test_a_zone_leader_killed_mid_exchange_is_replaced_and_a_dead_zone_drops_out(make_cluster):
    # b1 (B's leader) dies in the exchange at step 15; b2 leads B until it dies there at 30;
    # zone A trains on alone. No step is lost or applied twice.
    faults = {"b1": "kill@exchange:15", "b2": "kill@exchange:30"}
    c = start_zones(make_cluster, ENV, faults=faults)
    codes = c.wait_exit(timeout=120)
    assert fired(c.nodes["b1"], "kill") and fired(c.nodes["b2"], "kill"), c.diagnostics()
    assert codes == {"a1": 0, "b1": -signal.SIGKILL, "a2": 0, "b2": -signal.SIGKILL}, c.diagnostics()
    b2_inter = [e for e in c.nodes["b2"].entries() if e["kind"] == "commit" and e.get("wire", {}).get("inter")]
    assert b2_inter and min(e["step"] for e in b2_inter) <= 17, "b2 must have taken over as B's leader"
    assert_promises(c, ENV, finishers=2)


def test_auto_zones_on_one_site_make_one_zone(make_cluster):
    # Loopback: every node sees the coordinator within a millisecond, so --zone auto groups
    # them all into one zone and the step stays a plain all-reduce (exact: the reference).
    env = {**ENV, "UB_TEST_STEPS": "40"}
    c = make_cluster(env=env, min_nodes=3, node_args=["--digest-every", "1", "--zone", "auto"])
    c.start_coordinator()
    for name in ("n1", "n2", "n3"):
        c.start_node(name)
    c.wait_for(lambda: len(c.state()["members"]) == 3 and c.max_committed() >= 5, 60, "three members training")
    state = c.state()
    assert {m["zone"] for m in state["members"]} == {"auto-1"}, state["members"]
    # Loopback answers within a millisecond; a busy machine delays the answer by its load.
    assert all(m["capabilities"]["rtt_s"] < 0.010 * slowdown() for m in state["members"]), state["members"]
    codes = c.wait_exit(timeout=120)
    assert codes == {"n1": 0, "n2": 0, "n3": 0}, c.diagnostics()
    assert_promises(c, env, finishers=3)


def test_four_zone_leaders_measure_their_links_and_the_ring_leaves_the_slow_pairs_out(make_cluster):
    # Emulated links (each node delays what it receives from the zones named): A-B and C-D
    # are slow, the rest unlimited. In join order the leaders' ring is A B C D A, which uses
    # both slow pairs; the leaders measure every pair in the first epoch, and the next epoch
    # orders a ring whose every link is fast (A C B D or A D B C). Training goes on throughout.
    env = {"UB_TEST_STEPS": "100", "UB_TEST_DELAY_MS": "20", "UB_TEST_EVAL": "1"}
    slow_from = {"a": "B", "b": "A", "c": "D", "d": "C"}
    c = make_cluster(env=env, min_nodes=4, node_args=["--digest-every", "1"])
    c.start_coordinator()
    for name in "abcd":  # join order: ranks, and the ring before it is measured
        c.start_node(name, extra=["--zone", name.upper(), "--link-mbit", f"0,{slow_from[name]}=20"])
        c.wait_for(lambda n=name: n in {m["name"] for m in c.state()["members"]}, 60, f"{name} to join")
    codes = c.wait_exit(timeout=180)
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, c.diagnostics()
    measured = {n: [e for e in node.entries() if e["kind"] == "links"] for n, node in c.nodes.items()}
    assert all(measured.values()), measured
    for name, reports in measured.items():  # what each leader received from its slow zone is slow
        rates = reports[0]["rates"]
        slow = rates[slow_from[name]]
        assert slow < 3.0 and all(r > 2 * slow for z, r in rates.items() if z != slow_from[name]), (name, rates)
    reasons = [e["reason"] for e in events_of(c, "epoch")]
    reordered = [r.split("leaders' ring ")[1].split(":")[0].split(" > ") for r in reasons if "leaders' ring" in r]
    assert reordered, reasons
    ring = reordered[0]  # A C B D or A D B C: any ring whose links are all fast
    pairs = {frozenset(p) for p in zip(ring, [*ring[1:], ring[0]], strict=True)}
    assert sorted(ring) == list("ABCD") and not pairs & {frozenset("AB"), frozenset("CD")}, reasons
    assert_promises(c, env, finishers=4)
