"""Goodput under constant failure: unbroken against torchrun elastic, torchft and plain DDP.

    python bench/goodput.py --short          # one rate (a failure every 10 s), ~3 min on 2 cores
    python bench/goodput.py                  # a failure every 30, 10 and 5 s (~10 min)
    python bench/goodput.py --rates 20,10 --window 120 --seed 3
    python bench/goodput.py --apart          # the systems one after the other (4x as long)
    python bench/goodput.py --short --spares 1   # one of ours' processes a hot spare

One job of ``--nodes`` processes (``bench/jobs.py``'s small MLP, B=120, a per-sample compute
of ``--sample-ms`` so that a step takes ~200 ms) trains for a window of ``--window`` seconds
while a seeded random schedule of faults hits it (`unbroken.testing.chaos.schedule`, the
soak's own draws): SIGKILL a process (a replacement starts a second later), SIGSTOP one for
1.5-3 s, SIGTERM one (a leave; a replacement a second later), start a new one (a join).
A fault that would take out the last process training, or a join beyond two spares, is
passed over (`unbroken.testing.chaos.feasible_kinds`), as in a soak.

The systems run side by side, all started together, with one failure-free window and one
window under faults for all: each fault hits every system at the same moment (the victim by
the same fraction of its processes then, in start order). On a machine others share, the
load then weighs on all alike: run one after the other (``--apart``), a system whose
replacements start while the machine is busiest waits a minute for its cold starts where
another, minutes later, waits ten seconds. Their steady-state work is a sleep (the per-sample
compute), so they take from each other mainly when processes start.

- ``unbroken``: coordinator + nodes (`unbroken.testing.LocalCluster`), cold starts. With
  ``--spares K``, K of its ``--nodes`` processes start as hot spares (``--role standby``:
  they hold the state and train nothing), and each replacement starts as one: the planner
  promotes a spare in the epoch that drops the lost trainer, and the newcomer becomes the
  next spare once warm. The baselines train on all ``--nodes``: the committed samples/s
  printed beside goodput say what the spares cost.
- ``torchrun``: ``torch.distributed.run --nnodes=1:N+2 --max-restarts=1000
  --rdzv-backend=c10d`` running plain DDP (bench/elastic_worker.py) that checkpoints every
  ``--ckpt-every`` steps and resumes; kill and stop hit the worker (its agent restarts the
  whole group from the checkpoint; a stopped worker stalls its peers' collective), a leave
  is the agent's SIGTERM, a join a new agent. The rendezvous store lives in this process
  (``is_host=false``) so that no leaving agent takes it away; ``last_call_timeout=1``;
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the store shared (torch 2.13's default) the
  workers of a restarted round read the addresses their predecessors left in it, fail to
  connect, and the group restarts over and over without training again.
- ``torchft``: torchft 0.2.0, one replica group per process (bench/torchft_worker.py),
  Manager + ProcessGroupGloo + its lighthouse (heartbeat timeout 1 s, join timeout 1 s);
  the same global batch B a step as the others: the step's quorum of P replicas trains B/P
  samples each (not torchft's default of a fixed batch per replica, whose global batch grows
  with the replicas: its samples per second and ours would not count the same). Gradients go
  through ``manager.allreduce``, not ``torchft.DistributedDataParallel``, whose comm hook in
  0.2.0 crashes the survivors of a peer's death (see bench/torchft_worker.py).
- ``ddp``: plain DDP (bench/ddp_worker.py): no recovery, no joins (a join is passed over).

Goodput = committed samples per second during the window under faults ÷ the same system's
committed samples per second in the ``--free-window`` seconds without faults just before it
(the same processes, on this machine, in this invocation: each system normalised by its own
failure-free run). Committed samples:
unbroken — B for each step committed in the window, once (the commit logs, and every
promise checked over them by `unbroken.testing.promises.check_promises`: gapless steps, one
commit epoch each, equal replicas, exactly-once samples); torchrun and DDP — B for each step
of progress (the highest step reached; steps redone after a restart count once); torchft —
B for each step its Manager committed. All four train B samples a step with the same
per-sample compute on the same number of processes (``--nodes``, plus the joins), under the
same failure schedule, so a committed sample costs each the same work.

The table and bench/results/goodput.json (``--json``) give goodput against the seconds
between failures; with matplotlib, a plot next to it (``--plot``). Where the time went, per
fault and by kind (`FaultCost`, read from each system's commit timeline): the gap to the
next new step, how long the fault was in effect (until a replacement, the woken process or
the joiner trained), and the seconds of failure-free training lost meanwhile, which add up
to ``window × (1 - goodput)``; in the JSON as ``fault_costs``, with the machine's load. The last line printed is
one JSON object: ``goodput`` (unbroken, at the rate nearest 10 s), ``failures`` (faults
applied to it, joins included; ``faults`` by kind), ``promises_kept``, ``baselines`` (name →
goodput at that rate, or why it could not run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jobs
from common import HERE, NODE_ENV, DDPRun, ProgressLine, load, machine, print_command, print_table
from unbroken.testing import LocalCluster
from unbroken.testing.chaos import Planned, feasible_kinds, schedule
from unbroken.testing.promises import check_promises, environment

SYSTEMS = ("unbroken", "torchrun", "torchft", "ddp")
SPARED = "unbroken-spares"
"""Ours again, with hot spares, beside the others when named in ``--systems`` (not by default)."""
FAULT_KINDS = ("kill", "stop", "term", "join")
RESULTS = HERE / "results" / "goodput.json"
REPLACE_AFTER_S = 1.0
"""A killed or leaving process's replacement starts this long after (as in a soak)."""


def torchft_unavailable() -> str | None:
    """Why torchft cannot run here (None: it can)."""
    try:
        import torchft  # noqa: F401
    except Exception as exc:
        return f"unavailable: import torchft failed ({type(exc).__name__}: {exc}); pip install torchft==0.2.0"
    lighthouse = Path(sys.executable).parent / "torchft_lighthouse"
    if not lighthouse.exists():
        return f"unavailable: no torchft_lighthouse next to {sys.executable}"
    return None


# ------------------------------------------------------------------ one system under test


class Proc:
    """A process of a system: ``pid`` is what kill and stop hit (a torchrun node: its worker)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes] | None, log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log
        self.held = False
        self.spawned = time.time()
        self._read = 0
        self._entries: list[dict[str, Any]] = []

    def entries(self) -> list[dict[str, Any]]:
        """The log's lines so far, read on from where the last call stopped (the bench polls
        while the processes train on the same two cores: rereading whole logs would take from them)."""
        with contextlib.suppress(FileNotFoundError), self.log.open("rb") as f:
            f.seek(self._read)
            chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
            self._read += len(whole)
            for line in whole.splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut short by SIGKILL
                    self._entries.append(json.loads(line))
        return self._entries

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def committed(self) -> bool:
        return any(e.get("kind") == "commit" for e in self.entries())

    def committed_lately(self, within_s: float = 2.0) -> bool:
        """A commit in the last ``within_s`` seconds: it holds the group's latest state (a node
        woken from SIGSTOP is alive, yet stale until it has caught up: taking the last node
        that is not would lose the job's state, as `unbroken.testing.chaos` learnt)."""
        last = next((e["t"] for e in reversed(self.entries()) if e.get("kind") == "commit"), 0.0)
        return time.time() - last < within_s


class System:
    """One system's processes; subclasses start, hit and count them."""

    name = ""
    replaces = True
    """A killed or leaving process is replaced (plain DDP cannot take one in)."""
    joins = True

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.procs: list[Proc] = []
        self.count = 0
        self.job_env = jobs.env_for(100_000, args.batch, sample_ms=args.sample_ms)
        self.env = dict(NODE_ENV, **self.job_env)

    def start(self) -> None:
        for _ in range(self.args.nodes):
            self.add()

    def add(self, replacement: bool = False) -> Proc:
        """One more process of this system, started its own way: each subclass launches its own.
        ``replacement``: it replaces one killed or gone (not a join)."""
        raise NotImplementedError

    def trainers(self) -> list[Proc]:
        """Processes that train now (alive, not stopped, committing), in start order."""
        return [p for p in self.procs if p.alive() and not p.held and p.committed_lately()]

    def ready(self) -> bool:
        """Every one of the first ``--nodes`` processes trains, past the warm-up."""
        return len(self.trainers()) >= self.args.nodes and self.progress() >= self.args.warmup

    def progress(self) -> int:
        return max((int(e["step"]) for p in self.procs for e in p.entries() if e.get("kind") == "commit"), default=0)

    def pid(self, p: Proc) -> int | None:
        return p.popen.pid if p.popen is not None else None

    def hit(self, p: Proc, sig: int) -> None:
        pid = self.pid(p)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def leave(self, p: Proc) -> None:
        self.hit(p, signal.SIGTERM)

    def samples(self, t0: float, t1: float) -> float:
        """Committed samples in ``(t0, t1]``: B per step of progress (steps redone count once)."""

        def top(t: float) -> int:
            steps = [
                int(e["step"]) for p in self.procs for e in p.entries() if e.get("kind") == "commit" and e["t"] <= t
            ]
            return max(steps, default=0)

        return float((top(t1) - top(t0)) * self.args.batch)

    def progress_after(self, faults: list[tuple[float, str]]) -> dict[str, list[float]]:
        """Fault → the first commit of a step past every step committed before it (progress
        again: a restart's redone steps and the step in flight at the fault do not count)."""
        commits = sorted((e["t"], int(e["step"])) for p in self.procs for e in p.entries() if e.get("kind") == "commit")
        out: dict[str, list[float]] = {}
        for at, kind in faults:
            top = max((step for t, step in commits if t <= at), default=0)
            after = next((t for t, step in commits if t > at and step > top + 1), None)
            if after is not None:
                out.setdefault(kind, []).append(after - at)
        return out

    def first_commits(self) -> list[tuple[float, int]]:
        """(when, step) of each step's first commit by any process, in time order (a step
        redone after a restart keeps its first time)."""
        first: dict[int, float] = {}
        for p in self.procs:
            for e in p.entries():
                if e.get("kind") == "commit":
                    first[int(e["step"])] = min(first.get(int(e["step"]), e["t"]), e["t"])
        return sorted((t, step) for step, t in first.items())

    def cold_starts(self, since: float) -> list[float]:
        """Spawn → first commit of each process started after ``since`` (replacements, joins)."""
        out = []
        for p in self.procs:
            first = next((e["t"] for e in p.entries() if e.get("kind") == "commit"), None)
            if p.spawned > since and first is not None:
                out.append(first - p.spawned)
        return out

    def over(self) -> bool:
        """Nothing can train any more (plain DDP after its first failure)."""
        return False

    def check(self) -> tuple[bool | None, str]:
        """The promises, where the system makes them."""
        return None, ""

    def close(self) -> None:
        for p in self.procs:
            if p.popen is not None and p.popen.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        p.popen.send_signal(sig)
        for p in self.procs:
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(10)


class Unbroken(System):
    name = "unbroken"

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        super().__init__(workdir, args)
        self.spares: int = args.spares
        """How many of its first ``--nodes`` processes start as hot spares."""
        self.cluster = LocalCluster(
            jobs.job_ref("small"), workdir, env=self.job_env, min_nodes=args.nodes, node_args=["--digest-every", "1"]
        )

    def start(self) -> None:
        self.cluster.start_coordinator()
        for i in range(self.args.nodes):
            self.add(spare=i >= self.args.nodes - self.spares)

    def add(self, replacement: bool = False, spare: bool = False) -> Proc:
        """With ``--spares``, a replacement starts as a hot spare: a spare took the lost
        process's place at once, and the newcomer becomes the next spare once it is warm."""
        self.count += 1
        standby = spare or (replacement and self.spares > 0)
        node = self.cluster.start_node(f"n{self.count}", extra=["--role", "standby"] if standby else [])
        p = Proc(node.name, node.proc, node.commit_log)  # type: ignore[arg-type]
        self.procs.append(p)
        return p

    def promotions(self, t0: float, t1: float) -> list[float]:
        """When, in ``(t0, t1]``, the coordinator made a hot spare a trainer (its role events)."""
        said = [e for e in self.cluster.events() if e.get("kind") == "role"]
        return [e["time"] for e in said if "standby -> trainer" in e.get("reason", "") and t0 < e["time"] <= t1]

    def samples(self, t0: float, t1: float) -> float:
        first: dict[int, float] = {}
        for p in self.procs:
            for e in p.entries():
                if e.get("kind") == "commit":
                    first[int(e["step"])] = min(first.get(int(e["step"]), e["t"]), e["t"])
        return float(sum(1 for t in first.values() if t0 < t <= t1) * self.args.batch)

    def check(self) -> tuple[bool | None, str]:
        with environment(self.env):
            job = jobs.small()
        logs = {p.name: p.entries() for p in self.procs}
        top = self.progress()
        # The window ends with the job stopped, not finished: every promise over the steps committed.
        report = check_promises(logs, dataclasses.replace(job, num_steps=top), finishers=0)
        return report.ok, "; ".join(report.problems[:3])

    def close(self) -> None:
        self.cluster.close()


class UnbrokenSpares(Unbroken):
    """Ours with ``max(1, --spares)`` hot spares, to run beside ``unbroken`` without them:
    what the spares change, under the very same load and faults."""

    name = SPARED

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        super().__init__(workdir, args)
        self.spares = max(1, args.spares)


class Torchrun(System):
    name = "torchrun"

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        super().__init__(workdir, args)
        from datetime import timedelta

        import torch.distributed as dist

        self.store: Any = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        multi_tenant=True, timeout=timedelta(seconds=60))  # fmt: skip
        (workdir / "ckpt").mkdir(parents=True, exist_ok=True)

    def add(self, replacement: bool = False) -> Proc:
        self.count += 1
        name = f"n{self.count}"
        log = self.workdir / f"{name}.jsonl"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.args.nodes + 2}", "--nproc-per-node=1",
            "--max-restarts=1000", "--monitor-interval=0.1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.store.port}", "--rdzv-id=goodput",
            "--rdzv-conf=is_host=false,last_call_timeout=1,join_timeout=120",
            str(HERE / "elastic_worker.py"), "--job", "small", "--ckpt", str(self.workdir / "ckpt"),
            "--every", str(self.args.ckpt_every), "--commit-log", str(log),
        ]  # fmt: skip
        err = open(self.workdir / f"{name}.err", "ab")  # noqa: SIM115
        # A fresh store for each round's workers: with the rendezvous store shared (the default), a
        # restarted worker reads its peers' addresses of an earlier round and fails to connect.
        env = dict(os.environ, **self.env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        popen = subprocess.Popen(cmd, stdout=err, stderr=err, env=env, start_new_session=True)
        err.close()
        p = Proc(name, popen, log)
        self.procs.append(p)
        return p

    def ready(self) -> bool:
        # The group of the first N nodes (an earlier, smaller one restarts when the last arrive).
        last = [next((e for e in reversed(p.entries()) if e.get("kind") == "ready"), None) for p in self.procs]
        full = all(e is not None and e["world"] >= self.args.nodes for e in last)
        return full and super().ready()

    def trainers(self) -> list[Proc]:
        return [p for p in super().trainers() if _running(self.pid(p))]

    def pid(self, p: Proc) -> int | None:
        """The node's current worker (torchrun restarts it under a new pid)."""
        ready = next((e for e in reversed(p.entries()) if e.get("kind") == "ready"), None)
        return int(ready["pid"]) if ready else None

    def leave(self, p: Proc) -> None:
        assert p.popen is not None
        p.popen.send_signal(signal.SIGTERM)  # the agent: it stops its worker and leaves the rendezvous

    def close(self) -> None:
        # Workers of a round still starting have logged no pid yet: every process under each
        # agent is reaped, found before the agents go (an orphan's parent is no longer its agent).
        pids = {int(e["pid"]) for p in self.procs for e in p.entries() if e.get("kind") == "ready"}
        for p in self.procs:
            if p.popen is not None:
                pids |= _descendants(p.popen.pid)
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        super().close()
        self.store = None


class Torchft(System):
    name = "torchft"

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        super().__init__(workdir, args)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"http://127.0.0.1:{port}"
        err = open(workdir / "lighthouse.err", "ab")  # noqa: SIM115
        self.lighthouse = subprocess.Popen(
            [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
             "--bind", f"127.0.0.1:{port}", "--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "1000"],
            stdout=err, stderr=err,
        )  # fmt: skip
        err.close()

    def add(self, replacement: bool = False) -> Proc:
        self.count += 1
        name = f"r{self.count}"
        log = self.workdir / f"{name}.jsonl"
        cmd = [
            sys.executable, str(HERE / "torchft_worker.py"), "--job", "small", "--replica", str(self.count),
            "--batch", str(self.args.batch), "--lighthouse", self.address, "--log", str(log),
        ]  # fmt: skip
        err = open(self.workdir / f"{name}.err", "ab")  # noqa: SIM115
        popen = subprocess.Popen(cmd, stdout=err, stderr=err, env=dict(os.environ, **self.env))
        err.close()
        p = Proc(name, popen, log)
        self.procs.append(p)
        return p

    def close(self) -> None:
        super().close()
        self.lighthouse.kill()
        self.lighthouse.wait(10)


class PlainDDP(System):
    name = "ddp"
    replaces = False
    joins = False

    def start(self) -> None:
        self.run = DDPRun("small", self.args.nodes, self.workdir, self.job_env, timeout_s=30.0)
        self.procs = [Proc(f"rank{r}", proc, self.run.log_path(r)) for r, proc in self.run.procs.items()]

    def over(self) -> bool:
        return not any(p.alive() for p in self.procs)

    def close(self) -> None:
        if hasattr(self, "run"):
            self.run.close()


MAKERS: dict[str, Callable[[Path, argparse.Namespace], System]] = {
    "unbroken": Unbroken, SPARED: UnbrokenSpares, "torchrun": Torchrun, "torchft": Torchft, "ddp": PlainDDP,
}  # fmt: skip


# ------------------------------------------------------------------ one run


@dataclasses.dataclass
class Outcome:
    system: str
    every_s: float | None
    """Seconds between faults across the job (None: the failure-free run)."""
    window_s: float
    samples: float
    applied: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    """(when, kind) of each fault applied."""
    subjects: list[Proc | None] = dataclasses.field(default_factory=list)
    """For each fault applied, the process whose training again ends it (`FaultCost`): set
    when it starts (a replacement a second after its fault), None while it has not."""
    passed_over: int = 0
    promises: bool | None = None
    problems: str = ""
    recoveries: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Fault → progress again (`System.progress_after`), by kind."""
    cold_starts: list[float] = dataclasses.field(default_factory=list)
    costs: list[FaultCost] = dataclasses.field(default_factory=list)
    """What each fault applied cost (`fault_costs`), in the order applied."""
    lost_unowned_s: float = 0.0
    """Training lost while no fault was in effect (`FaultCost`): the load's, or a step's jitter."""
    promotions: list[float] = dataclasses.field(default_factory=list)
    """Each hot spare made trainer in the window (``--spares``): seconds since the latest kill,
    stop or leave before it."""

    free_window_s: float = 0.0
    free_samples: float = 0.0
    """Committed in the failure-free window before the faults' (the same processes)."""

    @property
    def rate(self) -> float:
        return self.samples / self.window_s

    @property
    def free_rate(self) -> float:
        return self.free_samples / self.free_window_s

    @property
    def goodput(self) -> float | None:
        return round(self.rate / self.free_rate, 3) if self.free_rate > 0 else None


@dataclasses.dataclass
class FaultCost:
    """What one fault cost a system, read from its commit timeline.

    A fault is in effect from the moment it hits until the process it concerns trains again
    (its first commit after the fault): a killed or leaving process's replacement, a stopped
    one once woken, a joiner; torchrun's restarted worker; never, for plain DDP's dead rank.
    The window is cut wherever a fault starts or ends; each piece lost ``length - committed
    samples / failure-free rate`` seconds of training, shared equally by the faults in effect
    over it that took a process away (kill, stop, leave), or by the joins in effect where
    none did (a piece with no fault in effect is the load's: `Outcome.lost_unowned_s`). The
    costs thus add up to ``window × (1 - goodput)``, and overlapping faults split what they
    lose together instead of the later one taking the earlier one's tail."""

    at_s: float
    """When, in seconds from the window's start."""
    kind: str
    gap_s: float | None
    """Fault -> the first commit of a step never committed before (None: none in the window)."""
    effect_s: float
    """Fault -> the process it concerns trains again (the window's end if it never did)."""
    lost_s: float
    """Seconds of failure-free training lost while it was in effect (its share of them)."""


def fault_costs(system: System, out: Outcome, t0: float, t1: float) -> tuple[list[FaultCost], float]:
    """Each applied fault's cost (`FaultCost`) over ``(t0, t1]``, and what the pieces of the
    window with no fault in effect lost."""
    rate = out.free_rate
    if rate <= 0:
        return [], 0.0
    commits = system.first_commits()
    ends = []
    for (at, _), subject in zip(out.applied, out.subjects, strict=True):
        back = None if subject is None else next(
            (e["t"] for e in subject.entries() if e.get("kind") == "commit" and e["t"] > at), None)  # fmt: skip
        ends.append(min(back, t1) if back is not None else t1)
    cuts = sorted({t0, t1, *(at for at, _ in out.applied), *ends})
    lost = [0.0] * len(out.applied)
    unowned = 0.0
    for a, b in itertools.pairwise(cuts):
        piece = b - a - system.samples(a, b) / rate
        active = [i for i, (at, _) in enumerate(out.applied) if at <= a and ends[i] >= b]
        # A joiner starting takes no process away: what is lost meanwhile is a fault's that did
        # (a replacement still starting), and the join's own only where none is in effect.
        owners = [i for i in active if out.applied[i][1] != "join"] or active
        if not owners:
            unowned += piece
        for i in owners:
            lost[i] += piece / len(owners)
    costs = []
    for i, (at, kind) in enumerate(out.applied):
        top = max((step for t, step in commits if t <= at), default=0)
        first = next((t for t, step in commits if at < t <= t1 and step > top), None)
        costs.append(FaultCost(
            at_s=round(at - t0, 2), kind=kind, gap_s=None if first is None else round(first - at, 3),
            effect_s=round(ends[i] - at, 2), lost_s=round(lost[i], 3),
        ))  # fmt: skip
    return costs, round(unowned, 3)


def run_together(
    systems: list[System], plan: list[Planned], free_s: float, window_s: float, progress: ProgressLine, label: str
) -> list[Outcome]:
    """Start the systems and wait for every one's warm-up; then ``free_s`` seconds without
    faults, then ``window_s`` seconds in which ``plan`` hits each of them at the same moments
    (its times from that window's start); count both windows for each."""
    args = systems[0].args
    due: list[tuple[float, Callable[[], object]]] = []
    outs = [Outcome(x.name, None, window_s, 0.0, free_window_s=free_s) for x in systems]
    shown = 0.0
    try:
        for x in systems:
            x.start()
        deadline = time.monotonic() + args.start_timeout
        while not all(x.ready() for x in systems):
            for x in systems:
                if not any(q.alive() for q in x.procs):
                    raise RuntimeError(f"{label}: {x.name}: every process exited before training "
                                       f"(see {x.workdir}/*.err)")  # fmt: skip
            if time.monotonic() > deadline:
                late = [x.name for x in systems if not x.ready()]
                raise RuntimeError(f"{label}: {late} not training on {args.nodes} processes after "
                                   f"{args.start_timeout:.0f} s (keep their logs with --workdir)")  # fmt: skip
            time.sleep(0.2)
        t_free = time.time()
        t0 = t_free + free_s
        pending = list(plan)
        while time.time() < t0 + window_s and not all(x.over() for x in systems):
            now = time.time()
            for item in [d for d in due if d[0] <= now]:
                due.remove(item)
                item[1]()
            if pending and now >= t0 + pending[0].at:
                fault = pending.pop(0)
                for x, out in zip(systems, outs, strict=True):
                    if not x.over():
                        _apply(x, fault, out, due)
            if now - shown >= 2.0:
                shown = now
                where = f"without faults {now - t_free:3.0f}/{free_s:.0f} s" if now < t0 else (
                    f"faults {now - t0:3.0f}/{window_s:.0f} s, {len(outs[0].applied)} so far")  # fmt: skip
                steps = ", ".join(f"{x.name} {x.progress()}" for x in systems)
                progress.update(f"{label}: {where}; steps {steps}")
            time.sleep(0.05)
        time.sleep(0.5)  # the last commits' lines reach the logs
        for x, out in zip(systems, outs, strict=True):
            out.free_samples = x.samples(t_free, t0)
            out.samples = x.samples(t0, t0 + window_s)
            out.recoveries = x.progress_after(out.applied)
            out.cold_starts = x.cold_starts(t0)
            out.costs, out.lost_unowned_s = fault_costs(x, out, t0, t0 + window_s)
            if isinstance(x, Unbroken):
                losses = [at for at, kind in out.applied if kind != "join"]
                out.promotions = [
                    round(t - max(at for at in losses if at <= t), 3)
                    for t in x.promotions(t0, t0 + window_s)
                    if any(at <= t for at in losses)
                ]
    finally:
        for x in systems:
            x.close()
    for x, out in zip(systems, outs, strict=True):
        out.promises, out.problems = x.check()
    return outs


def _apply(system: System, f: Planned, out: Outcome, due: list[tuple[float, Callable[[], object]]]) -> None:
    trainers = system.trainers()
    alive = [p for p in system.procs if p.alive()]
    feasible = feasible_kinds(
        training=len(trainers), slowable=0, alive=len(alive), nodes=system.args.nodes, links=False
    )
    if f.kind not in feasible or (f.kind == "join" and not system.joins):
        out.passed_over += 1
        return
    out.applied.append((time.time(), f.kind))
    index = len(out.subjects)
    out.subjects.append(None)
    if f.kind == "join":
        out.subjects[index] = system.add()
        return
    victim = trainers[int(f.pick * len(trainers))]
    if f.kind == "stop":
        system.hit(victim, signal.SIGSTOP)
        victim.held = True
        out.subjects[index] = victim
        pid = system.pid(victim)

        def wake() -> None:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            victim.held = False

        due.append((time.time() + f.lasts, wake))
        return
    if f.kind == "kill":
        system.hit(victim, signal.SIGKILL)
    else:
        system.leave(victim)
    if f.kind == "kill" and isinstance(system, Torchrun):
        out.subjects[index] = victim  # its agent restarts the worker (the whole group) itself
    elif system.replaces:  # a node that left or died is replaced

        def replace() -> None:
            out.subjects[index] = system.add(replacement=True)

        due.append((time.time() + REPLACE_AFTER_S, replace))


# ------------------------------------------------------------------ report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="one rate (10 s), short windows: ~6 min on 2 cores")
    p.add_argument("--rates", default="30,10,5", help="seconds between faults across the job, comma-separated")
    p.add_argument("--window", type=float, default=90.0, help="seconds of training under faults, per run")
    p.add_argument("--free-window", type=float, default=30.0, help="seconds of the failure-free runs")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="of unbroken's --nodes processes, how many start as hot spares (--role standby); its "
        "replacements then start as spares too. The baselines train on all --nodes",
    )
    p.add_argument("--batch", type=int, default=120, help="global batch B (divisible by 1..N+2 for torchrun)")
    p.add_argument("--sample-ms", type=float, default=4.0, help="emulated compute per sample, ms")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun worker's checkpoint interval, steps")
    p.add_argument("--warmup", type=int, default=5, help="steps before a window starts")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"some of {','.join((*SYSTEMS, SPARED))}")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument(
        "--apart",
        action="store_true",
        help="run the systems one after the other (default: side by side, hit at the same moments)",
    )
    p.add_argument("--json", default=str(RESULTS), help="where the results go ('' for nowhere)")
    p.add_argument("--plot", default=str(RESULTS.with_suffix(".png")), help="the plot (needs matplotlib; '' for none)")
    p.add_argument("--workdir", help="keep the logs here (default: a temporary directory)")
    args = p.parse_args()
    # Stopped from outside (SIGTERM), the runs' `finally` still reaps every process they started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.short:
        args.rates, args.window, args.free_window = "10", 40.0, 15.0
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        p.error(f"--rates {args.rates!r}: give seconds between faults, comma-separated, e.g. 30,10,5")
    if any(r <= 0 for r in rates):
        p.error(f"--rates {args.rates!r}: every interval must be positive seconds")
    if not 0 <= args.spares < args.nodes:
        p.error(f"--spares {args.spares}: give 0 to {args.nodes - 1} (at least one of --nodes {args.nodes} must train)")
    if SPARED in args.systems and args.nodes < 2:
        p.error(f"--systems {SPARED}: needs --nodes 2 or more (one trains, one stands by)")
    systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in systems if s not in (*SYSTEMS, SPARED)]:
        p.error(f"--systems: {unknown} unknown; use some of {','.join((*SYSTEMS, SPARED))}")
    for w in range(1, args.nodes + 3):
        if "torchrun" in systems and args.batch % w:
            p.error(f"--batch {args.batch}: torchrun's DDP needs it divisible by every world size 1..{args.nodes + 2}")
    print_command()
    unavailable = {"torchft": why} if "torchft" in systems and (why := torchft_unavailable()) else {}
    print(
        f"model small ({jobs.num_params('small'):,} parameters), B={args.batch}, {args.nodes} processes, "
        f"{args.sample_ms} ms compute per sample (a sleep: the CPUs stay free), OMP_NUM_THREADS=1; "
        f"windows {args.window:.0f} s under faults, {args.free_window:.0f} s without; seed {args.seed}\n"
        "goodput = committed samples/s under faults ÷ committed samples/s without faults, each system "
        "normalised by its own failure-free run (the same processes, the window just before the faults) "
        "on this machine in this invocation",
        flush=True,
    )
    runnable = [s for s in systems if s not in unavailable]
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-goodput-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    progress = ProgressLine(len(runnable) * len(rates))
    faulted: dict[tuple[str, float], Outcome] = {}
    try:
        for every in rates:
            plan = schedule(args.seed, 1.0 / every, args.window, kinds=FAULT_KINDS)
            for group in [[x] for x in runnable] if args.apart else [runnable]:
                label = f"{'+'.join(group)}, a fault every {every:g} s"
                made = [MAKERS[x](root / f"{x}-{every:g}", args) for x in group]
                for o in run_together(made, plan, args.free_window, args.window, progress, label):
                    o.every_s = every
                    faulted[(o.system, every)] = o
                    progress.update(f"{o.system}, a fault every {every:g} s: {o.free_rate:.0f} samples/s without "
                                    f"faults, goodput {o.goodput}", advance=1)  # fmt: skip
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()

    def goodput(s: str, every: float) -> float | None:
        o = faulted.get((s, every))
        return o.goodput if o else None

    rows = []
    for every in rates:
        ours = faulted.get(("unbroken", every))
        row: list[Any] = [f"{every:g} s ({every * args.nodes:g} s per node)"]
        for s in systems:
            g = goodput(s, every)
            row.append(unavailable.get(s, "-") if g is None else f"{g:.2f}")
        row.append(", ".join(f"{k} {n}" for k, n in _kinds(ours)) if ours else "-")
        row.append("-" if ours is None or ours.promises is None else ("kept" if ours.promises else "BROKEN"))
        rows.append(row)
    free = [" / ".join(f"{o.free_rate:.0f}" for e in rates if (o := faulted.get((s, e)))) or "-" for s in systems]
    rows.append(["samples/s without faults (each run's)", *free, "", ""])
    under = [" / ".join(f"{o.rate:.0f}" for e in rates if (o := faulted.get((s, e)))) or "-" for s in systems]
    rows.append(["committed samples/s under faults", *under, "", ""])
    print_table(
        "Goodput against failure rate (1.00 = as fast as without faults)",
        ["seconds between faults (across the job)", *systems, "faults applied to unbroken", "promises (unbroken)"],
        rows,
        caption=f"each system normalised by its own failure-free window ({args.free_window:.0f} s, the same "
        "processes just before the faults) on this machine, in this invocation; faults: SIGKILL, "
        f"SIGSTOP 1.5-3 s, SIGTERM (leave), join; seed {args.seed}; every system runs {args.nodes} processes"
        + (
            f", of which unbroken's {args.spares} start as hot spares (they train nothing until promoted)"
            if args.spares
            else ""
        )
        + (
            f"; {SPARED}: unbroken with {max(1, args.spares)} of them hot spares, beside the others"
            if SPARED in systems
            else ""
        ),
    )
    print_table(
        "Each run: the failure-free window, then the window under faults (same processes)",
        ["system", "seconds between faults", "samples/s without", "samples/s under faults", "goodput",
         "faults applied", "passed over"],
        [
            [s, f"{e:g}", f"{o.free_rate:.0f}", f"{o.rate:.0f}", o.goodput,
             ", ".join(f"{k} {n}" for k, n in _kinds(o)) or "-", o.passed_over]
            for e in rates for s in systems if (o := faulted.get((s, e)))
        ],
        caption="passed over: a fault that would take out the last trainer, a join beyond two spares, "
        "or a join plain DDP cannot take",
    )  # fmt: skip
    print_table(
        "Where the time goes: medians in seconds (count)",
        ["system", "seconds between faults", "spawn -> first commit (replacements, joins)",
         *[f"{k} -> progress again" for k in FAULT_KINDS], "fault -> spare promoted"],
        [
            [s, f"{e:g}", _med(o.cold_starts), *[_med(o.recoveries.get(k, [])) for k in FAULT_KINDS],
             _med(o.promotions)]
            for e in rates for s in systems if (o := faulted.get((s, e)))
        ],
        caption="progress again: the first commit of a step past the one in flight at the fault "
        "(a restart's redone steps do not count); a stop lasts 1.5-3 s; spare promoted (--spares): "
        "the coordinator's role event that made a hot spare a trainer, from the kill, stop or leave before it",
    )  # fmt: skip
    cost_title = "What each kind of fault cost: seconds of failure-free training lost"
    cost_columns = ["system", "seconds between faults", "fault", "count", "gap (median s)",
                    "in effect (median s)", "lost s per fault (mean)", "lost s (all)", "share of the loss"]  # fmt: skip
    cost_rows = [row for e in rates for s in systems if (o := faulted.get((s, e))) for row in _cost_rows(o)]
    print_table(
        cost_title,
        cost_columns,
        cost_rows,
        caption="in effect: from the fault until the process it concerns trains (a replacement, the stopped one "
        "woken, a joiner); lost: seconds of failure-free training lost meanwhile, shared by the faults in effect "
        "together, so a system's rows add up to window x (1 - goodput); gap: fault -> the first commit of a new step",
    )
    for every in rates:
        o = faulted.get(("unbroken", every))
        if o is not None and o.problems:
            print(f"unbroken, a fault every {every:g} s: promises broken: {o.problems}")
    results = {
        "rates": rates,
        "ours": [goodput("unbroken", e) for e in rates],
        "baselines": {
            s: [goodput(s, e) for e in rates] if s not in unavailable else unavailable[s]
            for s in systems
            if s != "unbroken"
        },
        "free_samples_per_s": {
            s: [round(o.free_rate, 1) if (o := faulted.get((s, e))) else None for e in rates] for s in runnable
        },
        "samples_per_s": {
            s: [round(o.rate, 1) if (o := faulted.get((s, e))) else None for e in rates] for s in runnable
        },
        "spares": args.spares,
        "promotions_s": {
            s: {f"{e:g}": o.promotions for e in rates if (o := faulted.get((s, e)))}
            for s in ("unbroken", SPARED)
            if s in runnable
        },
        "fault_costs": {
            s: {
                f"{e:g}": {"lost_unowned_s": o.lost_unowned_s, "faults": [dataclasses.asdict(c) for c in o.costs]}
                for e in rates
                if (o := faulted.get((s, e)))
            }
            for s in runnable
        },
        "tables": [{"title": cost_title, "columns": cost_columns, "rows": cost_rows}],
        "machine": machine(),
        "load": load(),
        "together": not args.apart,
        "window_s": args.window,
        "free_window_s": args.free_window,
        "nodes": args.nodes,
        "seed": args.seed,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"results: {args.json}")
    if args.plot:
        _plot(results, systems, Path(args.plot))
    at = min(rates, key=lambda r: abs(r - 10.0))
    ours = faulted.get(("unbroken", at))
    last = {
        "goodput": goodput("unbroken", at),
        "seconds_between_faults": at,
        "failures": len(ours.applied) if ours else 0,
        "faults": dict(_kinds(ours)) if ours else {},
        "promises_kept": ours.promises if ours else None,
        "baselines": {
            s: goodput(s, at) if s not in unavailable else unavailable[s] for s in systems if s != "unbroken"
        },
        "spares": args.spares,
        "samples_per_s": {s: round(o.rate, 1) for s in systems if (o := faulted.get((s, at)))},
    }
    print(json.dumps(last))


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _running(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a worker that exited but whose agent has not reaped it yet is no trainer
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    return True


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({len(xs)})" if xs else "-"


def _cost_rows(o: Outcome) -> list[list[Any]]:
    """`FaultCost`s by kind: one row each, then the time no fault was in effect."""
    lost = o.window_s * (1 - (o.goodput or 0.0))
    rows: list[list[Any]] = []
    for kind in FAULT_KINDS:
        cs = [c for c in o.costs if c.kind == kind]
        if not cs:
            continue
        total = sum(c.lost_s for c in cs)
        gaps = [c.gap_s for c in cs if c.gap_s is not None]
        rows.append([o.system, f"{o.every_s:g}", kind, len(cs), f"{statistics.median(gaps):.2f}" if gaps else "-",
                     f"{statistics.median(c.effect_s for c in cs):.1f}", f"{total / len(cs):.2f}", f"{total:.1f}",
                     f"{total / lost:.0%}" if lost > 0 else "-"])  # fmt: skip
    rows.append([o.system, f"{o.every_s:g}", "none in effect", "", "", "", "", f"{o.lost_unowned_s:.1f}",
                 f"{o.lost_unowned_s / lost:.0%}" if lost > 0 else "-"])  # fmt: skip
    return rows


def _kinds(o: Outcome) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for _, k in o.applied:
        counts[k] = counts.get(k, 0) + 1
    return sorted(counts.items())


def _plot(results: dict[str, Any], systems: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib); the table above has the figures")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    series = {"unbroken": results["ours"], **results["baselines"]}
    for s in systems:
        ys = series.get(s)
        if isinstance(ys, list) and any(y is not None for y in ys):
            ax.plot(results["rates"], ys, marker="o", label=s)
    ax.set_xlabel("seconds between faults (across the job)")
    ax.set_ylabel("goodput (vs. its own failure-free run)")
    ax.set_ylim(0, 1.1)
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
