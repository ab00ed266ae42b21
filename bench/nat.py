"""A member behind NAT: step time and inter-node bytes through a forwarder, against every
member reachable, side by side in one invocation (root: network namespaces, nftables).

    sudo python bench/nat.py                       # 2 configurations, 1 repeat, ~4 min on 2 cores
    sudo python bench/nat.py --repeats 3 --steps 300 --model medium

Three nodes, each in its own network namespace on one bridge (`unbroken.testing.netns`),
the coordinator on the bridge's address, n1 offering forwarding (``--offer-forwarding``):

- ``reachable``: every member accepts connections (the baseline);
- ``nat``: n3's namespace drops every inbound connection (nftables), and it trains with
  ``--no-inbound --forwarder n1``: whichever peer gloo has dial it (`unbroken.comm.forward`)
  reaches it through n1, and it dials the others itself.

Per configuration, medians over ``--repeats`` (runs interleaved, the order rotating):

- step time: the median gap between consecutive commits of one epoch past ``--warmup``,
  over every node's commit log;
- bytes per step: what each node sent over its link (the host end's ``rx_bytes``: every
  frame, headers, the control session and the data plane alike) over the whole run,
  divided by the steps; the total, and n1's (the forwarder's) alone.

Ratios are ``nat`` / ``reachable``. The links are veth pairs on one machine: no bandwidth
limit and no latency, so the step time shows the forwarder's CPU cost (a Python splice on
the same 2 cores as the nodes), not a slower network; the bytes are what crosses links.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, step_times
from unbroken.testing import LocalCluster, netns

TOKEN = "bench-nat-token-0123456789abcdef"
FORWARD_PORT = 7800
NODES = ("n1", "n2", "n3")
CONFIGS = ("reachable", "nat")


def run_config(args: argparse.Namespace, workdir: Path, config: str) -> dict[str, Any]:
    env = jobs.env_for(args.steps, args.batch) | {"UNBROKEN_TOKEN": TOKEN}
    with (
        netns.Network() as net,
        LocalCluster(jobs.job_ref(args.model), workdir, env=env, min_nodes=3, network=net) as c,
    ):
        c.start_coordinator()
        c.start_node("n1", extra=["--offer-forwarding", str(FORWARD_PORT)])
        c.start_node("n2")
        nat = config == "nat"
        extra = ["--no-inbound", "--forwarder", f"{net.address('n1')}:{FORWARD_PORT}"] if nat else []
        c.start_node("n3", extra=extra, no_inbound=nat)
        codes = c.wait_exit(timeout=args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"{config}: run failed: {codes}\n{c.diagnostics()}")
        sent = {name: net.counters(name)[0] for name in NODES}
        gaps = [g for name in NODES for g in step_times(c.nodes[name].entries(), args.warmup)]
        forwarded = "n3's session ended" in c.nodes["n1"].stderr()
    if nat and not forwarded:
        raise RuntimeError("nat: n3 never opened a session at n1's forwarder")
    return {
        "step_s": statistics.median(gaps) if gaps else None,
        "bytes_per_step": sum(sent.values()) / args.steps,
        "forwarder_bytes_per_step": sent["n1"] / args.steps,
        "nat_bytes_per_step": sent["n3"] / args.steps,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration, interleaved")
    p.add_argument("--steps", type=int, default=150, help="steps of every run")
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the step time")
    p.add_argument("--model", choices=sorted(jobs.SHAPES), default="small", help="bench/jobs.py's MLP size")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the model's)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    if args.steps < args.warmup + 10:
        p.error("--steps must exceed --warmup by at least 10")
    args.batch = args.batch or jobs.DEFAULT_BATCH[args.model]
    return args


def main() -> None:
    args = parse_args()
    reason = netns.inbound_probe()
    if reason is not None:
        sys.exit(f"bench/nat.py needs network namespaces and nftables: {reason}")
    print_command()
    n_params = jobs.num_params(args.model)
    print(
        f"model {args.model} MLP ({n_params:,} parameters, {4 * n_params / 1e6:.2f} MB float32 gradient), "
        f"B={args.batch}, {args.steps} steps per run (step time after step {args.warmup}); 3 nodes in network "
        f"namespaces on one bridge (veth, no bandwidth limit, no latency), coordinator on the bridge, n1 offers "
        f"forwarding; OMP_NUM_THREADS=1, everything on this machine",
        flush=True,
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-nat-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    raw: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    progress = ProgressLine(args.repeats * len(CONFIGS))
    try:
        for rep in range(args.repeats):
            k = rep % len(CONFIGS)
            for config in CONFIGS[k:] + CONFIGS[:k]:
                progress.update(f"repeat {rep + 1}/{args.repeats}: {config} running")
                t0 = time.monotonic()
                r = run_config(args, root / f"{config}-{rep}", config)
                raw[config].append(r)
                note = f"{fmt(r['step_s'] and 1e3 * r['step_s'])} ms/step, {r['bytes_per_step'] / 1e6:.2f} MB/step"
                progress.update(f"repeat {rep + 1}/{args.repeats}: {config}: {note} ({time.monotonic() - t0:.0f} s)", 1)
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()
    report(raw)


def report(raw: dict[str, list[dict[str, Any]]]) -> None:
    def med(config: str, key: str) -> float | None:
        return median(r[key] for r in raw[config])

    def mb(x: float | None) -> str:
        return fmt(x and x / 1e6, " MB")

    rows = []
    for config in CONFIGS:
        rows.append(
            [
                "all reachable" if config == "reachable" else "n3 behind NAT, through n1",
                fmt(med(config, "step_s") and 1e3 * med(config, "step_s"), " ms"),  # type: ignore[operator]
                ratio(med(config, "step_s"), med("reachable", "step_s")),
                mb(med(config, "bytes_per_step")),
                ratio(med(config, "bytes_per_step"), med("reachable", "bytes_per_step")),
                mb(med(config, "forwarder_bytes_per_step")),
                ratio(med(config, "forwarder_bytes_per_step"), med("reachable", "forwarder_bytes_per_step")),
                mb(med(config, "nat_bytes_per_step")),
            ]
        )
    print_table(
        "one member behind NAT vs all reachable",
        ["configuration", "step time", "x", "bytes sent / step (all)", "x", "n1 sent / step", "x", "n3 sent / step"],
        rows,
        caption="medians over repeats; x: ratio to all reachable; bytes: every frame each node sent on its link",
    )


if __name__ == "__main__":
    main()
