"""Checking the work: trainers commit to their slices, validators recompute some of them.

A trainer's gradient goes into a sum nobody sees part by part, and a node that computes
wrongly (a faulty device, a data loader reading the wrong samples, a bug, a node cutting
corners) passes every check of the sum while its norm looks ordinary. So each trainer
commits to what it contributed, and members with compute to spare recompute some of it,
bit for bit (the seeds' role for slow machines: redundant checking)::

    trainer    contribute  a digest of each parameter's gradient as its piece goes out, and of
                           the slice's positions (`train.commitment`): its commitment, sent
                           with its next progress report once the step committed
    validator  open        idle, and a coin says so (`CHANCE`): a trainer of the step, at
                           random (`choose`), and the state before the step copied (parameters,
                           buffers, the loss scale): a `Task`
               commit      its sidecar recomputes that slice from the copy, on the CPU: the
                           same positions, micro-batches, seed (`step.slice_seed`) and loss
                           scale; the digest goes to the leader (`m.Checked`)
    leader                 compares it with the commitment (`unbroken.control.checks`); a
                           mismatch is one member's word: another member is asked to check the
                           same trainer again (`m.Verify`: a validator, else a trainer, which
                           recomputes on its step loop), and two members' findings bench it

Bit for bit needs the same arithmetic (`commitment.arithmetic`: torch build, CPU kernels,
threads) and the same micro-batches: where the trainer's differ from the checker's, the
leader compares nothing and says so. A step whose scaled gradient overflowed updated
nothing and is not checked. Random ops draw from the generator seeded for the slice, which
only the sidecar's work (one thing at a time) touches on a member without samples.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from unbroken.comm.group import EpochGroup
from unbroken.comm.robust import all_finite
from unbroken.control import messages as m
from unbroken.events import Entry
from unbroken.job import Job
from unbroken.sched.shares import offsets
from unbroken.specs import Role
from unbroken.train.commitment import GradientDigest, arithmetic
from unbroken.train.sidecar import copy_model
from unbroken.train.step import Slice, slice_seed

if TYPE_CHECKING:
    from unbroken.train.views import ChecksNode

log = logging.getLogger(__name__)

CHANCE = 0.5
"""An idle validator checks the next step with this chance: no trainer can tell from when a
check would have ended which step the next one recomputes."""
VALIDATIONS_PER_CHECK = 2
"""Where the job evaluates, a validator's routine check comes after this many validations."""
ORDER_WAIT_S = 60.0
"""How long an order to check a trainer waits for a step in which it trains here."""
CPU = torch.device("cpu")


def choose(roles: Sequence[Role], shares: Sequence[int], me: int, rng: random.Random) -> int | None:
    """The rank of a trainer of this step to check, at random: one with samples, not ``me``."""
    roles = roles or [Role.TRAINER] * len(shares)
    ranks = [r for r, (role, share) in enumerate(zip(roles, shares, strict=True)) if role is Role.TRAINER and share > 0]
    ranks = [r for r in ranks if r != me]
    return rng.choice(ranks) if ranks else None


@dataclass(frozen=True)
class Snapshot:
    """The state a step started from, as far as its gradient depends on it."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    loss_scale: float | None
    """The job's loss scale then (None: it scales no loss)."""

    @staticmethod
    def of(model: nn.Module, loss_scale: float | None) -> Snapshot:
        params = [p.detach().clone() for p in model.parameters()]
        return Snapshot(params, [b.detach().clone() for b in model.buffers()], loss_scale)


@dataclass(frozen=True)
class Task:
    """A trainer's slice to recompute."""

    epoch: int
    step: int
    trainer: str
    indices: list[int]
    microbatch: int
    seed: int
    state: Snapshot
    ordered: bool
    """The leader asked for it (`m.Verify`)."""


def recompute(model: nn.Module, job: Job, task: Task, touch: Callable[[], None] = lambda: None) -> tuple[str, str]:
    """``task``'s commitment as its trainer computed it (`JobCompute` and the step
    protocol's ``_prepare``), recomputed on ``model`` (a CPU copy of the job's model): the
    digest and "", or "" and why there is none."""
    with torch.no_grad():
        for param, value in zip(model.parameters(), task.state.params, strict=True):
            param.copy_(value)
        for buffer, value in zip(model.buffers(), task.state.buffers, strict=True):
            buffer.copy_(value)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    model.train()
    torch.default_generator.manual_seed(task.seed)
    B, mb, scale = job.batch_size, task.microbatch, task.state.loss_scale
    for first in range(0, len(task.indices), mb):
        touch()
        chunk = task.indices[first : first + mb]
        loss = job.microbatch_loss(model, job.collate(job.samples(chunk)))
        (loss * (len(chunk) / B * (scale if scale is not None else 1.0))).backward()  # type: ignore[no-untyped-call]
    digest = GradientDigest([p.numel() for p in params])
    lo = 0
    for p in params:
        g: torch.Tensor = torch.zeros(p.numel()) if p.grad is None else p.grad.detach().reshape(-1).to(torch.float32)
        if scale is not None:
            g = g * torch.tensor(1.0 / scale, dtype=torch.float32)
            if not all_finite(g):
                return "", f"its scaled gradient overflowed at loss scale {scale:g} (the step updated nothing)"
        digest.add(lo, g)
        lo += p.numel()
    return digest.commitment(task.indices), ""


class Checker:
    """One node's part in checking the work (see the module's docstring): routine checks as
    a validator, ordered ones (`m.Verify`) in any role."""

    def __init__(self, node: ChecksNode, rng: random.Random | None = None) -> None:
        self.node = node
        self.rng = rng or random.Random(int.from_bytes(os.urandom(8), "little"))
        """The validator's own choices, unknown to the trainers (not torch's seeded generator)."""
        self._lock = threading.Lock()
        self._orders: dict[str, tuple[m.Verify, float]] = {}
        """Trainer → the leader's order to check it, and when it came."""
        self._planned: list[tuple[str, bool]] = []
        """(trainer, ordered) for each slice of the step in flight to check."""
        self._at: tuple[int, int] = (-1, -1)
        """The epoch and step ``_snapshot`` was taken at."""
        self._snapshot: Snapshot | None = None
        self._routine = False
        """A routine check is planned, queued or running (one at a time)."""
        self._model: nn.Module | None = None
        self._compute = threading.Lock()
        """Held while ``_model`` recomputes (a sidecar's check and a trainer's ordered one)."""

    def ordered(self, msg: m.Verify) -> None:
        """The leader's order (control thread): check ``msg.trainer`` at a step from ``msg.step``."""
        with self._lock:
            self._orders[msg.trainer] = (msg, time.monotonic())
        log.info("%s: asked to check %s's work from step %d: %s", self.node.name, msg.trainer, msg.step, msg.reason)

    def before(self, g: EpochGroup, sl: Slice) -> None:
        """Right after this node opened step ``sl.step`` (its state is the step's start):
        decide what to check of it, and copy that state if anything."""
        self._drop()
        node = self.node
        roles = g.roles or [Role.TRAINER] * g.size
        planned = self._due_orders(g, sl, roles)
        sidecar = node.sidecar
        routine = g.role is Role.VALIDATOR and sidecar is not None and sidecar.idle and not self._routine
        # A job that evaluates asked for that work too: a slow validator's check can take
        # seconds (a trainer's whole slice), so checks wait for validations in between.
        if routine and node.job.evaluate is not None and sidecar is not None:
            routine = sidecar.validations_since_check >= VALIDATIONS_PER_CHECK
        if routine and self.rng.random() < CHANCE:
            r = choose(roles, g.shares, g.rank, self.rng)
            if r is not None and all(g.members[r] != p for p, _ in planned):
                planned.append((g.members[r], False))
                self._routine = True
        if not planned:
            return
        self._planned, self._at = planned, (g.epoch, sl.step)
        self._snapshot = Snapshot.of(node.state.model, node.scale.scale if node.scale is not None else None)

    def after(self, g: EpochGroup, sl: Slice) -> None:
        """Step ``sl.step`` committed: what was planned of it is recomputed, on the sidecar
        (a validator), or here (a trainer: its next step waits that long)."""
        if not self._planned or self._at != (g.epoch, sl.step) or self._snapshot is None:
            return
        node = self.node
        tasks = [self._task(g, sl, trainer, ordered, self._snapshot) for trainer, ordered in self._planned]
        self._planned, self._snapshot = [], None
        if self._model is None:
            self._model = copy_model(node.state.model, node.job).to(CPU)  # here: it may draw random numbers
        sidecar = node.sidecar if g.role is not Role.TRAINER else None
        for task in tasks:
            if sidecar is not None:
                sidecar.submit_check(functools.partial(self._run, task, _nothing))
            else:
                self._run(task, node.client.touch)

    def _due_orders(self, g: EpochGroup, sl: Slice, roles: Sequence[Role]) -> list[tuple[str, bool]]:
        """The orders to carry out at this step (their trainer trains in it); the lapsed
        ones are reported as such."""
        now = time.monotonic()
        due: list[tuple[str, bool]] = []
        with self._lock:
            orders = list(self._orders.items())
        for trainer, (order, since) in orders:
            r = g.members.index(trainer) if trainer in g.members else -1
            if self.node.own_loop:
                self._unordered(trainer)
                self._lapsed(order, g.epoch, sl.step, "an own training loop's node recomputes no slices")
            elif r >= 0 and r != g.rank and roles[r] is Role.TRAINER and g.shares[r] > 0 and sl.step >= order.step:
                self._unordered(trainer)
                due.append((trainer, True))
            elif now - since > ORDER_WAIT_S:
                self._unordered(trainer)
                self._lapsed(order, g.epoch, sl.step, f"it trained in none of this node's steps for {ORDER_WAIT_S:g} s")
        return due

    def _unordered(self, trainer: str) -> None:
        with self._lock:
            self._orders.pop(trainer, None)

    def _drop(self) -> None:
        """What was planned of a step that did not commit: a routine check is off, an
        ordered one waits for the next step."""
        planned, (epoch, step) = self._planned, self._at
        self._planned, self._snapshot = [], None
        for trainer, ordered in planned:
            if not ordered:
                self._routine = False
                continue
            order = m.Verify(epoch=epoch, trainer=trainer, step=step, reason="its step did not commit")
            with self._lock:
                self._orders.setdefault(trainer, (order, time.monotonic()))

    def _task(self, g: EpochGroup, sl: Slice, trainer: str, ordered: bool, state: Snapshot) -> Task:
        r = g.members.index(trainer)
        share, offset = g.shares[r], offsets(g.shares)[r]
        planned = g.microbatches[r] if g.microbatches else 0
        microbatch = min(planned or share, share)
        indices = self.node.data.indices(sl.step, offset, share)
        seed = slice_seed(self.node.job.seed, sl.step, offset)
        return Task(g.epoch, sl.step, trainer, indices, microbatch, seed, state, ordered)

    def _run(self, task: Task, touch: Callable[[], None]) -> None:
        node = self.node
        start = time.perf_counter()
        try:
            assert self._model is not None
            with self._compute:
                digest, skipped = recompute(self._model, node.job, task, touch)
            node.throttle.stretch(time.perf_counter() - start, node.state.step, touch)
        except Exception as exc:  # the job's own code failing here must not take the node down
            log.exception("%s: recomputing %s's slice of step %d failed", node.name, task.trainer, task.step)
            digest, skipped = "", f"the recomputation raised {type(exc).__name__}: {exc}"
        finally:
            if not task.ordered:
                self._routine = False
        self._report(task, digest, skipped, time.perf_counter() - start)

    def _lapsed(self, order: m.Verify, epoch: int, step: int, why: str) -> None:
        task = Task(epoch, step, order.trainer, [], 0, 0, Snapshot([], [], None), ordered=True)
        self._report(task, "", f"not checked: {why}", 0.0)

    def _report(self, task: Task, digest: str, skipped: str, seconds: float) -> None:
        node = self.node
        msg = m.Checked(
            epoch=task.epoch,
            step=task.step,
            trainer=task.trainer,
            digest=digest,
            microbatch=task.microbatch,
            arithmetic=arithmetic(CPU),
            ordered=task.ordered,
            skipped=skipped[:500],
            seconds=min(seconds, 1e6),
        )
        node.client.send(msg)
        fields = {"epoch": task.epoch, "step": task.step, "trainer": task.trainer, "digest": digest}
        more = {"microbatch": task.microbatch, "ordered": task.ordered, "seconds": round(seconds, 4)}
        node.records.log(Entry.CHECK, fields | more | ({"skipped": skipped} if skipped else {}))


def _nothing() -> None:
    """A sidecar's check touches nothing: the step loop's liveness is its own to show."""
