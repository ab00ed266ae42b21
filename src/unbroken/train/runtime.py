"""The node runtime: join, form epochs, sync, and run the step loop until the job is done.

One step, for the trainer at rank ``r`` of epoch ``e``::

    slice of step s (DataPlan) ─▶ forward/backward in micro-batches, loss scaled by m/B
      ─▶ flat gradient + [vote=1, samples=m, switch, loss] ─▶ all-reduce (abortable)
      ─▶ commit iff votes == members and samples == B and the lease fence holds
      ─▶ optimizer step, step += 1, cursor += B

The vote rides in the same all-reduce as the gradient, so a step costs one collective.
``switch`` is how a graceful epoch change (join, leave) takes effect at a step boundary
every member agrees on: the first all-reduce in which any member has seen the new order
carries a non-zero switch, and everyone moves to the new epoch right after committing it.
A failure order is urgent instead: the step in flight is abandoned at once.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import math
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from unbroken.comm.codecs import Codec, make_codec
from unbroken.comm.group import PUBLISH_S, EpochGroup, Graveyard, Meeting, build_group, wait_until
from unbroken.comm.reach import Stall, accuse, reach, unreachable_fault
from unbroken.comm.reduce import LinkEmulation, Reducer, Wire
from unbroken.comm.robust import NORM_TOLERANCE
from unbroken.comm.transfer import Partial, gather_digests, sync_state
from unbroken.config import NodeConfig
from unbroken.control import messages as m
from unbroken.control.client import ControlClient
from unbroken.control.meeting import with_port
from unbroken.errors import (
    AuditMismatch,
    BadContribution,
    CollectiveFailed,
    CoordinatorUnreachable,
    EpochAborted,
    Expelled,
    JobFailed,
    JoinRefused,
    Suspicion,
    TransferError,
    Unreachable,
)
from unbroken.job import Job, StepInfo
from unbroken.sched.shares import offsets
from unbroken.sched.zones import WORLD, Zones
from unbroken.specs import Rule, parse_fragments, parse_rule
from unbroken.state.checkpoint import Checkpointer, load_newest, set_aside
from unbroken.state.fragments import rebuild
from unbroken.state.snapshot import TrainState, fingerprint
from unbroken.testing.faults import LIES, Fault, FaultPlan, flip_bit
from unbroken.testing.throttle import parse_throttle
from unbroken.train.candidate import Candidate
from unbroken.train.device import ComputeReplica, OutOfMemory, resolve_device
from unbroken.train.diloco import DiLoCo
from unbroken.train.guard import judge
from unbroken.train.measure import Meter
from unbroken.train.sidecar import Sidecar
from unbroken.train.sync import audit

log = logging.getLogger(__name__)

_EXTRA = 4  # vote, samples, switch, loss; then one gradient-norm slot per member
LEAVE_GRACE_S = 5.0
PROGRESS_EVERY_S = 0.05
"""How often progress is reported until a coordinator says (`Welcome.report_s`)."""
PROGRESS_LOG_EVERY_S = 10.0
RECENT_MAX = 512
"""Steps kept for the next progress report (the message's limit)."""
VALIDATE_EVERY_S = 0.5


def _zones(order: m.EpochOrder) -> Zones:
    return Zones(tuple(order.zones) if order.zones else tuple("" for _ in order.members))


@dataclass
class NodeResult:
    """How a node's run ended."""

    outcome: str
    """``finished`` (reached the last step), ``left`` (graceful leave) or ``job-finished``
    (the group finished before this node could contribute)."""
    step: int
    digest: str
    epochs: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class Node:
    """One training process. ``Node(job, config).run()`` blocks until the job is done."""

    def __init__(self, job: Job, config: NodeConfig, faults: list[Fault] | None = None) -> None:
        self.job = job
        self.config = config
        self.name = config.display_name
        self.wake = threading.Event()
        model, optimizer = job.build()
        scheduler, extra = job.build_scheduler(optimizer), job.build_state(model)
        self.state = TrainState(model, optimizer, scheduler=scheduler, extra=extra)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Buffers a forward pass updates (BatchNorm statistics) travel in the same
        # all-reduce as the gradients, so replicas stay bit-identical between syncs.
        self.buffers = [b for b in model.buffers() if b.dtype.is_floating_point or b.dtype == torch.int64]
        self.device = resolve_device(config.device)
        self.replica = ComputeReplica(model, self.device)
        self.compute_buffers = list(self.replica.buffers())
        self.throttle = parse_throttle(config.throttle)
        self.meter = Meter(job, self.replica, self.throttle, self.name)
        self._used_mb = 0
        self._last_validation = 0.0
        self.sidecar: Sidecar | None = None
        self.numel = sum(p.numel() for p in self.params) + sum(b.numel() for b in self.buffers)
        self.compressed_numel = sum(p.numel() for p in self.params)
        """The gradient part of the flat tensor: what the inter-zone codec compresses."""
        self.link = LinkEmulation(config.link_latency_ms / 1e3, config.link_mbit)
        self.wire = Wire()
        self._codec: Codec | None = None
        self._codec_spec = ""
        self._pending_codec_state: dict[str, Any] | None = None
        self.state.node_local = _CodecResidual(self)
        self.reducer: Reducer
        self.data = job.plan()
        self.faults = FaultPlan(faults or [], self._log)
        self.graveyard = Graveyard(hold_s=config.collective_timeout_s + 5)
        self.meeting = Meeting(self._meet)
        self._accusing = threading.Lock()
        self._accused: dict[tuple[int, str], bool] = {}
        """(epoch, group) builds whose peers' addresses this node tried: whether any failed."""
        self.checkpointer = Checkpointer(config.checkpoint_dir) if config.checkpoint_dir else None
        self._fingerprint = fingerprint(model)
        self.group: EpochGroup | None = None
        self._audit_every = 0
        self._fragments: tuple[int, int] | None = None
        self._audited: dict[str, Any] | None = None
        """The state at the last audit that passed (what a failed audit rolls back to)."""
        self.diloco: DiLoCo | None = None
        """DiLoCo's outer loop, once an epoch order says ``mode="diloco"``."""
        self._leave_requested = False
        self._leave_sent_at: float | None = None
        self._last_progress = 0.0
        self._recent: list[m.StepPoint] = []
        """Steps committed since the last progress report (rank 0 sends them: the curves)."""
        self._last_progress_log = time.monotonic()
        self._epochs_formed = 0
        self._restored_epoch: int | None = None
        """The epoch of the checkpoint this node cold-started from (`m.Hello.restored_epoch`)."""
        self._fresh: dict[str, Any] | None = None
        """The state as built, while a restored checkpoint may still prove another run's."""
        self._notes: list[tuple[str, str]] = []
        """Events for the job's log from before this node joined (sent once it has)."""
        self._checkpoint_failure: str | None = None
        """The checkpoint failure last reported (None: none, or writes succeed again)."""
        self._partial = Partial()
        """What this node fetched of a peer's state so far (kept when a transfer is cut short)."""
        self._log_file = open(config.commit_log, "a", encoding="utf-8") if config.commit_log else None  # noqa: SIM115
        self.client = ControlClient(
            config.coordinators,
            self._hello,
            name=self.name,
            connect_timeout_s=config.connect_timeout_s,
            wake=self.wake,
            stall_timeout_s=config.stall_timeout_s,
            token=config.token,
            tls_ca=str(config.tls_ca) if config.tls_ca else None,
            etcd=config.etcd,
            etcd_prefix=config.etcd_prefix,
            relays=config.relays,
        )

        self.client.on_command = self._command
        self.client.on_met = self._met
        self.client.on_probe = self._probe
        self.client.on_welcome = self._welcomed

    # ---------------------------------------------------------------- public

    def run(self) -> NodeResult:
        self._restore_checkpoint()
        self._install_signals()
        candidate = Candidate(self.config) if self.config.coordinate else None
        try:
            if candidate is not None:
                candidate.start()
                self._log({"kind": "candidate", "pid": candidate.proc.pid if candidate.proc else 0})
            self._calibrate()
            self.client.start()
            return self._loop()
        finally:
            if candidate is not None:
                candidate.close()
            if self.sidecar is not None:
                self.sidecar.close()
            self.client.close()
            if self.checkpointer is not None:
                self.checkpointer.close()
            if self._log_file is not None:
                self._log_file.close()

    def request_leave(self) -> None:
        """Leave the group gracefully after the current step (what SIGTERM does)."""
        self._leave_requested = True
        self.wake.set()

    # ---------------------------------------------------------------- main loop

    def _loop(self) -> NodeResult:
        while True:
            self._joined()
            if self.state.step >= self.job.num_steps:
                return self._finish()
            order = self._next_order()
            if isinstance(order, NodeResult):
                return order
            try:
                self._form(order)
                self._sync()
                self._train()
            except Expelled as exc:
                log.warning("%s: %s", self.name, exc)
                self._abandon()
            except EpochAborted as exc:
                log.info("%s: %s", self.name, exc)
                self._abandon()
            except Unreachable as exc:  # reported as such: the leader has the others try
                log.warning("%s: epoch %d: %s", self.name, order.epoch, exc)
                self._abandon()
            except (CollectiveFailed, TransferError) as exc:
                log.warning("%s: epoch %d: %s", self.name, order.epoch, exc)
                if self._unreachable_in_lazy_group(order, exc):
                    self._abandon()  # said whom it cannot reach: the leader has the others try
                    continue
                culprit = order.members[exc.rank] if isinstance(exc, BadContribution) else None
                kind: Literal["bad-gradient", "audit", "suspect"] = "bad-gradient"
                if isinstance(exc, (AuditMismatch, Suspicion)):
                    kind = "audit" if isinstance(exc, AuditMismatch) else "suspect"
                self._log({"kind": "refused", "step": self.state.step, "culprit": culprit, "reason": str(exc)})
                back = exc.rollback_to if isinstance(exc, AuditMismatch) else -1
                self.client.send(
                    m.Fault(
                        epoch=order.epoch,
                        reason=str(exc)[:2000],
                        culprit=culprit,
                        kind=kind,
                        rollback_to=back,
                        zone_only=isinstance(exc, BadContribution) and exc.zone_only,
                    )
                )
                self._abandon()

    def _next_order(self) -> m.EpochOrder | NodeResult:
        """Wait for an epoch to form that includes this node (rejoining if expelled)."""
        current = self.group.epoch if self.group else -1
        waited_since = time.monotonic()
        while True:
            self.wake.clear()
            self.client.touch()
            self.graveyard.sweep()
            if self.client.expelled is not None:
                log.warning("%s was expelled (%s); rejoining as a new member", self.name, self.client.expelled)
                self._log({"kind": "expelled", "reason": self.client.expelled, "step": self.state.step})
                self._abandon()
                current = -1
                try:
                    self.client.rejoin()
                except JoinRefused:
                    if self.client.finished is None:
                        raise
                except CoordinatorUnreachable as exc:
                    log.warning("%s: %s; still trying", self.name, exc)
                    self.client.expelled = "rejoin pending: coordinator unreachable"
                continue
            if self.client.finished is not None:
                return NodeResult("job-finished", self.state.step, self.state.digest(), self._epochs_formed)
            order = self.client.latest_order()
            if order is not None and order.epoch > current:
                if self.client.member_id in order.members:
                    return order
                if self._leave_requested:
                    return self._left()
            if self._leave_requested and (self.group is None or self.group.size == 1):
                return self._left()
            if self._leave_requested and time.monotonic() - waited_since > LEAVE_GRACE_S:
                return self._left()
            self.wake.wait(0.5)

    def _abort_reason(self, *, during_step: bool) -> str | None:
        """Why the current epoch must be left now, if it must (every wait polls this)."""
        self.client.touch()
        if self.client.expelled is not None:
            return f"expelled: {self.client.expelled}"
        latest = self.client.latest_order()
        current = self.group.epoch if self.group else -1
        if latest is not None and latest.epoch > current and (latest.urgent or not during_step):
            return f"epoch {latest.epoch} ordered: {latest.reason}"
        if not during_step and self.client.finished is not None:
            return "the job finished"
        return None

    def _abandon(self) -> None:
        if self.group is not None:
            for pg in [self.group.pg, *self.group.extra_pgs]:
                self.graveyard.bury(pg)
            self.group.pg = None
            self.group.extra_pgs = []

    # ---------------------------------------------------------------- epochs

    def _form(self, order: m.EpochOrder) -> None:
        rank = order.members.index(self.client.member_id)
        self.group = EpochGroup(
            order.epoch,
            rank,
            list(order.members),
            list(order.shares),
            None,
            roles=list(order.roles),
            microbatches=list(order.microbatches),
        )
        abort = functools.partial(self._abort_reason, during_step=False)
        build = self._builder(order.epoch, abort)
        # Where zones exist, the step reduces through the zone and leaders' groups: the
        # world group only carries the sync phase, robust gathers and audits, whose
        # rings and transfers touch a few peers each, so it connects only those.
        lazy = _zones(order).multi
        pg, took = build(WORLD, rank, list(order.members), lazy=lazy)
        self.group.pg, self.group.built_in_s, self.group.lazy = pg, took, lazy
        self._log({"kind": "epoch", "epoch": order.epoch, "term": order.term, "step": self.state.step})
        self.reducer = self._build_reducer(order, rank, pg, build)
        self._epochs_formed += 1
        self._first_in_epoch = True
        log.info(
            "%s: epoch %d rank %d/%d (%s, %d of %d samples) built in %.1f ms",
            self.name, order.epoch, rank, len(order.members), self.group.role, self.group.shares[rank],
            self.job.batch_size, took * 1e3,
        )  # fmt: skip
        self._set_role(self.group.role)
        self._audit_every = order.audit_every if order.mode == "sync" else 0
        self._fragments = parse_fragments(order.fragments) if order.fragments else None
        if order.mode == "diloco" and self.diloco is None:
            self.diloco = DiLoCo(self, order)

    def _builder(self, epoch: int, abort: Any) -> Callable[..., tuple[Any, float]]:
        """Builds the epoch's groups (by name, `Zones.groups`; ``ids``: its members by rank)
        on its rendezvous. A build waits for its peers up to the collective timeout: the
        others may still be finishing a step or a round; one that never comes is named by
        the leader (`--build-deadline` after most of the group started), and the next
        epoch's order ends the wait. A build that every entry reached but that still has
        not finished half a build deadline later, or failed, has a peer it cannot connect
        to: this node tries their addresses and says whom (`unbroken.comm.reach`). A
        ``lazy`` build returns at once and connects pairs on first use (`Meeting.device`)."""

        def build(group: str, rank: int, ids: list[str], lazy: bool = False) -> tuple[Any, float]:
            assert self.client.welcome is not None  # an order came: the node was welcomed
            complete = functools.partial(self.meeting.complete, epoch, group, len(ids))
            # Connecting takes milliseconds once the entries are in: half the deadline is
            # plenty, and leaves the other half to try the peers and bench one (≤ deadline).
            stall_s = self.client.welcome.build_deadline_s / 2
            stall = Stall(complete, stall_s, lambda: self._accuse(epoch, group, ids, rank))

            def tick() -> None:
                self.meeting.publish(epoch)
                stall()

            device = self.meeting.device(epoch, group, self._gloo_host(), lazy=lazy)
            try:
                pg, took = build_group(
                    self.meeting.store(epoch), group, rank, len(ids), device, self.config.collective_timeout_s,
                    self.wake, abort, tick,
                )  # fmt: skip
                if lazy:
                    # Returned at once: wait for every entry as an eager build does, so that
                    # the next builds (zone, leaders) start when they used to, with the
                    # members of the epoch before (the leader's clock for them starts then).
                    def entries_in() -> bool:
                        tick()
                        return complete()

                    timeout = self.config.collective_timeout_s
                    wait_until(entries_in, self.wake, abort, timeout, f"entries of group {group}", poll_s=PUBLISH_S)
                return pg, took
            except CollectiveFailed as exc:
                if complete() and self._accuse(epoch, group, ids, rank):
                    raise Unreachable(str(exc)) from exc
                raise

        return build

    def _unreachable_in_lazy_group(self, order: m.EpochOrder, exc: Exception) -> bool:
        """A collective of a lazily connected group failed: a peer this node cannot reach
        shows only now (its build never connected). Try them all and report whom."""
        g = self.group
        if g is None or not g.lazy or g.epoch != order.epoch or isinstance(exc, BadContribution):
            return False
        return self._accuse(order.epoch, WORLD, list(order.members), g.rank)

    def _accuse(self, epoch: int, group: str, ids: list[str], rank: int) -> bool:
        """Try the addresses of a build's peers; report the ones this node cannot reach."""
        with self._accusing:  # the stall's thread and the failed build's: one tries, both learn
            if (epoch, group) not in self._accused:
                for old in [k for k in self._accused if k[0] < epoch - 2]:
                    del self._accused[old]
                entries = self.meeting.entries(epoch, group)
                self._accused[epoch, group] = accuse(epoch, group, entries, ids, rank, self.client.send)
            return self._accused[epoch, group]

    def _probe(self, probe: m.Probe) -> None:
        """The leader asks: can this node connect to ``probe.member``'s data plane?"""

        def attempt() -> None:
            address = (probe.host, probe.port)
            if failed := reach({probe.member: address}):
                fault = unreachable_fault(probe.epoch, probe.group, probe.member, *address, failed[probe.member])
                self.client.send(fault)

        threading.Thread(target=attempt, name="probe", daemon=True).start()

    def _meet(self, epoch: int, key: str, value: bytes) -> None:
        if self.faults.muted(epoch):
            return
        if self.faults.unreachable(epoch):
            value = with_port(value, self.faults.dropping_port(self._gloo_host() or "127.0.0.1"))
        self.client.send(m.Meet(epoch=epoch, key=key, value=base64.b64encode(value).decode()))

    def _met(self, met: m.Met) -> None:
        self.meeting.deliver(met.epoch, {k: base64.b64decode(v) for k, v in met.entries.items()})

    def _welcomed(self, welcome: m.Welcome, new_coordinator: bool) -> None:
        if new_coordinator:
            self.meeting.reset()
        else:
            self.meeting.republish()

    def _build_reducer(self, order: m.EpochOrder, rank: int, pg: Any, build: Any) -> Reducer:
        """The step's reduction: flat, or two-level with a zone group and a leaders' group."""
        zones = _zones(order)
        if self._codec is None or self._codec_spec != order.codec:
            self._codec, self._codec_spec = make_codec(order.codec), order.codec
            if self._pending_codec_state is not None and self._pending_codec_state.get("spec") == order.codec:
                self._codec.load_state_dict(self._pending_codec_state["codec"])
            self._pending_codec_state = None
        B = self.job.batch_size
        reducer = Reducer(
            rank,
            zones,
            pg,
            codec=self._codec,
            compressed=self.compressed_numel,
            link=self.link,
            wire=self.wire,
            rule=parse_rule(order.aggregate) if order.mode == "sync" else Rule("mean"),
            weights=tuple(s / B for s in order.shares),
            shares=tuple(order.shares),
            norms_at=self.numel + _EXTRA,
        )
        if not zones.multi:
            return reducer
        mine = zones.of_rank[rank]
        members = zones.members(mine)
        z = zones.names.index(mine)
        assert self.group is not None
        if len(members) > 1:
            reducer.zone_pg, _ = build(f"zone{z}", members.index(rank), [order.members[r] for r in members])
            self.group.extra_pgs.append(reducer.zone_pg)
        if rank in zones.leaders:
            leaders = [order.members[r] for r in zones.leaders]
            reducer.leaders_pg, _ = build("leaders", zones.leaders.index(rank), leaders)
            self.group.extra_pgs.append(reducer.leaders_pg)
        return reducer

    def _gloo_host(self) -> str | None:
        if self.config.gloo_host:
            return self.config.gloo_host
        host = (self.config.coordinators or self.config.relays or (("", 0),))[0][0]
        return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else None

    def _sync(self) -> None:
        """Compare (step, digest) across the group; whoever is behind or different catches up."""
        if self.diloco is not None:
            self.diloco.rollback()
        self._audit_rollback()
        g = self.group
        assert g is not None and g.pg is not None
        abort = functools.partial(self._abort_reason, during_step=False)
        r = sync_state(
            g.pg, g.rank, g.size, self.state, self.wake, abort, self.config.collective_timeout_s,
            partial=self._partial, on_sent=functools.partial(self.faults.maybe_fire, "resync"),
            max_donors=self.config.max_donors, incremental=not self.config.full_resync,
        )  # fmt: skip
        if r.role != "receiver":
            self._partial.close()  # a fetch cut short earlier is moot now: let its copy go
        if self._audit_every and (self._audited is None or r.role == "receiver"):
            # Agreed by the sync phase: a state a failed audit may come back to.
            self._audited = self.state.capture(reuse=self._audited)
        if self.diloco is not None:
            self.diloco.sync_zone(received=r.role == "receiver")
        if r.role in ("source", "donor"):
            log.info(
                "%s: sent %.1f MB of the %.1f MB state of step %d to ranks %s in %.2f s",
                self.name, r.megabytes, r.state_megabytes, r.step, list(r.peers), r.seconds,
            )  # fmt: skip
        elif r.role == "receiver":
            entry = {"kind": "sync", "epoch": g.epoch, "step": self.state.step, "from": [g.members[p] for p in r.peers]}
            counts = {"chunks": r.chunks, "total_chunks": r.total_chunks, "resumed_chunks": r.resumed_chunks}
            self._log(
                entry | counts | {"mb": r.megabytes, "state_mb": r.state_megabytes, "seconds": r.seconds}
                | {"digest": self.state.digest()}
            )  # fmt: skip
            what = f"{r.megabytes:.1f} of {r.state_megabytes:.1f} MB from {len(r.peers)} peer(s) in {r.seconds:.2f} s"
            self.report("sync", f"received the state of step {self.state.step} ({what})")
            log.info("%s: received the state of step %d: %s", self.name, self.state.step, what)

    # ---------------------------------------------------------------- steps

    def _train(self) -> None:
        if self.diloco is not None:
            self.diloco.train()
            return
        g = self.group
        assert g is not None and g.pg is not None
        B = self.job.batch_size
        my_offset, my_share = offsets(g.shares)[g.rank], g.shares[g.rank]
        flat = torch.zeros(self.numel + _EXTRA + g.size, dtype=torch.float32)
        norms_at = self.numel + _EXTRA
        in_step = functools.partial(self._abort_reason, during_step=True)
        while self.state.step < self.job.num_steps:
            step = self.state.step
            reason = in_step()
            if reason is not None:
                raise EpochAborted(reason)
            if self._leave_requested and self._leave_sent_at is None:
                if g.size == 1:
                    return
                self._announce_leave()
            t0 = time.monotonic()
            self.faults.maybe_fire("compute", step)
            indices = self.data.indices(step, my_offset, my_share)
            before = [b.detach().clone() for b in self.buffers]
            try:
                loss = self._compute(indices, step, g.microbatch, before)
                reason = in_step()
                if reason is not None:
                    raise EpochAborted(reason)
                self._flatten(flat, before, my_share / B, g.size)
                poison = self.faults.corruption(step)
                if poison is not None:
                    flat[: self.compressed_numel] *= poison
                latest = self.client.latest_order()
                switch = 1.0 if (latest is not None and latest.epoch > g.epoch) or self._leave_sent_at else 0.0
                flat[self.numel : norms_at] = torch.tensor([1.0, float(my_share), switch, loss])
                flat[norms_at:] = 0.0
                flat[norms_at + g.rank] = torch.linalg.vector_norm(flat[: self.compressed_numel])
                if (lie := self.faults.lie(step)) is not None:
                    self._tell_lie(flat, lie, norms_at, g)
                entry = {"kind": "contrib", "epoch": g.epoch, "step": step, "rank": g.rank, "indices": indices}
                self._log(entry | {"role": g.role, "microbatch": self._used_mb, "compute_s": self.meter.last_compute_s})
                t_comm = time.monotonic()
                self.reducer.allreduce(
                    flat,
                    self.wake,
                    in_step,
                    self.config.collective_timeout_s,
                    f"all-reduce of step {step}",
                    after_post=functools.partial(self.faults.maybe_fire, "allreduce", step),
                    after_exchange_post=functools.partial(self.faults.maybe_fire, "exchange", step),
                )
                self.meter.last_comm_s = time.monotonic() - t_comm
                votes, samples, switched, global_loss = flat[self.numel : norms_at].tolist()
                if round(votes) != g.size or round(samples) != B:
                    raise CollectiveFailed(f"step {step} had {votes:.0f}/{g.size} votes and {samples:.0f}/{B} samples")
                self._check_sum(flat, norms_at, g, step)
                self._fence()
            except BaseException:
                # The step is not applied: undo what its forward passes did to the buffers,
                # so the retry starts from the committed state.
                self._restore_buffers(before)
                raise
            self._apply(flat, before)
            self._committed(g, step, global_loss, B / max(time.monotonic() - t0, 1e-9))
            if self.faults.bitflip(self.state.step):
                flip_bit(self.params[0])
            if self._audit_every and self.state.step % self._audit_every == 0:
                self._audit(g)
            if my_share:
                self.meter.maybe_recalibrate(self._probe_model, self.state.step)
            if g.role == "validator":
                self._maybe_validate()
            if switched > 0 or self.state.step >= self.job.num_steps:
                return

    def _tell_lie(self, flat: torch.Tensor, lie: str, norms_at: int, g: EpochGroup) -> None:
        """A hostile member's contribution (fault injection, `testing.faults.LIES`)."""
        if lie == "forge-slot":
            flat[norms_at + (g.rank + 1) % g.size] = LIES[lie]
        else:
            flat[: self.compressed_numel] *= LIES[lie]  # after its norm went into its slot

    def _check_sum(self, flat: torch.Tensor, norms_at: int, g: EpochGroup, step: int) -> None:
        """Refuse a step whose reduced gradient a member's contribution spoiled.

        Gathered rows (`Reducer.rule` robust or ``checked``) were each checked already, and
        their norms are true: the guard's verdict names a culprit. A plain sum can only be
        checked as a whole: finite, and no larger than the members' declared norms allow (the
        triangle inequality; not with a lossy codec, whose error feedback adds to what goes
        out). What fails there is a `Suspicion`, since a member can write any slot of a sum."""
        B = self.job.batch_size
        norms = flat[norms_at:].tolist()
        verdict = judge(norms, g.shares, B)
        if self.reducer.rule.robust:
            if verdict is not None:
                culprit, why = verdict
                raise BadContribution(culprit, f"step {step}: refused the contribution of rank {culprit}: {why}")
            return
        grad = flat[: self.compressed_numel]
        lossy = self.reducer.codec is not None and self.reducer.zones.multi and self._codec_spec != "none"
        if not bool(torch.isfinite(grad).all()):
            raise Suspicion(f"step {step}: the summed gradient is not finite, though no norm slot says whose")
        if verdict is not None:
            raise Suspicion(f"step {step}: rank {verdict[0]}'s norm slot says {verdict[1]}; not proven on a sum")
        total = float(torch.linalg.vector_norm(grad).item())
        bound = math.fsum(norms)
        if not lossy and total > bound * (1 + NORM_TOLERANCE) + 1e-12:
            raise Suspicion(f"step {step}: the summed gradient's norm {total:.4g} exceeds the declared {bound:.4g}")

    def _audit_rollback(self) -> None:
        """A failed audit's order: back to the state audited at ``rollback_to``, if held and ahead of it."""
        order = self.client.latest_order()
        back = order.rollback_to if order is not None else -1
        held = self._audited
        if back < 0 or held is None or int(held["step"]) != back or self.state.step <= back:
            return
        self._restore_audited()

    def _restore_audited(self) -> None:
        """Back to the state of the last audit that passed."""
        assert self._audited is not None
        self.state.restore(self._audited)
        self.client.step = self.state.step
        self._log({"kind": "restore", "step": self.state.step, "digest": self.state.digest(), "why": "failed audit"})

    def _audit(self, g: EpochGroup) -> None:
        """Compare state digests. A replica that differs from the majority was corrupted
        since the last audit, and its contributions since then are suspect: every member goes
        back to the last audited state (kept in memory), the culprit goes one step behind it
        so that the sync phase repairs it from a peer, and the steps since are redone with
        the same samples. The culprit is named and flagged."""
        assert g.pg is not None
        digest = self.state.digest()
        abort = functools.partial(self._abort_reason, during_step=True)
        timeout = self.config.collective_timeout_s
        verdict = audit(gather_digests(g.pg, g.size, self.state.step, digest, self.wake, abort, timeout, "audit"))
        self._log({"kind": "audit", "step": self.state.step, "digest": digest, "ok": verdict is None})
        if verdict is None:
            self._audited = self.state.capture(reuse=self._audited)
            return
        rank, why = verdict
        message = f"audit at step {self.state.step}: {g.members[rank]}'s state {why}"
        back = int(self._audited["step"]) if self._audited is not None else -1
        if self._audited is not None:
            # Back at once, not only when the next order says so: after the job's last step
            # there is no next order to wait for, and the suspect state must not be final.
            # (A member whose wait on this all-gather was cut short by an order never saw
            # the verdict: that order's `rollback_to` takes it back.)
            self._restore_audited()
            if rank == g.rank:
                self.state.step -= 1  # behind the group: the sync phase sends it a peer's state
                self.client.step = self.state.step
        raise AuditMismatch(rank, message, rollback_to=back)

    def _compute(self, indices: list[int], step: int, planned_mb: int, before: list[torch.Tensor]) -> float:
        """Forward/backward over this node's slice; gradients summed, scaled to the mean over B.

        Out of device memory, the micro-batch is halved and the slice computed again: the
        gradient is the same whatever the micro-batch size.
        """
        while True:
            mb = planned_mb or self.meter.mb_cap or len(indices) or 1
            if self.meter.oom_cap:
                mb = min(mb, self.meter.oom_cap)
            self._used_mb = mb if indices else 0
            try:
                return self._compute_slice(indices, step, mb)
            except OutOfMemory:
                if mb <= 1:
                    raise
                self.meter.oom_cap = mb // 2
                log.warning("%s: out of device memory at micro-batch %d; retrying at %d", self.name, mb, mb // 2)
                self._restore_buffers(before)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _compute_slice(self, indices: list[int], step: int, mb: int) -> float:
        self.replica.pull()
        model = self.replica.model
        model.train()
        for p in self.replica.params:
            p.grad = None
        torch.manual_seed(self.job.seed * 1_000_003 + step)
        B = self.job.batch_size
        total = 0.0
        start = time.perf_counter()
        n_micro = 0
        for first in range(0, len(indices), mb):
            self.client.touch()
            chunk = indices[first : first + mb]
            batch = self.replica.to_device(self.job.collate(self.job.samples(chunk)))
            t_mb = time.perf_counter()
            loss = self.job.microbatch_loss(model, batch)
            (loss * (len(chunk) / B)).backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach()) * len(chunk) / B
            self.throttle.stretch(time.perf_counter() - t_mb, step, self.client.touch)
            n_micro += 1
        if indices:
            self.meter.observe(len(indices), n_micro, time.perf_counter() - start)
        else:
            self.meter.last_compute_s = 0.0
        return total

    def _restore_buffers(self, before: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for b, b0 in zip(self.buffers, before, strict=True):
                b.copy_(b0)

    # ---------------------------------------------------------------- measuring

    def _calibrate(self) -> None:
        """Measure compute speed and activation memory before joining (on a model copy)."""
        model_bytes = sum(t.numel() * t.element_size() for t in self.state.model.state_dict().values())
        self.meter.calibrate(
            self._probe_model(), model_bytes, self.config.memory_limit, self.config.max_microbatch, self.state.step
        )

    def _probe_model(self) -> torch.nn.Module:
        """A copy of the model on the compute device, for timing passes that must not touch the state."""
        model = self.job.model()
        model.load_state_dict(self.state.model.state_dict())
        return model.to(self.device)

    def _capabilities(self) -> m.Capabilities:
        return self.meter.capabilities(self.client.rtt_s, self.state.step)

    # ---------------------------------------------------------------- roles

    def _set_role(self, role: str) -> None:
        """Trainers compute; other members probe their speed and, as validators, evaluate."""
        if role == "trainer":
            if self.sidecar is not None:
                self.sidecar.set_probing(False)
            return
        if self.sidecar is None:
            self.sidecar = Sidecar(
                self.job,
                self.name,
                self.device,
                lambda model: self.meter.probe(model, self.state.step),
                self.meter.probed,
                self._validated,
                lambda: self.throttle.factor(self.state.step),
            )
        self.sidecar.set_probing(True)

    def _maybe_validate(self) -> None:
        now = time.monotonic()
        if self.job.evaluate is None or self.sidecar is None or not self.sidecar.idle:
            return
        if now - self._last_validation < VALIDATE_EVERY_S and self.state.step < self.job.num_steps:
            return
        self._last_validation = now
        state = {k: v.detach().clone() for k, v in self.state.model.state_dict().items()}
        self.sidecar.submit(self.state.step, state)

    def _validated(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        self.client.send(m.Validation(step=step, metrics=finite(metrics), seconds=seconds))
        self._log({"kind": "validation", "step": step, "metrics": metrics, "seconds": seconds})
        log.info("%s: validated step %d: %s", self.name, step, metrics)

    def _flatten(self, flat: torch.Tensor, before: list[torch.Tensor], weight: float, size: int) -> None:
        off = 0
        for p in self.replica.params:
            n = p.numel()
            if p.grad is None:
                flat[off : off + n].zero_()
            else:
                flat[off : off + n].copy_(p.grad.reshape(-1))  # from the device: the CPU staging copy
            off += n
        for b, b0 in zip(self.compute_buffers, before, strict=True):
            # Deltas, not values: a buffer nobody changed stays bit-exact. Float buffers
            # are weighted by this node's share of B; counters are averaged.
            n = b.numel()
            delta = (b.detach().to(b0.device) - b0).reshape(-1).to(torch.float32)
            flat[off : off + n].copy_(delta * (weight if b.dtype.is_floating_point else 1.0 / size))
            off += n

    def _apply(self, flat: torch.Tensor, before: list[torch.Tensor]) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p).to(p.dtype)
            off += n
        with torch.no_grad():
            for b, b0 in zip(self.buffers, before, strict=True):
                n = b.numel()
                delta = flat[off : off + n].view_as(b)
                b.copy_(b0 + (delta if b.dtype.is_floating_point else delta.round()).to(b.dtype))
                off += n
        if self.job.before_update is not None:
            self._user("before_update", self.job.before_update, self.state.model, self.state.optimizer)
        self.state.optimizer.step()
        if self.state.scheduler is not None:
            self.state.scheduler.step()

    def _after_step(self, g: EpochGroup, loss: float) -> None:
        """The job's `Job.after_step` hook, on every replica, before the step's digest."""
        if self.job.after_step is None:
            return
        st = self.state
        info = StepInfo(st.step, loss, st.model, st.optimizer, st.scheduler, st.extra, g.rank, g.size)
        self._user("after_step", self.job.after_step, info)

    def _user(self, what: str, hook: Callable[..., object], *args: Any) -> None:
        """Run the job's own code: what it raises stops this node with its traceback."""
        try:
            hook(*args)
        except Exception as exc:
            trace = traceback.format_exc().rstrip()
            raise JobFailed(f"the job's {what} raised {type(exc).__name__}: {exc}\n{trace}") from exc

    def _fence(self) -> None:
        """Refuse to commit unless this node is sure it is still a member."""
        if self.client.commit_allowed():
            return
        log.warning("%s: lease not confirmed before commit; waiting for the coordinator", self.name)
        wait_until(
            self.client.commit_allowed,
            self.wake,
            functools.partial(self._abort_reason, during_step=True),
            self.config.collective_timeout_s,
            "commit fence",
        )

    def _committed(self, g: EpochGroup, step: int, loss: float, sps: float) -> None:
        self.state.step = step + 1
        self.state.cursor = self.state.step * self.job.batch_size
        self.client.step = self.state.step
        self._after_step(g, loss)
        entry: dict[str, Any] = {"kind": "commit", "epoch": g.epoch, "step": self.state.step, "loss": loss}
        if self.wire.last_inter:
            entry["wire"] = {"intra": self.wire.last_intra, "inter": self.wire.last_inter}
        every = self.config.digest_every
        if every and self.state.step % every == 0:
            entry["digest"] = self.state.digest()
        self._log(entry)
        self._report(g, self.state.step, loss, sps)
        self._maybe_checkpoint(g)
        if self.faults.false_alarm(self.state.step, g.epoch):
            self.client.send(m.Fault(epoch=g.epoch, reason=f"all-reduce of step {step} failed: connection reset"))

    def _committed_round(self, g: EpochGroup, first: int, last: int, loss: float) -> None:
        """DiLoCo: the outer step commits the round's inner steps ``first``..``last`` at once."""
        self.state.step = last + 1
        self.state.cursor = self.state.step * self.job.batch_size
        self.client.step = self.state.step
        self._after_step(g, loss)
        for s in range(first + 1, last + 2):
            entry: dict[str, Any] = {"kind": "commit", "epoch": g.epoch, "step": s, "loss": loss}
            if s == last + 1:
                entry["digest"] = self.state.digest()
                entry["outer"] = True
                if self.wire.last_inter:
                    entry["wire"] = {"intra": self.wire.last_intra, "inter": self.wire.last_inter}
            self._log(entry)
        log.info(
            "%s: outer step at %d/%d, epoch %d, %d members, loss %.4f",
            self.name, self.state.step, self.job.num_steps, g.epoch, g.size, loss,
        )  # fmt: skip
        self._maybe_checkpoint(g)

    def _report(self, g: EpochGroup, step: int, loss: float, sps: float) -> None:
        now = time.monotonic()
        finite = math.isfinite(loss)
        self._recent.append(
            m.StepPoint(
                step=step, loss=loss if finite else -1.0, finite=finite, samples_per_s=sps, wall_time=time.time()
            )
        )
        del self._recent[:-RECENT_MAX]
        if now - self._last_progress_log >= PROGRESS_LOG_EVERY_S or step == self.job.num_steps:
            log.info(
                "%s: step %d/%d, epoch %d, %d members, loss %.4f",
                self.name, step, self.job.num_steps, g.epoch, g.size, loss,
            )  # fmt: skip
            self._last_progress_log = now
        welcome = self.client.welcome
        every = welcome.report_s if welcome is not None else PROGRESS_EVERY_S
        if self._first_in_epoch or now - self._last_progress >= every or step >= self.job.num_steps:
            self.client.send(
                m.Progress(
                    epoch=g.epoch,
                    step=step,
                    loss=loss if finite else -1.0,
                    loss_finite=finite,
                    recent=self._recent if g.rank == 0 else [],
                    wall_time=time.time(),
                    first_in_epoch=self._first_in_epoch,
                    samples_per_s=sps,
                    compute_s=min(self.meter.last_compute_s, 1e6),
                    bytes_intra=self.wire.intra,
                    bytes_inter=self.wire.inter,
                    capabilities=self._capabilities(),
                )
            )
            self._first_in_epoch = False
            self._last_progress = now
            self._recent = []

    def _maybe_checkpoint(self, g: EpochGroup) -> None:
        ck = self.config.checkpoint_every
        if self.checkpointer is None or not ck or self.state.step % ck:
            return
        failure = self.checkpointer.failure
        if failure is not None and failure != self._checkpoint_failure:
            self.report("checkpoint-failed", failure)
        elif failure is None and self._checkpoint_failure is not None:
            self.report("checkpoint-ok", f"checkpoints are written to {self.config.checkpoint_dir} again")
        self._checkpoint_failure = failure
        if self._fragments is not None:
            k, m = self._fragments
            mine = [i for i in range(k + m) if i % g.size == g.rank]
            snap = self._checkpoint_tree()
            if mine and self.checkpointer.save_fragments_async(snap, k, m, mine, self.state.optimizer_in_digest):
                self.report("checkpoint", f"fragments {mine} of {k}+{m} of step {self.state.step} being written")
            return
        if g.rank == 0 and self.checkpointer.save_async(self._checkpoint_tree()):
            where = self.config.checkpoint_dir
            self.report("checkpoint", f"checkpoint of step {self.state.step} being written to {where}")

    # ---------------------------------------------------------------- ends

    def _finish(self) -> NodeResult:
        digest = self.state.digest()
        metrics: dict[str, float] = {}
        if self.job.evaluate is not None and (self.group is None or self.group.rank == 0):
            self.state.model.eval()
            with torch.no_grad():
                metrics = self.job.evaluate(self.state.model)
        if self.config.final_state is not None:
            torch.save(self.state.capture(), self.config.final_state)
        self._log({"kind": "final", "step": self.state.step, "digest": digest})
        # Sent before the session closes: `client.close` queues behind it.
        self.client.send(m.Done(step=self.state.step, digest=digest, metrics=finite(metrics)))
        self._abandon()
        return NodeResult("finished", self.state.step, digest, self._epochs_formed, metrics)

    def _announce_leave(self) -> None:
        self.client.send(m.Leave(reason="leave requested (SIGTERM, Ctrl-C or request_leave)"))
        self._leave_sent_at = time.monotonic()

    def _left(self) -> NodeResult:
        if self._leave_sent_at is None:
            self._announce_leave()
        if self.checkpointer is not None and (self.group is None or self.group.size == 1):
            # The last member going: keep what it committed since the last checkpoint.
            self.checkpointer.close()
            self.checkpointer.save_async(self._checkpoint_tree())
        self._log({"kind": "left", "step": self.state.step})
        self._abandon()
        return NodeResult("left", self.state.step, self.state.digest(), self._epochs_formed)

    # ---------------------------------------------------------------- plumbing

    def _hello(self, member_id: str) -> m.Hello:
        g = self.group
        latest = self.client.latest_order()
        resume = None
        if g is not None and member_id in g.members:
            resume = m.Resume(
                epoch=g.epoch,
                members=g.members,
                step=self.state.step,
                shares=g.shares,
                roles=g.roles,  # type: ignore[arg-type]
                abandoned=g.pg is None,
            )
        return m.Hello(
            job=self.job.name,
            job_identity=self.job.identity(),
            fingerprint=self._fingerprint,
            member_id=member_id,
            name=self.name,
            batch_size=self.job.batch_size,
            steps=self.job.num_steps,
            weight=self.config.weight,
            step=self.state.step,
            host=socket.gethostname(),
            pid=os.getpid(),
            resume=resume,
            last_epoch=latest.epoch if latest is not None else 0,
            restored_epoch=self._restored_epoch,
            capabilities=self._capabilities(),
            role=self.config.role,  # type: ignore[arg-type]
            evaluates=self.job.evaluate is not None,
            zone=self.config.zone,
        )

    def _checkpoint_tree(self) -> dict[str, Any]:
        tree = self.state.tree(local=True)  # the checkpointer copies it before the step goes on
        tree["epoch"] = self.group.epoch if self.group is not None else (self._restored_epoch or 0)
        tree["job"] = self.job.identity()
        return tree

    def _restore_checkpoint(self) -> None:
        if self.config.checkpoint_dir is None:
            return
        directory = self.config.checkpoint_dir
        newest = load_newest(directory)
        for why in newest[2] if newest else []:
            self._note("checkpoint-failed", f"{why}: using an older one")
        if newest is not None and newest[1].get("job", self.job.identity()) != self.job.identity():
            aside = self._set_aside(f"checkpoints of job {newest[1]['job']}, not of {self.job.identity()}")
            self._note(
                "checkpoint-failed",
                f"{newest[0]} is another job's (job identity {newest[1]['job']}, this job {self.job.identity()}: "
                f"name, batch size, steps, seed or dataset differ): not used, {aside}",
            )
            newest = None
        if newest is None:
            # Fragments in this directory (a shared one, or one `unbroken restore` did not
            # merge yet) rebuild the state when K of them are there.
            try:
                snap, manifest, _ = rebuild([self.config.checkpoint_dir])
            except TransferError:
                return
            path = self.config.checkpoint_dir / f"frag-{manifest.step:09d}.json"
        else:
            path, snap, _ = newest
        self._fresh = self.state.capture()  # until the group says this checkpoint is not ahead of it
        self.state.restore(snap)
        self._restored_epoch = int(snap.get("epoch", 0))
        self.client.step = self.state.step
        self._log({"kind": "restore", "step": self.state.step, "path": str(path), "digest": self.state.digest()})
        log.info("%s: restored step %d from %s", self.name, self.state.step, path)

    def _command(self, cmd: m.Command) -> None:
        """An operator's action (control thread)."""
        log.warning("%s: operator command %s: %s", self.name, cmd.action, cmd.reason)
        if cmd.action == "drain":
            self.request_leave()
        elif cmd.action == "kill":
            self._log(
                {"kind": "fault", "signal": "kill", "phase": "operator", "step": self.state.step, "pid": os.getpid()}
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _note(self, kind: str, reason: str) -> None:
        """An event for the job's log from before joining: logged now, reported once joined."""
        log.warning("%s: %s", self.name, reason)
        self._log({"kind": kind, "reason": reason, "step": self.state.step})
        self._notes.append((kind, reason))

    def _set_aside(self, why: str) -> str:
        """Move the checkpoint directory's checkpoints out of this run's way; where they went."""
        assert self.config.checkpoint_dir is not None
        try:
            return f"moved to {set_aside(self.config.checkpoint_dir, why)}"
        except OSError as exc:
            return f"left in place: they could not be moved ({exc.strerror or exc})"

    def _joined(self) -> None:
        """Once welcomed: drop a restored checkpoint that is ahead of the group (another run's:
        the group never moves to a step it did not commit), and send the notes."""
        welcome = self.client.welcome
        if welcome is None:
            return
        if self._fresh is not None:
            if welcome.group_step and self.state.step > welcome.group_step and self.config.checkpoint_dir:
                ahead = self.state.step
                self.state.restore(self._fresh, own=True)
                self._restored_epoch = None
                self.client.step = self.state.step
                why = f"a checkpoint of step {ahead}, ahead of the group's step {welcome.group_step}"
                aside = self._set_aside(f"{why}: another run's")
                self._note(
                    "checkpoint-failed",
                    f"{why}: another run's? Not used ({aside}); this node joins with the group's state",
                )
            self._fresh = None
        for kind, reason in self._notes:
            self.report(kind, reason)
        self._notes.clear()

    def report(self, kind: str, reason: str) -> None:
        """An event for the job's log at the coordinator (a checkpoint, a state transfer...)."""
        self.client.send(m.Report(kind=kind, step=self.state.step, reason=reason[:2000]))

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: object) -> None:
            if self._leave_requested:
                raise SystemExit(128 + signum)
            # Only a flag: Event.set() takes a lock the interrupted main thread may hold.
            # Every wait in the loop wakes at least every 0.5 s and sees it.
            self._leave_requested = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _log(self, entry: dict[str, object]) -> None:
        if self._log_file is not None:
            entry = {"t": time.time(), "node": self.name, **entry}
            self._log_file.write(json.dumps(entry) + "\n")
            self._log_file.flush()


class _CodecResidual:
    """The inter-zone codec's error-feedback residual as node-local snapshot state: a node
    restarted from its own checkpoint resumes it, so no compression error is dropped."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.owner = node.name

    def state_dict(self) -> dict[str, Any]:
        codec = self.node._codec
        if codec is None:
            return {}
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in codec.state_dict().items()}
        return {"spec": self.node._codec_spec, "codec": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        codec = self.node._codec
        if codec is not None and self.node._codec_spec == state["spec"]:
            codec.load_state_dict(state["codec"])
        else:  # the codec is made when the first epoch order names it
            self.node._pending_codec_state = state


def run_node(job: Job, config: NodeConfig, faults: list[Fault] | None = None) -> NodeResult:
    """Run one node to the end of the job (see `Node`)."""
    return Node(job, config, faults).run()


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics as the control plane takes them: a NaN or infinite one (a diverged model's
    evaluation) is left out, with a warning, instead of refusing the whole report."""
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if bad:
        log.warning("metrics %s are not finite: left out of the report", ", ".join(bad))
    return {k: v for k, v in metrics.items() if k not in bad}
