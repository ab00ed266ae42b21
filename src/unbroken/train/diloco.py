"""DiLoCo: zones train on their own for H inner steps, then exchange what they learned.

``unbroken coordinator --mode diloco --inner-steps H --codec int8`` (or
``CoordinatorConfig(policy=Policy(diloco=DiLoCoPolicy()))``): inside a zone the members train synchronously —
one zone all-reduce per inner step, nothing crosses the slow links — for H inner steps (a
*round*). Then the zones exchange their pseudo-gradients, the change of the parameters
since the round began, compressed by the inter-zone codec; the average weighted by each
zone's samples is the gradient of an outer optimizer (SGD with Nesterov momentum, as in
DiLoCo; plain SGD with ``--outer-momentum 0``) stepping the parameters of the round's start.
Every zone starts the next round from the result. Inter-zone bytes drop by about H x the
codec's ratio.

Data: inner step s consumes global batch s split by the epoch's shares, as in sync mode;
each zone computes its own members' slices. A round consumes batches kH .. kH+H-1 exactly
once, whichever zone computed which slice.

The promises hold at outer-step granularity:

- The committed state is the state at a round's start: parameters, buffers, the outer
  momentum, step kH and the cursor, the same on every node (their digests are compared),
  plus the inner optimizer's state, the same inside a zone (DiLoCo keeps it per worker:
  resetting it each round costs ~7% of held-out loss in ``bench/slowlink.py``'s job). The
  sync phase moves the first from any peer, then the second from a zone peer that trained
  in this zone (a node new to its zone takes it over; a zone with no such member keeps
  what its members agree on). A node that joins mid-round receives both and starts the
  next round with its zone.
- A failure (crash, hang, cut link) rolls every node back to the round's start; the round is
  retried with the same samples under the new epoch. A crash costs at most the round in
  flight, never a committed outer step, and nothing waits for a dead zone.
- Joins, leaves and plan changes take effect at the round's end (the switch vote travels
  with the exchange), so they cost no work.
- The exchange is the commit vote: votes and sample counts travel exactly (float32) with the
  pseudo-gradients; an outer step is applied by all members or by none, and a node that
  missed it (its zone leader died while broadcasting) catches up from a peer.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from unbroken.comm.group import EpochGroup
from unbroken.comm.outer_ranges import named
from unbroken.comm.reduce import Posted
from unbroken.comm.robust import all_finite
from unbroken.comm.transfer import gather_values, sync_state
from unbroken.errors import BadContribution, BadRequest, ConfigError, Suspicion
from unbroken.events import Entry, Kind
from unbroken.job import AnyOptimizer
from unbroken.state.snapshot import tree_digest
from unbroken.train.guard import judge
from unbroken.train.hooks import LIES
from unbroken.train.sharded_outer import ShardedOuter
from unbroken.train.step import Slice, add_deltas, after_step, write_deltas

if TYPE_CHECKING:
    from unbroken.control.messages import EpochOrder
    from unbroken.train.views import DiLoCoNode

log = logging.getLogger(__name__)


class DiLoCo:
    """The outer loop of one node: the round's anchor, the outer optimizer, the inner steps."""

    def __init__(self, node: DiLoCoNode, order: EpochOrder) -> None:
        if node.scale is not None:
            raise ConfigError("Job.loss_scale is for synchronous mode: DiLoCo's inner steps cannot use it yet")
        self.node = node
        policy = order.policy.parsed().diloco
        assert policy is not None, "a DiLoCo outer loop for an order in synchronous mode"
        self.inner_steps = policy.inner_steps
        self.anchor = [nn.Parameter(p.detach().clone(), requires_grad=False) for p in node.params]
        """The parameters at the round's start (what the outer optimizer steps)."""
        momentum = policy.outer_momentum  # 0: plain SGD (torch refuses Nesterov without momentum)
        settings = {"lr": policy.outer_lr, "momentum": momentum, "nesterov": momentum > 0}
        node.state.outer_settings = settings
        node.state.optimizer_in_digest = False
        self.sharded: ShardedOuter | None = None
        """A sharded zone's outer loop, range by range (`train.sharded_outer`)."""
        self.outer: torch.optim.SGD | None = None
        if node.zone is not None:
            if policy.overlap:
                raise ConfigError("--outer-overlap is not for sharded zones yet: leave it off, or train unsharded")
            self.sharded = ShardedOuter(node.zone, settings, order.policy.parsed().codec)
        else:
            self.outer = torch.optim.SGD(self.anchor, **settings)  # type: ignore[arg-type]
            node.state.attach_outer(self.outer)
        self._round_start: dict[str, object] | None = None
        self._round_buffers: list[torch.Tensor] = []
        self.inner_zone: str | None = None
        """The zone whose training the inner optimizer state comes from (None: elsewhere or fresh)."""
        self.inner_step = -1
        """...and the step it was committed at."""
        self.overlap = policy.overlap
        if self.overlap and node.buffers:
            raise ConfigError(
                "--outer-overlap needs a model without buffers (BatchNorm's running statistics): a round's "
                "buffers would have to be carried across the round applied late; leave --outer-overlap off"
            )
        self.in_flight: _InFlight | None = None
        """The round whose exchange runs while the next one trains (`DiLoCoPolicy.overlap`)."""
        self._local_start: list[torch.Tensor] = []
        """This zone's parameters when the round in training began (they differ from the
        committed ones by the progress of the round in flight)."""
        self._inner_start: tuple[dict[str, Any], dict[str, Any] | None] | None = None
        """The inner optimizer's and the scheduler's state when the round in training began:
        what the round is retried with."""
        self._moved = False
        """The live state differs from the committed one at the same step (a round applied
        late put back the inner optimizer of the round in training)."""

    def _zone(self) -> tuple[str, list[int]]:
        g, p = self.node.group, self.node.protocol
        assert g is not None and p is not None
        zones = p.reducer.zones
        if not zones.of_rank:
            return "", list(range(g.size))
        mine = zones.of_rank[g.rank]
        return mine, zones.members(mine)

    def sync_zone(self, received: bool) -> None:
        """After the sync phase: bring the inner optimizer state to the zone's."""
        node = self.node
        g = node.group
        assert g is not None
        if received:  # the state came from a peer, perhaps of another zone
            self.inner_zone = None
        mine, ranks = self._zone()
        assert node.protocol is not None
        reducer = node.protocol.reducer
        pg = reducer.zone_pg if reducer.zones.multi else g.pg
        if pg is not None and len(ranks) > 1:
            inner = _InnerState(node.state.optimizer, self.inner_step if self.inner_zone == mine else -1)
            try:
                r = sync_state(pg, ranks.index(g.rank), len(ranks), inner, node.scope(during_step=False))
            except BadRequest as exc:  # named by its rank in the zone: the epoch's is reported
                raise BadRequest(ranks[exc.rank], str(exc)) from exc
            if r.role == "receiver":
                zone = mine or "default"
                log.info("%s: took zone %s's inner optimizer state (%.1f MB)", node.name, zone, r.megabytes)
                node.records.log(Entry.INNER_SYNC, {"zone": mine, "step": node.state.step, "mb": r.megabytes})
        self.inner_zone, self.inner_step = mine, node.state.step
        if self.sharded is not None:  # after the zone's sync phase gave this member its ranges
            self.sharded.after_sync(node.scope(during_step=False))
            moved = self.sharded.zone.moved
            if moved is not None and moved.fresh:  # the state is committed as it is (a checkpoint's)
                self._round_start = None

    def round_end(self, step: int) -> int:
        """The step after the last inner step of the round that ``step`` is in."""
        return min(self.node.job.num_steps, (step // self.inner_steps + 1) * self.inner_steps)

    def begin_round(self) -> None:
        """Remember the committed state: where a failure rolls back to."""
        st = self.node.state
        with torch.no_grad():
            for a, p in zip(self.anchor, self.node.params, strict=True):
                a.copy_(p.detach())
        self._round_buffers = [b.detach().clone() for b in self.node.buffers]
        self._round_start = st.capture(reuse=self._round_start)
        self._moved = False
        if self.sharded is not None:
            self.sharded.begin_round(st.step)

    def rollback(self) -> None:
        """Back to the round's start (a failed round is retried with the same samples)."""
        self.in_flight = None  # its exchange was on the old epoch's groups: it is retried too
        st = self.node.state
        if self.sharded is not None:
            self.sharded.rollback(moved=self._round_start is not None and st.step != self._round_start["step"])
        if self._round_start is None or (st.step == self._round_start["step"] and not self._moved):
            return
        back = self._round_start["step"]
        log.info("%s: round abandoned at inner step %d; back to step %s", self.node.name, st.step, back)
        st.restore(self._round_start)
        self.node.restored()
        self.node.report(Kind.ROLLBACK, f"DiLoCo round abandoned; back to its start, step {back}")

    # ---------------------------------------------------------------- the round

    def train(self) -> Generator[Slice, float, None]:
        """Inner steps until the round ends, then the outer step; rounds until the job ends
        or the group must switch to a new epoch. Yields each inner step's slice to compute
        and takes its loss back (`train.step`)."""
        node, g, p = self.node, self.node.group, self.node.protocol
        assert g is not None and p is not None
        B = node.job.batch_size
        mine, zone_ranks = self._zone()
        zone = mine or "default"
        zone_samples = sum(g.shares[r] for r in zone_ranks)
        zone_shares = [s if r in zone_ranks else 0 for r, s in enumerate(g.shares)]
        self.begin_round()
        if node.zone is not None:  # its inner steps sum in its zone, to the zone's mean
            node.zone.inner_scale = B / max(zone_samples, 1)
        overlap = self.overlap and p.reducer.zones.multi
        if overlap:
            self.in_flight = None
            self._start_local_round()
        first = node.state.step
        losses: list[float] = []
        while node.state.step < node.job.num_steps:
            if p.leaving_alone():
                return
            sl = p.open(commits=False)
            try:
                loss = yield sl
                p.check()
                weight = sl.share / max(zone_samples, 1)
                p.contribute(sl, loss, weight=weight, members=len(zone_ranks), switch=False, zone=mine)
                p.reduce(sl, zone=True, what=f"inner step {sl.step} (zone {zone})")
                what = f"inner step {sl.step} in zone {zone}"
                tally = p.verify(members=len(zone_ranks), samples=zone_samples, what=what)
                verdict = judge(p.flat[p.norms_at :].tolist(), zone_shares, B)
                if verdict is not None:
                    culprit, why = verdict
                    raise BadContribution(
                        culprit, f"inner step {sl.step}: refused rank {culprit}'s gradient: {why}", zone_only=True
                    )
            except BaseException:
                p.undo(sl)
                raise
            # The sum is over the zone's samples: the zone's mean gradient, not the global one.
            p.flat[: node.compressed_numel] *= B / max(zone_samples, 1)
            p.apply(sl)
            node.state.step = sl.step + 1  # the cursor moves with the outer step
            node.applied_step = sl.step
            losses.append(tally.loss * B / max(zone_samples, 1))
            node.records.progress(g, node.state.step, losses[-1], B / max(time.monotonic() - sl.started, 1e-9))
            if node.state.step == self.round_end(sl.step):
                if overlap:
                    if self._overlapped_round_end(first, sl.step, losses):
                        return
                elif self._outer_step(sl.step, losses):
                    return
                losses, first = [], node.state.step

    def _outer_step(self, last: int, losses: list[float]) -> bool:
        """Exchange the zones' pseudo-gradients and apply the outer optimizer; True when
        the group switches to a new epoch after it."""
        if self.sharded is not None:
            return self._sharded_outer_step(last, losses)
        node, grp, p = self.node, self.node.group, self.node.protocol
        assert grp is not None and p is not None
        B = node.job.batch_size
        zones = p.reducer.zones
        mine, zone_ranks = self._zone()
        zone_samples = sum(grp.shares[r] for r in zone_ranks)
        first = int(self._round_start["step"]) if self._round_start else last  # type: ignore[call-overload]
        steps = last + 1 - first
        flat = p.flat
        flat.zero_()
        leader = zone_ranks[0] == grp.rank
        if leader:  # every member of a zone holds the same parameters: one speaks for it
            weight = zone_samples / B
            off = 0
            for a, q in zip(self.anchor, node.params, strict=True):
                n = q.numel()
                flat[off : off + n] = (a.detach() - q.detach()).reshape(-1) * weight
                off += n
            n_zones = len(zones.names) if zones.of_rank else 1
            write_deltas(flat, off, node.buffers, self._round_buffers, weight, n_zones)
            self._speak(flat, last)
        mean_loss = sum(losses) / max(len(losses), 1)
        p.vote(samples=p.share * steps, switch=p.switching(), loss=mean_loss * (zone_samples / B if leader else 0.0))
        t_comm = time.monotonic()
        p.reducer.allreduce(
            flat,
            p.scope,
            f"outer step after inner step {last}",
            after_exchange_post=functools.partial(node.faults.maybe_fire, "exchange", last),
            own_head=True,
            silent=self._zone_idle(),
        )
        node.meter.last_comm_s = time.monotonic() - t_comm
        tally = p.verify(members=grp.size, samples=B * steps, what=f"outer step after inner step {last}")
        self._check_outer(f"outer step after inner step {last}")
        p.fence()
        off = self._outer_update(flat)
        add_deltas(flat, off, node.buffers, self._round_buffers)
        self._commit_round(grp, first, last, tally.loss)
        self.inner_zone, self.inner_step = mine, node.state.step
        self.begin_round()  # the committed state: what a failure from now on rolls back to
        log.debug("%s: outer step after inner step %d (%d inner steps)", node.name, last, steps)
        return tally.switch > 0 or node.state.step >= node.job.num_steps

    def _sharded_outer_step(self, last: int, losses: list[float]) -> bool:
        """`_outer_step` of a sharded zone: the pseudo-gradients exchanged range by range
        between the zones' holders (`train.sharded_outer`), then the vote over the epoch,
        then each member's outer step on its own ranges."""
        node, grp, p, outer = self.node, self.node.group, self.node.protocol, self.sharded
        assert grp is not None and p is not None and outer is not None and node.zone is not None
        B = node.job.batch_size
        mine, zone_ranks = self._zone()
        zone_samples = sum(grp.shares[r] for r in zone_ranks)
        first = int(self._round_start["step"]) if self._round_start else last  # type: ignore[call-overload]
        steps, what = last + 1 - first, f"outer step after inner step {last}"
        t_comm = time.monotonic()
        node.faults.maybe_fire("exchange", last)
        outer.codecs.poison = node.faults.corruption(last, "outer")  # testing aid: a broken sender
        squares, sent = self._sharded_exchange(outer, zone_samples / B, zone_samples == 0, what)
        leader = zone_ranks[0] == grp.rank  # the zone's loss is every member's: one speaks for it
        mean_loss = sum(losses) / max(len(losses), 1)
        p.flat.zero_()
        p.vote(samples=p.share * steps, switch=p.switching(), loss=mean_loss * (zone_samples / B if leader else 0.0))
        p.flat[p.norms_at + grp.rank] = squares
        p.reducer.allreduce(p.flat, p.scope, what)
        p.reducer.wire.inter += sent
        p.reducer.wire.last_inter += sent
        node.meter.last_comm_s = time.monotonic() - t_comm
        tally = p.verify(members=grp.size, samples=B * steps, what=what)
        if not all_finite(p.flat[p.norms_at :]):  # every member's verdict, from the same sum
            raise Suspicion(f"{what}: the summed pseudo-gradient of a range is not finite")
        p.fence()
        outer.apply(last + 1)
        self._commit_round(grp, first, last, tally.loss)
        node.zone.committed(node.state.step)
        self.inner_zone, self.inner_step = mine, node.state.step
        self.begin_round()
        return tally.switch > 0 or node.state.step >= node.job.num_steps

    def _sharded_exchange(self, outer: ShardedOuter, weight: float, silent: bool, what: str) -> tuple[float, int]:
        """`ShardedOuter.exchange`, then what each member found of the ranges it received,
        gathered: a sender whose range most of its receivers found not finite is named by
        every member (`outer_ranges.named`), so that the tribunal hears it from the epoch
        and benches it; from its receivers alone (with two zones, half of the epoch at
        most) it would not, and the round, retried as it was, would fail again and again.

        Raises:
            BadContribution: a sender named (by most of its receivers, or by itself: its own
                part not finite), or a receiver's word alone (the tribunal weighs it).
            CollectiveFailed, EpochAborted: as `exchange`."""
        p, moved = self.node.protocol, outer.zone.moved
        assert p is not None and moved is not None
        accused, refused = -1, None
        try:
            result = outer.exchange(weight, silent, p.scope, what)
        except BadContribution as exc:  # its own part (said of itself) or a part it received
            accused, refused, result = exc.rank, exc, (0.0, 0)
        rows = gather_values(moved.pg, len(moved.world), [accused], p.scope, f"{what} (what the receivers found)")
        found = [row[0] for row in rows]
        zone_of = {m: z for z, layout in moved.layouts.items() for m in layout.members}
        culprit = named(found, moved.layouts, zone_of, moved.world)
        if culprit is not None and (refused is None or refused.rank != culprit):
            said = "says its own" if found[culprit] == culprit else "most of its receivers found its"
            refused = BadContribution(culprit, f"{what}: rank {culprit} {said} pseudo-gradient not finite")
        if refused is not None:
            raise refused
        return result

    def _speak(self, flat: torch.Tensor, last: int) -> None:
        """This zone leader's pseudo-gradient (at the head of ``flat``) as it goes out: its
        norm in this member's slot, for every member to judge (`_check_outer`)."""
        node, p, g = self.node, self.node.protocol, self.node.group
        assert p is not None and g is not None
        grad = flat[: node.compressed_numel]
        poison = node.faults.corruption(last, "outer")
        if poison is not None:  # testing aid: a broken zone (`testing.faults`)
            grad *= poison
        flat[p.norms_at + g.rank] = torch.linalg.vector_norm(grad)
        lie = node.faults.lie(last, "outer")
        if lie is not None:  # a hostile leader: a spoiled row, its true norm claimed
            grad *= LIES[lie]

    def _check_outer(self, what: str) -> None:
        """Refuse an outer step that a zone leader's pseudo-gradient spoiled (docs/design.md,
        promise 8) before anything is applied, as a step's sum is checked (`check_sum`):
        each leader's norm against its zone's samples (a zone's other members send none)."""
        p = self.node.protocol
        assert p is not None
        zones = p.reducer.zones
        shares = self._leader_shares()
        # Across zones each leader's row was its own and its norm was measured on arrival
        # (`Reducer.post`'s ``own_head``): a verdict names the leader; in one zone it is a sum.
        p.check_sum(what, shares, noun="pseudo-gradient", proven=zones.multi)

    def _leader_shares(self) -> list[int]:
        """Each zone's samples per inner step, at its leader's rank (the others' are 0)."""
        g, p = self.node.group, self.node.protocol
        assert g is not None and p is not None
        zones = p.reducer.zones
        shares = [0] * g.size
        for r in range(g.size):
            zone = zones.members(zones.of_rank[r]) if zones.of_rank else list(range(g.size))
            if zone[0] == r:
                shares[r] = sum(g.shares[m] for m in zone)
        return shares

    def _zone_idle(self) -> bool:
        """This node leads a zone that trains nothing this round (standbys, validators, a
        zone planned out): its row carries no pseudo-gradient, and no residual either."""
        g = self.node.group
        assert g is not None
        return self._leader_shares()[g.rank] == 0

    def _outer_update(self, flat: torch.Tensor) -> int:
        """The outer optimizer steps the anchor with the summed pseudo-gradient at the head of
        ``flat``; the parameters take the result. Returns where the pseudo-gradient ends."""
        with torch.no_grad():
            off = 0
            for a in self.anchor:
                n = a.numel()
                a.grad = flat[off : off + n].view_as(a).clone()
                off += n
            assert self.outer is not None, "an unsharded outer step"
            self.outer.step()
            for a, q in zip(self.anchor, self.node.params, strict=True):
                q.copy_(a)
                a.grad = None
        return off

    # ---------------------------------------------------------------- rounds applied late

    def _start_local_round(self) -> None:
        st = self.node.state
        self._local_start = [q.detach().clone() for q in self.node.params]
        scheduler = copy.deepcopy(st.scheduler.state_dict()) if st.scheduler is not None else None
        self._inner_start = (copy.deepcopy(st.optimizer.state_dict()), scheduler)

    def _overlapped_round_end(self, first: int, last: int, losses: list[float]) -> bool:
        """Apply the round before (its exchange ran during this one), post this round's, and
        start the next round from the result plus this zone's own progress; True when the
        group switches to a new epoch (what is in flight applied first)."""
        node, grp, p = self.node, self.node.group, self.node.protocol
        assert grp is not None and p is not None
        B = node.job.batch_size
        _, zone_ranks = self._zone()
        zone_samples = sum(grp.shares[r] for r in zone_ranks)
        steps = last + 1 - first
        progress = [(s - q.detach()) for s, q in zip(self._local_start, node.params, strict=True)]
        flat = torch.zeros_like(p.flat)
        leader = zone_ranks[0] == grp.rank
        if leader:  # every member of a zone holds the same parameters: one speaks for it
            torch.cat([d.reshape(-1) for d in progress], out=flat[: node.numel])
            flat[: node.numel] *= zone_samples / B
            self._speak(flat, last)
        mean_loss = sum(losses) / max(len(losses), 1)
        loss = mean_loss * (zone_samples / B if leader else 0.0)
        p.vote(samples=p.share * steps, switch=p.switching(), loss=loss, flat=flat)
        switch = False
        if self.in_flight is not None:
            # Before this round's payload is encoded: the codec's residual the committed state
            # carries must not hold what this round left out.
            switch = self._apply(self.in_flight, self._inner_start)
            self.in_flight = None
        what = f"outer step after inner step {last}"
        posted = p.reducer.post(
            flat, p.scope, what,
            after_exchange_post=functools.partial(node.faults.maybe_fire, "exchange", last), own_head=True,
            silent=self._zone_idle(),
        )  # fmt: skip
        done = _InFlight(posted, first, last, steps)
        if switch or last + 1 >= node.job.num_steps:
            self._apply(done, None)  # nothing stays in flight across an epoch change
            return True
        self.in_flight = done
        with torch.no_grad():  # the next round starts from the committed state plus this round's progress
            for q, a, d in zip(node.params, self.anchor, progress, strict=True):
                q.copy_(a - d)
        node.state.step = last + 1
        self._start_local_round()
        return False

    def _apply(self, done: _InFlight, start: tuple[dict[str, Any], dict[str, Any] | None] | None) -> bool:
        """Complete ``done``'s exchange, apply the outer step and commit its round, with
        ``start`` as the inner optimizer's and scheduler's state to retry the next round from
        (None: the live ones); True when a member asked for a new epoch."""
        node, grp, p = self.node, self.node.group, self.node.protocol
        assert grp is not None and p is not None
        st = node.state
        what = f"outer step after inner step {done.last}"
        t_comm = time.monotonic()
        p.reducer.finish(done.posted, p.scope, what)
        node.meter.last_comm_s = time.monotonic() - t_comm
        p.flat.copy_(done.posted.flat)
        tally = p.verify(members=grp.size, samples=node.job.batch_size * done.steps, what=what)
        self._check_outer(what)
        p.fence()
        self._outer_update(p.flat)
        live = None
        if start is not None:  # optimizers keep the tensors they are given: a swap, not a copy
            live = (st.optimizer.state_dict(), st.scheduler.state_dict() if st.scheduler is not None else None)
            st.optimizer.load_state_dict(start[0])
            if st.scheduler is not None and start[1] is not None:
                st.scheduler.load_state_dict(copy.deepcopy(start[1]))
        self._commit_round(grp, done.first, done.last, tally.loss)
        mine, _ = self._zone()
        self.inner_zone, self.inner_step = mine, node.state.step
        self.begin_round()
        node.records.settle()  # a checkpoint's capture of the committed state is done before it changes
        if live is not None:
            st.optimizer.load_state_dict(live[0])
            if st.scheduler is not None and live[1] is not None:
                st.scheduler.load_state_dict(live[1])
            self._moved = True
        return tally.switch > 0

    def _commit_round(self, g: EpochGroup, first: int, last: int, loss: float) -> None:
        """The outer step commits the round's inner steps ``first``..``last`` at once."""
        node = self.node
        node.advance(last + 1, loss)
        after_step(node, g, loss)
        for s in range(first + 1, last + 2):
            if s == last + 1:
                node.records.commit(g, s, loss, node.wire, node.state.digest(), outer=True)
            else:
                node.records.log(Entry.COMMIT, {"epoch": g.epoch, "step": s, "loss": loss})
        log.info(
            "%s: outer step at %d/%d, epoch %d, %d members, loss %.4f",
            node.name, node.state.step, node.job.num_steps, g.epoch, g.size, loss,
        )  # fmt: skip
        node.records.maybe_checkpoint(g)


@dataclass
class _InFlight:
    """A round whose exchange between zones runs while the next round trains."""

    posted: Posted
    first: int
    last: int
    steps: int


class _InnerState:
    """The inner optimizer's state as the sync phase sees it (inside one zone)."""

    def __init__(self, optimizer: AnyOptimizer, step: int) -> None:
        self.optimizer = optimizer
        self.step = step

    def digest(self) -> str:
        return tree_digest(self.optimizer.state_dict())

    def tree(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def digest_of(self, tree: dict[str, Any]) -> str:
        return tree_digest(tree)

    def source_only(self) -> tuple[str, ...]:
        return ()

    def load_tree(self, tree: dict[str, Any], own: bool = True) -> None:
        self.optimizer.load_state_dict(tree if own else copy.deepcopy(tree))
