"""The control plane at scale: a real coordinator (and relays) against fake nodes.

    python bench/scale.py                                  # 300, 1000, 3000 nodes; flat and relayed
    python bench/scale.py --sizes 10000 --layouts relay --duration 300 --events 50
    python bench/scale.py --short                          # the CI version (200 nodes, 8 s)

Per layout and size: a real `unbroken coordinator` process (and, relayed, one `unbroken
relay` process per ``--zone-size`` nodes) and fake nodes in this process that speak the
real protocol (`unbroken.testing.fakes`: hello, a progress report per 0.5 s step that
keeps the lease, heartbeats when idle, rejoin after expulsion, fall back to the leader
when a relay dies). After all are admitted and the first epoch reached everyone, the run
injects ``--events`` failures and joins, alternating, evenly over ``--duration`` seconds,
and prints:

* admit: first connection to the first epoch order at every node;
* CPU of each control process (the coordinator; the relays' sum and busiest), per 1,000 nodes;
* the round trip of acknowledgements (p50/p99; through a relay it includes the relay's
  batching, a tenth of a lease);
* each epoch change's time to reach every live node (median/max), and changes that never did;
* RSS of the control processes; false expulsions (of nodes nobody killed);
* control messages per node per second, both ways;
* the fake side's own CPU: at 100 % of a core it is the limit of the run, not the
  control plane, and the table says so.

The baseline is the flat layout beside the relayed one at the same size, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ProgressLine, fmt, print_command, print_table, write_results
from unbroken.testing.cluster import LocalCluster
from unbroken.testing.fakes import FakeNodes

TICKS = os.sysconf("SC_CLK_TCK")
RECOVERY_WINDOW_S = 1.0
"""The coordinator's wait for members of a previous incarnation (there are none here)."""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_one(layout: str, n: int, args: argparse.Namespace, progress: ProgressLine) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"scale-{layout}-{n}-"))
    zones = max(1, round(n / args.zone_size)) if layout == "relay" else 0
    with LocalCluster("fake-job", workdir, lease_s=args.lease, recovery_window_s=RECOVERY_WINDOW_S) as c:
        root = c.start_coordinator()
        relays = [c.start_relay(zone=f"z{i}") for i in range(zones)]
        procs = [c.coordinator] + [p for p, _ in c.relays]
        assert procs[0] is not None
        pids = [p.pid for p in procs if p is not None]
        me = os.getpid()
        time.sleep(RECOVERY_WINDOW_S + 0.2)  # past the coordinator's recovery window: admission alone is measured
        start = time.monotonic()
        # A fleet connects from many hosts: one loopback address per 12 fakes (the leader and
        # relays read unproven sessions 16 at a time per address, against floods from one).
        sources = min(250, max(1, n // 12))
        with FakeNodes(
            relays or [root], n, step_s=args.step, fallback=[root] if relays else [], ramp_s=0.0, sources=sources
        ) as fakes:
            progress.update(f"{layout} {n}: admitting")
            deadline = start + args.admit_timeout
            admitted = None
            while time.monotonic() < deadline:
                if fakes.joined() >= n and fakes.all_reached(1) is not None:
                    admitted = (fakes.all_reached(1) or 0) - start
                    break
                time.sleep(0.1)
            if admitted is None:
                return {"layout": layout, "n": n, "error": f"{fakes.joined()} of {n} joined; no epoch at all"}
            time.sleep(2.0)  # let the admission's echoes settle
            fakes.clear_rtts()
            cpu0 = {pid: cpu_s(pid) for pid in [*pids, me]}
            t0 = time.monotonic()
            sent0, recv0 = fakes.sent, fakes.received
            changes: list[float] = []
            missed = 0
            gap = args.duration / max(args.events, 1)
            for i in range(args.events):
                progress.update(f"{layout} {n}: event {i + 1}/{args.events}, expelled {fakes.expelled()}")
                epoch = fakes.newest_epoch()
                at = fakes.kill(1) if i % 2 == 0 else fakes.add(1)
                reached = None
                until = at + gap
                while time.monotonic() < until:
                    reached = fakes.all_reached(epoch + 1)
                    if reached is not None:
                        break
                    time.sleep(0.01)
                if reached is None:
                    missed += 1
                else:
                    changes.append(reached - at)
                time.sleep(max(0.0, until - time.monotonic()))
            wall = time.monotonic() - t0
            cpu = {pid: (cpu_s(pid) - cpu0[pid]) / wall for pid in cpu0}
            rtts = fakes.rtts()
            traffic = (fakes.sent - sent0 + fakes.received - recv0) / wall / max(len(fakes.live()), 1)
            rss = [rss_mb(pid) for pid in pids]
            expelled = fakes.expelled()
            # The fake side shares the machine: while its own loop stalls its nodes fall silent.
            on_fakes = fakes.expelled_while_silent()
            stall = fakes.longest_stall_s
    relay_cpu = [cpu[pid] for pid in pids[1:]]
    return {
        "layout": layout,
        "n": n,
        "zones": zones,
        "admit_s": admitted,
        "coord_cpu": cpu[pids[0]],
        "relay_cpu_sum": sum(relay_cpu),
        "relay_cpu_max": max(relay_cpu, default=0.0),
        "fake_cpu": cpu[me],
        "rtt_p50": pct(rtts, 0.5),
        "rtt_p99": pct(rtts, 0.99),
        "change_median": statistics.median(changes) if changes else None,
        "change_max": max(changes) if changes else None,
        "missed": missed,
        "coord_rss": rss[0],
        "relay_rss_max": max(rss[1:], default=0.0),
        "expelled": expelled,
        "expelled_on_fakes": on_fakes,
        "fake_stall": stall,
        "msgs_per_node_s": traffic,
    }


def ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1e3, " ms", 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="300,1000,3000", help="fake nodes per run, comma-separated")
    p.add_argument("--layouts", default="flat,relay", help="flat, relay or both")
    p.add_argument("--zone-size", type=int, default=100, help="nodes per relay")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of failures and joins per run")
    p.add_argument("--events", type=int, default=10, help="failures and joins per run, alternating")
    p.add_argument("--step", type=float, default=0.5, help="the fake nodes' step time (a report each)")
    p.add_argument("--lease", type=float, default=1.0)
    p.add_argument("--admit-timeout", type=float, default=120.0)
    p.add_argument("--short", action="store_true", help="the CI version: 200 nodes, 8 s, 4 events")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.short:
        args.sizes, args.duration, args.events, args.zone_size = "200", 8.0, 4, 50
    print_command()
    sizes = [int(s) for s in args.sizes.split(",")]
    layouts = args.layouts.split(",")
    progress = ProgressLine(len(sizes) * len(layouts))
    results = []
    for n in sizes:
        for layout in layouts:
            results.append(run_one(layout, n, args, progress))
            progress.update(f"{layout} {n} done", advance=1)
    progress.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["layout"], r["n"], r["error"]] + [""] * 10)
            continue
        per_k = 1000 / r["n"]
        rows.append(
            [
                r["layout"] + (f" ({r['zones']} relays)" if r["zones"] else ""),
                r["n"],
                fmt(r["admit_s"], " s", 2),
                f"{r['coord_cpu'] * 100:.0f} % ({r['coord_cpu'] * 100 * per_k:.0f} %/1k)",
                f"{r['relay_cpu_sum'] * 100:.0f} % (max {r['relay_cpu_max'] * 100:.0f} %)" if r["zones"] else "-",
                f"{ms(r['rtt_p50'])} / {ms(r['rtt_p99'])}",
                f"{fmt(r['change_median'], ' s', 2)} / {fmt(r['change_max'], ' s', 2)}"
                + (f" ({r['missed']} never)" if r["missed"] else ""),
                f"{r['coord_rss']:.0f} MB" + (f" / {r['relay_rss_max']:.0f} MB" if r["zones"] else ""),
                f"{r['expelled']} ({r['expelled_on_fakes']} after the fake's own silence)" if r["expelled"] else 0,
                f"{r['msgs_per_node_s']:.1f}",
                f"{r['fake_cpu'] * 100:.0f} %, stalls ≤ {r['fake_stall']:.2f} s"
                + (" (saturated: the run's limit)" if r["fake_cpu"] > 0.9 else ""),
            ]
        )
    columns = [
        "layout", "nodes", "admit", "coordinator CPU", "relays CPU", "ack RTT p50/p99",
        "epoch change to all (median/max)", "RSS coord/relay", "false expulsions", "msgs/node/s",
        "fake side CPU, loop stalls",
    ]  # fmt: skip
    print_table(
        "control plane at scale (fake nodes, real coordinator and relays)",
        columns,
        rows,
        caption=f"{args.events} failures and joins over {args.duration:g} s per run; lease {args.lease:g} s; "
        f"step {args.step:g} s; relays of {args.zone_size} nodes; a false expulsion of a fake that had itself "
        "sent nothing for 0.8 of a lease just before (the fake side's loop stalled) is counted as its own silence",
    )


if __name__ == "__main__":
    main()
    write_results()
