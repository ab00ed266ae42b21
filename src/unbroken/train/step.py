"""The step protocol: what one member of an epoch does for one step, in one place.

The Job loop (`train.runtime`), DiLoCo's inner and outer steps (`train.diloco`) and a
user's own loop (`unbroken.swarm`) all drive it the same way::

    open        my slice of step s: positions [s*B + offset, + share) of the data plan
    prepare     buffers remembered, gradients cleared, the step's seed: right before compute
    (compute)   forward and backward, by whoever drives: the loss is scaled by m/B; the last
                backward posts the gradient's buckets as they fill (`train.buckets`)
    contribute  flat = [gradient, buffer deltas | vote=1, samples=m, switch, loss, overflow | a norm per member];
                where the epoch has a validator, a commitment to the gradient (`train.checks`)
    reduce      the rest of flat summed right after the buckets (abortable): the vote travels
                with the gradient, and nothing commits unless every piece arrived
    verify      votes == members, samples == B, and the guard on the norms (`train.guard`)
    fence       this node is sure it is still a member (the lease, `control.client`)
    apply       the summed gradient into ``.grad``; before_update; optimizer and scheduler step
    commit      step += 1, cursor += B; after_step; the commit log, progress, checkpoints

Whatever fails before apply is undone (`undo`): the buffers go back to what they were at
prepare, and the step is retried with the same samples in the next epoch. ``switch`` is how
a graceful epoch change (join, leave) takes effect at a step boundary every member agrees
on: the first all-reduce in which any member has seen the new order carries a non-zero
switch, and every member moves to the new epoch right after committing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unbroken.comm.group import EpochGroup, wait_until
from unbroken.comm.reduce import VOTE_SLOTS, Early, Reducer
from unbroken.comm.robust import NORM_TOLERANCE, all_finite
from unbroken.control import messages as m
from unbroken.errors import BadContribution, CollectiveFailed, EpochAborted, JobFailed, Suspicion
from unbroken.events import Entry
from unbroken.job import StepInfo
from unbroken.sched.shares import offsets
from unbroken.train.buckets import Buckets, layout
from unbroken.train.commitment import GradientDigest
from unbroken.train.guard import judge
from unbroken.train.hooks import LIES
from unbroken.train.leaving import Leaving, leave_now

if TYPE_CHECKING:
    from unbroken.train.views import StepNode

log = logging.getLogger(__name__)

EXTRA = VOTE_SLOTS
"""Slots after the gradient and buffers: vote, samples, switch, loss, overflow (`train.scale`);
then one norm per member."""


def flat_length(numel: int, members: int) -> int:
    """The step's flat tensor: gradient and buffers, the `EXTRA` slots, a norm per member."""
    return numel + EXTRA + members


@dataclass
class Slice:
    """This member's part of one step."""

    step: int
    indices: list[int]
    """Positions of the data plan (`Job.samples` reads them)."""
    batch_size: int
    started: float = field(default_factory=time.monotonic)
    before: list[torch.Tensor] = field(default_factory=list)
    """The buffers at `StepProtocol.prepare`: what a failed step puts back."""
    reads: list[int] | None = None
    """Positions the data loader reads instead of ``indices``: a testing fault's
    (``shift@data``, `unbroken.testing.faults`), reported as ``indices`` all the same."""

    @property
    def share(self) -> int:
        return len(self.indices)

    @property
    def weight(self) -> float:
        """This slice's part of the mean over the global batch (what its loss is scaled by)."""
        return self.share / self.batch_size


@dataclass(frozen=True)
class Tally:
    """The reduced control slots of a step."""

    votes: float
    samples: float
    switch: float
    loss: float
    overflow: float
    """Members whose scaled gradient overflowed (the step commits without an update)."""


assert len(dataclasses.fields(Tally)) == EXTRA, "a control slot of the flat tensor per field of Tally"


class StepProtocol:
    """One member's step in one epoch (see the module's docstring)."""

    def __init__(
        self,
        node: StepNode,
        group: EpochGroup,
        reducer: Reducer,
        *,
        flat: torch.Tensor | None = None,
        commit: bool = False,
    ) -> None:
        """``flat``: the flat tensor to use, of `flat_length` (the node keeps one from epoch
        to epoch: a fresh one of 200 MB, for a 50M model, took 1.4 s at every member on each
        epoch change on a busy machine); zeros of its own otherwise. ``commit``: commit to
        each slice's gradient (`train.checks`: the epoch has a validator to check them)."""
        self.node = node
        self.group = group
        self.reducer = reducer
        self.norms_at = node.numel + EXTRA
        length = flat_length(node.numel, group.size)
        self.flat = torch.zeros(length, dtype=torch.float32) if flat is None else flat
        assert self.flat.numel() == length
        self.offset = offsets(group.shares)[group.rank]
        self.share = group.shares[group.rank]
        self.scope = node.scope(during_step=True)
        """The epoch's waits inside a step: only an urgent order or an expulsion ends them."""
        # One bucket (staged after backward, sent with the tail) where pieces cannot go out
        # early: no first hop (robust rules, alone in a zone), or an accelerator, where a
        # hook's copy to the CPU would stop the device at every parameter.
        early = reducer.bucket_bytes and reducer.first_hop is not None and node.replica.device.type == "cpu"
        params = node.replica.params if node.zone is None else []  # a sharded zone sums its blocks in backward
        self.buckets = Buckets(
            params,
            self.flat,
            layout([q.numel() for q in params], reducer.bucket_bytes if early else sys.maxsize),
            post=lambda piece: reducer.first_hop.allreduce([piece]),
            prepare=self._prepare,
        )
        """The gradient's buckets, summed while backward runs (`train.buckets`)."""
        self._step = -1
        self._overflow = False
        self._squares = 0.0
        self._poison: float | None = None
        self._lie: str | None = None
        self._lapses = node.client.lapses
        """The control session's lapses when the step (or the epoch) opened (`fence`)."""
        self.witness = GradientDigest([q.numel() for q in node.replica.params]) if commit else None
        """Digests of this member's gradient as its pieces go out (`train.commitment`)."""
        self.commitment: m.Commitment | None = None
        """This member's commitment to its slice of the step in flight (sent after its commit)."""
        self._asked: tuple[float, int] | None = None
        """When, and at which step, this epoch first saw a leave requested (`leaving_alone`)."""
        self._told: Leaving | None = None

    # ---------------------------------------------------------------- before compute

    def check(self) -> None:
        """Raise `EpochAborted` if this epoch must be left now (an urgent order, expulsion)."""
        reason = self.scope.abort()
        if reason is not None:
            raise reason

    def leaving_alone(self) -> bool:
        """A leave was requested: announce it once the others hold this node's state (the
        group switches after this step); alone, train on a while for a member to take it,
        then stop here (`train.leaving`)."""
        node = self.node
        if not node.leave_requested or node.leave_sent_at is not None:
            return False
        now = time.monotonic()
        if self._asked is None:
            self._asked = (now, node.state.step)
        since, first = self._asked
        d = leave_now(
            requested=True, announced=False, members=self.group.size, committed_here=node.state.step > first,
            waited_s=now - since, step=node.state.step,
        )  # fmt: skip
        if d.action is not self._told:  # once each: a reason for every step would flood the log
            self._told = d.action
            log.log(logging.INFO if d.action is Leaving.STAY else logging.WARNING, "%s: leave: %s", node.name, d.reason)
        if d.action is Leaving.STAY:
            return False
        node.announce_leave(last=d.action is Leaving.GO)
        return d.action is Leaving.GO

    def open(self, *, commits: bool = True) -> Slice:
        """This member's slice of the next step. ``commits``: the step commits on its own
        (not a DiLoCo inner step, committed by its round's outer step): the commit fence
        watches the control session from here (from the epoch's start otherwise)."""
        self.check()
        node = self.node
        if commits:
            self._lapses = node.client.lapses
        step = node.state.step
        node.faults.maybe_fire("compute", step)
        sl = Slice(step, node.data.indices(step, self.offset, self.share), node.job.batch_size)
        if self.share and node.faults.wrong_samples(step):  # a loader off by a batch: the next step's samples
            sl.reads = node.data.indices(step + 1, self.offset, self.share)
        return sl

    def prepare(self, sl: Slice) -> None:
        """Right before computing ``sl``: the buffers are remembered, the gradients cleared,
        the slice's seed set (`slice_seed`: each slice of a step draws its own noise)."""
        node = self.node
        if not sl.before:
            sl.before = [b.detach().clone() for b in node.buffers]
        self._start_gradient(sl.step)
        node.replica.pull()
        for p in node.replica.params:
            p.grad = None
        if not sl.indices and not node.own_loop:
            return  # nothing to draw noise for; a validator's sidecar seeds its own checks
        seed = slice_seed(node.job.seed, sl.step, self.offset)
        if node.replica.device.type == "cpu":
            torch.default_generator.manual_seed(seed)  # what `torch.manual_seed` seeds on a CPU, 100x cheaper
        else:
            torch.manual_seed(seed)  # the accelerators' generators too

    def undo(self, sl: Slice) -> None:
        """The step is not applied: what its forward passes did to the buffers is undone."""
        if self.node.zone is not None:
            self.node.zone.abandon(sl.step)
        if not sl.before:
            return
        with torch.no_grad():
            for b, b0 in zip(self.node.buffers, sl.before, strict=True):
                b.copy_(b0)

    # ---------------------------------------------------------------- the exchange

    def switching(self) -> bool:
        """Whether this member asks the group to move to a new epoch after this step."""
        latest = self.node.client.latest_order()
        return (latest is not None and latest.epoch > self.group.epoch) or self.node.leave_sent_at is not None

    def contribute(self, sl: Slice, loss: float, *, weight: float, members: int, switch: bool, **log: Any) -> None:
        """Write this member's contribution into `flat`: its gradient and buffer deltas
        (float buffers weighted by ``weight``, counters averaged over ``members``), its vote,
        sample count, switch and loss, and the gradient's norm in its own slot."""
        node, g, flat, at = self.node, self.group, self.flat, self.norms_at
        if self._step != sl.step:  # a loop that did not `prepare` (a member with no samples)
            self._start_gradient(sl.step)
        self.buckets.complete()
        if node.zone is not None:  # its gradient went out block by block in backward
            self._squares = node.zone.finish_backward(sl.step) ** 2
        if self.witness is not None and sl.indices:
            mb = min(int(log.get("microbatch") or sl.share), sl.share)
            digest = self.witness.commitment(sl.indices)
            self.commitment = m.Commitment(epoch=g.epoch, step=sl.step, digest=digest, microbatch=mb)
        write_deltas(flat, node.compressed_numel, node.compute_buffers, sl.before, weight, members)
        self.vote(samples=sl.share, switch=switch, loss=loss, overflow=self._overflow)
        flat[at:] = 0.0
        flat[at + g.rank] = math.sqrt(self._squares)
        if self._lie == "forge-slot":  # a hostile member (`train.hooks.LIES`)
            flat[at + (g.rank + 1) % g.size] = LIES["forge-slot"]
        if len(self.buckets.buckets) > 1:
            log["buckets"] = [self.buckets.in_backward, len(self.buckets.buckets)]  # sent in backward, of all
        entry = {"epoch": g.epoch, "step": sl.step, "rank": g.rank, "indices": sl.indices}
        node.records.log(Entry.CONTRIB, entry | {"role": g.role, **log, "compute_s": node.meter.last_compute_s})

    def _start_gradient(self, step: int) -> None:
        faults = self.node.faults
        if step != self._step:  # a fault fires once a step, whatever the buckets and retries
            self._poison, self._lie = faults.corruption(step), faults.lie(step)
            zone = self.node.zone
            if zone is not None and zone.engine is not None:  # its blocks' sums go out in backward
                lie = LIES[self._lie] if self._lie is not None and self._lie != "forge-slot" else None
                zone.engine.spoil = self._poison if self._poison is not None else lie
        self._step, self._overflow, self._squares = step, False, 0.0
        self.buckets.reset()
        self.commitment = None
        if self.witness is not None:
            self.witness.reset()

    def _prepare(self, grad: torch.Tensor) -> None:
        """A piece of this member's gradient (the whole, or a bucket in posting order) as it
        goes out: unscaled, zero once any piece overflowed (the group skips the update; the
        pieces already sent do not matter then), its norm counted before a hostile member
        (`testing.faults`) spoils it."""
        node = self.node
        if node.scale is not None:
            grad.mul_(torch.tensor(1.0 / node.scale.scale, dtype=torch.float32))
            self._overflow = self._overflow or not all_finite(grad)
            if self._overflow:
                grad.zero_()
        if self._poison is not None:
            grad *= self._poison
        self._squares += float(torch.linalg.vector_norm(grad)) ** 2
        if self._lie is not None and self._lie != "forge-slot":
            grad *= LIES[self._lie]
        if self.witness is not None:  # what goes out, as it goes out (the sum overwrites it)
            self.witness.add(int(grad.storage_offset() - self.flat.storage_offset()), grad)

    def backward(self) -> contextlib.AbstractContextManager[None]:
        """Around the backward that completes this step's gradient (the last micro-batch's):
        its buckets are summed while it runs (`train.buckets`)."""
        return self.buckets.during_backward()

    def reduce(self, sl: Slice, *, zone: bool = False, what: str = "") -> None:
        """Sum `flat` over the epoch's members (or, ``zone``, over this node's zone only)."""
        node = self.node
        fire = node.faults.maybe_fire
        if zone:
            post = functools.partial(fire, "allreduce", sl.step)
            early = Early(self.buckets.works, self.buckets.end)
            self.reducer.zone_allreduce(self.flat, self.scope, what, after_post=post, early=early)
            return
        t = time.monotonic()
        early = Early(self.buckets.works, self.buckets.end)
        self.reducer.allreduce(
            self.flat,
            self.scope,
            what or f"all-reduce of step {sl.step}",
            after_post=functools.partial(fire, "allreduce", sl.step),
            after_exchange_post=functools.partial(fire, "exchange", sl.step),
            early=early,
        )
        node.meter.last_comm_s = time.monotonic() - t

    def vote(
        self, *, samples: float, switch: bool, loss: float, overflow: bool = False, flat: torch.Tensor | None = None
    ) -> None:
        """Write this member's control slots (a `Tally` of one) into `flat` (or ``flat``): its
        vote, the ``samples`` it summed, whether it asks to ``switch`` epochs, its part of the
        mean ``loss``, and whether its gradient ``overflow``ed."""
        own = Tally(votes=1.0, samples=float(samples), switch=float(switch), loss=loss, overflow=float(overflow))
        (self.flat if flat is None else flat)[self.node.numel : self.norms_at] = torch.tensor(dataclasses.astuple(own))

    def tally(self) -> Tally:
        """The control slots, summed over the members."""
        return Tally(*self.flat[self.node.numel : self.norms_at].tolist())

    def verify(self, *, members: int, samples: int, what: str) -> Tally:
        """Every member voted and exactly ``samples`` samples went in, or nothing commits."""
        t = self.tally()
        if round(t.votes) != members or round(t.samples) != samples:
            raise CollectiveFailed(f"{what} had {t.votes:.0f}/{members} votes and {t.samples:.0f}/{samples} samples")
        return t

    def check_sum(
        self, what: str, shares: Sequence[int] | None = None, noun: str = "gradient", proven: bool = False
    ) -> None:
        """Refuse a step (``what``) whose reduced ``noun`` a member's contribution spoiled,
        each member's norm judged against its part of ``shares`` (the epoch's by default).

        Gathered rows (`Reducer.rule` robust or ``checked``) were each checked already, and
        their norms are true: the guard's verdict names a culprit; so it does where the norm
        slots were measured on each member's own row (``proven``: DiLoCo's leaders' exchange,
        `Reducer.post`'s ``own_head``). A plain sum can only be checked as a whole: finite,
        and no larger than the members' declared norms allow (the triangle inequality; not
        with a lossy codec, whose error feedback adds to what goes out). What fails there is
        a `Suspicion`, since a member can write any slot of a sum."""
        node, g = self.node, self.group
        norms = self.flat[self.norms_at :].tolist()
        verdict = judge(norms, g.shares if shares is None else shares, node.job.batch_size)
        if proven and verdict is not None:
            culprit, why = verdict
            raise BadContribution(culprit, f"{what}: refused rank {culprit}'s {noun}: {why}")
        if self.reducer.rule.robust:
            if verdict is not None:
                culprit, why = verdict
                raise BadContribution(culprit, f"{what}: refused the contribution of rank {culprit}: {why}")
            return
        grad = self.flat[: node.compressed_numel]
        lossy = self.reducer.codec is not None and self.reducer.zones.multi and not self.reducer.codec.lossless
        # Finite: so is every element. A sharded zone's gradient is in its ranges: the norm
        # summed over them.
        total = node.zone.total_norm if node.zone is not None else float(torch.linalg.vector_norm(grad).item())
        if not math.isfinite(total) and (node.zone is not None or not all_finite(grad)):
            says = "no norm slot says whose" if verdict is None else f"rank {verdict[0]}'s norm slot says {verdict[1]}"
            raise Suspicion(f"{what}: the summed {noun} is not finite; {says} (not proven on a sum)")
        if verdict is not None:
            raise Suspicion(f"{what}: rank {verdict[0]}'s norm slot says {verdict[1]}; not proven on a sum")
        bound = math.fsum(norms)
        if not lossy and total > bound * (1 + NORM_TOLERANCE) + 1e-12:
            raise Suspicion(f"{what}: the summed {noun}'s norm {total:.4g} exceeds the declared {bound:.4g}")

    def check_overflow(self, tally: Tally, step: int) -> bool:
        """Whether the step overflowed (and commits without an update). The slot is a
        member's word alone: it counts only where the job scales its loss, and only for
        `scale.MAX_SKIPS` steps in a row (then the rows are gathered, and a member that
        still says so is named: `Reducer.overflow_allowed`)."""
        if tally.overflow <= 0:
            return False
        scale = self.node.scale
        if scale is None:
            raise Suspicion(f"step {step}: a member says its gradient overflowed, but this job scales no loss")
        if not scale.may_skip:
            raise Suspicion(
                f"step {step}: a member's gradient overflowed {scale.skipped} steps in a row, the scale now "
                f"{scale.scale:g}: not an overflow any more"
            )
        return True

    def lapsed(self) -> bool:
        """The control session was lost with the lease stale since the step in flight opened
        (since the epoch began, for DiLoCo's inner steps): `fence` refuses to commit it."""
        return self.node.client.lapses != self._lapses

    def fence(self) -> None:
        """Refuse to commit unless this node is sure it is still a member. A session lost
        with the lease stale since the step opened ends the epoch here: a coordinator may
        have ordered another epoch without this node meanwhile (one that took over, still
        recovering, may even welcome it back into this one before it learns of the newer),
        and a later session's lease proves nothing of this epoch. The step is retried in
        the next one, whose sync brings whatever the group committed."""
        node, client = self.node, self.node.client
        if node.faults.lapse(node.state.step):  # injected (`testing.faults`): told, as a lapse is
            client.send(m.Fault(epoch=self.group.epoch, reason=f"commit fence of step {node.state.step}: lease lapsed"))
            raise EpochAborted(f"the lease lapsed before step {node.state.step} committed here", where=node.where())
        if not client.commit_allowed():
            log.warning("%s: lease not confirmed before commit; waiting for the coordinator", self.node.name)
            wait_until(client.commit_allowed, self.scope, "commit fence")
        if self.lapsed():
            raise EpochAborted(
                f"the lease lapsed with the coordinator session during step {self.node.state.step}: "
                f"epoch {self.group.epoch} may be over, so the step is not committed here",
                where=self.node.where(),
            )

    # ---------------------------------------------------------------- after the vote

    def apply(self, sl: Slice, *, overflow: bool = False) -> None:
        """The reduced gradient into each parameter's ``.grad``, the buffer deltas onto the
        buffers; then the job's before_update, the optimizer and the scheduler. A step in
        which a member's scaled gradient ``overflow``-ed updates no parameter (`train.scale`)."""
        node, flat = self.node, self.flat
        node.records.settle()
        if node.zone is not None:  # the summed gradient is in the held ranges already
            if not overflow:
                node.zone.apply()
            if node.state.scheduler is not None:
                node.state.scheduler.step()
            return
        off = 0
        for p in node.params:
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p).to(p.device, p.dtype)
            off += n
        if self.group.size == 1:  # its own values, bit for bit (b0 + (b - b0) rounds)
            with torch.no_grad():
                for b, mine in zip(node.buffers, node.compute_buffers, strict=True):
                    if b is not mine:
                        b.copy_(mine)
        else:
            add_deltas(flat, off, node.buffers, sl.before)
        st = node.state
        if not overflow:
            if node.job.before_update is not None:
                user("before_update", node.job.before_update, st.model, st.optimizer)
            st.optimizer.step()
        if st.scheduler is not None:
            st.scheduler.step()
        if node.scale is not None:
            node.scale.update(overflow)

    def commit(self, sl: Slice, loss: float, *, overflow: bool = False) -> None:
        """Step ``sl.step`` is the group's: the state moves on, the job's after_step runs,
        and the commit is logged, reported and checkpointed."""
        node, g = self.node, self.group
        node.advance(sl.step + 1, loss)
        node.applied_step = sl.step
        if node.zone is not None:
            node.zone.committed(sl.step + 1)
        after_step(node, g, loss)
        step, every = node.state.step, node.config.digest_every
        digest = node.state.digest() if every and step % every == 0 else None
        node.records.commit(g, step, loss, node.wire, digest, **({"overflow": True} if overflow else {}))
        if self.commitment is not None and self.commitment.step == sl.step:
            node.records.committed_to(self.commitment)  # sent with the progress report below
        node.records.progress(g, step, loss, node.job.batch_size / max(time.monotonic() - sl.started, 1e-9))
        node.records.maybe_checkpoint(g)
        if node.faults.false_alarm(node.state.step, g.epoch):
            node.client.send(m.Fault(epoch=g.epoch, reason=f"all-reduce of step {sl.step} failed: connection reset"))


def slice_seed(seed: int, step: int, offset: int) -> int:
    """The seed of torch's generators for the slice of step ``step`` that starts at position
    ``offset`` of the global batch: random ops (dropout, noise, augmentation) draw from it.
    Keyed by the data, not the node: the slices of a step draw different noise, as the parts
    of one batch do in one process; the slice at offset 0 (the whole batch, on one node)
    seeds as ``torch.manual_seed(seed * 1_000_003 + step)`` at each step of a plain loop,
    so one node is bit-identical to that loop; a step retried with the same split draws the
    same noise."""
    return seed * 1_000_003 + step + (offset << 32)


def write_deltas(
    flat: torch.Tensor, off: int, buffers: list[torch.Tensor], before: list[torch.Tensor], weight: float, count: int
) -> None:
    """The buffers' changes since ``before`` into ``flat`` from ``off``. Deltas, not values:
    a buffer nobody changed stays bit-exact. An element that did not change is a zero delta
    even where it is infinite (an additive attention mask holds -inf, and -inf - -inf is
    NaN). Float buffers are weighted (a share of the batch), counters averaged over
    ``count`` contributors."""
    for b, b0 in zip(buffers, before, strict=True):
        n = b.numel()
        now = b.detach().to(b0.device)
        delta = torch.where(now == b0, torch.zeros((), dtype=b0.dtype), now - b0).reshape(-1).to(torch.float32)
        flat[off : off + n].copy_(delta * (weight if b.dtype.is_floating_point else 1.0 / count))
        off += n


def add_deltas(flat: torch.Tensor, off: int, buffers: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    """Each buffer becomes its value at ``before`` plus the summed delta in ``flat`` from
    ``off`` (counters rounded back to integers); an element whose delta is zero keeps its
    value as it was, bit for bit (-0.0, -inf)."""
    with torch.no_grad():
        for b, b0 in zip(buffers, before, strict=True):
            n = b.numel()
            delta = flat[off : off + n].view_as(b).to(b.device)
            moved = b0 + (delta if b.dtype.is_floating_point else delta.round()).to(b.dtype)
            b.copy_(torch.where(delta == 0, b0, moved))
            off += n


def after_step(node: StepNode, g: EpochGroup, loss: float) -> None:
    """The job's `Job.after_step` hook, on every replica, before the step's digest."""
    if node.job.after_step is None:
        return
    st = node.state
    info = StepInfo(st.step, loss, st.model, st.optimizer, st.scheduler, st.extra, g.rank, g.size)
    user("after_step", node.job.after_step, info)


def user(what: str, hook: Callable[..., object], *args: Any) -> None:
    """Run the job's own code: what it raises stops this node with its traceback."""
    try:
        hook(*args)
    except Exception as exc:
        trace = traceback.format_exc().rstrip()
        raise JobFailed(f"the job's {what} raised {type(exc).__name__}: {exc}\n{trace}") from exc
