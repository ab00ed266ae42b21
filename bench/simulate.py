"""The control plane simulated: 10,000 and 100,000 nodes behind relays, on a virtual clock.

    python bench/simulate.py --short                 # 10,000 nodes (see "Its own cost" below)
    python bench/simulate.py                         # 10,000 and 100,000
    python bench/simulate.py --sizes 3000 --cross-check scale-3000.json
                                                     # beside `bench/scale.py --json` at that size

The real coordinator (`unbroken.control.coordinator.Coordinator`, not served) and the real
relay batching (`unbroken.control.batches`), driven in one process with no sockets by a
virtual clock and a modelled network (`unbroken.testing.simulate`): 50 ms round trip
between a zone's relay and the coordinator, 1 ms inside a zone, and loss with TCP-like
retransmission if asked. Messages are encoded and parsed by the real code, so their sizes
are real; each control process is a single-threaded server charged the CPU its handlers
really took here, so a coordinator that cannot keep up queues in virtual time.

After every node was admitted, storms hit ``--storm`` nodes at once (default: 1 % of
them), in turn a crash, a join and a freeze of three leases, ``--every`` seconds apart.
Per size it prints: the CPU per node message of the relays and of the coordinator, per
epoch change of the coordinator; the coordinator's share of one core; messages and bytes
on each kind of link; the epoch changes (event → every node concerned heard of a newer
epoch; per kind of event); false expulsions (of nodes neither killed nor frozen).

What the figures leave out: aiohttp (websocket framing, the event loop) in the relays and
the coordinator, the nodes' own CPU, and garbage collections: in one process a collection
walks every simulated node's objects, so one that ran inside a handler is not charged to it
(`unbroken.testing.virtual`); what was left out of the coordinator's figure is in the JSON
(``cpu_s.coordinator_gc_left_out``). ``--cross-check FILE`` (what ``bench/scale.py
--layouts relay --json FILE`` wrote for one size) runs the simulation with that run's
settings (its events: one crash or one join at a time, its fake nodes naming no zone) and
prints the real and simulated CPU per node-second and per node message side by side, with
their ratio, and again with what the real processes pay around the simulated code added:
aiohttp's frames, the loop's wake-ups and the parsing thread's hop, measured here at the
run's mean message sizes (`bench/wirecost.py`). No session is sealed on either side
(``bench/scale.py`` runs without a token).

The last line is one JSON object: the largest run's figures, with every run's under ``runs``.

Its own cost: the simulated nodes' 50,000 messages a second at 10,000 nodes are parsed by
the real code. On 2 cores shared with other work ``--sizes 10000 --events 3 --every 3``
takes 2-4 minutes (2026-12-08, load 8-10).

At 100,000 nodes (tried 2026-12-08, load 8-12, not completed): the simulated nodes cost
this process 30-70 s a simulated second once 15,000-20,000 talked, and with the default 2 s
ramp the leader could not keep up with 100,000 hellos (each a signature to verify) while it
formed an epoch every 0.25 s of joins: 22,000 were welcomed in 12 simulated seconds (9
minutes here), then the leader's queue held its acknowledgements for two leases and every
relay left it (0 welcomed at 15 s, 19 minutes here). Since then joins past 5,000 members
wait longer for each other (`Roster.join_settle_s`); a fleet of 100,000 must also arrive
over a minute or more (``--ramp``), and the run needs hours of this machine.

``--profile FILE`` runs the coordinator's handlers under cProfile (CPU time) and prints
where its time went; it slows them, so its run's timings mean nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ProgressLine, fmt, print_command, print_table, ratio, write_results
from unbroken.testing.simulate import SimConfig, Simulation
from unbroken.testing.storms import KINDS, Report, admit, storms
from unbroken.testing.virtual import LinkSpec
from wirecost import wire_costs

STARVED = 0.8
"""A real run's nodes sent fewer than this share of the simulated nodes' messages: its fake
side fell behind, and its CPU per message is not compared."""


def simulate(
    n: int, args: argparse.Namespace, progress: ProgressLine, kinds: tuple[str, ...], like_fakes: bool
) -> Report:
    config = SimConfig(
        nodes=n,
        zone_size=args.zone_size,
        zoned=not like_fakes,
        reports_epoch=not like_fakes,
        lease_s=args.lease,
        step_s=args.step,
        between_zones=LinkSpec(latency_s=args.rtt_ms / 2e3, bandwidth_Bps=args.bandwidth * 1e6 / 8, loss=args.loss),
        in_zone=LinkSpec(latency_s=args.zone_rtt_ms / 2e3, bandwidth_Bps=10e9 / 8, loss=args.loss),
        ramp_s=args.ramp,
        seed=args.seed,
    )
    progress.update(f"{n}: {n:,} nodes joining")
    wall = time.perf_counter()
    sim = Simulation(config)
    if args.profile:
        sim.coordinator.profile = cProfile.Profile(time.thread_time)  # CPU: the machine may be busy

    def told(what: str) -> None:
        progress.update(f"{n}: {what}")

    admitted = admit(sim, timeout_s=args.admit_timeout, progress=told)
    if admitted is None:
        profiled(sim, n, args.profile, progress)
        welcomed = sum(x.welcomed_at is not None for x in sim.nodes)
        raise SystemExit(
            f"{n} nodes: {welcomed} welcomed, not all in an epoch within {args.admit_timeout:g} s (virtual)"
        )
    gc.collect()
    # The simulated nodes' objects are no control process's: a collection walking them would
    # be charged to whichever handler it interrupted.
    gc.freeze()
    progress.update(f"{n}: admitted in {admitted:.2f} s (virtual, {time.perf_counter() - wall:.0f} s real); storms")
    storm = args.storm or max(1, n // 100)
    report = storms(sim, args.events, args.every, storm, kinds=kinds, admit_s=admitted, progress=told)
    gc.unfreeze()
    profiled(sim, n, args.profile, progress)
    return report


def profiled(sim: Simulation, n: int, where: str | None, progress: ProgressLine) -> None:
    """Print where the coordinator's CPU went (``--profile``), and keep all of it in a file."""
    if sim.coordinator.profile is None or where is None:
        return
    path = Path(f"{where}-{n}")
    sim.coordinator.profile.dump_stats(path)
    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(25)
    progress.close()
    print(f"the coordinator's handlers at {n:,} nodes, by own time (all of it in {path}):", out.getvalue())


def summary(r: Report, storm: int) -> dict[str, Any]:
    out = r.as_dict()
    out["storm"] = storm
    return out


def wire_seconds(r: Report) -> dict[str, float]:
    """CPU seconds the simulated run's messages would have cost the real coordinator and
    relays in aiohttp and their event loops (`bench/wirecost.py`, at the run's mean sizes)."""
    msgs, size = r.messages, {k: r.bytes[k] // max(1, v) for k, v in r.messages.items()}
    up_in, down_out = wire_costs(size["relay_to_coordinator"], size["coordinator_to_relay"])
    node_in, node_out = wire_costs(size["node_to_relay"], size["relay_to_node"])
    down_in, up_out = wire_costs(size["coordinator_to_relay"], size["relay_to_coordinator"])
    return {
        "coordinator": msgs["relay_to_coordinator"] * up_in + msgs["coordinator_to_relay"] * down_out,
        "relays": msgs["node_to_relay"] * node_in
        + msgs["relay_to_node"] * node_out
        + msgs["coordinator_to_relay"] * down_in
        + msgs["relay_to_coordinator"] * up_out,
    }


def cross_check(args: argparse.Namespace, progress: ProgressLine) -> None:
    real = json.loads(Path(args.cross_check).read_text())
    real = [x for x in real if x.get("layout") == "relay" and "error" not in x]
    if not real:
        raise SystemExit(f"{args.cross_check}: no relayed run in it (run bench/scale.py --layouts relay --json FILE)")
    rows, out = [], []
    for x in real:
        n = int(x["n"])
        # bench/scale.py's run: one event at a time, a crash or a join, evenly over its duration.
        args.storm, args.events, args.every = 1, args.scale_events, args.scale_duration / args.scale_events
        r = simulate(n, args, progress, kinds=("crash", "join"), like_fakes=True)
        live = max(r.live, 1)
        both_ways = r.messages["node_to_relay"] + r.messages["relay_to_node"]
        sim_rate = both_ways / r.duration_s / live  # as bench/scale.py counts: at the nodes, both ways
        per_msg = {
            "real": x["coord_cpu"] / (x["msgs_per_node_s"] * n) * 1e6,
            "sim": r.coordinator_core_share / (sim_rate * live) * 1e6,
        }
        # A real fake side that falls behind (it shares the machine with the coordinator and
        # relays it measures) sends fewer messages than its nodes would: per message, the
        # real coordinator's CPU is then divided by too few (0.16x at 1,000 on 2 busy cores).
        starved = x["msgs_per_node_s"] < STARVED * sim_rate
        relays = {
            "real": x["relay_cpu_sum"] / (x["msgs_per_node_s"] * n) * 1e6,
            "sim": r.cpu_s["relays"] / r.duration_s / (sim_rate * live) * 1e6,
        }
        share = {"real": x["coord_cpu"], "sim": r.coordinator_core_share}
        # Like for like: what the real processes pay around the simulated code (aiohttp's
        # frames, the loop's wake-ups, the parsing thread's hop), measured here at this run's
        # mean sizes (`bench/wirecost.py`); sealing costs neither side (bench/scale.py runs
        # without a token, so no message is sealed).
        progress.update(f"{n}: websocket costs at this run's sizes")
        wire = wire_seconds(r)
        share["sim+wire"] = share["sim"] + wire["coordinator"] / r.duration_s
        per_msg["sim+wire"] = share["sim+wire"] / (sim_rate * live) * 1e6
        relays["sim+wire"] = (r.cpu_s["relays"] + wire["relays"]) / r.duration_s / (sim_rate * live) * 1e6
        rows.append(
            [
                n,
                f"{x['coord_cpu'] * 100:.1f} % / {r.coordinator_core_share * 100:.1f} % / "
                f"{share['sim+wire'] * 100:.1f} %",
                f"{ratio(share['sim'], share['real'])} / {ratio(share['sim+wire'], share['real'])}",
                f"{x['msgs_per_node_s']:.2f} / {sim_rate:.2f}",
                f"{per_msg['real']:.2f} / {per_msg['sim']:.2f} / {per_msg['sim+wire']:.2f} µs",
                "- (real fake side starved)"
                if starved
                else f"{ratio(per_msg['sim'], per_msg['real'])} / {ratio(per_msg['sim+wire'], per_msg['real'])}",
                f"{relays['real']:.2f} / {relays['sim']:.2f} / {relays['sim+wire']:.2f} µs",
                f"{ratio(relays['sim'], relays['real'])} / {ratio(relays['sim+wire'], relays['real'])}",
                f"{fmt(x['change_median'], ' s', 2)} / {fmt(r.epoch_change_s['p50'], ' s', 2)}",
            ]
        )
        out.append({"nodes": n, "coordinator_core_share": share, "ratio_per_node_s": share["sim"] / share["real"],
                    "ratio_per_node_s_with_wire": share["sim+wire"] / share["real"], "wire_cpu_s": wire,
                    "coordinator_us_per_msg": per_msg, "ratio_per_msg": per_msg["sim"] / per_msg["real"],
                    "real_fake_side_starved": starved,
                    "relays_us_per_msg": relays, "real_fake_side_stall_s": x["fake_stall"],
                    "real_false_expulsions": x["expelled"]})  # fmt: skip
    progress.close()
    print_table(
        "cross-check: bench/scale.py (real processes) / simulator, same sizes and events",
        [
            "nodes",
            "coordinator CPU (per node-second)",
            "sim/real",
            "msgs/node/s",
            "coord CPU per msg",
            "sim/real",
            "relays CPU per msg",
            "sim/real",
            "epoch change p50",
        ],
        rows,
        caption="real / simulated / simulated with what the real processes pay around that code (aiohttp's frames, "
        "the event loop's wake-ups, the hop to a parsing thread: bench/wirecost.py, measured here at the run's mean "
        "message sizes; no sealing on either side: bench/scale.py runs without a token). Real: the coordinator "
        "process's CPU (garbage collections included); simulated: the same code's decisions, parsing and encoding, "
        "collections left out. Per node-second: the share of a core at the "
        "same nodes; per message: CPU / (messages at the nodes, both ways). The fake side of a real run that falls "
        "behind sends fewer messages than its nodes would: then only the per node-second figure compares",
    )
    write_results({"cross_check": out})
    print(json.dumps({"cross_check": out}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10000,100000", help="nodes per run, comma-separated")
    p.add_argument("--short", action="store_true", help="10,000 nodes only")
    p.add_argument("--zone-size", type=int, default=100, help="nodes per relay (and zone)")
    p.add_argument("--events", type=int, default=9, help="storms per run (a crash, a join, a freeze, in turn)")
    p.add_argument("--every", type=float, default=4.0, help="seconds between storms (virtual)")
    p.add_argument("--storm", type=int, default=0, help="nodes per storm (default: 1 %% of them)")
    p.add_argument("--kinds", default=",".join(KINDS), help="kinds of events, in turn")
    p.add_argument("--lease", type=float, default=1.0)
    p.add_argument("--step", type=float, default=0.5, help="the nodes' step time (a report each)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round trip between a relay and the coordinator")
    p.add_argument("--zone-rtt-ms", type=float, default=1.0, help="round trip between a node and its relay")
    p.add_argument("--bandwidth", type=float, default=1000.0, help="Mbit/s between zones")
    p.add_argument("--loss", type=float, default=0.0, help="chance a message is lost (retransmitted, TCP-like)")
    p.add_argument("--ramp", type=float, default=2.0, help="the first hellos spread over this long")
    p.add_argument("--admit-timeout", type=float, default=600.0, help="virtual seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", help="profile the coordinator's handlers into FILE-<nodes> (slows it: no timings)")
    p.add_argument("--cross-check", help="bench/scale.py --json output: simulate its sizes and settings beside it")
    p.add_argument("--scale-events", type=int, default=10, help="with --cross-check: its --events")
    p.add_argument("--scale-duration", type=float, default=60.0, help="with --cross-check: its --duration")
    args = p.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if args.short:
        args.sizes = "10000"
    print_command()
    if args.cross_check:
        cross_check(args, ProgressLine(1))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    progress = ProgressLine(len(sizes))
    reports = []
    for n in sizes:
        reports.append(simulate(n, args, progress, kinds, like_fakes=False))
        progress.update(f"{n} done", advance=1)
    progress.close()
    rows = []
    for r in reports:
        per = r.cpu_per_event_us
        kinds_s = ", ".join(f"{k} {fmt(v['p50'], ' s', 2)}/{fmt(v['max'], ' s', 2)}" for k, v in r.by_kind.items())
        ch = r.epoch_change_s
        rows.append(
            [
                f"{r.nodes:,} ({r.relays} relays)",
                fmt(r.admit_s, " s", 1),
                f"{per['relay']:.1f} / {per['coordinator']:.1f} µs",
                f"{per['epoch'] / 1e3:.0f} ms",
                f"{r.coordinator_core_share * 100:.0f} %",
                f"{r.relay_core_share_max * 100:.1f} %",
                f"{sum(r.messages.values()) / r.duration_s / 1e3:.0f} k/s, "
                f"{sum(r.bytes.values()) / r.duration_s / 1e6:.1f} MB/s",
                f"{fmt(ch['p50'], ' s', 2)} / {fmt(ch['p95'], ' s', 2)} / {fmt(ch['max'], ' s', 2)}"
                + (f" ({r.missed} never)" if r.missed else ""),
                kinds_s,
                r.false_expulsions,
                f"{r.wall_s:.0f} s",
            ]
        )
    print_table(
        "control plane simulated (real coordinator and relay batching, virtual clock, modelled network)",
        [
            "nodes",
            "admit",
            "CPU per node msg relay/coord",
            "CPU per epoch",
            "coordinator core",
            "busiest relay",
            "traffic",
            "epoch change p50/p95/max",
            "by kind p50/max",
            "false expulsions",
            "real time",
        ],
        rows,
        caption=f"{args.events} storms of {args.storm or '1 % of the'} nodes, {args.every:g} s apart; lease "
        f"{args.lease:g} s; step {args.step:g} s; {args.rtt_ms:g} ms round trip between zones, {args.zone_rtt_ms:g} "
        f"ms inside; loss {args.loss:g}; CPU is the real code's on this machine, without aiohttp",
    )
    runs = [summary(r, args.storm or max(1, r.nodes // 100)) for r in reports]
    write_results({"runs": runs})
    print(json.dumps({**runs[-1], "runs": runs}))


if __name__ == "__main__":
    main()
