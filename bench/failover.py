"""Leader failover with etcd vs a single coordinator restarted by hand, side by side.

    python bench/failover.py                 # ~4 min on 2 cores
    python bench/failover.py --repeats 5 --ttl 1

Each run is a fresh 3-node job (``bench/jobs.py``'s small MLP, B=96, a 20 ms sleep per
forward pass so a step takes ~0.1 s) on loopback, with a real 3-member etcd cluster
(``unbroken.testing.EtcdCluster``, Raft tuned for a LAN: 50 ms heartbeat, 500 ms election)
and two coordinators, or, for the baseline, one coordinator without etcd.

Scenarios (t0 = the moment the bench sends the signal):

- ``kill``: SIGKILL the leader. Figures: t0 -> a standby answers ``/api/state`` as leader;
  commits in the 3 s after t0 ÷ commits in the 3 s before (1.00 = no pause); steps gapless.
  Baseline: SIGKILL the single coordinator and restart it on the same port 1 s later (an
  operator's restart, at its fastest).
- ``kill+node``: SIGKILL the leader, then node n3 0.1 s later. Figure: n3's kill -> the
  survivors' first commit in an epoch without it. Baseline: the same with the single
  coordinator restarted 1 s after its kill.
- ``stop``: SIGSTOP the leader for 4 s, then SIGCONT. Figures: t0 -> a standby leads; the
  commit rate as above; orders of the old term any node followed after the new term led
  (must be 0). No baseline: a frozen single coordinator simply holds every change.

Times are wall-clock on this machine (the nodes' commit logs and the bench's own clock).
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, wait_until, write_results
from unbroken.testing import EtcdCluster, LocalCluster

NODES = ("n1", "n2", "n3")
WINDOW_S = 3.0
START_STEP = 30


def _commits(c: LocalCluster, names: tuple[str, ...] = NODES) -> list[dict[str, Any]]:
    """Every committed step once (the first node to log it), in time order."""
    first: dict[int, dict[str, Any]] = {}
    for name in names:
        for e in c.nodes[name].entries():
            if e.get("kind") != "commit":
                continue
            s = int(e["step"])
            if s not in first or first[s]["t"] > e["t"]:
                first[s] = e
    return sorted(first.values(), key=lambda e: e["t"])


def _rate_ratio(c: LocalCluster, t0: float) -> float | None:
    commits = _commits(c)
    before = sum(1 for e in commits if t0 - WINDOW_S <= e["t"] < t0)
    after = sum(1 for e in commits if t0 <= e["t"] < t0 + WINDOW_S)
    return after / before if before else None


def _commit_times(c: LocalCluster, t0: float) -> list[float]:
    """Each committed step's time, s from the fault, from the window before it to the one after (the plot's)."""
    return [round(e["t"] - t0, 4) for e in _commits(c) if -WINDOW_S <= e["t"] - t0 <= WINDOW_S + 0.5]


def _gapless(c: LocalCluster, names: tuple[str, ...]) -> bool:
    ok = True
    for name in names:
        steps = [int(e["step"]) for e in c.nodes[name].entries() if e.get("kind") == "commit"]
        ok &= bool(steps) and steps == list(range(steps[0], steps[0] + len(steps)))
    return ok


def _role(address: tuple[str, int]) -> str | None:
    try:
        with urllib.request.urlopen("http://{}:{}/api/state".format(*address), timeout=0.5) as r:
            role: str = json.load(r)["leadership"]["role"]
            return role
    except (OSError, ValueError, KeyError):
        return None


def _cluster(args: argparse.Namespace, workdir: Path, etcd: EtcdCluster | None) -> LocalCluster:
    env = jobs.env_for(100_000, 96) | {"UB_BENCH_DELAY_MS": "20"}
    c = LocalCluster(
        jobs.job_ref("small"),
        workdir,
        env=env,
        min_nodes=3,
        lease_s=args.lease,
        etcd=etcd.endpoints if etcd else None,
        coordinator_args=["--etcd-ttl", str(args.ttl)] if etcd else [],
    )
    for _ in range(2 if etcd else 1):
        c.start_coordinator()
    if etcd:
        wait_until(lambda: c.leader() is not None, 20, "a leader")
    for name in NODES:
        c.start_node(name)
    wait_until(lambda: c.max_committed() >= START_STEP, args.timeout, f"step {START_STEP}")
    time.sleep(WINDOW_S + 1)  # steady state before the fault: the window before t0 has no start-up in it
    return c


def _new_leader(c: LocalCluster, old: int, t0: float, timeout: float) -> float:
    others = [addr for i, (_, addr) in enumerate(c.coordinators) if i != old]
    wait_until(lambda: any(_role(a) == "leader" for a in others), timeout, "a standby to lead", poll=0.005)
    return time.time() - t0


def _next_commit_without(c: LocalCluster, victim: str, t_kill: float, timeout: float) -> float:
    survivors = [n for n in NODES if n != victim]
    killed_epoch = max((int(e["epoch"]) for e in c.nodes[victim].entries() if e.get("kind") == "epoch"), default=0)

    def found() -> float | None:
        ts = [
            e["t"]
            for n in survivors
            for e in c.nodes[n].entries()
            if e.get("kind") == "commit" and e["t"] > t_kill and int(e["epoch"]) > killed_epoch
        ]
        return min(ts) if ts else None

    return float(wait_until(found, timeout, "a survivor's commit in an epoch without the killed node")) - t_kill


def ha_kill(args: argparse.Namespace, workdir: Path, with_node: bool) -> dict[str, Any]:
    with EtcdCluster(workdir / "etcd") as etcd, _cluster(args, workdir, etcd) as c:
        old = c.leader()
        assert old is not None
        t0 = time.time()
        c.kill_coordinator(old)
        out: dict[str, Any] = {}
        if with_node:
            time.sleep(0.1)
            t_kill = time.time()
            c.nodes["n3"].kill()
            out["next_commit"] = _next_commit_without(c, "n3", t_kill, args.timeout)
        out["leader"] = _new_leader(c, old, t0, args.timeout)
        time.sleep(max(0.0, t0 + WINDOW_S + 0.5 - time.time()))
        out["rate"] = _rate_ratio(c, t0)
        out["gapless"] = _gapless(c, ("n1", "n2") if with_node else NODES)
        out["commit_times"] = _commit_times(c, t0)
        return out


def single_kill(args: argparse.Namespace, workdir: Path, with_node: bool) -> dict[str, Any]:
    with _cluster(args, workdir, None) as c:
        assert c.address is not None
        port = c.address[1]
        t0 = time.time()
        c.kill_coordinator()
        out: dict[str, Any] = {}
        t_kill = 0.0
        if with_node:
            time.sleep(0.1)
            t_kill = time.time()
            c.nodes["n3"].kill()
        time.sleep(max(0.0, t0 + 1.0 - time.time()))
        c.start_coordinator(port=port)
        out["leader"] = time.time() - t0
        if with_node:
            out["next_commit"] = _next_commit_without(c, "n3", t_kill, args.timeout)
        time.sleep(max(0.0, t0 + WINDOW_S + 0.5 - time.time()))
        out["rate"] = _rate_ratio(c, t0)
        out["gapless"] = _gapless(c, ("n1", "n2") if with_node else NODES)
        out["commit_times"] = _commit_times(c, t0)
        return out


def ha_stop(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with EtcdCluster(workdir / "etcd") as etcd, _cluster(args, workdir, etcd) as c:
        old = c.leader()
        assert old is not None
        proc = c.coordinators[old][0]
        old_term = c.coordinator_state(old)["leadership"]["term"]
        t0 = time.time()
        proc.send_signal(signal.SIGSTOP)
        try:
            took = _new_leader(c, old, t0, args.timeout)
            time.sleep(max(0.0, t0 + 4.0 - time.time()))
        finally:
            proc.send_signal(signal.SIGCONT)
        t_cont = time.time()
        wait_until(lambda: _role(c.coordinators[old][1]) == "standby", 10, "the old leader to stand down")
        stood_down = time.time() - t_cont
        time.sleep(2.0)
        stale = 0
        for name in NODES:
            seen_new = False
            for e in c.nodes[name].entries():
                if e.get("kind") != "epoch":
                    continue
                seen_new |= int(e["term"]) > old_term
                stale += seen_new and int(e["term"]) <= old_term
        return {
            "leader": took,
            "rate": _rate_ratio(c, t0),
            "gapless": _gapless(c, NODES),
            "stale_orders": stale,
            "stood_down": stood_down,
            "commit_times": _commit_times(c, t0),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttl", type=int, default=1, help="the leader's etcd lease (s)")
    p.add_argument("--lease", type=float, default=1.0, help="the nodes' heartbeat lease (s)")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--only", help="comma-separated scenarios: ha-kill,1-kill,ha-kn,1-kn,ha-stop (default: all)")
    args = p.parse_args()
    print_command()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("ha-kill", "1-kill", "ha-kn", "1-kn", "ha-stop")}
    progress = ProgressLine(args.repeats * len(runs))
    with tempfile.TemporaryDirectory(prefix="ub-failover-") as tmp:
        for r in range(args.repeats):
            for key, fn in (
                ("ha-kill", lambda w: ha_kill(args, w, False)),
                ("1-kill", lambda w: single_kill(args, w, False)),
                ("ha-kn", lambda w: ha_kill(args, w, True)),
                ("1-kn", lambda w: single_kill(args, w, True)),
                ("ha-stop", lambda w: ha_stop(args, w)),
            ):
                if args.only and key not in args.only.split(","):
                    continue
                progress.update(f"{key} #{r + 1}")
                res = fn(Path(tmp) / f"{key}-{r}")
                runs[key].append(res)
                shown = ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in res.items()
                    if k != "commit_times"
                )
                progress.update(f"{key} #{r + 1}: {shown}", advance=1)
    progress.close()

    def med(key: str, field: str) -> float | None:
        return median(r.get(field) for r in runs[key])

    def every(key: str, field: str) -> str:
        return " / ".join(fmt(r.get(field), digits=2) for r in runs[key])

    rows = [
        ["leader SIGKILL -> a coordinator leads (s)", fmt(med("ha-kill", "leader")), fmt(med("1-kill", "leader")),
         ratio(med("ha-kill", "leader"), med("1-kill", "leader")), every("ha-kill", "leader")],
        ["commits in 3 s after ÷ 3 s before (kill)", fmt(med("ha-kill", "rate"), digits=2),
         fmt(med("1-kill", "rate"), digits=2), ratio(med("ha-kill", "rate"), med("1-kill", "rate")),
         every("ha-kill", "rate")],
        ["leader kill, node kill 0.1 s later -> next commit (s)", fmt(med("ha-kn", "next_commit")),
         fmt(med("1-kn", "next_commit")), ratio(med("ha-kn", "next_commit"), med("1-kn", "next_commit")),
         every("ha-kn", "next_commit")],
        ["leader SIGSTOP -> a standby leads (s)", fmt(med("ha-stop", "leader")), "never (frozen)", "-",
         every("ha-stop", "leader")],
        ["commits in 3 s after ÷ 3 s before (stop)", fmt(med("ha-stop", "rate"), digits=2), "0 until SIGCONT", "-",
         every("ha-stop", "rate")],
        ["old-term orders followed after SIGCONT", str(sum(r["stale_orders"] for r in runs["ha-stop"])), "-", "-",
         every("ha-stop", "stale_orders")],
        ["SIGCONT -> old leader reports standby (s)", fmt(med("ha-stop", "stood_down")), "-", "-",
         every("ha-stop", "stood_down")],
    ]  # fmt: skip
    gapless = all(r["gapless"] for rs in runs.values() for r in rs)
    print_table(
        f"Failover, medians of {args.repeats} (etcd lease {args.ttl} s, node lease {args.lease} s)",
        ["figure", "etcd, 2 coordinators", "single, restarted 1 s later", "ratio", "each run (etcd)"],
        rows,
        caption=f"every survivor's committed steps gapless in every run: {gapless}",
    )
    write_results(
        {
            "commit_times": {
                "about": "each committed step's time, s from the coordinator's fault, first run of each scenario",
                **{key: rs[0]["commit_times"] for key, rs in runs.items() if rs},
            },
            "runs": runs,
        }
    )


if __name__ == "__main__":
    main()
