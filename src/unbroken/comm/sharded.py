"""A sharded zone's data plane: ZeRO-3 over flat ranges, each range also held by a buddy.

The zone's parameters are one flat index space, block after block (`Blocks`); a `Layout`
(`unbroken.state.shards`) gives each member a contiguous primary range, sized by the memory
it offers, and a buddy for every range. A member keeps only what it holds: its primary
range and the ranges it is buddy for, each with its optimizer state (`Holding`). A step::

    forward   before each block: its parameters gathered from their primaries (all-gather),
              written into the block's own tensors; after it: those tensors' storage freed
    backward  before each block (a hook on its output's gradient): gathered again; once
              every parameter of the block has its gradient, the block's gradient is summed
              over the zone (all-reduce) and each member keeps the part of every range it
              holds, primary and buddy alike; the block's storage is freed again
    update    each member steps its optimizer on everything it holds: the primary and its
              buddy copies take the same update from the same summed gradient, so a copy is
              bit-identical to its primary at every committed step (checked by `digests`)

A loss of members is repaired by `reshard` on the survivors' next group (the plan of
`unbroken.state.shards`: which live holder sends which range, values and optimizer state, to
whom; a range both of whose holders died is the caller's to fetch elsewhere). Every wait is
abortable (`EpochScope`): a dead peer fails it in milliseconds, a frozen one at the deadline.

Why not FSDP2's `fully_shard`: its shards are even slices of each parameter's first
dimension (they cannot follow memory), with no second copy (a re-shard after a death would
need the dead rank's state). Taken from it: the per-block gather, storage freed between
uses, version counters untouched while a block's storage is refilled.

Devices (`unbroken.comm.placement`): the ranges and the zone's collective buffers live on
the ``shards`` device (a GPU under NCCL, else the CPU), the model's parameters on the
``compute`` one (a block staged between them where they differ); what leaves the zone
(`export`: transfers, digests, shard files, the zones' sums) is on the CPU.

Not yet here: buffers summed (they are kept whole on every member; running statistics are
refused) and parameters shared between blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from unbroken.comm.blocks import (
    Block,
    Holding,
    Piece,
    blocks_of,
    collect,
    fill,
    free,
    move_model,
    refuse_running_statistics,
    sum_of_squares,
    tensors_of,
)
from unbroken.comm.group import EpochScope, ProcessGroup, posted, wait_all, wait_polled
from unbroken.comm.placement import CPU, Placement
from unbroken.comm.reshard import (
    cross_sum,
    exchange_ranges,
    load_ranges,
    move_ranges,
    range_digest,
    shared_state,
    state_layout,
)
from unbroken.errors import CollectiveFailed, ConfigError, EpochAborted
from unbroken.state.shards import Layout, Plan, Purpose

log = logging.getLogger(__name__)

Optimizer = torch.optim.Optimizer
OptimizerFactory = Callable[[list[dict[str, Any]]], Optimizer]
"""Builds the optimizer over param groups (``[{"params": [...], "lr": ...}, ...]``)."""


class ShardedModel:
    """One member's share of a sharded zone (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        me: str,
        ranks: Mapping[str, int],
        group: ProcessGroup,
        scope: EpochScope,
        make_optimizer: OptimizerFactory,
        *,
        blocks: Sequence[nn.Module] | None = None,
        groups: Sequence[Mapping[str, Any]] | None = None,
        values: Callable[[int, int], torch.Tensor] | None = None,
        placement: Placement | None = None,
    ) -> None:
        """``model``: built on the CPU (its values are read where ``values`` is None, then its
        parameters' storage is freed). ``layout``: the zone's; ``me`` its member name for
        this process, ``ranks`` each member's rank in ``group``. ``groups``: the param
        groups' hyperparameters, one per group, with ``"params"`` naming the parameters by
        their names in ``model`` (default: one group of all). ``values(start, end)``: the
        initial flat values of a range (default: read from ``model``). ``placement``: where
        the shards live and the model computes (default: the CPU, gloo)."""
        refuse_running_statistics(model)
        self.placement = placement or Placement()
        self.model = model
        self.layout = layout
        self.me = me
        self.ranks = dict(ranks)
        self.group = group
        self.scope = scope
        self.make_optimizer = make_optimizer
        self.blocks: list[Block] = []
        self.params: list[nn.Parameter] = []
        names = {id(p): n for n, p in model.named_parameters()}
        at = 0
        for module, params in blocks_of(model, blocks):
            offsets = []
            start = at
            for p in params:
                offsets.append(at)
                at += p.numel()
                self.params.append(p)
            self.blocks.append(Block(module, params, start, at, offsets))
        if at != layout.numel:
            raise ConfigError(f"the layout covers {layout.numel:,} elements but the model has {at:,} parameters")
        self._names = [names[id(p)] for p in self.params]
        # The order forward reaches the blocks in (the model itself, holding what no block
        # does, first: its forward encloses the others'), the same on every member: so are
        # the gathers posted ahead of use (`_neighbour`).
        self._order = [b for b in self.blocks if b.module is model] + [b for b in self.blocks if b.module is not model]
        self._spans = [(b.offsets[i], b.offsets[i] + p.numel()) for b in self.blocks for i, p in enumerate(b.params)]
        self._group_of = self._param_groups(groups)
        self._group_settings = [
            {k: v for k, v in g.items() if k != "params"} for g in (groups or [{"params": self._names}])
        ]
        read = values if values is not None else self._read_model
        self.holdings = [
            self._holding(s.start, s.end, purpose, read(s.start, s.end)) for s, purpose in self._held(layout, me)
        ]
        self._built: list[int] = []
        """The param group each group of `optimizer` was built from (empty ones are left out)."""
        self.optimizer = self._build_optimizer()
        self.defer = False
        """A failed collective is not raised inside forward or backward but kept in `failure`
        and raised by `finish_backward` (a user's own loop runs them: what they raise would end
        the script); the rest of the step runs on zeros, and is not applied."""
        self.failure: CollectiveFailed | EpochAborted | None = None
        self.spoil: float | None = None
        """What this member's gradient is multiplied by as it goes out (fault injection)."""
        self._sums: list[tuple[Any, torch.Tensor, Block]] = []
        """Blocks' gradient sums in flight, oldest first."""
        self._norms: list[torch.Tensor] = []
        """The norm of this member's own gradient, block by block as it goes out to be summed,
        since `take_squares` (its norm slot of the step: `train.guard`): kept where they were
        computed and read once a step, not once a block (a read waits for the device)."""
        self.broken = False
        """A collective of the zone's group failed, or the backend refused a post, since the
        group was last set (`unsettled`)."""
        move_model(model, self.placement.compute)
        for p in self.params:  # the model keeps its tensors' shapes; their bytes live in the holdings
            free(p)
        self._hooks: list[Any] = []
        self._install()

    # ---------------------------------------------------------------- set-up

    def _param_groups(self, groups: Sequence[Mapping[str, Any]] | None) -> list[int]:
        if groups is None:
            return [0] * len(self.params)
        index = {n: i for i, n in enumerate(self._names)}
        out = [-1] * len(self.params)
        for g, group in enumerate(groups):
            for name in group["params"]:
                if name not in index:
                    raise ConfigError(f"param group {g} names {name!r}, not a parameter of the model")
                out[index[name]] = g
        if -1 in out:
            raise ConfigError(
                f"parameters in no param group: {[n for n, g in zip(self._names, out, strict=True) if g < 0][:5]}"
            )
        return out

    @staticmethod
    def _held(layout: Layout, me: str) -> list[tuple[Any, Purpose]]:
        own = [(s, Purpose.PRIMARY) for s in layout.shards if s.primary == me]
        return own + [(s, Purpose.BUDDY) for s in layout.shards if s.buddy == me]

    def _read_model(self, start: int, end: int) -> torch.Tensor:
        out = torch.empty(end - start, dtype=torch.float32)
        for i, (lo, hi) in enumerate(self._spans):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - start : b - start] = self.params[i].detach().reshape(-1)[a - lo : b - lo]
        return out

    @property
    def device(self) -> torch.device:
        """Where the held ranges and the zone's collective buffers live."""
        return self.placement.shards

    def _holding(self, start: int, end: int, purpose: Purpose, flat: torch.Tensor) -> Holding:
        h = Holding(start, end, purpose)
        for i, (lo, hi) in enumerate(self._spans):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                h.pieces.append(Piece(i, a, b, flat[a - start : b - start].to(self.device, copy=True)))
        return h

    def _pieces(self) -> Iterator[Piece]:
        for h in self.holdings:
            yield from h.pieces

    def _build_optimizer(self) -> Optimizer:
        by_group: list[list[torch.Tensor]] = [[] for _ in self._group_settings]
        for piece in self._pieces():
            by_group[self._group_of[piece.param]].append(piece.tensor)
        self._built = [g for g, ps in enumerate(by_group) if ps]
        groups = [dict(self._group_settings[g], params=by_group[g]) for g in self._built]
        if not groups:  # a member holding nothing (a spare) still steps in time with the others
            self._built = [0]
            groups = [dict(self._group_settings[0], params=[torch.zeros(0, device=self.device)])]
        return self.make_optimizer(groups)

    def set_hyperparameters(self, groups: Sequence[Mapping[str, Any]]) -> None:
        """Each param group's settings (learning rate, ...) as ``groups`` has them now, one
        per group in the order given at construction (a scheduler moved them)."""
        if len(groups) != len(self._group_settings):
            raise ConfigError(f"{len(groups)} param groups given, the zone has {len(self._group_settings)}")
        self._group_settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        for built, group in zip(self._built, self.optimizer.param_groups, strict=True):
            group.update(self._group_settings[built])

    def take_squares(self) -> float:
        """The sum of squares of this member's own gradient since the last call (one read
        of the device); starts the count again."""
        norms, self._norms = self._norms, []
        return sum_of_squares(norms)

    def _install(self) -> None:
        for block in self.blocks:
            self._hooks.append(block.module.register_forward_pre_hook(self._before_forward(block)))
            self._hooks.append(block.module.register_forward_hook(self._after_forward(block)))
            for p in block.params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulated(block)))  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Remove the hooks (the model is left with freed parameters)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- the step

    def _before_forward(self, block: Block) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._gather(block)
            block.waiting = sum(1 for p in block.params if p.requires_grad)
            if (ahead := self._neighbour(block, +1)) is not None:
                self._post_gather(ahead)  # its bytes travel while this block computes

        return hook

    def _neighbour(self, block: Block, direction: int) -> Block | None:
        """The block forward reaches after ``block`` (+1) or before it (-1) (`_order`)."""
        at = self._order.index(block) + direction
        return self._order[at] if 0 <= at < len(self._order) else None

    def _after_forward(self, block: Block) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if torch.is_grad_enabled() and block.waiting:
                armed = False
                for t in tensors_of(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad: self._before_backward(block, grad))  # type: ignore[no-untyped-call]
                        armed = True
                if armed:
                    self._release(block)
                    return output
            self._release(block)
            return output

        return hook

    def _before_backward(self, block: Block, grad: torch.Tensor) -> torch.Tensor:
        self._gather(block)
        if (ahead := self._neighbour(block, -1)) is not None and ahead.waiting:
            self._post_gather(ahead)
        return grad

    def _accumulated(self, block: Block) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            block.waiting -= 1
            if block.waiting == 0:
                self._reduce(block)

        return hook

    def _post_gather(self, block: Block) -> None:
        """Post the block's all-gather (from every primary of its span), not waiting for it."""
        if block.gathered or block.fetch is not None or self.failure is not None:
            return
        pieces = [(s.primary, max(s.start, block.start), min(s.end, block.end)) for s in self.layout.shards]
        pieces = [(who, a, b) for who, a, b in pieces if a < b]
        longest = max(b - a for _, a, b in pieces)
        mine = torch.empty(longest, device=self.device)  # only what a receiver reads of it is written: its own pieces
        for who, a, b in pieces:
            if who == self.me:
                mine[: b - a] = self._collect(a, b)["values"]
        outputs = [[torch.empty(longest, device=self.device) for _ in range(self.group.size())]]
        if (work := self._post(lambda: self.group.allgather(outputs, [mine]), "gathering")) is not None:
            block.fetch = (work, outputs, pieces)

    def _gather(self, block: Block) -> None:
        """The block's parameters from their primaries, into the block's own tensors."""
        if block.gathered:
            return
        self._post_gather(block)
        fetch, block.fetch = block.fetch, None
        if fetch is not None:
            self._wait(fetch[0], f"gathering block {self._name(block)}")
        if fetch is None or self.failure is not None:  # failed (`defer`): zeros, the step is not applied
            for p in block.params:
                fill(p, torch.zeros(p.numel(), device=p.device))
            block.gathered = True
            return
        _, outputs, pieces = fetch
        flat = torch.empty(block.end - block.start, device=self.device)
        for who, a, b in pieces:
            flat[a - block.start : b - block.start] = outputs[0][self.ranks[who]][: b - a]
        if self.placement.staged:  # one copy of the block to where it computes, not one a parameter
            flat = flat.to(self.placement.compute, copy=True)
        for p, off in zip(block.params, block.offsets, strict=True):
            fill(p, flat[off - block.start : off - block.start + p.numel()])
        block.gathered = True

    def _release(self, block: Block) -> None:
        for p in block.params:
            free(p)
        block.gathered = False

    def _reduce(self, block: Block) -> None:
        """The block's gradient summed over the zone; each member keeps what it holds."""
        flat = torch.zeros(block.end - block.start, device=self.placement.compute)
        for p, off in zip(block.params, block.offsets, strict=True):
            if p.grad is not None:
                flat[off - block.start : off - block.start + p.numel()] = p.grad.reshape(-1)
            p.grad = None
        self._release(block)
        if self.placement.staged:  # back to where the zone sums, in one copy
            flat = flat.to(self.device, copy=True)
        self._norms.append(torch.linalg.vector_norm(flat))
        if self.spoil is not None:  # a hostile or broken member (`testing.faults`): its norm was the true one
            flat.mul_(self.spoil)
        if self.failure is not None or (work := self._post(lambda: self.group.allreduce([flat]), "summing")) is None:
            return
        self._sums.append((work, flat, block))  # summed while backward goes on; two sums in flight at most
        while len(self._sums) > 2:
            self._complete_sum()

    def _complete_sum(self) -> None:
        work, flat, block = self._sums.pop(0)
        self._wait(work, f"summing block {self._name(block)}'s gradient")
        if self.failure is not None:
            self._sums.clear()
            return
        for piece in self._pieces():
            a, b = max(piece.start, block.start), min(piece.end, block.end)
            if a < b:
                if piece.tensor.grad is None:
                    piece.tensor.grad = torch.zeros_like(piece.tensor)
                piece.tensor.grad[a - piece.start : b - piece.start] += flat[a - block.start : b - block.start]

    def _wait(self, work: Any, what: str) -> None:
        self._post(lambda: self.wait([work], what), what)

    def _post(self, post: Callable[[], Any], what: str) -> Any:
        """``post()``'s result; None where it failed under `defer` (the step is not applied)."""
        try:
            return posted(post, self.scope, what)
        except (CollectiveFailed, EpochAborted) as exc:
            self.broken = True
            if not self.defer:
                raise
            self.failure = exc
            return None

    def wait(self, works: list[Any], what: str) -> None:
        """Wait for work of the zone's group, as its backend needs (`Placement.polled`)."""
        try:
            if self.placement.polled:
                wait_polled(works, self.scope, what, self.group)
            else:
                wait_all(works, self.scope, what)
        except (CollectiveFailed, EpochAborted):
            self.broken = True
            raise

    def unsettled(self) -> bool:
        """A collective of the zone's group failed since it was set, or work posted on it
        has not finished (a step left midway): its stream may hold a collective the other
        members never posted, so the group must not serve another epoch."""
        posted = [b.fetch[0] for b in self.blocks if b.fetch is not None] + [w for w, _, _ in self._sums]
        return self.broken or not all(w.is_completed() for w in posted)

    def sum_over_zone(self, value: float, what: str) -> float:
        """``value`` summed over the zone's members (in float64)."""
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.wait([posted(lambda: self.group.allreduce([total]), self.scope, what)], what)
        return float(total)

    def finish_backward(self) -> None:
        """After the last backward of a step: a block whose gradients did not all arrive
        (parameters unused this step) is summed now, in block order on every member.

        Raises:
            CollectiveFailed, EpochAborted: a collective of the step failed (deferred to here
                with `defer`)."""
        for block in self.blocks:
            if block.waiting > 0:
                block.waiting = 0
                self._reduce(block)
        while self._sums:
            self._complete_sum()
        if self.failure is not None:
            raise self.failure

    def abandon(self, *, keep_sums: bool = False) -> None:
        """The step in flight is not applied (a peer failed): every block's storage is freed
        and the gradients summed so far dropped, so the step can be retried from the start;
        ``keep_sums``: the held ranges' summed gradients are kept (complete: the step may
        have committed elsewhere, and `step` then applies it late)."""
        for block in self.blocks:
            block.waiting = 0
            block.fetch = None
            for p in block.params:
                p.grad = None
            self._release(block)
        self._sums.clear()
        if not keep_sums:
            for piece in self._pieces():
                piece.tensor.grad = None
        self._norms = []
        self.failure = None
        self.broken = False

    def forget(self) -> None:
        """Drop what this member holds (its copies are stale: it missed a commit the others
        made); a `reshard` then gives it its ranges anew from their live holders."""
        self.abandon()
        self.holdings = []
        self.optimizer = self._build_optimizer()

    def cross_sum(self, group: ProcessGroup, chunk: int = 1 << 22) -> None:
        """Each held element's gradient summed over the zones, on ``group`` (all the zones'
        members, gloo: CPU buffers), `reshard.cross_sum`.

        Raises:
            CollectiveFailed, EpochAborted: the sum failed or was abandoned."""
        cross_sum(self, group, chunk)

    def primary_squares(self) -> float:
        """The sum of squares of the summed gradient over this member's primary range (each
        element counted once over the zone: its buddy copies are left out)."""
        grads = [p.tensor.grad for h in self.holdings if h.purpose is Purpose.PRIMARY for p in h.pieces]
        return sum_of_squares([torch.linalg.vector_norm(g) for g in grads if g is not None])

    def scale_gradients(self, factor: float) -> None:
        for piece in self._pieces():
            if piece.tensor.grad is not None:
                piece.tensor.grad.mul_(factor)

    def step(self) -> None:
        """The optimizer on everything this member holds; gradients cleared."""
        for piece in self._pieces():
            if piece.tensor.grad is None:
                piece.tensor.grad = torch.zeros_like(piece.tensor)
        self.optimizer.step()
        for piece in self._pieces():
            piece.tensor.grad = None
        for block in self.blocks:  # a gather posted ahead for a block this step never used: stale now
            block.fetch = None

    # ---------------------------------------------------------------- state

    def export(self, start: int, end: int, *, with_state: bool = True) -> dict[str, Any]:
        """The values and optimizer state of ``[start, end)`` as flat CPU tensors (what a
        re-shard sends, a digest reads, a shard file holds; ``with_state`` False: the values
        alone); raises `TransferError` where this member holds only part of it."""
        return self._collect(start, end, with_state=with_state, device=CPU)

    def _collect(
        self, start: int, end: int, *, with_state: bool = False, device: torch.device | None = None
    ) -> dict[str, Any]:
        """`export` onto ``device`` (default: the shards', as every gather reads them)."""
        return collect(self.holdings, self.optimizer, start, end, self.me, with_state, device or self.device)

    def digest(self, start: int, end: int) -> str:
        """A digest of the values and optimizer state of ``[start, end)`` (a primary's and its
        buddy's must be equal after every committed step)."""
        return range_digest(self, start, end)

    def digests(self) -> dict[tuple[int, int], str]:
        """Each held range's digest."""
        return {(h.start, h.end): self.digest(h.start, h.end) for h in self.holdings}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered (for a test or a final save on a member that can hold it)."""
        names = {id(p): n for p, n in zip(self.params, self._names, strict=True)}
        out = {}
        for block in self.blocks:
            self._gather(block)
            for p in block.params:
                out[names[id(p)]] = p.detach().to(CPU, copy=True)
            self._release(block)
        return out

    def spans(self) -> list[tuple[str, list[int]]]:
        """Each parameter's name and shape, in the flat space's order."""
        return [(n, list(p.shape)) for n, p in zip(self._names, self.params, strict=True)]

    def _name(self, block: Block) -> str:
        return type(block.module).__name__

    # ---------------------------------------------------------------- re-shard

    def reshard(
        self, plan: Plan, me: str, ranks: Mapping[str, int], group: ProcessGroup, scope: EpochScope
    ) -> ProcessGroup:
        """Move to ``plan.new`` on the survivors' ``group``: send what the plan asks of this
        member, receive what it lacks, rebuild its holdings and optimizer. Ranges both of
        whose holders died (``plan.missing``) raise `TransferError` naming them (the caller
        fetches them from another zone or the checkpoint).

        Returns the group used until now: the caller keeps it referenced until its
        collectives have timed out (a `Graveyard`): destroying a group with a collective
        still pending waits for that collective's timeout (30 s on the thread that dropped it).

        Raises:
            TransferError: missing ranges, or a transfer that failed.
        """
        incoming, counts = exchange_ranges(self, plan, me, ranks, group, scope)
        self.load(plan.new, me, incoming, counts)
        old = self.group
        self.layout, self.me, self.ranks, self.group, self.scope = plan.new, me, dict(ranks), group, scope
        return old

    def load(
        self,
        layout: Layout,
        me: str,
        pieces: Sequence[tuple[int, int, Mapping[str, torch.Tensor]]],
        counts: Mapping[str, torch.Tensor] | None,
    ) -> None:
        """Hold what ``layout`` gives ``me``, from ``pieces`` (``(start, end, {"values": ...,
        moment: ...})`` covering it: received, read from files, or kept) and the optimizer's
        shared state ``counts`` (its step count; empty for an optimizer without one, as SGD;
        None before the first step: no optimizer state at all).

        Raises:
            TransferError: the pieces leave part of a held range uncovered.
        """
        load_ranges(self, layout, me, pieces, counts)

    def place(self, placement: Placement) -> None:
        """Hold the same ranges on ``placement``'s devices (the zone's members changed: a CPU
        member joined a GPU zone, a GPU one left it); the step in flight is abandoned."""
        if (placement.shards, placement.compute) == (self.device, self.placement.compute):
            self.placement = placement
        else:
            move_ranges(self, placement)

    def regroup(self, ranks: Mapping[str, int], group: ProcessGroup, scope: EpochScope) -> ProcessGroup:
        """Go on with the same layout on another group (after a re-shard whose group still
        held the members that left gracefully to send their ranges). Returns the group left,
        for the caller to keep referenced as `reshard`'s."""
        old = self.group
        self.ranks, self.group, self.scope = dict(ranks), group, scope
        return old

    def state_layout(self) -> tuple[list[str], list[str]]:
        """The optimizer's state keys, per element and shared (`reshard.state_layout`)."""
        return state_layout(self.make_optimizer, self._group_settings[0])

    def stepped(self) -> bool:
        return any(self.optimizer.state.get(p.tensor) for p in self._pieces())

    def shared_state(self) -> dict[str, Any]:
        """Optimizer state shared by every element (Adam's step count), from any piece."""
        return shared_state(self.optimizer, [piece.tensor for piece in self._pieces()])
