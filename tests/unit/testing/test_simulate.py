"""A small simulated control plane (`unbroken.testing.simulate`): 200 nodes behind 2 relays,
the real coordinator and relay batching on a virtual clock."""

from __future__ import annotations

import math

import pytest

from unbroken.control import messages as m
from unbroken.control.batches import HEARD_WITHIN
from unbroken.events import Kind
from unbroken.observe.board import members_json
from unbroken.testing.simulate import SimConfig, Simulation
from unbroken.testing.storms import admit, storms

LEASE_S = 1.0


@pytest.fixture(scope="module")
def sim() -> Simulation:
    s = Simulation(SimConfig(nodes=200, zone_size=100, lease_s=LEASE_S, seed=3))
    assert admit(s, timeout_s=60) is not None, "200 nodes were not all admitted into an epoch"
    return s


def _newest_everywhere(sim: Simulation) -> set[int]:
    return {max(n.epochs) for n in sim.live()}


def test_every_node_is_admitted_into_one_epoch_through_its_relay(sim: Simulation) -> None:
    ms = sim.coord.membership
    assert len(sim.relays) == 2 and all(len(r.members) == 100 for r in sim.relays)
    assert sorted(ms.epoch_members) == sorted(n.member_id for n in sim.nodes)
    assert _newest_everywhere(sim) == {ms.epoch}


def test_a_crash_is_seen_through_the_relay_and_the_next_epoch_reaches_every_live_node(sim: Simulation) -> None:
    before = sim.coord.membership.epoch
    victims = sim.kill(3)
    sim.clock.run_until(sim.clock.now + 0.5)  # half a lease: no lease lapsed, the sessions' ends told
    ms = sim.coord.membership
    assert ms.epoch > before
    assert not {v.member_id for v in victims} & set(ms.epoch_members)
    assert len(ms.epoch_members) == 197
    assert _newest_everywhere(sim) == {ms.epoch}, "every live node heard of the epoch without the dead"
    dropped = [
        e for e in sim.coord.events.last(20) if e.kind is Kind.FAILURE and "control connection dropped" in e.reason
    ]
    assert len(dropped) == 3, [e.reason for e in sim.coord.events.last(20)]


def test_a_frozen_node_is_expelled_by_its_lease_and_no_other_is(sim: Simulation) -> None:
    frozen = sim.freeze(2, seconds=3 * LEASE_S)
    ids = {n.member_id for n in frozen}
    sim.clock.run_until(sim.clock.now + 2 * LEASE_S)
    ms = sim.coord.membership
    assert not ids & set(ms.epoch_members), "a frozen node is out within its lease and a little"
    assert _newest_everywhere(sim) == {ms.epoch}
    sim.clock.run_until(sim.clock.now + 3 * LEASE_S)  # they thaw, hear their expulsion and rejoin
    assert all(n.expulsions and n.expulsions[-1][1] for n in frozen)
    assert not any(n.expulsions for n in sim.nodes if n not in frozen), "a node that kept talking was expelled"
    assert all(n.member_id in ms.epoch_members for n in frozen), "they are back as new members"


def test_storms_report_their_epoch_changes_traffic_and_cpu(sim: Simulation) -> None:
    r = storms(sim, events=3, every_s=3.0, storm=3)
    assert r.missed == 0 and r.false_expulsions == 0 and r.frozen_expulsions == 3
    kinds = dict(r.changes)
    # Modelled: 50 ms round trip to the coordinator. A crash is told by the session's end, far
    # sooner than a lease; a freeze is found by its lease, which runs from when the frozen
    # node was last heard (up to a heartbeat, a fifth of a lease, before it froze).
    assert kinds["crash"] is not None and kinds["crash"] < LEASE_S / 2
    assert kinds["join"] is not None and kinds["join"] < LEASE_S
    assert kinds["freeze"] is not None and 0.75 * LEASE_S < kinds["freeze"] < 3 * LEASE_S
    assert r.events == 3 and r.nodes_hit == 9 and r.live == len(sim.live())
    assert r.messages["node_to_relay"] >= r.node_messages > 200 * 9 * 2  # two a second at least, each node
    assert all(r.bytes[k] > r.messages[k] for k in r.messages)
    assert r.cpu_per_event_us["relay"] > 0 and r.cpu_per_event_us["coordinator"] > 0
    assert 0 < r.coordinator_core_share < 1
    d = r.as_dict()
    assert {"nodes", "zones", "relays", "events", "cpu_per_event_us", "messages", "bytes", "epoch_change_s",
            "false_expulsions", "coordinator_core_share"} <= d.keys()  # fmt: skip


def test_a_member_its_relay_stops_vouching_for_lapses_a_lease_after_it_was_last_heard(sim: Simulation) -> None:
    """Its relay's summaries renew its lease; once they name it unheard, nothing does, and it
    lapses no earlier than a directly connected member would: a lease after its relay last
    heard it. Another relay naming it with a step renews nothing: a relay speaks only for
    sessions it holds."""
    ms = sim.coord.membership
    relays = sim.coord.relays
    sim.clock.run_until(sim.clock.now + 2 * LEASE_S)  # every node back in the epoch after the storms
    (x,) = sim.freeze(1, seconds=3 * LEASE_S)
    t0 = sim.clock.now
    other = next(link for link in relays.links.values() if link.relay_id != x.relay.relay_id)
    own = relays.links[x.relay.relay_id]
    assert relays.vouched(x.member_id) == own.vouched_at > t0 - LEASE_S
    seq = 10**6
    while x.member_id in ms.members and sim.clock.now < t0 + 3 * LEASE_S:
        seq += 1
        step = ms.members[x.member_id].step
        other.heard_at = sim.clock.now
        relays.up(other, m.Up(seq=seq, alive=[x.member_id], steps=[step], heard_within=0.0))
        sim.clock.run_until(sim.clock.now + LEASE_S / 50)
    assert x.member_id not in ms.members or x.member_id not in ms.epoch_members
    last_heard = x.relay.batches.last_heard(x.member_id)
    assert last_heard is not None and last_heard <= t0
    lapsed_after = sim.clock.now - last_heard
    # Not before a lease; the lag of a late tick (the coordinator's CPU, measured) is forgiven.
    assert LEASE_S <= lapsed_after < 1.6 * LEASE_S, f"expelled {lapsed_after:.2f} s after its relay last heard it"
    assert relays.vouched(x.member_id) == -math.inf
    assert not any(n.expulsions for n in sim.nodes if n is not x and not n.freezes), "the others vouched for"


def test_the_dashboard_shows_when_a_relayed_member_was_heard_not_when_its_lease_was_last_read(sim: Simulation) -> None:
    sim.clock.run_until(sim.clock.now + 4 * LEASE_S)  # the frozen one back, its relay vouching again
    rows = members_json(sim.coord.membership, sim.clock.now)
    ages = [row["last_seen_s"] for row in rows]
    assert ages and max(ages) <= HEARD_WITHIN * LEASE_S + 0.1 * LEASE_S, sorted(ages)[-5:]
