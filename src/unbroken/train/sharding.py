"""A sharded zone in the node runtime: the members hold ranges of the state, not all of it.

With `Job.shard` set, the node's replicated state (`TrainState`) keeps what every member
holds alike: the step, the data cursor, the scheduler, the job's extra state and the param
groups' hyperparameters (the optimizer as the job built it, never stepped). The parameters,
their gradients and the optimizer's moments live in the zone's ranges (`ShardedModel`):
each member its primary range and the ranges it is buddy for. An epoch's sync phase::

    sync_state   the small replicated state, as an unsharded job's whole state: a member
                 behind the group's step receives it from one at it
    report       every member says (all-gather) the layout it holds ranges of, the epoch
                 that layout was made in, the step its ranges are at, and the memory it offers
    decide       the layout held at the newest (step, epoch) is the old one (`decide`, the
                 same on every member); its members that hold it at that step keep their
                 ranges, the others (dead, behind, or new) are lost and joining
    re-shard     the plan of `unbroken.state.shards` moves what each member lacks from a live
                 holder (`ShardedModel.reshard`); nothing moves when the members are the same

A step is the unsharded one with the gradient out of the step's flat tensor: backward sums
each block's gradient over the zone as it completes (`ShardedModel`), and the flat
all-reduce carries the votes, sample counts, losses and each member's norm of its own
gradient (the guard judges them as before). A member without samples this step computes
one sample at weight zero, so that it joins the zone's gathers and sums in the same order.
Apply steps the optimizer on the held ranges; a step not applied drops its sums (`abandon`).

Several zones (``--zone``): each zone holds a whole replica, sharded over its members by its
own layout; the gradient is summed in the zone as above, then over every member of the job
in chunks, each zone putting in its primaries (`ShardedModel.cross_sum`); a zone takes what
none of its members holds from another zone's (the epoch's group carries those transfers).

With a lossy ``--codec`` the zones' sum goes range by range through it instead
(`unbroken.comm.outer_ranges.CodedSum`); in DiLoCo mode the inner steps are the zone's sums
alone (``inner_scale``) and the round's end is `unbroken.train.sharded_outer`'s.

Devices: every sync phase, the zone's members' devices (in their reports) decide where its
shards live and which backend sums them (`unbroken.comm.placement.place`): a zone of GPUs of
one kind, one each, gets an NCCL group of its own, built over its gloo group and kept while
its members and their ranks stay (`unbroken.train.shard_devices`); otherwise gloo, with the
shards on the CPU and each block staged to the device.

Not yet here: DiLoCo's ``--outer-overlap`` (refused); audits and work checks (validators),
a job's ``before_update`` (no member holds the whole gradient; clipping is
`Sharding.clip_norm`), loss scaling.

Ranges that lost every holder in every zone while others live: once no holder rejoined
within ``--absent-wait``, the whole job goes back to the newest checkpoint every member can
read whole, in process (`unbroken.train.shard_fallback`), or stops naming the ranges.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from unbroken.comm.blocks import broadcast_model, refuse_running_statistics, restore_storage
from unbroken.comm.codecs import make_codec
from unbroken.comm.group import EpochGroup, EpochScope, ProcessGroup
from unbroken.comm.outer_ranges import CodedSum
from unbroken.comm.placement import CPU, MemberDevice, Placement
from unbroken.comm.shard_files import complete_steps, prune_shards, restore_shards, save_shard
from unbroken.comm.sharded import ShardedModel
from unbroken.comm.solo import Solo
from unbroken.errors import ConfigError, JobHalted, RangesAbsent, TransferError
from unbroken.events import Entry
from unbroken.job import Job, Optimizers, Sharding
from unbroken.specs import CodecSpec
from unbroken.state.checkpoint import KEEP
from unbroken.state.shards import Layout, Transfer
from unbroken.train.shard_devices import ZoneDevices
from unbroken.train.shard_fallback import fall_back, report_recovery
from unbroken.train.shard_reports import Report, decide, decode, encode, exchange

if TYPE_CHECKING:
    from unbroken.comm.reduce import Reducer, Wire
    from unbroken.train.runtime import Node

log = logging.getLogger(__name__)

MIB = 1 << 20


def memory_weight(limit_bytes: int, device: torch.device | None = None) -> int:
    """The memory a node offers, in MiB: its ``--memory-limit``, else the machine's; on a GPU
    the smaller of the machine's and the GPU's (a zone under NCCL keeps its shards there)."""
    if limit_bytes > 0:
        return max(1, limit_bytes // MIB)
    offered = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device is not None and device.type == "cuda":
        offered = min(offered, torch.cuda.get_device_properties(device).total_memory)
    return max(1, offered // MIB)


class ShardedZone:
    """This node's part of a sharded zone (see the module's docstring)."""

    def __init__(
        self,
        job: Job,
        model: nn.Module,
        optimizer: Any,
        memory_limit: int,
        *,
        defer: bool = False,
        device: torch.device = CPU,
    ) -> None:
        """``model`` and ``optimizer`` as the job built them (the model's values are this
        member's initial ranges at step 0; its parameters' storage is freed once sharded).
        ``defer``: a user's own loop runs forward and backward (`ShardedModel.defer`)."""
        sharding = job.shard
        assert sharding is not None
        if isinstance(optimizer, Optimizers):
            raise ConfigError("a sharded job takes one optimizer, not several by name: give Job.optimizer one")
        for what, given in (
            ("before_update", job.before_update is not None),
            ("loss_scale", job.loss_scale is not None),
        ):
            if given:
                raise ConfigError(
                    f"a sharded job cannot take Job.{what} yet (no member holds the whole gradient): clip with "
                    "Sharding(clip_norm=...), or train unsharded"
                )
        for what, given in (("evaluate", job.evaluate is not None), ("after_step", job.after_step is not None)):
            if given:
                raise ConfigError(
                    f"a sharded job cannot take Job.{what} yet (no member holds the whole model between steps): "
                    "evaluate the finished model (its nodes' --final-state files, put together by "
                    "`unbroken assemble model.pt FILES...`), or train unsharded"
                )
        self.sharding: Sharding = sharding
        self.model = model
        self.optimizer = optimizer
        """The optimizer as the job built it: its param groups' settings are replicated state
        (a scheduler moves them); the zone's own optimizer steps the ranges."""
        self.weight = memory_weight(memory_limit, device)
        self.numel = sum(p.numel() for p in model.parameters())
        names = {id(p): n for n, p in model.named_parameters()}
        self.groups = [
            {"params": [names[id(p)] for p in g["params"]], **{k: v for k, v in g.items() if k != "params"}}
            for g in optimizer.param_groups
        ]
        if any(not p.requires_grad for p in model.parameters()):
            raise ConfigError("a sharded job trains every parameter: frozen ones are not sharded yet")
        refuse_running_statistics(model)  # said before joining, not at the first sync phase
        self.buffers = [(n, b, b.detach().clone()) for n, b in model.named_buffers() if b.dtype.is_floating_point]
        """Every member keeps the buffers whole, as built (an attention mask): none may change."""
        self._refuse_shape_dependent()
        self.shell = nn.Module()
        """What the replicated state holds as its model: nothing (the values are in the ranges)."""
        self.engine: ShardedModel | None = None
        self.world: ProcessGroup | None = None
        """The epoch's group where there are several zones (each a replica): the gradient is
        summed over it after its zone's sum; None in one zone."""
        self.defer = defer
        """A user's own loop runs forward and backward: their failures wait for the step
        (`ShardedModel.defer`)."""
        self._clip = 1.0
        """What the step's summed gradient is multiplied by (`Sharding.clip_norm`)."""
        self.total_norm = 0.0
        """The norm of the step's gradient summed over the zone (every range counted once):
        what `StepProtocol.check_sum` holds against the members' declared norms."""
        self._summed = -1
        """The step whose gradient the held ranges hold summed over the zone, complete."""
        self.pending: tuple[int, list[dict[str, Any]], float] | None = None
        """A step not applied here whose sum is complete: (step, its param groups' settings,
        its clip factor), applied late if the group committed it (`Decision.late`)."""
        self.epoch = -1
        """The epoch the layout held was made in."""
        self.step = -1
        """The committed step the held ranges are at."""
        self.lineage = 0
        """The history the held ranges are of (`TrainState.lineage`)."""
        self.momentum_of: Callable[[int, int, int], torch.Tensor | None] | None = None
        """Sharded DiLoCo's outer momentum (step, start, end) of a range: saved with it."""
        self.read_momentum: dict[tuple[int, int], torch.Tensor] = {}
        """The outer momentum the last restore from shard files read, by the files' ranges."""
        self._absent_since = 0.0
        """When a sync phase first found ranges no member holds (0: it has not since the last
        that found them all)."""
        self._saved: list[tuple[int, list[Path]]] = []
        """The checkpoint steps this member wrote shard files of, and those files (`save`)."""
        self.inner_scale: float | None = None
        """DiLoCo's inner steps: the zone's sum is multiplied by this (to its samples' mean)
        and nothing crosses zones (`train.sharded_outer`); None in sync mode."""
        self.moved: Moved | None = None
        """What the last sync phase did to the ranges, for state that travels with them."""
        self.coded: CodedSum | None = None
        """Several zones and a lossy ``--codec``: the zones' sum goes through it, range by range."""
        self.wire: Wire | None = None
        """The node's byte counts (the coded sum's bytes go with the step's)."""
        self.devices = ZoneDevices(device)
        """Where this member computes, what its reports say of it, the zone's NCCL group."""

    def make_optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The job's optimizer class over the held ranges, with its settings (those of its
        defaults its constructor takes: AdamW keeps one of Adam's it does not)."""
        kind = type(self.optimizer)
        takes = inspect.signature(kind).parameters
        settings = {k: v for k, v in self.optimizer.defaults.items() if k in takes}
        opt: torch.optim.Optimizer = kind(groups, **settings)
        return opt

    def _refuse_shape_dependent(self) -> None:
        """The zone steps flat pieces of the parameters: an optimizer whose update depends on a
        parameter's shape or on the whole of it (Adafactor's factored moments, LAMB's trust
        ratio, Muon) would train another model. Probed: three steps of a 2-D parameter, whole
        against flattened and cut in two, must agree."""
        g = torch.Generator().manual_seed(0)
        start = torch.randn(6, 5, generator=g)
        grads = [torch.randn(6, 5, generator=g) for _ in range(3)]
        whole = nn.Parameter(start.clone())
        a, b = nn.Parameter(start.reshape(-1)[:13].clone()), nn.Parameter(start.reshape(-1)[13:].clone())
        settings = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        one, two = (
            self.make_optimizer([dict(settings, params=[whole])]),
            self.make_optimizer([dict(settings, params=[a, b])]),
        )
        for grad in grads:
            whole.grad, a.grad, b.grad = grad.clone(), grad.reshape(-1)[:13].clone(), grad.reshape(-1)[13:].clone()
            one.step()
            two.step()
        if not torch.allclose(whole.detach().reshape(-1), torch.cat([a.detach(), b.detach()]), rtol=1e-5, atol=1e-7):
            raise ConfigError(
                f"{type(self.optimizer).__name__} updates a parameter by its shape or as a whole: a sharded zone "
                "steps flat pieces of the parameters, so it would train another model. Use an element-wise "
                "optimizer (SGD, Adam, AdamW, RMSprop, ...) or train unsharded"
            )

    def report(self, zone: Sequence[str], forwarded: bool = False) -> Report:
        """What this member says of its ranges (``zone``: its zone's members this epoch, in rank
        order; ``forwarded``: peers reach it through a forwarder)."""
        said = self.devices.said(forwarded, zone)
        if self.engine is None:
            return Report(self.weight, device=said)
        summed = self.pending[0] if self.pending is not None else -1
        holdings = sorted(self.engine.holdings, key=lambda h: (h.start, h.end))
        held = tuple((h.start, h.end) for h in holdings)
        digests = tuple(self.engine.digest(h.start, h.end) for h in holdings)
        return Report(
            self.weight, self.engine.layout, self.epoch, self.step, summed, held, digests, self.lineage, said
        )  # fmt: skip

    def sync(self, node: Node, g: EpochGroup, step: int, reducer: Reducer) -> list[ProcessGroup]:
        """Give this member the ranges of epoch ``g`` at committed ``step`` (after the
        replicated state's sync). With several zones each holds a whole replica: a zone decides
        its layout from its members' reports, takes from another zone what none of its own
        holds (the transfers run on the epoch's group), and steps on its own group; the
        gradient is then summed over the zones too (`finish_backward`). Returns the groups the
        ranges were held on until now, for the caller to keep referenced (`Graveyard`)."""
        assert g.pg is not None
        node.records.mark("synced")
        scope = node.scope(during_step=False)
        me = node.client.member_id
        world = {m: i for i, m in enumerate(g.members)}
        zones = reducer.zones
        zone_of = {m: zones.of_rank[i] if zones.multi else "" for i, m in enumerate(g.members)}
        names = list(dict.fromkeys(zone_of.values()))
        members = [m for m in g.members if zone_of[m] == zone_of[me]]
        said = exchange(g.pg, encode(self.report(members, node.epochs.forwarded)), scope)
        reports = dict(zip(g.members, [decode(b) for b in said], strict=True))
        node.records.mark("reported")
        try:
            decisions = {
                z: decide(
                    {m: r for m, r in reports.items() if zone_of[m] == z},
                    step,
                    self.numel,
                    self.sharding.align,
                    outside={m: r for m, r in reports.items() if zone_of[m] != z},
                    lineage=node.state.lineage,
                )
                for z in names
            }
        except RangesAbsent as exc:  # lost in every zone: a checkpoint, once no holder rejoined
            self._absent_since = self._absent_since or time.monotonic()
            waited = time.monotonic() - self._absent_since
            decisions, step = fall_back(node, g, step, self.numel, self.sharding.align, reports, zone_of, exc, waited)
        self._absent_since = 0.0
        decision = decisions[zone_of[me]]
        report_recovery(node, g, decision, reports, zone_of, step)
        ranks = {m: i for i, m in enumerate(members)}
        group: ProcessGroup = g.pg
        if zones.multi:  # its zone's group; a member alone in its zone gathers from itself
            group = reducer.zone_pg if reducer.zone_pg is not None else Solo()
        self.world = g.pg if zones.multi else None
        placement, group = self._place(node, g, reports, ranks, group, scope)
        left: list[ProcessGroup] = []
        late = ""
        if decision.fresh is not None:  # no member of any zone holds a range
            if self.engine is not None:
                self.engine.close()
                restore_storage(self.model)  # on the CPU, where the values are read from
            if not decision.restore:
                broadcast_model(self.model, g.pg, world[decision.source], scope)
            self.engine = self._build(decision.fresh, me, ranks, group, scope, placement)
            if decision.restore:
                self._restore(node, decision.fresh, me, step)
            origin = (
                f"read from the checkpoint of step {step}" if decision.restore else f"from {decision.source}'s model"
            )
            what = f"layout of {len(decision.fresh.shards)} ranges made, {origin}"
        else:
            p = decision.plan
            assert p is not None
            if self.engine is None:
                self.engine = self._build(p.old, me, ranks, group, scope, placement)
            elif me in decision.late:
                self._apply_late(node, step)
                self.step = step  # its ranges are the group's step now, whatever the re-shard does
                late = f"applied step {step - 1} late (the group committed it; its vote failed here)"
            elif me not in decision.keep:
                self.engine.forget()
            elif self.pending is not None:  # the step it summed did not commit: retried from the start
                self.engine.abandon()
            self.pending = None
            self.engine.place(placement)
            transfers = tuple(t for z in names if (q := decisions[z].plan) is not None for t in q.transfers)
            if decision.unchanged and all(me not in (t.source, t.destination) for t in transfers):
                left.append(self.engine.regroup(ranks, group, scope))
                what = ""
            else:  # every zone's transfers, in one order everywhere, on the epoch's group
                left.append(self.engine.reshard(replace(p, transfers=transfers), me, world, g.pg, scope))
                left.append(self.engine.regroup(ranks, group, scope))
                what = p.reason
                if decision.unchanged:  # it only gave another zone what that zone lost
                    sent = sum(t.size for t in transfers if t.source == me)
                    what = f"sent {sent:,} elements to another zone"
        self.epoch, self.step, self.pending, self.lineage = g.epoch, step, None, node.state.lineage
        layouts = {z: x for z, d in decisions.items() if (x := d.fresh or (d.plan.new if d.plan else None))}
        moves = () if decision.fresh is not None else transfers
        fresh = decision.fresh is not None
        self.moved = Moved(zone_of[me], layouts, moves, fresh, decision.unchanged and not fresh, world, g.pg)
        self._set_codec(node.epochs.codec.spec if zones.multi else None)
        self.wire = reducer.wire
        self.engine.scope = node.scope(during_step=True)
        what = "; ".join(x for x in (late, what) if x)
        if what:
            held = sum(e - s for s, e in self.engine.layout.held(me))
            own = mine.size if (mine := self.engine.layout.primary(me)) is not None else 0
            pairs = [[s.primary, s.buddy] for s in self.engine.layout.shards]  # each range's two holders
            entry = {"epoch": g.epoch, "step": step, "reason": what, "held": held, "primary": own, "pairs": pairs}
            node.records.log(Entry.RESHARD, entry)
            log.info("%s: sharded zone at step %d: %s; holds %s elements", node.name, step, what, f"{held:,}")
        node.records.mark("resharded")
        current = {id(g.pg), id(group)}
        return [x for x in left if id(x) not in current]

    def _place(
        self,
        node: Node,
        g: EpochGroup,
        reports: Mapping[str, Report],
        ranks: Mapping[str, int],
        group: ProcessGroup,
        scope: EpochScope,
    ) -> tuple[Placement, ProcessGroup]:
        """Where the zone's shards live this epoch, and the group its gathers and sums run
        on (`ZoneDevices.place`)."""
        spec = node.epochs.codec.spec if self.world is not None else None
        lossy = spec is not None and not make_codec(spec).lossless
        ranged = self.world is not None and (node.diloco is not None or lossy)  # `outer_ranges`: CPU tensors
        devices = {m: MemberDevice.decode(reports[m].device) for m in ranks}
        name = f"nccl-{g.epoch}-{next(iter(ranks))}"  # the zone's first member: one name for all
        return self.devices.place(name, node.client.member_id, devices, ranks, group, scope, ranged=ranged)

    def _set_codec(self, spec: CodecSpec | None) -> None:
        """The zones' sum through ``spec`` where it is lossy; residuals forgotten where this
        zone's layout or holdings changed (a new holder has none to agree on)."""
        if spec is None or make_codec(spec).lossless:
            self.coded = None
        elif self.coded is None or self.coded.codecs.spec != spec or (self.moved and not self.moved.unchanged):
            self.coded = CodedSum(spec)

    def _restore(self, node: Node, layout: Layout, me: str, step: int) -> None:
        directory = node.config.checkpoint_dir
        if not layout.held(me):  # a spare (it could not read the checkpoint): nothing to read
            return
        if directory is None:
            raise JobHalted(
                f"the group resumes at step {step} but no member holds the state's ranges and this node has no "
                "--checkpoint-dir to read them from: give every node the checkpoint directory"
            )
        try:
            self.read_momentum = {}
            restore_shards(self.ready, Path(directory), layout, me, step=step, momentum=self.read_momentum)
        except TransferError as exc:
            raise JobHalted(f"the group resumes at step {step}, but its ranges cannot be read: {exc}") from exc

    def save(self, directory: Path, step: int, *, copies: bool = False) -> None:
        """This member's primary range at ``step`` into ``directory`` (with a checkpoint;
        ``copies``: the ranges it is buddy for too, so that each range lies on two disks); the
        files of steps older than the `KEEP` newest complete ones go (every member's: those
        steps are superseded).

        Raises:
            OSError: the file could not be written."""
        of = self.momentum_of
        momentum = None if of is None else lambda start, end: of(step, start, end)
        self._saved.append((step, save_shard(self.ready, directory, step, copies=copies, momentum=momentum)))
        prune_shards(directory, self.numel, KEEP, own=self._saved)
        self._saved = [(at, paths) for at, paths in self._saved if any(p.exists() for p in paths)]

    def restorable(self, directory: Path) -> Callable[[int], str | None]:
        """Why the replicated checkpoint of a step cannot be used (its ranges' files are not
        all there), for `load_newest`."""
        complete = set(complete_steps(directory, self.numel))
        return lambda step: None if step in complete else "the shard files of its step do not cover the state"

    def _build(
        self,
        layout: Layout,
        me: str,
        ranks: Mapping[str, int],
        pg: ProcessGroup,
        scope: EpochScope,
        placement: Placement | None = None,
    ) -> ShardedModel:
        blocks = self.sharding.blocks(self.model) if self.sharding.blocks is not None else None
        engine = ShardedModel(
            self.model, layout, me, ranks, pg, scope, self.make_optimizer, blocks=blocks, groups=self.groups,
            placement=placement,
        )  # fmt: skip
        engine.defer = self.defer
        return engine

    # ---------------------------------------------------------------- the step

    @property
    def ready(self) -> ShardedModel:
        assert self.engine is not None, "the sharded zone's ranges are given at the sync phase"
        return self.engine

    def finish_backward(self, step: int) -> float:
        """After this step's last backward: every block summed, and the summed gradient's norm
        over the zone (`total_norm`: one more all-reduce, before the vote, so a failure there
        retries the step); this member's own gradient norm."""
        engine = self.ready
        engine.finish_backward()
        own = math.sqrt(engine.take_squares())
        if self.inner_scale is not None:  # a DiLoCo inner step: the zone's mean, nothing crosses zones
            engine.scale_gradients(self.inner_scale)
        elif self.world is not None and self.coded is not None and self.moved is not None:
            m = self.moved  # several zones, a lossy codec: the sum over them range by range
            self.coded.sum(engine, m.layouts, m.zone, m.world, self.world, f"the zones' sum of step {step}")
        elif self.world is not None:  # several zones: the sum over them too
            engine.cross_sum(self.world)
        self.total_norm = math.sqrt(engine.sum_over_zone(engine.primary_squares(), "summing the gradient's norm"))
        self._clip = 1.0
        if self.sharding.clip_norm is not None:
            self._clip = min(1.0, self.sharding.clip_norm / (self.total_norm + 1e-6))  # clip_grad_norm_'s rule
        self._summed = step
        return own

    def apply(self) -> None:
        """The optimizer on the held ranges, with the param groups' settings of now."""
        for name, now, built in self.buffers:  # the same on every member: they stop together
            if not torch.equal(now.to(built.device), built):
                raise ConfigError(
                    f"the model's forward changed its buffer {name!r}: a sharded zone keeps buffers as built and "
                    "does not sum them; keep it constant, or train unsharded"
                )
        self._step(self.optimizer.param_groups, self._clip)
        if self.coded is not None and self.wire is not None and self.inner_scale is None:
            self.wire.inter += self.coded.sent  # counted with the step's all-reduce, just done
            self.wire.last_inter += self.coded.sent
        # The job's scheduler asks its optimizer whether it stepped before it (torch warns
        # otherwise): it did, range by range, through the zone's own optimizer.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _step(self, groups: list[dict[str, Any]], clip: float) -> None:
        engine = self.ready
        engine.set_hyperparameters(groups)
        if clip < 1.0:
            engine.scale_gradients(clip)
        engine.step()
        self._summed, self.pending = -1, None

    def _apply_late(self, node: Node, step: int) -> None:
        assert self.pending is not None
        if self.coded is not None:
            self.coded.redo()
        self._step(self.pending[1], self.pending[2])
        log.info("%s: applied step %d late: the group committed it while its commit failed here", node.name, step - 1)

    def abandon(self, step: int) -> None:
        """Step ``step`` is not applied here. Where its sum is complete, it is kept: the group
        may have committed it (a commit failed here, not everywhere), and `sync` applies it."""
        if self.engine is None:
            return
        if self.engine.unsettled():  # its NCCL group may hold work the others never posted
            self.devices.comm.drop()
        if self.coded is not None:
            self.coded.undo()
        if self.pending is not None and self.pending[0] == step:  # abandoned again (the epoch, after the step)
            self.engine.abandon(keep_sums=True)
            return
        complete = self._summed == step and self.engine.failure is None
        if complete:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            self.pending = (step, groups, self._clip)
        self.engine.abandon(keep_sums=complete)
        self._summed = -1

    def committed(self, step: int) -> None:
        self.step = step
        if self.coded is not None:
            self.coded.committed()

    # ---------------------------------------------------------------- what a finished node keeps

    def digests(self) -> dict[str, str]:
        """Each held range's digest by ``"start-end"``: a primary's equals its buddy's."""
        return {f"{a}-{b}": d for (a, b), d in self.ready.digests().items()}

    def final(self) -> dict[str, Any]:
        """The ranges this member holds (values) and where they lie: the parts of the finished
        model that `assemble` puts together from the members'."""
        engine = self.ready
        buffers = {n: b.detach().cpu().clone() for n, b in self.model.named_buffers()}  # whole on every member
        out: dict[str, Any] = {"spans": engine.spans(), "numel": self.numel, "buffers": buffers, "step": self.step}
        # Every range it holds, its copies too: any finished nodes whose ranges cover the
        # model will do (after a death, one survivor may hold it all).
        pieces = [(h.start, h.end, engine.export(h.start, h.end, with_state=False)["values"]) for h in engine.holdings]
        return out | {"pieces": pieces}


@dataclass(frozen=True)
class Moved:
    """What a sync phase did to the ranges: every zone's layout (in zone order), the
    transfers every zone's re-shard made (on ``world``'s group ``pg``; empty where nothing
    moved), whether the ranges were made afresh (from a model or a checkpoint), and whether
    this member's zone kept its layout and holdings as they were."""

    zone: str
    layouts: dict[str, Layout]
    transfers: tuple[Transfer, ...]
    fresh: bool
    unchanged: bool
    world: dict[str, int]
    pg: ProcessGroup


def assemble(parts: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The finished model's state dict (parameters, buffers) from the `ShardedZone.final` of
    members whose primaries cover the flat space.

    Raises:
        ValueError: the parts leave elements uncovered.
    """
    if not parts:
        raise ValueError("no parts to assemble")
    numel = int(parts[0]["numel"])
    if len({(int(p["numel"]), p.get("step")) for p in parts}) > 1:
        seen = ", ".join(f"step {p.get('step')} of a {int(p['numel']):,}-element model" for p in parts)
        raise ValueError(f"the parts are of different steps or models ({seen})")
    flat = torch.full((numel,), float("nan"))
    covered = torch.zeros(numel, dtype=torch.bool)
    for part in parts:
        pieces = part.get("pieces") or ([(part["start"], part["end"], part["values"])] if "values" in part else [])
        for start, end, values in pieces:
            flat[start:end] = values
            covered[start:end] = True
    if not bool(covered.all()):
        raise ValueError(f"the parts cover {int(covered.sum()):,} of {numel:,} elements")
    out, at = {}, 0
    for name, shape in parts[0]["spans"]:
        n = int(torch.Size(shape).numel())
        out[name] = flat[at : at + n].view(shape).clone()
        at += n
    return out | dict(parts[0].get("buffers", {}))


def assemble_files(paths: Sequence[Path]) -> dict[str, torch.Tensor]:
    """`assemble` of the ``"shard"`` part of finished nodes' ``--final-state`` files."""
    return assemble([torch.load(p, weights_only=True)["shard"] for p in paths])
