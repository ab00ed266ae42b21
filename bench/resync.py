"""Incremental resync and multi-donor joins: bytes and time to bring a node up to date.

    python bench/resync.py                          # medium model, 3 repeats, ~6 min on 2 cores
    python bench/resync.py --model large --repeats 1 --mbit 200

The job is ``--model`` of ``bench/jobs.py`` (``medium``: 5.2M parameters, SGD with
momentum, so the state is parameters + momentum buffers, ~42 MB), trained on loopback.

Part 1, bytes moved: the node that catches up runs once with incremental resync (the
default: it sends its chunks' digests and fetches the chunks that differ) and once with
``--full-resync`` (every chunk), side by side, in three scenarios:

- absence, full training: 3 nodes train; n3 is SIGSTOPped until the group expels it (one
  lease), SIGCONTed 0.5 s later, and catches up in the next epoch's sync phase;
- absence, fine-tune: the same with ``UB_BENCH_FREEZE=2`` (the first two of three Linear
  layers frozen: the backbone);
- join, fine-tune: 2 nodes train the fine-tune, a third joins; it builds the backbone from
  the job's seed like everyone, so only the head and its momentum differ.

Figures: MB moved, the state's MB, the transfer's seconds (the receiver's sync line), and
the ratio incremental / full.

Part 2, multi-donor join (needs root: network namespaces and tc tbf; skipped otherwise, with
the reason): 3 donors on links capped at ``--mbit`` Mbit/s each way (home uplinks), the
joiner on an uncapped link (a well-connected server). The joiner fetches the ~42 MB state
from all 3 donors vs. ``--max-donors 1``; throughput MB/s and the ratio.

Medians over ``--repeats`` interleaved repeats.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, wait_until, write_results
from unbroken.testing import LocalCluster, netns

WARMUP = 10
SCENARIOS = ("absence, full training", "absence, fine-tune", "join, fine-tune")


def _syncs(node: Any) -> list[dict[str, Any]]:
    return [e for e in node.entries() if e.get("kind") == "sync"]


def _events(c: LocalCluster, kind: str, name: str) -> list[dict[str, Any]]:
    return [e for e in c.events() if e["kind"] == kind and e.get("node") == name]


def bytes_run(args: argparse.Namespace, workdir: Path, scenario: str, full: bool) -> dict[str, Any]:
    env = jobs.env_for(100_000) | {"UB_BENCH_FREEZE": "0" if scenario.endswith("full training") else "2"}
    extra = ["--full-resync"] if full else []
    joining = scenario.startswith("join")
    with LocalCluster(jobs.job_ref(args.model), workdir, env=env, min_nodes=2 if joining else 3) as c:
        c.start_coordinator()
        c.start_node("n1")
        c.start_node("n2")
        target = None if joining else c.start_node("n3", extra=extra)
        try:
            c.wait_step(WARMUP, timeout=args.timeout)
            if target is None:
                target = c.start_node("n3", extra=extra)
            else:
                before = len(_syncs(target))
                target.signal(signal.SIGSTOP)
                wait_until(lambda: _events(c, "failure", "n3"), args.timeout, "n3 expelled")
                time.sleep(0.5)
                target.signal(signal.SIGCONT)
                wait_until(lambda: len(_syncs(target)) > before, args.timeout, "n3's catch-up")
            sync = wait_until(lambda: _syncs(target), args.timeout, "the sync")[-1]
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{c.diagnostics()}") from None
    return {"mb": float(sync["mb"]), "state_mb": float(sync["state_mb"]), "seconds": float(sync["seconds"])}


def donors_run(args: argparse.Namespace, workdir: Path, net: netns.Network, max_donors: int) -> dict[str, Any]:
    env = jobs.env_for(100_000)
    with LocalCluster(jobs.job_ref(args.model), workdir, env=env, min_nodes=3, network=net) as c:
        c.start_coordinator()
        for name in ("d1", "d2", "d3"):
            c.start_node(name)
            net.slow(name, args.mbit)
        try:
            c.wait_step(WARMUP, timeout=args.timeout)
            joiner = c.start_node("j", extra=["--max-donors", str(max_donors)])
            sync = wait_until(lambda: _syncs(joiner), args.timeout, "the joiner's sync")[0]
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{c.diagnostics()}") from None
    mb, seconds = float(sync["mb"]), float(sync["seconds"])
    return {"mb": mb, "seconds": seconds, "mb_s": mb / max(seconds, 1e-9), "donors": len(sync["from"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(jobs.JOBS), default="medium")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every configuration, interleaved")
    p.add_argument("--mbit", type=float, default=100.0, help="each donor's link cap in part 2 (Mbit/s each way)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one wait")
    args = p.parse_args()
    print_command()
    why_not = netns.probe()
    runs = args.repeats * (2 * len(SCENARIOS) + (2 if why_not is None else 0))
    progress = ProgressLine(runs)
    raw: dict[tuple[str, bool], list[dict[str, Any]]] = {(s, f): [] for s in SCENARIOS for f in (False, True)}
    donors: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="ub-resync-") as tmp:
        try:
            for rep in range(args.repeats):
                for scenario in SCENARIOS:
                    for full in (False, True):
                        mode = "full" if full else "incremental"
                        progress.update(f"repeat {rep + 1}: {scenario}, {mode}")
                        where = Path(tmp) / f"{rep}-{SCENARIOS.index(scenario)}-{mode}"
                        raw[(scenario, full)].append(bytes_run(args, where, scenario, full))
                        progress.update(f"repeat {rep + 1}: {scenario}, {mode} done", advance=1)
                if why_not is None:
                    for max_donors in (0, 1):
                        progress.update(f"repeat {rep + 1}: join from {'all donors' if max_donors == 0 else '1 donor'}")
                        with netns.Network() as net:
                            where = Path(tmp) / f"{rep}-donors{max_donors}"
                            donors[max_donors].append(donors_run(args, where, net, max_donors))
                        progress.update("done", advance=1)
        finally:
            progress.close()
    rows = []
    for scenario in SCENARIOS:
        inc, full = raw[(scenario, False)], raw[(scenario, True)]
        mb_i, mb_f = median(r["mb"] for r in inc), median(r["mb"] for r in full)
        s_i, s_f = median(r["seconds"] for r in inc), median(r["seconds"] for r in full)
        state = median(r["state_mb"] for r in inc)
        rows.append(
            [scenario, fmt(state, " MB", 1), fmt(mb_i, " MB", 2), fmt(mb_f, " MB", 2), ratio(mb_i, mb_f, 3),
             fmt(s_i, " s"), fmt(s_f, " s"), ratio(s_i, s_f)]
        )  # fmt: skip
    print_table(
        f"Part 1: bytes to catch up ({args.model}, medians of {args.repeats})",
        ["scenario", "state", "incremental", "full", "bytes ratio", "incr. time", "full time", "time ratio"],
        rows,
        caption="ratio = incremental / full resync (same scenario, same invocation)",
    )
    if why_not is not None:
        print(f"Part 2 (multi-donor join) skipped: {why_not}")
        return
    many, one = donors[0], donors[1]
    tp_many, tp_one = median(r["mb_s"] for r in many), median(r["mb_s"] for r in one)
    rows = [
        [str(median(r["donors"] for r in runs)), fmt(median(r["mb"] for r in runs), " MB", 1),
         fmt(median(r["seconds"] for r in runs), " s"), fmt(tp, " MB/s", 1), ratio(tp, tp_one)]
        for runs, tp in ((many, tp_many), (one, tp_one))
    ]  # fmt: skip
    print_table(
        f"Part 2: join from several donors, donors' links at {args.mbit:g} Mbit/s, joiner's uncapped "
        f"(medians of {args.repeats})",
        ["donors", "state", "transfer", "throughput", "ratio vs 1 donor"],
        rows,
        caption=f"a link cap of {args.mbit:g} Mbit/s is {args.mbit / 8:g} MB/s; tbf bandwidth only (no netem here)",
    )


if __name__ == "__main__":
    main()
    write_results()
