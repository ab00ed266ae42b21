"""A job in one process: the library's own nodes as threads, their groups in memory, the
test as the leader.

For unit tests of the step loop (synchronous steps, DiLoCo rounds, the sync phase between
epochs) with deterministic faults and without sockets or processes. Each node is a real
`Node`, given an in-memory control plane (`MemoryControl`) and data plane (`MemoryGroups`,
on `unbroken.testing.fake`); the test orders the epochs and reads what nodes told the leader::

    with MemoryJob(job, ["a", "b", "c"], tmp_path, faults={"c": Crash("exchange", 9)}) as mj:
        mj.order(["a", "b", "c"])
        mj.wait_fault(timeout=30)               # a and b lost c mid-exchange
        mj.order(["a", "b"], urgent=True)
        results = mj.join(60)
    check_promises(mj.logs(), job)
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from unbroken.comm.group import EpochScope, ProcessGroup
from unbroken.config import NodeConfig
from unbroken.control import messages as m
from unbroken.control.client import Listener, Notice
from unbroken.errors import JoinRefused
from unbroken.events import Entry
from unbroken.job import Job
from unbroken.specs import Policy, Role
from unbroken.testing.fake import FakeWorld
from unbroken.train.hooks import Build, Faults, NoFaults, Record
from unbroken.train.runtime import Node, NodeResult

WELCOME = m.Welcome(lease_s=1.0, heartbeat_s=0.25, coordinator_id="memory", build_deadline_s=5.0)


class Crashed(BaseException):
    """An in-memory node's crash: its thread ends here, as a killed process would (no
    handler of the step loop catches it; its session is closed on the way out)."""


class Crash(NoFaults):
    """A node that dies at ``phase`` of ``step`` (the phases of `Faults.maybe_fire`, e.g.
    ``exchange``: right after its part of a collective went out): its peers' collectives of
    that epoch fail, as a killed process's connections do. ``delivered``: it dies once what
    it sent has arrived (its collectives in flight complete first), as a process killed a
    moment later would; otherwise they fail too, whether or not every peer had joined them."""

    def __init__(self, phase: str, step: int, *, delivered: bool = False) -> None:
        self.phase, self.step, self.delivered = phase, step, delivered
        self.fired = False
        self.die: Callable[[bool], None] = lambda delivered: None
        """What the node's death does to its groups (set by `MemoryJob`)."""
        self._record: Record | None = None

    def attach(self, record: Record) -> None:
        self._record = record

    def maybe_fire(self, phase: str, step: int) -> None:
        if self.fired or (phase, step) != (self.phase, self.step):
            return
        self.fired = True
        if self._record is not None:
            self._record(Entry.FAULT, {"signal": "kill", "phase": phase, "step": step, "pid": 0})
        self.die(self.delivered)
        raise Crashed(f"crashed at {phase} of step {step}")


class MemoryGroups:
    """Every epoch's process groups: the members asking for group ``name`` of epoch ``e``
    each get their rank's view of one `FakeWorld`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worlds: dict[tuple[int, str], tuple[FakeWorld, list[str]]] = {}
        self.met: Callable[[int, str], None] = lambda epoch, key: None
        """What a build's rendezvous entry does (set by `MemoryJob`: every node sees it)."""

    def world(self, epoch: int, name: str, ids: Sequence[str]) -> FakeWorld:
        with self._lock:
            world, members = self._worlds.setdefault((epoch, name), (FakeWorld(len(ids)), list(ids)))
        if members != list(ids):
            raise RuntimeError(f"group {name} of epoch {epoch}: members {list(ids)} against {members}")
        return world

    def maker(self, epoch: int, scope: EpochScope) -> Build:
        """`unbroken.train.hooks.GroupMaker`: built at once (there is nothing to connect)."""

        def build(
            name: str, rank: int, ids: list[str], lazy: bool = False, streams: int = 1
        ) -> tuple[ProcessGroup, float]:
            world = self.world(epoch, name, ids)
            self.met(epoch, f"{name}/0/{rank}")
            return world.group(rank), 0.0

        return build

    def kill(self, member: str, delivered: bool = False, timeout_s: float = 10.0) -> None:
        """``member`` died: every group it is in fails on the others (what they have posted
        and what they post later); ``delivered``: once its collectives in flight in its
        latest epoch completed (raises if they do not within ``timeout_s``)."""
        with self._lock:
            mine = [(e, w, ids.index(member)) for (e, _), (w, ids) in self._worlds.items() if member in ids]
        latest = max((e for e, _, _ in mine), default=0)
        current = [(w, r) for e, w, r in mine if e == latest]
        deadline = time.monotonic() + timeout_s
        while delivered and not all(w.delivered(r) for w, r in current):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{member}'s collectives of epoch {latest} did not complete in {timeout_s:g} s")
            time.sleep(0.001)
        for world, rank in [(w, r) for _, w, r in mine]:
            world.kill(rank)


class MemoryControl:
    """A node's session with the in-memory leader (`unbroken.train.hooks.Control`)."""

    def __init__(self, job: MemoryJob, member_id: str) -> None:
        self._job = job
        self.member_id = member_id
        self.welcome: m.Welcome | None = None
        self.expelled: str | None = None
        self.quarantined = False
        self.finished: int | None = None
        self.halted: str | None = None
        self.final_digest = ""
        self.step = 0
        self.lapses = 0
        self.rtt_s = 0.0
        self.listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def tell(self, notice: Notice) -> None:
        """Deliver ``notice`` as the leader's session would."""
        for listener in self.listeners:
            listener(notice)

    def expel(self, reason: str) -> None:
        self.expelled = reason

    def start(self) -> m.Welcome:
        self.welcome = WELCOME
        return WELCOME

    def rejoin(self) -> m.Welcome:
        raise JoinRefused(f"{self.member_id}: in-memory members are never expelled, so never rejoin")

    def close(self) -> None:
        pass

    def send(self, msg: BaseModel) -> None:
        self._job.receive(self.member_id, msg)

    def touch(self) -> None:
        pass

    def latest_order(self) -> m.EpochOrder | None:
        return self._job.latest_order()

    def commit_allowed(self) -> bool:
        return True


class MemoryJob:
    """``names`` nodes of ``job`` as threads of this process (see the module docstring).
    Each writes its commit log and final state under ``workdir``. The threads share torch's,
    Python's and numpy's global generators: a job that draws from them as it trains
    (dropout, an unseeded shuffle) is not exact here as it is across processes."""

    def __init__(
        self,
        job: Job,
        names: Sequence[str],
        workdir: Path,
        *,
        policy: Policy | None = None,
        zones: Mapping[str, str] | None = None,
        faults: Mapping[str, Faults] | None = None,
        collective_timeout_s: float = 20.0,
        checkpoint_every: int = 0,
        max_donors: int = 0,
    ) -> None:
        """``checkpoint_every``: each node checkpoints into ``workdir/<name>-ckpt`` (0: none);
        ``max_donors``: the donors a node catching up asks (`NodeConfig.max_donors`)."""
        self.job = job
        self.workdir = workdir
        self.policy = m.PolicyMsg.of(policy or Policy())
        self.zones = dict(zones or {})
        self.groups = MemoryGroups()
        self.groups.met = self._met
        self._lock = threading.Lock()
        self._orders: list[m.EpochOrder] = []
        self.received: list[tuple[str, BaseModel]] = []
        """What the nodes sent the leader, in order."""
        self.results: dict[str, NodeResult | BaseException] = {}
        self.nodes: dict[str, Node] = {}
        faults = faults or {}
        for name in names:  # one at a time: building a model draws from torch's global generator
            fault = faults.get(name)
            if isinstance(fault, Crash):
                fault.die = functools.partial(self.groups.kill, name)
            config = NodeConfig(
                coordinators=(("memory", 0),),
                name=name,
                zone=self.zones.get(name, ""),
                commit_log=workdir / f"{name}.jsonl",
                final_state=workdir / f"{name}.pt",
                collective_timeout_s=collective_timeout_s,
                checkpoint_dir=workdir / f"{name}-ckpt" if checkpoint_every else None,
                checkpoint_every=checkpoint_every,
                max_donors=max_donors,
            )
            self.nodes[name] = Node(
                job, config, fault, control=lambda node: MemoryControl(self, node.name), groups=self.groups.maker
            )
        unknown = sorted(set(faults) - set(self.nodes))
        if unknown:
            raise ValueError(f"faults for {unknown}, who are not among the nodes {list(self.nodes)}")
        # Daemons: a node a failed test left waiting must not keep the interpreter alive.
        self._threads = [
            threading.Thread(target=self._run, args=(n,), name=f"node-{n}", daemon=True) for n in self.nodes
        ]

    def __enter__(self) -> MemoryJob:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes.values():  # whatever still runs leaves between steps...
            node.request_leave()
        try:
            self.join(10)
        except TimeoutError:
            for name in self.nodes:  # ...or, stuck in a collective, when its groups fail
                self.groups.kill(name)
            try:
                self.join(60)
            except TimeoutError:
                if exc[0] is None:  # else the test's own failure is the one to see
                    raise

    def _run(self, name: str) -> None:
        try:
            self.results[name] = self.nodes[name].run()
        except BaseException as exc:  # a crash, or a failure the test reports
            self.results[name] = exc

    # ---------------------------------------------------------------- the leader's part

    def order(
        self,
        members: Sequence[str],
        *,
        urgent: bool = False,
        reason: str = "ordered by the test",
        roles: Mapping[str, Role] | None = None,
        microbatch: int = 0,
    ) -> int:
        """Order the next epoch: ``members`` in rank order, equal shares, all trainers but
        those ``roles`` names (a validator or standby, without a share); ``microbatch``:
        the micro-batch size of every trainer (0: a slice's whole share, memory allowing)."""
        B = self.job.batch_size
        kinds = [(roles or {}).get(name, Role.TRAINER) for name in members]
        k = kinds.count(Role.TRAINER)
        split = iter([B // k + (1 if r < B % k else 0) for r in range(k)])
        shares = [next(split) if kind is Role.TRAINER else 0 for kind in kinds]
        zones = [self.zones.get(name, "") for name in members]
        ring = list(dict.fromkeys(zones)) if any(zones) else []
        with self._lock:
            epoch = len(self._orders) + 1
            order = m.EpochOrder(
                epoch=epoch, members=list(members), shares=shares, urgent=urgent, reason=reason,
                roles=kinds, zones=zones if any(zones) else [], ring=ring, policy=self.policy,
                microbatches=[min(microbatch, s) for s in shares] if microbatch else [],
            )  # fmt: skip
            self._orders.append(order)
        for node in self.nodes.values():
            node.wake.set()
        return epoch

    def latest_order(self) -> m.EpochOrder | None:
        with self._lock:
            return self._orders[-1] if self._orders else None

    def _met(self, epoch: int, key: str) -> None:
        """A rendezvous entry, handed to every node as the leader hands them out (`m.Met`)."""
        for node in list(self.nodes.values()):
            node.epochs.meeting.deliver(epoch, {key: b"memory"})
            node.wake.set()

    def finish(self, step: int, digest: str) -> None:
        """The job is over at ``step`` with the state of ``digest`` (what `m.Finished` says)."""
        for node in self.nodes.values():
            node.client.final_digest = digest  # first, as `ControlClient` does
            node.client.finished = step
            node.wake.set()

    def receive(self, member: str, msg: BaseModel) -> None:
        with self._lock:
            self.received.append((member, msg))

    def faults(self) -> list[tuple[str, m.Fault]]:
        """The failures nodes reported, in order."""
        with self._lock:
            return [(who, msg) for who, msg in self.received if isinstance(msg, m.Fault)]

    def wait_fault(self, timeout: float, count: int = 1) -> list[tuple[str, m.Fault]]:
        """Wait until nodes reported ``count`` failures (raises after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while len(self.faults()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.faults())} of {count} failures reported in {timeout:g} s")
            time.sleep(0.01)
        return self.faults()

    # ---------------------------------------------------------------- the end

    def join(self, timeout: float) -> dict[str, NodeResult | BaseException]:
        """Wait for every node's thread; how each ended (raises if one is still running)."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(max(0.0, deadline - time.monotonic()))
        running = [t.name for t in self._threads if t.is_alive()]
        if running:
            raise TimeoutError(f"{', '.join(running)} still running after {timeout:g} s")
        return dict(self.results)

    def logs(self) -> dict[str, list[dict[str, Any]]]:
        """Each node's commit log (what `unbroken.testing.promises.check_promises` reads)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for name in self.nodes:
            path = self.workdir / f"{name}.jsonl"
            out[name] = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return out
