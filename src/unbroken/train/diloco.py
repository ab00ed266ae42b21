"""DiLoCo: zones train on their own for H inner steps, then exchange what they learned.

``unbroken coordinator --mode diloco --inner-steps H --codec int8`` (or
``CoordinatorConfig(mode="diloco")``): inside a zone the members train synchronously —
one zone all-reduce per inner step, nothing crosses the slow links — for H inner steps (a
*round*). Then the zones exchange their pseudo-gradients, the change of the parameters
since the round began, compressed by the inter-zone codec; the average weighted by each
zone's samples is the gradient of an outer optimizer (SGD with Nesterov momentum, as in
DiLoCo) stepping the parameters of the round's start. Every zone starts the next round from
the result. Inter-zone bytes drop by about H x the codec's ratio.

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

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from unbroken.comm.transfer import sync_state
from unbroken.errors import BadContribution, CollectiveFailed, EpochAborted
from unbroken.job import AnyOptimizer
from unbroken.sched.shares import offsets
from unbroken.state.snapshot import tree_digest
from unbroken.train.guard import judge

if TYPE_CHECKING:
    from unbroken.control.messages import EpochOrder
    from unbroken.train.runtime import Node

log = logging.getLogger(__name__)


class DiLoCo:
    """The outer loop of one node: the round's anchor, the outer optimizer, the inner steps."""

    def __init__(self, node: Node, order: EpochOrder) -> None:
        self.node = node
        self.inner_steps = order.inner_steps
        self.anchor = [nn.Parameter(p.detach().clone(), requires_grad=False) for p in node.params]
        """The parameters at the round's start (what the outer optimizer steps)."""
        self.outer = torch.optim.SGD(self.anchor, lr=order.outer_lr, momentum=order.outer_momentum, nesterov=True)
        node.state.attach_outer(self.outer)
        node.state.optimizer_in_digest = False
        self._round_start: dict[str, object] | None = None
        self._round_buffers: list[torch.Tensor] = []
        self.inner_zone: str | None = None
        """The zone whose training the inner optimizer state comes from (None: elsewhere or fresh)."""
        self.inner_step = -1
        """...and the step it was committed at."""

    def _zone(self) -> tuple[str, list[int]]:
        g = self.node.group
        assert g is not None
        zones = self.node.reducer.zones
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
        pg = node.reducer.zone_pg if node.reducer.zones.multi else g.pg
        if pg is not None and len(ranks) > 1:
            inner = _InnerState(node.state.optimizer, self.inner_step if self.inner_zone == mine else -1)
            abort = functools.partial(node._abort_reason, during_step=False)
            r = sync_state(
                pg, ranks.index(g.rank), len(ranks), inner, node.wake, abort, node.config.collective_timeout_s
            )
            if r.role == "receiver":
                zone = mine or "default"
                log.info("%s: took zone %s's inner optimizer state (%.1f MB)", node.name, zone, r.megabytes)
                node._log({"kind": "inner-sync", "zone": mine, "step": node.state.step, "mb": r.megabytes})
        self.inner_zone, self.inner_step = mine, node.state.step

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

    def rollback(self) -> None:
        """Back to the round's start (a failed round is retried with the same samples)."""
        st = self.node.state
        if self._round_start is None or st.step == self._round_start["step"]:
            return
        back = self._round_start["step"]
        log.info("%s: round abandoned at inner step %d; back to step %s", self.node.name, st.step, back)
        st.restore(self._round_start)
        self.node.client.step = st.step
        self.node.report("rollback", f"DiLoCo round abandoned; back to its start, step {back}")

    # ---------------------------------------------------------------- the round

    def train(self) -> None:
        """Inner steps until the round ends, then the outer step; rounds until the job ends
        or the group must switch to a new epoch."""
        node = self.node
        g = node.group
        assert g is not None
        B = node.job.batch_size
        mine, zone_ranks = self._zone()
        zone_samples = sum(g.shares[r] for r in zone_ranks)
        zone_shares = [s if r in zone_ranks else 0 for r, s in enumerate(g.shares)]
        my_offset, my_share = offsets(g.shares)[g.rank], g.shares[g.rank]
        norms_at = node.numel + _EXTRA
        flat = torch.zeros(norms_at + g.size, dtype=torch.float32)
        in_step = functools.partial(node._abort_reason, during_step=True)
        self.begin_round()
        losses: list[float] = []
        while node.state.step < node.job.num_steps:
            step = node.state.step
            t0 = time.monotonic()
            reason = in_step()
            if reason is not None:
                raise EpochAborted(reason)
            if node._leave_requested and node._leave_sent_at is None:
                if g.size == 1:
                    return
                node._announce_leave()
            node.faults.maybe_fire("compute", step)
            indices = node.data.indices(step, my_offset, my_share)
            before = [b.detach().clone() for b in node.buffers]
            try:
                loss = node._compute(indices, step, g.microbatch, before)
                reason = in_step()
                if reason is not None:
                    raise EpochAborted(reason)
                node._flatten(flat, before, my_share / max(zone_samples, 1), len(zone_ranks))
                poison = node.faults.corruption(step)
                if poison is not None:
                    flat[: node.compressed_numel] *= poison
                flat[node.numel : norms_at] = torch.tensor([1.0, float(my_share), 0.0, loss])
                flat[norms_at:] = 0.0
                flat[norms_at + g.rank] = torch.linalg.vector_norm(flat[: node.compressed_numel])
                entry = {"kind": "contrib", "epoch": g.epoch, "step": step, "rank": g.rank, "indices": indices}
                node._log(entry | {"role": g.role, "zone": mine, "compute_s": node.meter.last_compute_s})
                node.reducer.zone_allreduce(
                    flat,
                    node.wake,
                    in_step,
                    node.config.collective_timeout_s,
                    f"inner step {step} (zone {mine or 'default'})",
                    after_post=functools.partial(node.faults.maybe_fire, "allreduce", step),
                )
                votes, samples, _, zone_loss = flat[node.numel : norms_at].tolist()
                if round(votes) != len(zone_ranks) or round(samples) != zone_samples:
                    raise CollectiveFailed(
                        f"inner step {step} had {votes:.0f}/{len(zone_ranks)} votes and "
                        f"{samples:.0f}/{zone_samples} samples in zone {mine or 'default'}"
                    )
                verdict = judge(flat[norms_at:].tolist(), zone_shares, B)
                if verdict is not None:
                    culprit, why = verdict
                    raise BadContribution(
                        culprit, f"inner step {step}: refused rank {culprit}'s gradient: {why}", zone_only=True
                    )
            except BaseException:
                node._restore_buffers(before)
                raise
            # The sum is over the zone's samples: the zone's mean gradient, not the global one.
            flat[: node.compressed_numel] *= B / max(zone_samples, 1)
            node._apply(flat, before)
            node.state.step = step + 1
            losses.append(zone_loss * B / max(zone_samples, 1))
            node._report(g, node.state.step, losses[-1], B / max(time.monotonic() - t0, 1e-9))
            if node.state.step == self.round_end(step):
                if self._outer_step(step, losses):
                    return
                losses = []

    def _outer_step(self, last: int, losses: list[float]) -> bool:
        """Exchange the zones' pseudo-gradients and apply the outer optimizer; True when
        the group switches to a new epoch after it."""
        node = self.node
        grp = node.group
        assert grp is not None
        B = node.job.batch_size
        zones = node.reducer.zones
        mine, zone_ranks = self._zone()
        zone_samples = sum(grp.shares[r] for r in zone_ranks)
        first = int(self._round_start["step"]) if self._round_start else last  # type: ignore[call-overload]
        steps = last + 1 - first
        norms_at = node.numel + _EXTRA
        flat = torch.zeros(norms_at + grp.size, dtype=torch.float32)
        leader = zone_ranks[0] == grp.rank
        if leader:  # every member of a zone holds the same parameters: one speaks for it
            weight = zone_samples / B
            off = 0
            for a, p in zip(self.anchor, node.params, strict=True):
                n = p.numel()
                flat[off : off + n] = (a.detach() - p.detach()).reshape(-1) * weight
                off += n
            n_zones = len(zones.names) if zones.of_rank else 1
            for b, b0 in zip(node.buffers, self._round_buffers, strict=True):
                n = b.numel()
                delta = (b.detach() - b0).reshape(-1).to(torch.float32)
                flat[off : off + n] = delta * (weight if b.dtype.is_floating_point else 1.0 / n_zones)
                off += n
        latest = node.client.latest_order()
        switch = 1.0 if (latest is not None and latest.epoch > grp.epoch) or node._leave_sent_at else 0.0
        mean_loss = sum(losses) / max(len(losses), 1)
        flat[node.numel : norms_at] = torch.tensor(
            [1.0, float(grp.shares[grp.rank] * steps), switch, mean_loss * (zone_samples / B if leader else 0.0)]
        )
        in_step = functools.partial(node._abort_reason, during_step=True)
        t_comm = time.monotonic()
        node.reducer.allreduce(
            flat,
            node.wake,
            in_step,
            node.config.collective_timeout_s,
            f"outer step after inner step {last}",
            after_exchange_post=functools.partial(node.faults.maybe_fire, "exchange", last),
        )
        node.meter.last_comm_s = time.monotonic() - t_comm
        votes, samples, switched, global_loss = flat[node.numel : norms_at].tolist()
        if round(votes) != grp.size or round(samples) != B * steps:
            raise CollectiveFailed(
                f"outer step after inner step {last} had {votes:.0f}/{grp.size} votes and "
                f"{samples:.0f}/{B * steps} samples"
            )
        node._fence()
        with torch.no_grad():
            off = 0
            for a, p in zip(self.anchor, node.params, strict=True):
                n = p.numel()
                a.grad = flat[off : off + n].view_as(a).clone()
                off += n
            self.outer.step()
            for a, p in zip(self.anchor, node.params, strict=True):
                p.copy_(a)
                a.grad = None
            for b, b0 in zip(node.buffers, self._round_buffers, strict=True):
                n = b.numel()
                delta = flat[off : off + n].view_as(b)
                b.copy_(b0 + (delta if b.dtype.is_floating_point else delta.round()).to(b.dtype))
                off += n
        node._committed_round(grp, first, last, global_loss)
        self.inner_zone, self.inner_step = mine, node.state.step
        self.begin_round()  # the committed state: what a failure from now on rolls back to
        log.debug("%s: outer step after inner step %d (%d inner steps)", node.name, last, steps)
        return switched > 0 or node.state.step >= node.job.num_steps


_EXTRA = 4
"""Vote, samples, switch, loss (the runtime's layout)."""


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

    def load_tree(self, tree: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(tree)
