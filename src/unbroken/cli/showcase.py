"""``unbroken demo`` and ``unbroken chaos``: the library shown at work on this machine, the
second while faults are injected at random, each promise checked at the end."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from unbroken.demo.driver import run_demo

    return run_demo(steps=args.steps, nodes=args.nodes, out_dir=Path(args.out) if args.out else None, ha=args.ha)


def _chaos(args: argparse.Namespace) -> int:
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from unbroken.testing.chaos import Chaos, write_report

    # SIGTERM unwinds like Ctrl-C: the nodes are reaped and the network namespaces deleted.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    console = Console(stderr=True)
    workdir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="unbroken-chaos-"))
    chaos = Chaos(
        workdir,
        duration_s=args.duration,
        rate=args.rate,
        nodes=args.nodes,
        seed=args.seed,
        links=args.links,
        ha=args.ha,
    )
    ha = " with etcd (3 members) and 2 coordinators" if args.ha else ""
    console.print(
        f"[bold]unbroken chaos[/]: {args.nodes} nodes{ha}, faults at {args.rate}/s for {args.duration:g} s "
        f"(seed {args.seed}); logs in {workdir}\nlink faults {chaos.links_note}"
    )
    with console.status("starting") as status:
        chaos.on_progress = status.update
        report = chaos.run()
    summary = report.summary()
    write_report(report, workdir / "chaos-report.json")
    table = Table(title="chaos report", show_header=False)
    table.add_row("faults injected", f"{summary['faults_total']}: {summary['faults']}")
    table.add_row("link faults", summary["link_faults"])
    rows = [(f"recovery: {kind}", st) for kind, st in summary["recovery_s"].items()]
    rows.append(("recovery beyond coordinator downtime", summary["recovery_beyond_coordinator_down_s"]))
    rows += [(f"next commit: {kind}", st) for kind, st in summary["next_commit_s"].items()]
    for label, st in rows:
        if st:
            table.add_row(
                label, f"median {st['median']:.2f} s, p95 {st['p95']:.2f} s, max {st['max']:.2f} s ({st['count']})"
            )
    table.add_row("steps committed", str(report.steps))
    table.add_row("committed steps lost", str(summary["steps_lost"]))
    table.add_row("replicas equal, samples exactly once", "yes" if report.promises.ok else "NO")
    diff = summary["final_vs_reference_max_abs_diff"]
    table.add_row("final model vs single-process", "-" if diff is None else f"max |diff| {diff:.1e}")
    table.add_row("verdict", "[green]every promise kept[/]" if report.ok else "[red]BROKEN[/]")
    console.print(table)
    for problem in report.problems[:20]:
        console.print(f"[red]broken:[/] {problem}")
    print(json.dumps(summary))
    return 0 if report.ok else 1


def add_parsers(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    d = sub.add_parser(
        "demo", help="local coordinator + nodes with a kill and a join, live progress", formatter_class=fmt
    )
    d.add_argument("--steps", type=int, default=0, help="training steps (default: the demo job's)")
    d.add_argument("--nodes", type=int, default=3, help="nodes to start with")
    d.add_argument("--out", help="directory for logs and checkpoints (default: a temporary one)")
    d.add_argument(
        "--ha", action="store_true", help="3 etcd members and 2 coordinators; the leader is killed, then a node"
    )
    d.set_defaults(func=_demo)

    h = sub.add_parser(
        "chaos", help="train while injecting random faults, then check every promise", formatter_class=fmt
    )
    h.add_argument("--duration", type=float, default=60.0, help="seconds of fault injection")
    h.add_argument("--rate", type=float, default=0.25, help="faults per second (random gaps)")
    h.add_argument("--nodes", type=int, default=3, help="nodes to start with")
    h.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    h.add_argument(
        "--links",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also cut and slow nodes' links for real, in network namespaces (root; None: where available)",
    )
    h.add_argument("--out", help="directory for logs and the JSON report (default: a temporary one)")
    h.add_argument(
        "--ha",
        action="store_true",
        help="a real etcd cluster and 2 coordinators: leader-kill, leader-stop and etcd-kill faults",
    )
    h.set_defaults(func=_chaos)
