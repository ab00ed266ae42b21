"""`unbroken chaos`: train a job while injecting random faults, then check every promise.

A local coordinator and nodes (real processes) train `unbroken.testing.soakjob` while
faults arrive at random (exponential gaps at ``rate`` per second, at most three mean gaps
long so that one long draw does not leave a short soak idle; seeded):

- ``kill``: SIGKILL a node; a replacement node starts a second later;
- ``stop``: SIGSTOP a node, SIGCONT it 1.5-3 s later (it is expelled and rejoins);
- ``term``: SIGTERM a node (a graceful leave); a replacement starts a second later;
- ``join``: a new node joins;
- ``coordinator``: SIGKILL the coordinator and restart it on the same port a second later;
- ``cut``: drop every packet of a node's link for 1.5-3 s (it is expelled and rejoins);
- ``slow``: cap a node's link at 1-5 Mbit/s for 2-4 s (the group slows, keeps committing).

With ``ha`` (``unbroken chaos --ha``), a real 3-member etcd cluster runs on loopback and
two coordinators stand for election; ``coordinator`` is then replaced by:

- ``leader-kill``: SIGKILL the leading coordinator, restart it a second later (a standby);
- ``leader-stop``: SIGSTOP the leader for 1.5-3 s (a standby takes over; woken, it is fenced);
- ``etcd-kill``: SIGKILL one etcd member (never a second), restart it 2-4 s later.

The link faults are real (see `unbroken.testing.netns`): where network namespaces work
(root), every node runs in its own namespace behind a veth pair and a bridge, and the
coordinator listens on the bridge; ``cut`` sets the veth down, ``slow`` is ``tc tbf``
(its queueing is the only added latency: this kernel has no ``tc netem``, so no fixed
delay or random loss). Elsewhere the nodes run on loopback and the report says why link
faults were skipped. The last node that trains is never stopped or cut (nodes still
starting up do not count). After ``duration`` seconds the faults stop and the job runs
to its end; then the report: faults by kind, recovery time after each (fault → the
group's first commit of a step computed wholly after the fault: median, p95, max; and, as
reported before, fault → its next commit of a new step, which a step already in flight at
the fault can make almost at once), committed steps lost (0 is the promise), replicas
equal after every step, exactly-once samples, and the final model against single-process
training.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.testing import netns
from unbroken.testing.cluster import LocalCluster, NodeProcess
from unbroken.testing.etcd import EtcdCluster
from unbroken.testing.promises import PromiseReport, check_promises, environment, reference_state

JOB = "unbroken.testing.soakjob:job"
KINDS = {
    "kill": 0.3, "stop": 0.2, "term": 0.15, "join": 0.2, "coordinator": 0.15, "cut": 0.15, "slow": 0.1,
    "leader-kill": 0.1, "leader-stop": 0.1, "etcd-kill": 0.1,
}  # fmt: skip
"""Relative weights. Without link faults the schedule of a seed is what it was before they
existed, and so it is without ``ha``, whose kinds come last."""
LINK_KINDS = ("cut", "slow")
HA_KINDS = ("leader-kill", "leader-stop", "etcd-kill")
ATOL = 1e-5


@dataclass
class Fault:
    kind: str
    at: float
    target: str
    detail: str = ""
    """How long a stop, cut or slow lasted, and a slow link's rate."""


def feasible_kinds(
    *, training: int, slowable: int, alive: int, nodes: int, links: bool, ha: bool = False, etcd_down: bool = False
) -> list[str]:
    """The fault kinds that may be drawn now, in `KINDS` order.

    Faults that take a trainer out (kill, stop, term, cut) need another one to carry on:
    the group must never lose its last training node. A slow link only needs a trainer to
    slow (one not slowed already). Joins stop once two spare nodes are up. With ``ha`` the
    leader faults replace ``coordinator``, and one etcd member at most is down at a time.
    """
    kinds = []
    for kind in KINDS:
        if kind in LINK_KINDS and not links:
            continue
        if (kind in HA_KINDS and not ha) or (kind == "coordinator" and ha):
            continue
        if kind == "etcd-kill" and etcd_down:
            continue
        if kind in ("kill", "stop", "term", "cut") and training < 2:
            continue
        if kind == "slow" and slowable < 1:
            continue
        if kind == "join" and alive >= nodes + 2:
            continue
        kinds.append(kind)
    return kinds


STOP_S = (1.5, 3.0)
"""How long a stopped node (or a cut link, or a stopped leader) stays so: drawn uniformly, seconds."""


def next_gap(rng: random.Random, rate: float) -> float:
    """Seconds to the next fault: exponential at ``rate`` per second, capped at three mean gaps
    (a cap changes when faults land, not which ones: the draws stay the same)."""
    return min(rng.expovariate(rate), 3.0 / rate)


def draw_kind(rng: random.Random, kinds: list[str]) -> str:
    """One of ``kinds`` (feasible now), at the relative weights of `KINDS`."""
    return rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]


@dataclass(frozen=True)
class Planned:
    """One fault of a schedule drawn in advance (`schedule`)."""

    at: float
    """Seconds from the schedule's start."""
    kind: str
    pick: float
    """Which trainer it hits, as a fraction in [0, 1) of the trainers up then, in a fixed order
    (one fraction picks comparable victims in systems whose members are named differently)."""
    lasts: float
    """How long a ``stop`` lasts, seconds (drawn for every kind, so that one kind's draw does not
    shift the next fault's)."""


def schedule(
    seed: int, rate: float, duration_s: float, kinds: tuple[str, ...] = ("kill", "stop", "term", "join")
) -> list[Planned]:
    """The faults of ``duration_s`` seconds at ``rate`` per second, drawn in advance with a soak's
    draws (`next_gap`, `draw_kind`, `STOP_S`): the same schedule for several systems side by side
    (bench/goodput.py), where a soak draws each fault against the live cluster.

    Raises:
        ConfigError: ``rate`` is not positive, or ``kinds`` names a kind `KINDS` has not.
    """
    if rate <= 0:
        raise ConfigError(f"fault rate {rate}: must be positive (faults per second)")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ConfigError(f"fault kinds {unknown}: not known; use some of {sorted(KINDS)}")
    rng = random.Random(seed)
    out: list[Planned] = []
    at = next_gap(rng, rate)
    while at < duration_s:
        kind = draw_kind(rng, list(kinds))
        out.append(Planned(at, kind, rng.random(), rng.uniform(*STOP_S)))
        at += next_gap(rng, rate)
    return out


def time_outside(start: float, end: float, gaps: list[tuple[float, float]]) -> float:
    """Seconds of ``[start, end]`` outside every one of ``gaps`` (intervals that do not overlap)."""
    inside = sum(max(0.0, min(b, end) - max(a, start)) for a, b in gaps)
    return max(0.0, end - start) - inside


class Commits:
    """The group's commits, from every node's commit log, and when each step began."""

    def __init__(self, logs: dict[str, list[dict[str, Any]]]) -> None:
        entries = [e for log in logs.values() for e in log]
        self.commits = sorted((e["t"], e["step"], e.get("epoch")) for e in entries if e["kind"] == "commit")
        self.begun: dict[tuple[Any, int], float] = {}
        """(epoch, step committed) → when its first contribution's compute began (a
        contribution to step s commits s + 1, and is logged once computed)."""
        for e in entries:
            if e["kind"] == "contrib":
                key = (e.get("epoch"), e["step"] + 1)
                start = e["t"] - float(e.get("compute_s") or 0.0)
                self.begun[key] = min(self.begun.get(key, start), start)

    def after(self, at: float) -> tuple[float | None, float | None]:
        """After a fault at ``at``: the group's next commit of a new step, and its first
        commit of a step computed wholly after the fault (the recovery: a step in flight at
        the fault may still commit just after it, before the group stalls)."""
        before = max((s for t, s, _ in self.commits if t <= at), default=0)
        # Other nodes may still commit `before` just after the fault: a new step is later.
        later = [(t, s, ep) for t, s, ep in self.commits if t > at and s > before]
        fresh = next((t for t, s, ep in later if self.begun.get((ep, s), t) > at), None)
        return (later[0][0] if later else None), fresh


@dataclass
class ChaosReport:
    duration_s: float
    steps: int
    faults: list[Fault]
    recoveries: dict[str, list[float]]
    """Per fault kind: fault → the group's first commit of a step computed wholly after it."""
    steps_lost: int
    promises: PromiseReport
    max_diff: float | None
    problems: list[str] = field(default_factory=list)
    links: str = ""
    """Whether link faults were injected, how, or why not."""
    next_commits: dict[str, list[float]] = field(default_factory=dict)
    """Per fault kind: fault → the group's next commit of a new step, whenever it was computed
    (what recovery meant before 2026-12-04: a step in flight at the fault counts as ~0 s)."""
    beyond_down: list[float] = field(default_factory=list)
    """Each recovery less the time within it that no coordinator served (killed, not yet
    restarted): what a single coordinator can answer for. Empty with ``ha``."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float] | None:
            if not xs:
                return None
            ordered = sorted(xs)
            p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
            return {"median": statistics.median(ordered), "p95": p95, "max": ordered[-1], "count": len(ordered)}

        every = [x for xs in self.recoveries.values() for x in xs]
        return {
            "duration_s": round(self.duration_s, 1),
            "steps": self.steps,
            "faults": dict(collections.Counter(f.kind for f in self.faults)),
            "faults_total": len(self.faults),
            "recovery_s": {k: stats(v) for k, v in self.recoveries.items()} | {"all": stats(every)},
            "recovery_beyond_coordinator_down_s": stats(self.beyond_down),
            "next_commit_s": {k: stats(v) for k, v in self.next_commits.items()},
            "steps_lost": self.steps_lost,
            "link_faults": self.links,
            "fault_log": [{"kind": f.kind, "at": f.at, "target": f.target, "detail": f.detail} for f in self.faults],
            "replicas_equal_and_exactly_once": self.promises.ok,
            "final_vs_reference_max_abs_diff": self.max_diff,
            "problems": self.problems,
        }


class Chaos:
    """Runs one soak; `run` returns the report."""

    def __init__(
        self,
        workdir: Path,
        *,
        duration_s: float = 60.0,
        rate: float = 0.25,
        nodes: int = 3,
        seed: int = 0,
        delay_ms: float = 20.0,
        links: bool | None = None,
        ha: bool = False,
        on_progress: Callable[[str], None] = lambda s: None,
    ) -> None:
        """``links``: inject link faults (True: required, an error where they cannot be;
        None: where they can be; False: never).

        Raises:
            ConfigError: ``links=True`` on a host without network namespaces (says why).
        """
        self.workdir = Path(workdir)
        self.ha = ha
        self.etcd: EtcdCluster | None = None
        self._etcd_down: int | None = None
        self.duration_s = duration_s
        self.rate = rate
        self.nodes = nodes
        self.rng = random.Random(seed)
        self.delay_ms = delay_ms
        self.on_progress = on_progress
        # Enough steps to outlast the faults: a healthy group takes more than delay_ms + 10 ms
        # a step, and quick recoveries must not end the job (and the faults) before ``duration_s``.
        self.steps = max(200, int(duration_s * 1000 / (delay_ms + 10)))
        self.env = {"UNBROKEN_SOAK_STEPS": str(self.steps), "UNBROKEN_SOAK_DELAY_MS": str(delay_ms)}
        self.faults: list[Fault] = []
        self._coordinator_down: list[tuple[float, float]] = []
        """When no coordinator served: from a kill to its restart serving."""
        self._count = 0
        self._due: list[tuple[float, Callable[[], object]]] = []
        """Deferred actions (restarts, SIGCONTs), run by the main loop: one thread drives the cluster."""
        self._held: set[str] = set()
        """Nodes stopped or cut off right now: alive, but no trainer until they are back."""
        self._slowed: set[str] = set()
        self.net: netns.Network | None = None
        why_not = netns.probe() if links is not False else "turned off (--no-links)"
        if links and why_not is not None:
            raise ConfigError(f"--links: link faults cannot be injected here: {why_not}")
        self.links = why_not is None
        self.links_note = (
            "injected: real network namespaces, veth pairs and a bridge; cut = link down, slow = tc tbf "
            "(added latency only from tbf queueing: no tc netem on this kernel)"
            if self.links
            else f"skipped: {why_not}"
        )

    def run(self) -> ChaosReport:
        self.net = netns.Network() if self.links else None
        host = self.net.gateway if self.net is not None else "127.0.0.1"
        self.etcd = EtcdCluster(self.workdir / "etcd", start=False, host=host) if self.ha else None
        args = ["--digest-every", "1"]
        cluster = LocalCluster(
            JOB,
            self.workdir,
            env=self.env,
            min_nodes=self.nodes,
            node_args=args,
            network=self.net,
            etcd=self.etcd.endpoints if self.etcd else None,
        )
        # The network closes after the cluster (namespaces outlive the nodes in them), on any exit.
        with self.net or contextlib.nullcontext(), self.etcd or contextlib.nullcontext(), cluster as c:
            if self.etcd is not None:
                self.etcd.start()  # the network is up: the members listen on its gateway
            _, port = c.start_coordinator()
            if self.etcd is not None:
                c.start_coordinator()
                c.wait_for(lambda: c.leader() is not None, 30, "a leader")
            for _ in range(self.nodes):
                self._start(c)
            c.wait_step(5, timeout=120)
            start = time.monotonic()
            next_at = start + self._gap()
            while time.monotonic() - start < self.duration_s:
                if c.max_committed() >= self.steps:
                    break
                self._run_due()
                if time.monotonic() >= next_at:
                    self._inject(c, port)
                    next_at = time.monotonic() + self._gap()
                self.on_progress(
                    f"step {c.max_committed()}/{self.steps}, {len(self.faults)} faults, {len(self._alive(c))} nodes up"
                )
                time.sleep(0.05)
            elapsed = time.monotonic() - start
            self._run_due(everything=True)
            if not any(proc.poll() is None for proc, _ in c.coordinators):
                c.start_coordinator(port=port)
            for n in c.nodes.values():
                n.signal(signal.SIGCONT)
            self.on_progress("faults over: letting the job finish")
            live = [n.name for n in self._alive(c)]
            try:
                c.wait_exit(live, timeout=max(120.0, self.steps * (self.delay_ms + 30) / 1000))
                stuck = ""
            except TimeoutError as exc:  # a broken promise like any other: reported, not raised
                stuck = str(exc).splitlines()[0]
            report = self._report(c, elapsed)
            if stuck:
                report.problems.insert(0, f"the job did not finish after the faults: {stuck} (see its log)")
            return report

    # ---------------------------------------------------------------- faults

    def _alive(self, c: LocalCluster) -> list[NodeProcess]:
        return [n for n in c.nodes.values() if n.proc.poll() is None and n.name not in self._held]

    def _gap(self) -> float:
        return next_gap(self.rng, self.rate)

    def _start(self, c: LocalCluster) -> NodeProcess:
        self._count += 1
        return c.start_node(f"n{self._count}")

    def _restart_coordinator(self, c: LocalCluster, port: int, down_since: float) -> None:
        c.start_coordinator(port=port)  # returns once it serves
        self._coordinator_down.append((down_since, time.time()))

    def _later(self, delay: float, fn: Callable[[], object]) -> None:
        self._due.append((time.monotonic() + delay, fn))
        self._due.sort(key=lambda d: d[0])

    def _run_due(self, everything: bool = False) -> None:
        if everything:
            while self._due:
                wait = self._due[0][0] - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._due.pop(0)[1]()
            return
        now = time.monotonic()
        for item in [d for d in self._due if d[0] <= now]:
            self._due.remove(item)
            item[1]()

    def _training(self, c: LocalCluster) -> list[NodeProcess]:
        """Nodes that committed a step in the last two seconds (not merely started).

        A commit, not any line of the log: a node woken from SIGSTOP or back from a cut logs
        ``expelled`` at once, yet holds a stale state until it has caught up. Counting it
        let a soak kill the only node holding the last commits (and lose them).
        """
        now = time.time()
        out = []
        for n in self._alive(c):
            try:
                if now - n.commit_log.stat().st_mtime >= 2.0:
                    continue  # cheap: nothing at all was logged lately
            except FileNotFoundError:
                continue
            last = next((e.get("t", 0.0) for e in reversed(n.entries()) if e.get("kind") == "commit"), 0.0)
            if now - last < 2.0:
                out.append(n)
        return out

    def _inject(self, c: LocalCluster, port: int) -> None:
        alive = self._alive(c)
        # Never the last member of the group: processes still starting up do not count.
        training = self._training(c)
        slowable = [n for n in training if n.name not in self._slowed]
        kinds = feasible_kinds(
            training=len(training),
            slowable=len(slowable),
            alive=len(alive),
            nodes=self.nodes,
            links=self.links,
            ha=self.ha,
            etcd_down=self._etcd_down is not None,
        )
        kind = draw_kind(self.rng, kinds)
        if kind in HA_KINDS:
            self._inject_ha(c, kind)
            return
        if kind == "coordinator":
            if c.coordinator is None or c.coordinator.poll() is not None:
                return
            c.kill_coordinator()
            killed = Fault(kind, time.time(), "coordinator")
            self.faults.append(killed)
            self._later(1.0, lambda: self._restart_coordinator(c, port, down_since=killed.at))
            return
        if kind == "join":
            node = self._start(c)
            self.faults.append(Fault(kind, time.time(), node.name))
            return
        victim = self.rng.choice(slowable if kind == "slow" else training)
        fault = Fault(kind, time.time(), victim.name)
        self.faults.append(fault)
        if kind == "kill":
            victim.kill()
            self._later(1.0, lambda: self._start(c))
        elif kind == "term":
            victim.signal(signal.SIGTERM)
            self._later(1.0, lambda: self._start(c))
        elif kind == "stop":
            victim.signal(signal.SIGSTOP)
            self._held.add(victim.name)

            def wake() -> None:
                victim.signal(signal.SIGCONT)
                self._held.discard(victim.name)

            lasts = self.rng.uniform(*STOP_S)
            fault.detail = f"{lasts:.1f} s"
            self._later(lasts, wake)
        elif kind == "cut":
            assert self.net is not None
            self.net.cut(victim.name)
            self._held.add(victim.name)

            def reconnect() -> None:
                assert self.net is not None
                self.net.restore(victim.name)  # a no-op if the node exited meanwhile
                self._held.discard(victim.name)

            lasts = self.rng.uniform(*STOP_S)
            fault.detail = f"{lasts:.1f} s"
            self._later(lasts, reconnect)
        elif kind == "slow":
            assert self.net is not None
            mbit, lasts = self.rng.uniform(1.0, 5.0), self.rng.uniform(2.0, 4.0)
            self.net.slow(victim.name, mbit)
            self._slowed.add(victim.name)
            step = c.max_committed()

            def unslow() -> None:
                assert self.net is not None
                self.net.unslow(victim.name)
                self._slowed.discard(victim.name)
                fault.detail += f", {c.max_committed() - step} steps committed meanwhile"

            fault.detail = f"{mbit:.1f} Mbit/s for {lasts:.1f} s"
            self._later(lasts, unslow)

    def _inject_ha(self, c: LocalCluster, kind: str) -> None:
        assert self.etcd is not None
        if kind == "etcd-kill":
            member = self.rng.randrange(self.etcd.size)
            self.etcd.kill(member)
            self._etcd_down = member
            fault = Fault(kind, time.time(), f"etcd e{member}")
            lasts = self.rng.uniform(2.0, 4.0)
            fault.detail = f"{lasts:.1f} s"
            self.faults.append(fault)

            def back() -> None:
                assert self.etcd is not None
                self.etcd.restart(member, wait=False)
                self._etcd_down = None

            self._later(lasts, back)
            return
        index = c.leader()
        if index is None:
            return  # an election is under way: no leader to hit
        proc, (_, port) = c.coordinators[index]
        fault = Fault(kind, time.time(), f"coordinator :{port}")
        self.faults.append(fault)
        if kind == "leader-kill":
            c.kill_coordinator(index)
            self._later(1.0, lambda: c.start_coordinator(port=port))
            return
        proc.send_signal(signal.SIGSTOP)
        lasts = self.rng.uniform(*STOP_S)
        fault.detail = f"{lasts:.1f} s"
        self._later(lasts, lambda: proc.send_signal(signal.SIGCONT))

    # ---------------------------------------------------------------- report

    def _report(self, c: LocalCluster, elapsed: float) -> ChaosReport:
        from unbroken.testing.soakjob import job as make_job

        with environment(self.env | {"UNBROKEN_SOAK_DELAY_MS": "0"}):  # the sleep is not part of the math
            job = make_job()
        logs = {name: n.entries() for name, n in c.nodes.items()}
        finishers = [n for n in c.nodes.values() if any(e["kind"] == "final" for e in n.entries())]
        promises = check_promises(logs, job, finishers=1)
        commits = Commits(logs)
        recoveries: dict[str, list[float]] = collections.defaultdict(list)
        next_commits: dict[str, list[float]] = collections.defaultdict(list)
        beyond_down: list[float] = []
        for f in self.faults:
            if f.kind == "join":
                node = c.nodes.get(f.target)
                first = next((e["t"] for e in node.entries() if e["kind"] == "commit"), None) if node else None
                if first is not None:
                    recoveries["join (spawn to first commit)"].append(first - f.at)
                continue
            after, fresh = commits.after(f.at)
            if after is not None:
                next_commits[f.kind].append(after - f.at)
            if fresh is not None:
                recoveries[f.kind].append(fresh - f.at)
                if not self.ha:
                    beyond_down.append(time_outside(f.at, fresh, self._coordinator_down))
        # A lost committed step would have to be committed again later, in another epoch.
        lost = sum(1 for p in promises.problems if "committed in epoch" in p and "and again" in p)
        problems = list(promises.problems)
        max_diff = None
        if finishers:
            final = torch.load(finishers[0].final_state, weights_only=True)["model"]
            ref = reference_state(job)
            max_diff = max((final[k] - v).abs().max().item() for k, v in ref.items())
            if max_diff > ATOL:
                problems.append(f"final model differs from single-process training by {max_diff:.2e}")
        else:
            problems.append("no node finished the job")
        if lost:
            problems.append(f"{lost} committed steps were lost")
        return ChaosReport(
            elapsed,
            self.steps,
            self.faults,
            dict(recoveries),
            lost,
            promises,
            max_diff,
            problems,
            self.links_note,
            next_commits=dict(next_commits),
            beyond_down=beyond_down,
        )


def write_report(report: ChaosReport, path: Path) -> None:
    path.write_text(json.dumps(report.summary(), indent=2) + "\n", encoding="utf-8")
