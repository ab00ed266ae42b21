"""The node runtime: join, form epochs, sync, and step until the job is done.

A node's life, for every epoch that includes it::

    next order ─▶ form (`train.epochs`) ─▶ sync (`comm.transfer.sync_state`) ─▶ steps
        ▲                                                                        │
        └── abandoned on an urgent order, expulsion or failure; or switched ◀────┘

The steps follow the step protocol (`train.step`): open my slice, compute it, contribute,
reduce, verify, fence, apply, commit. `Node.steps` is that life as a generator of slices
to compute: the Job loop (`Node.run`) computes each with the job's loss, a user's own loop
(`unbroken.swarm`) with their own code, and both send the slice's loss back. Everything
else (failure handling, epochs, sync, audits, DiLoCo rounds) is the same code for both.

`Node` wires its helpers (records, audits, epochs, the step protocol, DiLoCo...); each sees
only its view of the node (`train.views`). Its dealings with the control plane (the hello,
what the session tells it, the resources of a run) are in `train.session`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from unbroken.comm.group import EpochGroup, EpochScope, Graveyard
from unbroken.comm.reduce import LinkEmulation, Wire
from unbroken.comm.transfer import Partial, sync_state
from unbroken.config import NodeConfig
from unbroken.control import messages as m
from unbroken.errors import (
    CollectiveFailed,
    CoordinatorUnreachable,
    EpochAborted,
    Expelled,
    JobHalted,
    JoinRefused,
    TransferError,
    Unreachable,
    Where,
)
from unbroken.events import Entry, Kind
from unbroken.job import Job
from unbroken.specs import Mode, Role
from unbroken.state.snapshot import TrainState, fingerprint
from unbroken.train.audits import Audits
from unbroken.train.catchup import catch_up
from unbroken.train.checks import Checker
from unbroken.train.compute import JobCompute
from unbroken.train.device import Calibration, ComputeReplica, resolve_device
from unbroken.train.diloco import DiLoCo
from unbroken.train.epochs import Epochs
from unbroken.train.hooks import Control, Faults, GroupMaker, NoFaults, flip_bit
from unbroken.train.measure import Meter
from unbroken.train.memory import keep_freed_memory
from unbroken.train.records import Records
from unbroken.train.scale import KEY as SCALE_KEY
from unbroken.train.scale import ScaleState
from unbroken.train.session import Session, connect, finite, heard
from unbroken.train.sharding import ShardedZone
from unbroken.train.sidecar import Sidecar
from unbroken.train.step import Slice, StepProtocol, flat_length
from unbroken.train.throttle import parse_throttle

log = logging.getLogger(__name__)

LEAVE_GRACE_S = 5.0
FLAT_MEMBERS = 64
"""Members the kept flat tensor has norm slots for at first (twice the group's past that)."""
VALIDATE_EVERY_S = 0.5

Steps = Generator[Slice, float, "NodeResult"]
"""A node's life (`Node.steps`): yields each slice to compute, takes its loss back."""


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

    def __init__(
        self,
        job: Job,
        config: NodeConfig,
        faults: Faults | None = None,
        *,
        own_loop: bool = False,
        control: Callable[[Node], Control] | None = None,
        groups: GroupMaker | None = None,
    ) -> None:
        """``faults``: injected by the CLI's ``--fault`` or a test (`unbroken.testing.faults`).
        ``own_loop``: the user's code computes each slice on its own model, wherever it
        lives (`unbroken.swarm`): no compute copy, no speed probes, no roles but trainer.
        ``control`` and ``groups``: the control plane this node talks to and how it builds
        an epoch's process groups (default: a session with ``config``'s coordinators, gloo
        groups on their rendezvous; in-memory ones in tests, `unbroken.testing.inmemory`)."""
        self.job = job
        self.config = config
        self.name = config.display_name
        self.wake = threading.Event()
        began = time.time()  # imports done: what follows builds the job's model (`Records.mark`)
        keep_freed_memory()  # with UNBROKEN_MALLOC=kept
        model, optimizer = job.build()
        self.device = next(model.parameters()).device if own_loop else resolve_device(config.device)
        self.zone = (
            ShardedZone(job, model, optimizer, config.memory_limit, defer=own_loop, device=self.device)
            if job.shard
            else None
        )
        """This node's part of a sharded zone (`train.sharding`); None: it holds the whole state."""
        scheduler, extra = job.build_scheduler(optimizer), job.build_state(model)
        self.scale = ScaleState(job.loss_scale) if job.loss_scale is not None else None
        """The group's float16 loss scale (`train.scale`), replicated with the extra state."""
        if self.scale is not None:
            extra[SCALE_KEY] = self.scale
        held = model if self.zone is None else self.zone.shell
        self.state = TrainState(held, optimizer, scheduler=scheduler, extra=extra)
        # The optimizer as the job's code built it, before any state is loaded into it: a
        # node whose code sets another learning rate is refused as another job.
        self.job_identity = job.identity(optimizer)
        self.job_spec = json.dumps(job.identity_spec(optimizer), sort_keys=True)
        # A sharded zone's gradients are summed block by block in backward: none in the flat.
        self.params = [p for p in model.parameters() if p.requires_grad] if self.zone is None else []
        # Buffers a forward pass updates (BatchNorm statistics) travel in the same
        # all-reduce as the gradients, so replicas stay bit-identical between syncs.
        # A sharded zone keeps buffers as built (`train.sharding`): none in the flat.
        self.buffers = [b for b in model.buffers() if b.dtype.is_floating_point or b.dtype == torch.int64]
        self.buffers = self.buffers if self.zone is None else []
        self.own_loop = own_loop
        # A sharded zone's engine fills the model's own parameters where it computes.
        separate = False if own_loop or self.zone is not None else None
        self.replica = ComputeReplica(model, self.device, separate=separate)
        self.compute_buffers = list(self.replica.buffers()) if self.zone is None else []
        self.throttle = parse_throttle(config.throttle)
        self.meter = Meter(job, self.replica, self.throttle, self.name)
        if own_loop or self.zone is not None:
            # A median node until its steps are timed: there is no loss to measure with (own
            # loop), or the model is the zone's, gathered block by block in a step (sharded).
            self.meter.calibration = Calibration(0.0, 0.0, 1, 0)
        self.compute = JobCompute(self)
        self.numel = sum(p.numel() for p in self.params) + sum(b.numel() for b in self.buffers)
        self._flat: torch.Tensor | None = None
        """The step's flat tensor, kept from epoch to epoch (`_step_buffer`); a joiner lays
        it out here, while the group still trains, not in its first epoch."""
        self._step_buffer(1)
        self.compressed_numel = sum(p.numel() for p in self.params)
        """The gradient part of the flat tensor: what the inter-zone codec compresses."""
        self.link = LinkEmulation(config.link_latency_ms / 1e3, config.link_mbit, dict(config.link_mbit_from))
        self.wire = Wire()
        self.data = job.plan()
        self.records = Records(self, began)
        self.faults: Faults = faults or NoFaults()
        self.faults.attach(self.records.log)
        self.graveyard = Graveyard(hold_s=config.collective_timeout_s + 5)
        self.epochs = Epochs(self, groups)
        self.state.node_local = self.epochs.codec
        self.audits = Audits(self)
        self.checker = Checker(self)
        """Checks of the trainers' work this node makes (`train.checks`)."""
        self.group: EpochGroup | None = None
        self.protocol: StepProtocol | None = None
        """The step protocol of the current epoch."""
        self.diloco: DiLoCo | None = None
        """DiLoCo's outer loop, once an epoch order says ``mode="diloco"``."""
        self.sidecar: Sidecar | None = None
        self.leave_requested = False
        self.last_loss = math.nan
        """The global mean loss of the last committed step."""
        self.applied_step = -1
        """The last step this node applied itself (not received from a peer)."""
        self.leave_sent_at: float | None = None
        self.model_fingerprint = fingerprint(model)
        self._last_validation, self._epochs_formed = 0.0, 0
        self._partial = Partial()
        """What this node fetched of a peer's state so far (kept when a transfer is cut short)."""
        self.client: Control = control(self) if control is not None else connect(self)
        self.client.add_listener(functools.partial(heard, self))

    # ---------------------------------------------------------------- public

    def run(self) -> NodeResult:
        """The Job loop: every slice computed with the job's loss (`JobCompute`), until the
        job is done or this node leaves (SIGTERM, `request_leave`); how it ended.

        Failures of peers, links and the leader are not raised: the node abandons the epoch
        and joins the next. What ends the run early is raised:

        Raises:
            CoordinatorUnreachable: no coordinator (or etcd leader record) answered within
                ``NodeConfig.connect_timeout_s``; the message lists what each address said.
            JoinRefused: the leader refused this node: another job or model, a wrong token,
                or (``Refused.finished``) a job already over.
            JobFailed: the job's own code (model, loss, data, collate) raised; the original
                error and its traceback are in the message.
            ConfigError: the job asks for what the group's policy cannot do (``Job.loss_scale``
                in DiLoCo mode, ``--outer-overlap`` with buffers).
        """
        with self.session(calibrate=self.compute.calibrate if self.zone is None else None):
            steps = self.steps()
            try:
                sl = next(steps)
                while True:
                    assert self.protocol is not None
                    try:
                        loss = self.compute(self.protocol, sl)
                    except BaseException as exc:  # the step undoes itself, then it is raised here
                        sl = steps.throw(exc)
                        continue
                    sl = steps.send(loss)
            except StopIteration as stop:
                result: NodeResult = stop.value
                return result

    def session(self, calibrate: Callable[[], None] | None = None) -> Session:
        """The node's resources for one run: checkpoint restored, signals, the coordinator
        candidate (``--coordinate``), the control session; all closed on exit."""
        return Session(self, calibrate)

    def request_leave(self) -> None:
        """Leave the group gracefully after the current step (what SIGTERM does)."""
        self.leave_requested = True
        self.wake.set()

    def report(self, kind: Kind, reason: str) -> None:
        """An event for the job's log at the coordinator (a checkpoint, a state transfer...)."""
        self.records.report(kind, reason)

    def advance(self, step: int, loss: float = math.nan) -> None:
        """The committed step is now ``step`` (its samples consumed: the cursor follows)."""
        self.last_loss = loss
        self.state.step = step
        self.state.cursor = step * self.job.batch_size
        self.client.step = step

    def restored(self) -> None:
        """The state was put back to a copy (a checkpoint, an audited state, a DiLoCo round's
        start): nothing in it was applied here, and heartbeats say its step."""
        self.applied_step = -1
        self.client.step = self.state.step

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without `Job.loss_scale`)."""
        return self.scale.scale if self.scale is not None else 1.0

    def capabilities(self) -> m.Capabilities:
        return self.meter.capabilities(self.client.rtt_s, self.state.step)

    def scope(self, *, during_step: bool) -> EpochScope:
        """The waits of this epoch: woken by this node's events, ended by `abort_reason`
        (``during_step``: only an urgent order ends a step), each at most the collective
        timeout long."""
        abort = functools.partial(self.abort_reason, during_step=during_step)
        return EpochScope(self.wake, abort, self.config.collective_timeout_s, self.where)

    def where(self) -> Where:
        """This node's epoch, the step it is taking and its rank (what its errors carry)."""
        g = self.group
        return Where(g.epoch if g else None, self.state.step + 1, g.rank if g else None)

    def abort_reason(self, *, during_step: bool) -> EpochAborted | None:
        """Why the current epoch must be left now, if it must (every wait polls this): the
        error to raise, with where this node was."""
        self.client.touch()
        current = self.group.epoch if self.group else -1

        def left(error: type[EpochAborted], reason: str) -> EpochAborted:  # built only when it is so
            return error(reason, where=self.where())

        if self.client.expelled is not None:
            return left(Expelled, f"expelled: {self.client.expelled}")
        if self.client.halted is not None:
            return left(EpochAborted, f"the job was stopped: {self.client.halted}")
        latest = self.client.latest_order()
        if latest is not None and latest.epoch > current and (latest.urgent or not during_step):
            return left(EpochAborted, f"epoch {latest.epoch} ordered: {latest.reason}")
        if latest is not None and latest.epoch > current and (gone := self.epochs.gone_ahead(latest)) is not None:
            return left(EpochAborted, f"epoch {latest.epoch} ordered and {gone} of this epoch builds it already")
        if not during_step and self.client.finished is not None:
            return left(EpochAborted, "the job finished")
        return None

    def announce_leave(self, last: bool = False) -> None:
        """``last``: this node alone holds the group's state and nobody came to take it."""
        self.client.send(m.Leave(reason="leave requested (SIGTERM, Ctrl-C or request_leave)", last=last))
        self.leave_sent_at = time.monotonic()

    # ---------------------------------------------------------------- the node's life

    def steps(self) -> Steps:
        """Epoch after epoch until the job is done: yields each slice this node computes
        (after `StepProtocol.open`), takes back its loss, and returns how the run ended.
        A failure abandons the epoch (the step in flight is undone) and waits for the next."""
        while True:
            self.records.joined()
            if self.state.step >= self.job.num_steps and not (self.audits.behind or self.audits.unsettled):
                return self._finish()
            order = self._next_order()
            if isinstance(order, NodeResult):
                return order
            try:
                self._form(order)
                self._sync(order)
                yield from self._train()
            except Expelled as exc:
                log.warning("%s: %s", self.name, exc)
                self._abandon()
            except EpochAborted as exc:
                log.info("%s: %s", self.name, exc)
                self._abandon()
            except Unreachable as exc:  # reported as such: the leader has the others try
                log.warning("%s: %s", self.name, exc.at(self.where()))
                self._abandon()
            except (CollectiveFailed, TransferError) as exc:
                exc.at(self.where())  # raised outside a wait (a vote count, a transfer's check)
                log.warning("%s: %s", self.name, exc)
                if not self.epochs.unreachable_in_lazy_group(order, exc):
                    self.records.refused(order, exc)
                self._abandon()  # after `unreachable_in_lazy_group`: said whom it cannot reach

    def _next_order(self) -> m.EpochOrder | NodeResult:
        """Wait for an epoch to form that includes this node (rejoining if expelled)."""
        current = self.group.epoch if self.group else -1
        waited_since = time.monotonic()
        while True:
            self.wake.clear()
            self.client.touch()
            self.graveyard.sweep()
            if self.client.halted is not None:
                raise JobHalted(f"the group stopped the job at step {self.client.finished}: {self.client.halted}")
            if self.client.expelled is not None and self.client.quarantined:
                self.records.log(Entry.EXPELLED, {"reason": self.client.expelled, "step": self.state.step})
                raise JoinRefused(f"quarantined by the group: {self.client.expelled}")
            if self.client.expelled is not None:
                log.warning("%s was expelled (%s); rejoining as a new member", self.name, self.client.expelled)
                self.records.log(Entry.EXPELLED, {"reason": self.client.expelled, "step": self.state.step})
                self._abandon()
                current = -1
                try:
                    self.client.rejoin()
                except JoinRefused:
                    if self.client.finished is None:
                        raise
                except CoordinatorUnreachable as exc:
                    log.warning("%s: %s; still trying", self.name, exc)
                    self.client.expel("rejoin pending: coordinator unreachable")
                continue
            if self.client.finished is not None:
                return self._job_finished()
            order = self.client.latest_order()
            if order is not None and order.epoch > current:
                if self.client.member_id in order.members:
                    return order
                if self.leave_requested:
                    return self._left()
            if self.leave_requested and (self.group is None or (self.group.size == 1 and self.leave_sent_at)):
                return self._left()  # alone, it announced only once nobody came for its state
            if self.leave_requested and time.monotonic() - waited_since > LEAVE_GRACE_S:
                return self._left()
            self.wake.wait(0.5)

    def _abandon(self) -> None:
        self._flat = None  # a collective of the abandoned epoch may still write into it
        if self.zone is not None:
            self.zone.abandon(self.state.step)
        if self.group is not None:
            for pg in [self.group.pg, *self.group.extra_pgs]:
                self.graveyard.bury(pg)
            self.group.pg = None
            self.group.extra_pgs = []

    def _form(self, order: m.EpochOrder) -> None:
        g, reducer = self.epochs.form(order)
        if g.size == 1:  # a leave announced to a larger epoch: the coordinator kept the last holder
            self.leave_sent_at = None
        policy = order.policy.parsed()
        sync = policy.mode is Mode.SYNC
        if sync:
            flat = self._step_buffer(g.size)
        else:  # DiLoCo's rounds keep exchanges in flight across steps: each epoch has a flat of its own
            self._flat = flat = None
        # Trainers commit to their slices where a validator can check them (`train.checks`).
        commit = sync and not self.own_loop and self.zone is None and Role.VALIDATOR in g.roles
        self.protocol = StepProtocol(self, g, reducer, flat=flat, commit=commit)
        self.records.log(Entry.EPOCH, {"epoch": order.epoch, "term": order.term, "step": self.state.step})
        self.records.first_in_epoch = True
        self._epochs_formed += 1
        log.info(
            "%s: epoch %d rank %d/%d (%s, %d of %d samples) built in %.1f ms",
            self.name, order.epoch, g.rank, g.size, g.role, g.shares[g.rank], self.job.batch_size, g.built_in_s * 1e3,
        )  # fmt: skip
        self._set_role(g.role)
        self.audits.every = policy.audit_every if sync and self.zone is None else 0
        self.records.fragments = policy.fragments
        if policy.mode is Mode.DILOCO and self.diloco is None:
            self.diloco = DiLoCo(self, order)

    def _step_buffer(self, members: int) -> torch.Tensor:
        """The flat tensor of an epoch of ``members``: the one this node keeps (the epoch
        before ended at a commit: nothing writes into it any more). Not cleared: each step's
        contribution writes all of it, and until then the parameters' ``.grad`` still show
        the last step's sum (an own loop may read them after `Swarm.step`)."""
        length = flat_length(self.numel, members)
        if self._flat is None or self._flat.numel() < length:
            self._flat = None  # (the last epoch's protocol and `.grad` views hold it until replaced)
            self._flat = torch.zeros(flat_length(self.numel, max(2 * members, FLAT_MEMBERS)), dtype=torch.float32)
        return self._flat[:length]

    def _sync(self, order: m.EpochOrder) -> None:
        """Compare (step, digest) across the group; whoever is behind or different catches up."""
        self.records.settle()  # a receiver's state is overwritten, a rollback's too
        if self.diloco is not None:
            self.diloco.rollback()
        self.audits.rollback_if_ordered()
        self.audits.refuse_if_recorded()
        g = self.group
        assert g is not None and g.pg is not None
        catch_up(self, g, order.group_step)
        r = sync_state(
            g.pg, g.rank, g.size, self.state, self.scope(during_step=False), partial=self._partial,
            on_sent=functools.partial(self.faults.maybe_fire, "resync"), max_donors=self.config.max_donors,
            incremental=not self.config.full_resync, keep=self.audits.every > 0 and self.audits.audited is None,
            standing=self.audits.standing(), refused=self.audits.missed_verdict, claim=self.faults.greedy(g.epoch),
            lineage=self.state.lineage,
        )  # fmt: skip
        if r.role == "diverged":
            who = f"{g.members[r.culprit]}'s " if r.culprit >= 0 else ""
            self.audits.failed(g, r.culprit, f"sync phase: {who}{r.reason}", below_top=not r.compared)
        if self.audits.behind and r.role != "receiver":
            log.warning("%s: no member holds the audited state to go back to; going on from step %d",
                        self.name, self.state.step)  # fmt: skip
        if r.role != "receiver":
            self._partial.close()  # a fetch cut short earlier is moot now: let its copy go
        else:
            self.applied_step = -1  # the state is a peer's now
        self.audits.synced(g.epoch, received=r.role == "receiver", fetched=r.fetched)
        if self.zone is not None:
            assert self.protocol is not None
            for left in self.zone.sync(self, g, self.state.step, self.protocol.reducer):
                self.graveyard.bury(left)
        if self.diloco is not None:
            self.diloco.sync_zone(received=r.role == "receiver")
        if r.role in ("source", "donor"):
            log.info(
                "%s: sent %.1f MB of the %.1f MB state of step %d to ranks %s in %.2f s",
                self.name, r.megabytes, r.state_megabytes, r.step, list(r.peers), r.seconds,
            )  # fmt: skip
        elif r.role == "receiver":
            entry = {"epoch": g.epoch, "step": self.state.step, "from": [g.members[p] for p in r.peers]}
            counts = {"chunks": r.chunks, "total_chunks": r.total_chunks, "resumed_chunks": r.resumed_chunks}
            sizes = {"mb": r.megabytes, "state_mb": r.state_megabytes, "seconds": r.seconds, "load_s": r.load_s}
            self.records.log(Entry.SYNC, entry | counts | sizes | {"digest": self.state.digest()})
            what = f"{r.megabytes:.1f} of {r.state_megabytes:.1f} MB from {len(r.peers)} peer(s) in {r.seconds:.2f} s"
            self.report(Kind.SYNC, f"received the state of step {self.state.step} ({what})")
            log.info("%s: received the state of step %d: %s", self.name, self.state.step, what)

    def _train(self) -> Generator[Slice, float, None]:
        """Synchronous steps until the job ends or the group switches to a new epoch."""
        if self.diloco is not None:
            yield from self.diloco.train()
            return
        p, g = self.protocol, self.group
        assert p is not None and g is not None
        B = self.job.batch_size
        while self.state.step < self.job.num_steps:
            if p.leaving_alone():
                return
            sl = p.open()
            self.checker.before(g, sl)
            try:
                loss = yield sl
                p.check()
                mb = self.compute.used_mb
                p.contribute(sl, loss, weight=sl.weight, members=g.size, switch=p.switching(), microbatch=mb)
                p.reduce(sl)
                tally = p.verify(members=g.size, samples=B, what=f"step {sl.step}")
                p.check_sum(f"step {sl.step}")
                overflow = p.check_overflow(tally, sl.step)
                p.fence()
            except BaseException:
                p.undo(sl)  # the retry starts from the committed state
                raise
            p.apply(sl, overflow=overflow)
            p.commit(sl, tally.loss, overflow=overflow)
            self.checker.after(g, sl)
            self.audits.committed_epoch, self.audits.checkpoint_epoch = g.epoch, -1
            if sl.indices:
                self.compute.measure_again()
            if self.faults.bitflip(self.state.step) and self.zone is None:
                self.records.settle()
                flip_bit(self.params[0])
            if self.audits.due(self.state.step):
                self.audits.check(g)
            if g.role is Role.VALIDATOR:
                self._maybe_validate()
            if tally.switch > 0 or self.state.step >= self.job.num_steps:
                return

    # ---------------------------------------------------------------- roles

    def _set_role(self, role: Role) -> None:
        """Trainers compute; other members probe their speed and, as validators, evaluate
        (not in a user's own loop: there is no loss to probe with; its share is just 0)."""
        if role is Role.TRAINER or self.own_loop or self.zone is not None:
            if self.sidecar is not None:
                self.sidecar.set_probing(False)
            return
        if self.sidecar is None:
            self.sidecar = Sidecar(
                self.job,
                self.name,
                self.state.model,
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
        self.records.log(Entry.VALIDATION, {"step": step, "metrics": metrics, "seconds": seconds})
        log.info("%s: validated step %d: %s", self.name, step, metrics)

    # ---------------------------------------------------------------- ends

    def _job_finished(self) -> NodeResult:
        """The job finished without this node's word. At the last step with the state most
        trainers finished with (the audit it waited for there was cut short: its lease ran
        out, the others finished first), it finished too; otherwise its run just ends."""
        digest = self.state.digest()
        if self.state.step == self.job.num_steps and digest == self.client.final_digest:
            log.info("%s: the job finished with this node's state (step %d)", self.name, self.state.step)
            return self._finish(digest)
        return NodeResult("job-finished", self.state.step, digest, self._epochs_formed)

    def _finish(self, digest: str | None = None) -> NodeResult:
        digest = digest or self.state.digest()
        metrics: dict[str, float] = {}
        if self.job.evaluate is not None and self.zone is None and (self.group is None or self.group.rank == 0):
            self.state.model.eval()
            with torch.no_grad():
                metrics = self.job.evaluate(self.state.model)
        entry: dict[str, object] = {"step": self.state.step, "digest": digest}
        if self.config.final_state is not None:
            final = self.state.capture()
            if self.zone is not None and self.zone.engine is not None:
                final["shard"] = self.zone.final()
            torch.save(final, self.config.final_state)
        if self.zone is not None and self.zone.engine is not None:
            entry["ranges"] = self.zone.digests()  # a primary's and its buddy's must be equal
        self.records.log(Entry.FINAL, entry)
        # Sent before the session closes: `client.close` queues behind it.
        self.client.send(m.Done(step=self.state.step, digest=digest, metrics=finite(metrics)))
        self._abandon()
        return NodeResult("finished", self.state.step, digest, self._epochs_formed, metrics)

    def _left(self) -> NodeResult:
        if self.leave_sent_at is None:
            self.announce_leave(last=self.group is not None and self.group.size == 1)
        if self.group is None or self.group.size == 1:
            self.records.save_last()
        self.records.log(Entry.LEFT, {"step": self.state.step})
        self._abandon()
        return NodeResult("left", self.state.step, self.state.digest(), self._epochs_formed)


def run_node(job: Job, config: NodeConfig, faults: Faults | None = None) -> NodeResult:
    """Run one node to the end of the job; raises what `Node.run` raises."""
    return Node(job, config, faults).run()
