"""Join latency: a node joining a running job vs. the same node cold-starting a job alone.

    python bench/join.py                              # small x2 + large x1, ~3 min on 2 cores
    python bench/join.py --repeats 5 --large-repeats 3

For each model (``bench/jobs.py``: ``small`` ~0.67M parameters, ``large`` ~50M, SGD with
momentum, so the state is parameters + momentum buffers):

- join: a 2-node job (n1, n2) runs on loopback; past ``--warmup`` steps the bench spawns a
  third node. Measured from the moment the bench spawns the process to the first ``commit``
  line in its commit log that follows its ``sync`` line (the first step it contributed to),
  with a breakdown: spawn -> connected (the coordinator's "join" event: process start,
  imports, model build), connected -> in sync (waiting for the group's step boundary, the
  new epoch's process group, the peer-to-peer state transfer), transfer alone (the sync
  line's "seconds", and of it "load_s", the check and load of what arrived), in sync -> first
  commit. State size ("mb") and throughput (MB/s: "seconds" less "load_s") come
  from the (first) sync line. If the joiner is expelled before its first commit (e.g. its
  lease expires during the transfer) it rejoins and syncs again; the table counts that.
  What the join costs the group: the longest gap between n1's commits from the spawn to
  ``--after`` seconds past the joiner's first commit (its start-up, the epoch change, the
  transfer, its first steps), against n1's median gap in the 15 s before the spawn.
  The joiner then leaves gracefully (SIGTERM) for the next repeat.
- baseline, cold start: the same node alone, a 1-node job on a fresh coordinator, spawned
  while the 2-node job keeps training (so both see the same CPU load on this machine):
  spawn -> connected and spawn -> first commit.

The ratio join / cold start is the price of joining a running job.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, wait_until, write_results
from unbroken.testing import LocalCluster
from unbroken.testing.cluster import NodeProcess

WARMUP = {"small": 20, "large": 3}


def _connected_at(c: LocalCluster, name: str) -> float | None:
    return next((e["time"] for e in c.events() if e["kind"] == "join" and e.get("node") == name), None)


def _joined(node: NodeProcess) -> tuple[list[dict[str, Any]], dict[str, Any], int] | None:
    """The joiner's syncs before its first commit, that commit, and how often it was expelled meanwhile."""
    entries = node.entries()
    commit = next((e for e in entries if e.get("kind") == "commit"), None)
    if commit is None:
        return None
    before = [e for e in entries if e["t"] <= commit["t"]]
    syncs = [e for e in before if e.get("kind") == "sync"]
    return (syncs, commit, sum(1 for e in before if e.get("kind") == "expelled")) if syncs else None


def cold_start(args: argparse.Namespace, model: str, workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    with LocalCluster(jobs.job_ref(model), workdir, env=env, min_nodes=1) as b:
        b.start_coordinator()
        t0 = time.time()
        node = b.start_node("cold")
        try:
            commit = wait_until(
                lambda: next((e for e in node.entries() if e.get("kind") == "commit"), None),
                args.timeout,
                "the cold node's first commit",
            )
            connected = wait_until(lambda: _connected_at(b, "cold"), 5.0, "the cold node's join event")
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{b.diagnostics()}") from None
        return {"connected": connected - t0, "commit": commit["t"] - t0}


def join(args: argparse.Namespace, a: LocalCluster, name: str) -> dict[str, Any]:
    t0 = time.time()
    node = a.start_node(name)
    try:
        syncs, commit, expelled = wait_until(lambda: _joined(node), args.timeout, f"{name}'s first commit")
        connected = wait_until(lambda: _connected_at(a, name), 5.0, f"{name}'s join event")
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}\n{a.diagnostics()}") from None
    time.sleep(args.after)
    group = [e["t"] for e in a.nodes["n1"].entries() if e.get("kind") == "commit"]
    before = [t for t in group if t0 - 15 <= t <= t0]
    during = [t for t in group if t0 <= t <= commit["t"] + args.after]
    first, last = syncs[0], syncs[-1]
    out = {
        "connected": connected - t0,
        "in_sync": last["t"] - t0,
        "commit": commit["t"] - t0,
        "mb": float(first["mb"]),
        "transfer": float(first["seconds"]),
        "load": float(first.get("load_s", 0.0)),
        "throughput": float(first["mb"]) / max(float(first["seconds"]) - float(first.get("load_s", 0.0)), 1e-9),
        "first_step": commit["t"] - last["t"],
        "syncs": len(syncs),
        "expelled": expelled,
        "gap_before": median(b - a for a, b in itertools.pairwise(before)),
        "gap_longest": max((b - a for a, b in itertools.pairwise(during)), default=None),
    }
    node.signal(signal.SIGTERM)  # leave gracefully before the next repeat
    try:
        node.wait(args.timeout)
    except subprocess.TimeoutExpired:
        node.kill()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small,large", help="comma-separated, from: " + ", ".join(jobs.JOBS))
    p.add_argument("--repeats", type=int, default=2, help="joins (and cold starts) of the small model")
    p.add_argument("--large-repeats", type=int, default=1, help="joins (and cold starts) of the large model")
    p.add_argument("--lease", type=float, default=1.0, help="coordinator heartbeat lease of the 2-node job, seconds")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for any one wait")
    p.add_argument("--after", type=float, default=8.0, help="seconds the joiner stays after its first commit")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in jobs.JOBS:
            p.error(f"unknown model {m!r}")
    print_command()
    print(
        "join: python -m unbroken node JOB --coordinator HOST:PORT --name jK  (into a running 2-node job)\n"
        "cold: python -m unbroken node JOB --coordinator HOST2:PORT2 --name cold  (a 1-node job, fresh coordinator)\n"
        "OMP_NUM_THREADS=1; each node runs on gloo/CPU over loopback",
        flush=True,
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-join-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    res: dict[str, dict[str, list[dict[str, Any]]]] = {m: {"join": [], "cold": []} for m in models}
    reps = {m: args.large_repeats if m == "large" else args.repeats for m in models}
    progress = ProgressLine(2 * sum(reps.values()))
    try:
        for model in models:
            env = jobs.env_for(100_000)
            progress.update(f"{model}: starting the 2-node job")
            with LocalCluster(
                jobs.job_ref(model), root / f"{model}-job", env=env, min_nodes=2, lease_s=args.lease
            ) as a:
                a.start_coordinator()
                a.start_node("n1")
                a.start_node("n2")
                for rep in range(reps[model]):
                    order = ["cold", "join"] if rep % 2 == 0 else ["join", "cold"]
                    for what in order:
                        # past the warm-up, and the group trains again after the last joiner left
                        a.wait_step(max(WARMUP[model], a.max_committed() + 2), timeout=args.timeout)
                        progress.update(f"{model} #{rep + 1}: {what}")
                        if what == "cold":
                            r = cold_start(args, model, root / f"{model}-cold{rep}", env)
                            note = f"spawn -> first commit {r['commit']:.2f} s"
                        else:
                            r = join(args, a, f"j{rep}")
                            note = (
                                f"spawn -> first commit {r['commit']:.2f} s, {r['mb']:.1f} MB "
                                f"in {r['transfer']:.2f} s ({r['throughput']:.0f} MB/s), expelled {r['expelled']}x"
                            )
                        res[model][what].append(r)
                        progress.update(f"{model} #{rep + 1}: {what}: {note}", advance=1)
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()

    def med(model: str, what: str, key: str) -> float | None:
        return median(r.get(key) for r in res[model][what])

    rows = []
    for model in models:
        j_commit, c_commit = med(model, "join", "commit"), med(model, "cold", "commit")
        j_conn, c_conn = med(model, "join", "connected"), med(model, "cold", "connected")
        j_sync = median(r["in_sync"] - r["connected"] for r in res[model]["join"])
        rows += [
            [f"{model} MLP ({jobs.num_params(model) / 1e6:.2f}M params)", "", "", ""],
            ["  spawn -> first commit", fmt(j_commit, " s", 2), fmt(c_commit, " s", 2), ratio(j_commit, c_commit)],
            [
                "  spawn -> connected to the coordinator",
                fmt(j_conn, " s", 2),
                fmt(c_conn, " s", 2),
                ratio(j_conn, c_conn),
            ],
            [
                "  connected -> first commit",
                fmt(j_commit and j_conn and j_commit - j_conn, " s", 2),
                fmt(c_commit and c_conn and c_commit - c_conn, " s", 2),
                ratio(j_commit and j_conn and j_commit - j_conn, c_commit and c_conn and c_commit - c_conn),
            ],
            ["  connected -> in sync (step boundary, group, transfer)", fmt(j_sync, " s", 2), "-", "-"],
            ["  state transfer: size", fmt(med(model, "join", "mb"), " MB", 1), "-", "-"],
            ["  state transfer: time", fmt(med(model, "join", "transfer"), " s", 3), "-", "-"],
            ["  state transfer: of which checking and loading", fmt(med(model, "join", "load"), " s", 3), "-", "-"],
            ["  state transfer: throughput less load", fmt(med(model, "join", "throughput"), " MB/s", 0), "-", "-"],
            ["  in sync -> first commit (first step)", fmt(med(model, "join", "first_step"), " s", 3), "-", "-"],
            [
                f"  the group's longest commit gap, spawn -> first commit + {args.after:g} s (vs median before)",
                fmt(med(model, "join", "gap_longest"), " s", 3),
                fmt(med(model, "join", "gap_before"), " s", 3),
                ratio(med(model, "join", "gap_longest"), med(model, "join", "gap_before")),
            ],
            [
                "  joiner expelled before its first commit (per run)",
                ", ".join(str(r["expelled"]) for r in res[model]["join"]),
                "-",
                "-",
            ],
            [
                "  per-run spawn -> first commit",
                ", ".join(fmt(r["commit"], "", 2) for r in res[model]["join"]),
                ", ".join(fmt(r["commit"], "", 2) for r in res[model]["cold"]),
                "",
            ],
        ]
    print_table(
        "Join vs cold start, medians over "
        + ", ".join(f"{reps[m]} ({m})" for m in models)
        + " repeats; a 2-node job trains in the background for both",
        ["measure", "join a running job", "cold start alone (baseline)", "join / cold"],
        rows,
        caption="join: a 3rd node joins a 2-node job; cold: the same node as a 1-node job on a fresh coordinator; "
        f"lease {args.lease} s",
    )


if __name__ == "__main__":
    main()
    write_results()
