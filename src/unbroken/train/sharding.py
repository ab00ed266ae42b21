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

Not yet here: the zones' sum through their leaders with a codec, and DiLoCo (refused);
audits and work checks (validators), a job's ``before_update`` (no member holds the whole
gradient; clipping is `Sharding.clip_norm`), loss scaling, accelerators. Ranges that lost
every holder in every zone while others live stop the job with the ranges named (a restart
reads them from the checkpoint's shard files: every member writes its primary range there
at each checkpoint).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from unbroken.comm.blocks import broadcast_model, refuse_running_statistics, restore_storage
from unbroken.comm.fake import FakeWorld
from unbroken.comm.group import EpochGroup, EpochScope, ProcessGroup, wait_all
from unbroken.comm.shard_files import complete_steps, prune_shards, restore_shards, save_shard
from unbroken.comm.sharded import ShardedModel
from unbroken.errors import ConfigError, JobHalted, TransferError
from unbroken.events import Entry
from unbroken.job import Job, Optimizers, Sharding
from unbroken.state.checkpoint import KEEP
from unbroken.state.shards import Layout, Plan, Ranges, Shard, layout_for, replan, union

if TYPE_CHECKING:
    from unbroken.comm.reduce import Reducer
    from unbroken.train.runtime import Node

log = logging.getLogger(__name__)

MIB = 1 << 20
_WHERE = " (nodes run with --checkpoint-dir write one; without, from the start)"


@dataclass(frozen=True)
class Report:
    """What a member says of its ranges at a sync phase."""

    weight: int
    """The memory it offers, in MiB (`Layout.weights`)."""
    layout: Layout | None = None
    """The layout it holds ranges of (None: it holds none yet)."""
    epoch: int = -1
    """The epoch that layout was made in."""
    step: int = -1
    """The committed step its ranges are at."""
    summed: int = -1
    """The step whose summed gradient it holds complete, not applied (its commit failed
    here): where that step committed elsewhere, it applies it late (`Decision.late`)."""
    held: Ranges = ()
    """The ranges it holds now (those of ``layout`` unless a re-shard was cut short)."""
    digests: tuple[str, ...] = ()
    """Each held range's digest (values and optimizer state), parallel to ``held``: a range's
    two holders at one step must agree."""


@dataclass(frozen=True)
class Decision:
    """How a sync phase gives every member its ranges."""

    fresh: Layout | None = None
    """No member holds ranges: this layout, from the model as `source` built it (step 0)."""
    source: str = ""
    """The member whose model every member's ranges start from, in every zone (so that an own
    loop's unseeded init is one model, not a mix)."""
    plan: Plan | None = None
    """Otherwise: the re-shard from the ranges held (no transfers where nothing changed)."""
    keep: frozenset[str] = frozenset()
    """Members whose ranges are current: the others' copies, if any, are dropped (behind the
    group, of another layout, or of a member expelled and back under a new name)."""
    restore: bool = False
    """The ``fresh`` layout's ranges come from the shard files of a checkpoint (step > 0)."""
    late: frozenset[str] = frozenset()
    """Members one step behind that hold that step's summed gradient: they apply it now (a
    step is applied by all or none: others committed it while their commit failed)."""

    unchanged: bool = False
    """Every member holds what the new layout gives it, on that layout: nothing moves."""


def decide(
    reports: Mapping[str, Report], step: int, numel: int, align: int, outside: Mapping[str, Report] | None = None
) -> Decision:
    """The same decision on every member from the same reports (``reports``: the zone's
    members', in rank order; ``outside``: the other zones' members', each zone holding a
    whole replica of the same state).

    Every range a member holds at the group's ``step`` is current, whatever layout it came
    from (a re-shard cut short leaves members on two layouts at one step); so is the range of
    a member one step behind that holds that step's complete sum from the attempt that
    committed it (it applies it: `Decision.late`). The newest layout's ring order is kept.
    What no member of the zone holds comes from another zone's members, if one holds it.

    Raises:
        JobHalted: elements no member holds at ``step`` (every holder lost, or the group
            ahead of every member's ranges): the job must restart from a checkpoint.
    """
    weights = {m: r.weight for m, r in reports.items()}
    held = {m: r for m, r in reports.items() if r.layout is not None and r.held}
    far = {m: r for m, r in (outside or {}).items() if r.layout is not None and r.held and r.step == step}
    if not held and not far:  # a new job, or one restarted from its checkpoint
        fresh = layout_for(numel, weights, align=align)
        if step > 0:
            return Decision(fresh=fresh, restore=True)
        everyone = {**reports, **(outside or {})}
        # Never sharded: its model is whole. By name: every zone picks the same one.
        intact = sorted(m for m, r in everyone.items() if r.epoch < 0)
        if not intact:
            raise JobHalted("every member that held the new job's ranges was lost before its first step: restart it")
        return Decision(fresh=fresh, source=intact[0])
    newest = max((r.step, r.epoch) for r in held.values()) if held else (step, -1)
    if newest[0] != step:
        raise JobHalted(
            f"the group is at step {step} but the newest ranges any member holds are of step {newest[0]}: "
            f"restart the job from its last checkpoint{_WHERE}"
        )
    found = next((r.layout for r in held.values() if (r.step, r.epoch) == newest), None)
    base = found if found is not None else layout_for(numel, weights, align=align)  # a zone new to the job
    late = {m for m, r in held.items() if r.epoch == newest[1] and r.summed == r.step == step - 1}
    sources = {m: r.held for m, r in held.items() if r.step == step or m in late}
    _check_copies({m: r for m, r in {**held, **far}.items() if r.step == step})
    p = replan(base, sources, weights, outside={m: r.held for m, r in far.items()})
    if p.missing:
        ranges = ", ".join(f"[{x.start:,}, {x.end:,})" for x in p.missing)
        gone = sorted(m for m in base.members if m not in sources)
        raise JobHalted(
            f"ranges {ranges} of the state lost every holder at step {step} ({', '.join(gone)}), in every zone: "
            f"restart the job from its last checkpoint{_WHERE}"
        )
    unchanged = (
        not p.transfers
        and all(r.layout == p.new for r in reports.values())
        and all(union(sources.get(m, ())) == p.new.held(m) for m in p.new.members)
    )
    return Decision(plan=p, keep=frozenset(sources), late=frozenset(late), unchanged=unchanged)


def _check_copies(current: Mapping[str, Report]) -> None:
    """Two members holding one range at one step hold the same bytes, or the job stops.

    Raises:
        JobHalted: naming the range, its holders and their digests (a copy was corrupted, or
            stepped differently: with two copies, which one is right cannot be told).
    """
    seen: dict[tuple[int, int], tuple[str, str]] = {}
    for m, r in current.items():
        for span, digest in zip(r.held, r.digests, strict=True):
            if span not in seen:
                seen[span] = (m, digest)
            elif seen[span][1] != digest:
                other, theirs = seen[span]
                raise JobHalted(
                    f"range [{span[0]:,}, {span[1]:,}) differs between its holders {other} ({theirs[:12]}) and {m} "
                    f"({digest[:12]}) at step {r.step}: one copy was corrupted and which cannot be told; restart "
                    f"the job from its last checkpoint{_WHERE}"
                )


def encode(report: Report) -> bytes:
    lay = report.layout
    body: dict[str, Any] = {
        "weight": report.weight,
        "epoch": report.epoch,
        "step": report.step,
        "summed": report.summed,
        "held": [list(r) for r in report.held],
        "digests": list(report.digests),
    }
    if lay is not None:
        body["layout"] = {
            "numel": lay.numel,
            "align": lay.align,
            "members": list(lay.members),
            "weights": list(lay.weights),
            "shards": [[s.start, s.end, s.primary, s.buddy] for s in lay.shards],
        }
    return json.dumps(body, sort_keys=True).encode()


def decode(data: bytes) -> Report:
    body = json.loads(data)
    lay = body.get("layout")
    layout = None
    if lay is not None:
        shards = tuple(Shard(int(a), int(b), str(p), None if q is None else str(q)) for a, b, p, q in lay["shards"])
        layout = Layout(
            int(lay["numel"]), int(lay["align"]), tuple(lay["members"]), tuple(int(w) for w in lay["weights"]), shards
        )
    held = tuple((int(a), int(b)) for a, b in body["held"])
    digests = tuple(str(d) for d in body["digests"])
    if len(digests) != len(held):
        raise TransferError(f"a member's report gives {len(digests)} digests for {len(held)} ranges")
    return Report(
        int(body["weight"]), layout, int(body["epoch"]), int(body["step"]), int(body["summed"]), held, digests
    )


def exchange(pg: ProcessGroup, mine: bytes, scope: EpochScope) -> list[bytes]:
    """Every member's ``mine``, in rank order (two all-gathers: the lengths, then the bytes)."""
    size = pg.size()
    length = torch.tensor([len(mine)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    wait_all([pg.allgather([lengths], [length])], scope, "exchanging the zone's layouts")
    longest = max(int(x) for x in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    wait_all([pg.allgather([out], [padded])], scope, "exchanging the zone's layouts")
    return [bytes(t[: int(n)].tolist()) for t, n in zip(out, lengths, strict=True)]


def memory_weight(limit_bytes: int) -> int:
    """The memory a node offers, in MiB: its ``--memory-limit``, else the machine's."""
    if limit_bytes > 0:
        return max(1, limit_bytes // MIB)
    return max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB)


class ShardedZone:
    """This node's part of a sharded zone (see the module's docstring)."""

    def __init__(self, job: Job, model: nn.Module, optimizer: Any, memory_limit: int, *, defer: bool = False) -> None:
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
        self.weight = memory_weight(memory_limit)
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

    def report(self) -> Report:
        if self.engine is None:
            return Report(self.weight)
        summed = self.pending[0] if self.pending is not None else -1
        holdings = sorted(self.engine.holdings, key=lambda h: (h.start, h.end))
        held = tuple((h.start, h.end) for h in holdings)
        digests = tuple(self.engine.digest(h.start, h.end) for h in holdings)
        return Report(self.weight, self.engine.layout, self.epoch, self.step, summed, held, digests)

    def sync(self, node: Node, g: EpochGroup, step: int, reducer: Reducer) -> list[ProcessGroup]:
        """Give this member the ranges of epoch ``g`` at committed ``step`` (after the
        replicated state's sync). With several zones each holds a whole replica: a zone decides
        its layout from its members' reports, takes from another zone what none of its own
        holds (the transfers run on the epoch's group), and steps on its own group; the
        gradient is then summed over the zones too (`finish_backward`). Returns the groups the
        ranges were held on until now, for the caller to keep referenced (`Graveyard`)."""
        assert g.pg is not None
        scope = node.scope(during_step=False)
        me = node.client.member_id
        world = {m: i for i, m in enumerate(g.members)}
        zones = reducer.zones
        zone_of = {m: zones.of_rank[i] if zones.multi else "" for i, m in enumerate(g.members)}
        names = list(dict.fromkeys(zone_of.values()))
        reports = dict(zip(g.members, [decode(b) for b in exchange(g.pg, encode(self.report()), scope)], strict=True))
        decisions = {
            z: decide(
                {m: r for m, r in reports.items() if zone_of[m] == z},
                step,
                self.numel,
                self.sharding.align,
                outside={m: r for m, r in reports.items() if zone_of[m] != z},
            )
            for z in names
        }
        decision = decisions[zone_of[me]]
        members = [m for m in g.members if zone_of[m] == zone_of[me]]
        ranks = {m: i for i, m in enumerate(members)}
        group: ProcessGroup = g.pg
        if zones.multi:  # its zone's group; a member alone in its zone gathers from itself
            group = reducer.zone_pg if reducer.zone_pg is not None else FakeWorld(1).group(0)
        self.world = g.pg if zones.multi else None
        left: list[ProcessGroup] = []
        late = ""
        if decision.fresh is not None:  # no member of any zone holds a range
            if self.engine is not None:
                self.engine.close()
                restore_storage(self.model)
            if not decision.restore:
                broadcast_model(self.model, g.pg, world[decision.source], scope)
            self.engine = self._build(decision.fresh, me, ranks, group, scope)
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
                self.engine = self._build(p.old, me, ranks, group, scope)
            elif me in decision.late:
                self._apply_late(node, step)
                self.step = step  # its ranges are the group's step now, whatever the re-shard does
                late = f"applied step {step - 1} late (the group committed it; its vote failed here)"
            elif me not in decision.keep:
                self.engine.forget()
            elif self.pending is not None:  # the step it summed did not commit: retried from the start
                self.engine.abandon()
            self.pending = None
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
        self.epoch, self.step, self.pending = g.epoch, step, None
        self.engine.scope = node.scope(during_step=True)
        what = "; ".join(x for x in (late, what) if x)
        if what:
            held = sum(e - s for s, e in self.engine.layout.held(me))
            own = mine.size if (mine := self.engine.layout.primary(me)) is not None else 0
            entry = {"epoch": g.epoch, "step": step, "reason": what, "held": held, "primary": own}
            node.records.log(Entry.RESHARD, entry)
            log.info("%s: sharded zone at step %d: %s; holds %s elements", node.name, step, what, f"{held:,}")
        current = {id(g.pg), id(group)}
        return [x for x in left if id(x) not in current]

    def _restore(self, node: Node, layout: Layout, me: str, step: int) -> None:
        directory = node.config.checkpoint_dir
        if directory is None:
            raise JobHalted(
                f"the group resumes at step {step} but no member holds the state's ranges and this node has no "
                "--checkpoint-dir to read them from: give every node the checkpoint directory"
            )
        try:
            restore_shards(self.ready, Path(directory), layout, me, step=step)
        except TransferError as exc:
            raise JobHalted(f"the group resumes at step {step}, but its ranges cannot be read: {exc}") from exc

    def save(self, directory: Path, step: int, *, copies: bool = False) -> None:
        """This member's primary range at ``step`` into ``directory`` (with a checkpoint;
        ``copies``: the ranges it is buddy for too, so that each range lies on two disks); the
        files of steps older than the `KEEP` newest complete ones go (every member's: those
        steps are superseded).

        Raises:
            OSError: the file could not be written."""
        save_shard(self.ready, directory, step, copies=copies)
        prune_shards(directory, self.numel, KEEP)

    def restorable(self, directory: Path) -> Callable[[int], str | None]:
        """Why the replicated checkpoint of a step cannot be used (its ranges' files are not
        all there), for `load_newest`."""
        complete = set(complete_steps(directory, self.numel))
        return lambda step: None if step in complete else "the shard files of its step do not cover the state"

    def _build(
        self, layout: Layout, me: str, ranks: Mapping[str, int], pg: ProcessGroup, scope: EpochScope
    ) -> ShardedModel:
        blocks = self.sharding.blocks(self.model) if self.sharding.blocks is not None else None
        engine = ShardedModel(
            self.model, layout, me, ranks, pg, scope, self.make_optimizer, blocks=blocks, groups=self.groups
        )
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
        if self.world is not None:  # several zones: the sum over them too
            engine.cross_sum(self.world)
        total = torch.tensor([engine.primary_squares()], dtype=torch.float64)
        wait_all([engine.group.allreduce([total])], engine.scope, "summing the gradient's norm over the zone")
        self.total_norm = math.sqrt(float(total))
        self._clip = 1.0
        if self.sharding.clip_norm is not None:
            self._clip = min(1.0, self.sharding.clip_norm / (self.total_norm + 1e-6))  # clip_grad_norm_'s rule
        self._summed = step
        return own

    def apply(self) -> None:
        """The optimizer on the held ranges, with the param groups' settings of now."""
        for name, now, built in self.buffers:  # the same on every member: they stop together
            if not torch.equal(now, built):
                raise ConfigError(
                    f"the model's forward changed its buffer {name!r}: a sharded zone keeps buffers as built and "
                    "does not sum them; keep it constant, or train unsharded"
                )
        self._step(self.optimizer.param_groups, self._clip)
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
        self._step(self.pending[1], self.pending[2])
        log.info("%s: applied step %d late: the group committed it while its commit failed here", node.name, step - 1)

    def abandon(self, step: int) -> None:
        """Step ``step`` is not applied here. Where its sum is complete, it is kept: the group
        may have committed it (a commit failed here, not everywhere), and `sync` applies it."""
        if self.engine is None:
            return
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

    # ---------------------------------------------------------------- what a finished node keeps

    def digests(self) -> dict[str, str]:
        """Each held range's digest by ``"start-end"``: a primary's equals its buddy's."""
        return {f"{a}-{b}": d for (a, b), d in self.ready.digests().items()}

    def final(self) -> dict[str, Any]:
        """The ranges this member holds (values) and where they lie: the parts of the finished
        model that `assemble` puts together from the members'."""
        engine = self.ready
        buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}  # whole on every member
        out: dict[str, Any] = {"spans": engine.spans(), "numel": self.numel, "buffers": buffers, "step": self.step}
        # Every range it holds, its copies too: any finished nodes whose ranges cover the
        # model will do (after a death, one survivor may hold it all).
        pieces = [(h.start, h.end, engine.export(h.start, h.end, with_state=False)["values"]) for h in engine.holdings]
        return out | {"pieces": pieces}


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
