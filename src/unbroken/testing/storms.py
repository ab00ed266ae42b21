"""Storms of failures and joins on a simulated control plane, and what they cost.

::

    sim = Simulation(SimConfig(nodes=10_000))
    admitted_s = admit(sim)
    report = storms(sim, events=12, every_s=3.0, storm=10)
    print(report.as_dict())

An event hits ``storm`` nodes at once: a crash, a join or a freeze (longer than a lease),
in turn. Its epoch change is the time from the event until every node it concerns heard
of a newer epoch than the one in force: every node live through it, and the joiners. The
CPU figures are the real code's on this machine (`unbroken.testing.virtual.Process`),
in the window of the storms alone (admission is reported apart).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from unbroken.testing.simulate import SimNode, Simulation

KINDS = ("crash", "join", "freeze")
FREEZE_LEASES = 3.0
"""A frozen node stays frozen this many leases (it is expelled, then rejoins)."""
RECENT_LEASES = 3.0
"""A node down this many leases before an event is not among the nodes it concerns."""


@dataclass
class Event:
    at: float
    kind: str
    nodes: list[SimNode]
    epoch: int
    """The newest epoch the coordinator had formed when it happened."""


@dataclass
class Report:
    """What a run of storms cost (module docstring)."""

    nodes: int
    """Nodes at the start."""
    live: int
    """Nodes live at the end."""
    zones: int
    relays: int
    admit_s: float | None
    """From the first hello to the first epoch at every node (virtual seconds)."""
    duration_s: float
    """The storms' window, virtual seconds."""
    events: int
    nodes_hit: int
    node_messages: int
    """Heartbeats, reports and hellos the relays heard in the window."""
    cpu_s: dict[str, float]
    """CPU of the coordinator, the relays (summed, the busiest), and the garbage collections
    inside the coordinator's handlers, left out of its figure (`unbroken.testing.virtual`)."""
    cpu_per_event_us: dict[str, float]
    """CPU per node message (``relay``, ``coordinator``) and per epoch change (``epoch``: the
    coordinator's handler that formed it)."""
    coordinator_core_share: float
    """The coordinator's CPU over the window's virtual time (1.0: one core, saturated)."""
    relay_core_share_max: float
    messages: dict[str, int]
    bytes: dict[str, int]
    epoch_change_s: dict[str, float | None]
    missed: int
    """Events whose epoch change never reached every node it concerns."""
    false_expulsions: int
    """Expulsions of nodes that were neither killed nor frozen."""
    frozen_expulsions: int
    refusals: int
    coordinator_longest_wait_s: float
    """The longest a message waited in the coordinator's queue (it was busy)."""
    relay_longest_unacked_s: float
    """The longest a relay went without an acknowledged batch (it leaves its leader after two
    leases)."""
    relay_links_lost: dict[str, int]
    """Relays' links to the leader that ended, by why (``dropped``: the leader heard nothing
    for half a lease; ``unacknowledged``: the relay heard no acknowledgement for two)."""
    wall_s: float
    """Real seconds the simulation of the window took."""
    changes: list[tuple[str, float | None]] = field(default_factory=list)
    """Each event's kind and epoch change (None: missed)."""
    by_kind: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Epoch changes per kind of event: p50 and max."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["changes"]
        return out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]


def admit(
    sim: Simulation, timeout_s: float = 300.0, settle_s: float = 2.0, progress: Callable[[str], None] | None = None
) -> float | None:
    """Run until every node was welcomed and heard of an epoch (then ``settle_s`` more);
    how long that took (virtual seconds), or None if not within ``timeout_s``. ``progress``
    is told how far it is, every virtual second."""
    start, wall0 = sim.clock.now, time.perf_counter()
    admitted = None
    while sim.clock.now - start < timeout_s:
        sim.clock.run_until(sim.clock.now + 0.1)
        if progress is not None and round((sim.clock.now - start) * 10) % 10 == 0:
            welcomed = sum(n.welcomed_at is not None for n in sim.nodes)
            progress(
                f"{welcomed:,}/{len(sim.nodes):,} welcomed, epoch {sim.coord.membership.epoch}, "
                f"{sim.clock.now - start:.0f} s virtual, {time.perf_counter() - wall0:.0f} s real"
            )
        if all(n.welcomed_at is not None and n.epochs for n in sim.nodes):
            admitted = max(min(n.epochs.values()) for n in sim.nodes) - start
            break
    sim.clock.run_until(sim.clock.now + settle_s)
    return admitted


def _traffic(sim: Simulation) -> tuple[dict[str, int], dict[str, int]]:
    links = {
        "node_to_relay": [n.up for n in sim.nodes],
        "relay_to_node": [n.down for n in sim.nodes],
        "relay_to_coordinator": [r.to_leader for r in sim.relays],
        "coordinator_to_relay": [r.from_leader for r in sim.relays],
    }
    return (
        {k: sum(x.messages for x in v) for k, v in links.items()},
        {k: sum(x.bytes for x in v) for k, v in links.items()},
    )


def _change(sim: Simulation, ev: Event, until: float) -> float | None:
    """When every node the event concerns heard of an epoch after ``ev.epoch`` (None: not all
    did by ``until``). A node concerns it if it was live through it, and not down in the
    leases before it either (one thawing then is expelled and rejoins: its own event)."""
    target = ev.epoch + 1
    since = ev.at - RECENT_LEASES * sim.config.lease_s
    joiners = {id(n) for n in ev.nodes} if ev.kind == "join" else set()
    last = ev.at
    for n in sim.nodes:
        joined = id(n) in joiners
        if not joined and (n.epochs == {} or min(n.epochs.values()) > ev.at):
            continue  # not in the job when it happened
        reached = min((t for e, t in n.epochs.items() if e >= target), default=None)
        end = reached if reached is not None else until
        if n.down_between(since, end):
            continue  # not live through it
        if reached is None:
            return None
        last = max(last, reached)
    return last - ev.at


def storms(
    sim: Simulation,
    events: int,
    every_s: float,
    storm: int,
    kinds: tuple[str, ...] = KINDS,
    admit_s: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """``events`` events of ``storm`` nodes each, ``every_s`` apart (module docstring);
    ``progress`` is told of each."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown event kinds {sorted(unknown)}: use {', '.join(KINDS)}")
    lease = sim.config.lease_s
    relays0 = [r.process.cpu_s for r in sim.relays]
    coord0, gc0 = sim.coordinator.cpu_s, sim.coordinator.gc_s
    msgs0, bytes0 = _traffic(sim)
    texts0 = sim.relay_texts
    formed0 = set(sim.epochs_formed)
    lost0 = [len(r.links_lost) for r in sim.relays]
    for n in sim.nodes:
        n.expulsions.clear()
        n.refusals = 0
    sim.coordinator.longest_wait_s = 0.0
    for r in sim.relays:
        r.longest_unacked_s = 0.0
    t0, wall0 = sim.clock.now, time.perf_counter()
    happened: list[Event] = []
    for i in range(events):
        kind = kinds[i % len(kinds)]
        epoch = sim.coord.membership.epoch
        if kind == "crash":
            hit = sim.kill(storm)
        elif kind == "freeze":
            hit = sim.freeze(storm, FREEZE_LEASES * lease)
        else:
            hit = sim.add(storm)
        happened.append(Event(sim.clock.now, kind, hit, epoch))
        sim.clock.run_until(sim.clock.now + every_s)
        if progress is not None:
            progress(
                f"storm {i + 1}/{events} ({kind}), epoch {sim.coord.membership.epoch}, "
                f"{time.perf_counter() - wall0:.0f} s real"
            )
    wall = time.perf_counter() - wall0
    duration = sim.clock.now - t0
    each = [(ev.kind, _change(sim, ev, sim.clock.now)) for ev in happened]
    changes = [c for _, c in each if c is not None]
    missed = sum(c is None for _, c in each)
    by_kind = {}
    for kind in dict.fromkeys(k for k, _ in each):
        mine = [c for k, c in each if k == kind and c is not None]
        by_kind[kind] = {"p50": pct(mine, 0.5), "max": max(mine, default=None)}
    relay_cpu = [r.process.cpu_s - c for r, c in zip(sim.relays, relays0, strict=True)]
    coord_cpu = sim.coordinator.cpu_s - coord0
    msgs1, bytes1 = _traffic(sim)
    texts = sim.relay_texts - texts0
    formed = [e for e in sim.epochs_formed if e not in formed0]
    epoch_cpu = [sim.epoch_cpu_s[e] for e in formed if e in sim.epoch_cpu_s]
    expulsions = [x for n in sim.nodes for x in n.expulsions]
    return Report(
        nodes=sim.config.nodes,
        live=len(sim.live()),
        zones=len({r.zone for r in sim.relays}),
        relays=len(sim.relays),
        admit_s=admit_s,
        duration_s=duration,
        events=len(happened),
        nodes_hit=sum(len(e.nodes) for e in happened),
        node_messages=texts,
        cpu_s={
            "coordinator": coord_cpu,
            "relays": sum(relay_cpu),
            "relay_max": max(relay_cpu, default=0.0),
            "coordinator_gc_left_out": sim.coordinator.gc_s - gc0,
        },
        cpu_per_event_us={
            "relay": 1e6 * sum(relay_cpu) / max(texts, 1),
            "coordinator": 1e6 * coord_cpu / max(texts, 1),
            "epoch": 1e6 * sum(epoch_cpu) / len(epoch_cpu) if epoch_cpu else 0.0,
        },
        coordinator_core_share=coord_cpu / duration if duration else 0.0,
        relay_core_share_max=max(relay_cpu, default=0.0) / duration if duration else 0.0,
        messages={k: msgs1[k] - msgs0[k] for k in msgs1},
        bytes={k: bytes1[k] - bytes0[k] for k in bytes1},
        epoch_change_s={"p50": pct(changes, 0.5), "p95": pct(changes, 0.95), "max": max(changes, default=None)},
        missed=missed,
        false_expulsions=sum(not frozen for _, frozen in expulsions),
        frozen_expulsions=sum(frozen for _, frozen in expulsions),
        refusals=sum(n.refusals for n in sim.nodes),
        coordinator_longest_wait_s=sim.coordinator.longest_wait_s,
        relay_longest_unacked_s=max(r.longest_unacked_s for r in sim.relays),
        relay_links_lost=dict(Counter(why for r, n in zip(sim.relays, lost0, strict=True) for why in r.links_lost[n:])),
        wall_s=wall,
        changes=each,
        by_kind=by_kind,
    )
