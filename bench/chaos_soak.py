"""A long chaos soak: 10 minutes of random faults (100+), then every promise checked.

    python bench/chaos_soak.py                     # 600 s at 0.25 faults/s, seed 7
    python bench/chaos_soak.py --duration 120      # shorter
    sudo python bench/chaos_soak.py                # with real link faults (cut, slow)
    python bench/chaos_soak.py --ha --rate 0.3     # etcd + 2 coordinators: leader and etcd faults too

A thin wrapper over ``unbroken chaos`` (see `unbroken.testing.chaos`) that prints the
command, the report table and the JSON summary, and keeps the logs under --out. Link
faults (a node's link cut, or capped by ``tc tbf``: no ``tc netem`` here, so no added
delay beyond tbf's queueing) are included whenever network namespaces work, i.e. as root;
the report says when and why they were skipped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import print_command, write_results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--rate", type=float, default=0.25)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="/tmp/unbroken-chaos-soak")
    p.add_argument(
        "--links",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="real link faults in network namespaces (default: where available, i.e. as root)",
    )
    p.add_argument("--ha", action="store_true", help="a real etcd cluster and 2 coordinators (leader/etcd faults)")
    args = p.parse_args()
    print_command()
    cmd = [sys.executable, "-m", "unbroken", "chaos", "--duration", str(args.duration), "--rate", str(args.rate)]
    cmd += ["--nodes", str(args.nodes), "--seed", str(args.seed), "--out", args.out]
    if args.links is not None:
        cmd.append("--links" if args.links else "--no-links")
    if args.ha:
        cmd.append("--ha")
    started = time.time()
    code = subprocess.run(cmd, check=False).returncode
    report = Path(args.out) / "chaos-report.json"
    # the summary `unbroken chaos` printed, as it wrote it (not one a run before left in --out)
    if report.exists() and report.stat().st_mtime >= started:
        write_results({"exit_code": code, "summary": json.loads(report.read_text())})
    return code


if __name__ == "__main__":
    sys.exit(main())
