"""Your own training loop on unbroken: keep the script, model, optimizer, scheduler, data
pipeline and logging; add a handful of lines::

    swarm = unbroken.join("10.0.0.1:29400", job="charlm", batch_size=64, steps=2000)
    model, opt, sched = swarm.replicate(model, opt, sched)
    for x, y in swarm.batches(loader):      # my slice of each global step, exactly once
        loss = F.cross_entropy(model(x), y)  # any forward, any number of passes
        swarm.backward(loss)                 # weighted by my share of the global batch
        if swarm.step():                     # all-reduce, vote, fence: opt and sched step on commit
            log(swarm.global_step, loss)

Run it on every machine with ``unbroken run script.py --coordinator H:P -- ARGS`` (the
node options of ``unbroken node`` apply: ``--checkpoint-dir``, ``--name``, ``--token-file``,
...) or as ``python script.py``, with the coordinator given to `join` or in
``$UNBROKEN_COORDINATOR``.

It is the Job loop's runtime (`Node.steps`), with the user's code computing each slice:
the global batch B stays constant, every sample is used exactly once per pass (a retried
step reads the same samples), replicas stay bit-identical, a joiner receives every
replicated state, and a crash, hang or leave costs at most the step in flight. So:

- the optimizer and the scheduler step inside `Swarm.step`, on every replica, only when
  the step commits: do not call ``opt.step()``, ``opt.zero_grad()`` or ``sched.step()``
  yourself (a scheduler stepped twice is caught and named);
- `Swarm.step` returns False when the step did not commit (a member failed, the group
  changed): the loop just goes on, and `Swarm.batches` hands the same samples again;
- `Swarm.batches` reads a DataLoader's dataset in the order the loader would (its sampler
  and seeded generator; ``drop_last`` holds), a map-style dataset in a seeded permutation
  per pass, an IterableDataset or `Stream` in its own order. Samples are read and collated
  in this process (the loader's workers are not used);
- ``UNBROKEN_MALLOC=kept`` makes the process keep the large tensors each step frees for the
  next (`unbroken.train.memory`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, default_collate

from unbroken.config import ENV_COORDINATOR, NodeConfig, environment_coordinators, parse_address
from unbroken.control.auth import load_token
from unbroken.errors import ConfigError, NotFinal
from unbroken.job import Job, Sharding
from unbroken.specs import Preference
from unbroken.train.data import LoaderOrder, PassOrder
from unbroken.train.hooks import Faults
from unbroken.train.runtime import Node, NodeResult, Steps
from unbroken.train.scale import LossScale
from unbroken.train.step import Slice
from unbroken.train.stream import IterableStream, Stream

M = TypeVar("M", bound=nn.Module)
Opt = TypeVar("Opt")
S = TypeVar("S")

Hook = Callable[[], object]

_launched: tuple[NodeConfig, Faults | None] | None = None
"""What ``unbroken run`` was given: it wins over what the script passes to `join`."""


def launch(config: NodeConfig, faults: Faults | None = None) -> None:
    """``unbroken run``: the node options for the `join` of the script it runs next."""
    global _launched
    _launched = (config, faults)


def join(
    coordinator: str | None = None,
    *,
    job: str,
    batch_size: int,
    steps: int,
    seed: int = 0,
    args: Sequence[str] | None = None,
    **options: Any,
) -> Swarm:
    """Join (or start) job ``job`` with your own loop; see this module's docstring.

    ``coordinator``: ``HOST:PORT`` (several comma-separated: any names the leader); default
    ``$UNBROKEN_COORDINATOR``. ``args``: the script's arguments that every node must share,
    part of the job's identity (default ``sys.argv[1:]``; give ``[]`` or a subset when nodes
    take arguments of their own). ``options``: any `NodeConfig` field (``name``, ``token``,
    ``checkpoint_dir``...). Under ``unbroken run`` its command-line options win.

    Raises:
        ConfigError: an option that is not a `NodeConfig` field or is out of range, or no
            coordinator given anywhere (the message says the three ways to give one).
    """
    fields = {f.name: f for f in dataclasses.fields(NodeConfig)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigError(f"unbroken.join: unknown option(s) {unknown}: give NodeConfig fields ({', '.join(fields)})")
    faults: Faults | None = None
    if _launched is not None:
        launched, faults = _launched
        for name, f in fields.items():
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if getattr(launched, name) != default:
                options[name] = getattr(launched, name)
    if not options.get("coordinators") and not options.get("etcd") and not options.get("relays"):
        addresses = coordinator.split(",") if coordinator else environment_coordinators()
        options["coordinators"] = tuple(parse_address(a.strip()) for a in addresses if a.strip())
        if not options["coordinators"]:
            raise ConfigError(
                f"unbroken.join: no coordinator: give join(coordinator='HOST:PORT'), set ${ENV_COORDINATOR}, "
                "or start the script with `unbroken run script.py --coordinator HOST:PORT`"
            )
    options.setdefault("token", load_token())
    shared = tuple(sys.argv[1:] if args is None else args)
    return Swarm(job, batch_size, steps, seed, NodeConfig(**options), faults, shared)


def _ignoring_arguments(hook: Hook) -> Callable[..., None]:
    """A `Job` hook (which gets the model, the step's info...) that runs the loop's own closure."""

    def call(*args: Any) -> None:
        hook()

    return call


def _scheduled(optimizer: Any) -> bool:
    """Whether a torch learning-rate scheduler was built on ``optimizer`` (or on one of a
    dict of them): every `LRScheduler` writes ``initial_lr`` into the groups it drives."""
    optimizers = optimizer.values() if isinstance(optimizer, dict) else [optimizer]
    return any("initial_lr" in g for o in optimizers for g in getattr(o, "param_groups", []))


def _own_loop(model: nn.Module, batch: Any) -> torch.Tensor:
    raise AssertionError("the own loop computes its slices itself")


class Swarm:
    """One node of a job trained by the user's own loop (`join` makes it)."""

    def __init__(
        self,
        job: str,
        batch_size: int,
        steps: int,
        seed: int,
        config: NodeConfig,
        faults: Faults | None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.name, self.batch_size, self.num_steps, self.seed = job, batch_size, steps, seed
        self.args = args
        """The job's arguments: part of its identity (`join`'s ``args``)."""
        self.config = config
        self.faults = faults
        self.node: Node | None = None
        self.result: NodeResult | None = None
        """How this node's run ended (once `batches` is exhausted)."""
        self._replicated: tuple[nn.Module, Any, Any, dict[str, Any]] | None = None
        self._shard: Sharding | None = None
        self._steps: Steps | None = None
        self._current: Slice | None = None
        self._next: Slice | None = None
        self._loss = 0.0
        self._computing_since = 0.0
        self._backwards = 0
        """`backward` calls for the batch in hand."""
        self._in_backward = False
        self._stray = 0
        """Gradients accumulated into the model outside `backward` (a plain ``loss.backward()``)."""

    # ---------------------------------------------------------------- set-up

    @overload
    def replicate(self, model: M, optimizer: Opt, *, shard: bool | Sharding = False) -> tuple[M, Opt]: ...
    @overload
    def replicate(
        self, model: M, optimizer: Opt, scheduler: S, *, shard: bool | Sharding = False, **state: Any
    ) -> tuple[M, Opt, S]: ...

    def replicate(
        self, model: Any, optimizer: Any, scheduler: Any = None, *, shard: bool | Sharding = False, **state: Any
    ) -> tuple[Any, ...]:
        """Register the replicated state: the model, its optimizer (or a dict of several),
        the scheduler, and any more by name (``ema=EMA(model)``: each with ``state_dict``
        and ``load_state_dict``). Digested, sent to joiners, checkpointed; a joiner's are
        overwritten by the group's when it joins. Returns them, for ``model, opt = ...``.

        ``shard``: hold a range of the model's parameters and optimizer state instead of the
        whole (`Sharding`; True: a block per child module). The model's parameters are then
        gathered for its forward and backward only: run the model inside the loop's batches,
        the same way on every node (a forward elsewhere gathers from every member), and keep
        the finished model with ``--final-state`` (each node writes its range there)."""
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Swarm.replicate: the model must be a torch.nn.Module, not a {type(model).__name__}")
        self._replicated = (model, optimizer, scheduler, state)
        self._shard = Sharding() if shard is True else shard or None
        return (model, optimizer) if scheduler is None and not state else (model, optimizer, scheduler)

    def _job(
        self,
        data: Any,
        collate: Callable[[list[Any]], Any] | None,
        before_update: Hook | None,
        after_step: Hook | None,
        loss_scale: LossScale | None,
    ) -> Job:
        if self._replicated is None:
            raise ConfigError("Swarm.batches: call swarm.replicate(model, optimizer[, scheduler]) first")
        model, optimizer, scheduler, state = self._replicated
        if scheduler is None and _scheduled(optimizer):
            raise ConfigError(
                "the optimizer has a learning-rate scheduler (its param groups carry 'initial_lr') that "
                "swarm.replicate was not given: its step count would be this node's alone (a joiner's would "
                "differ, a retried step would count twice); pass it, swarm.replicate(model, opt, sched), and "
                "remove sched.step() from the loop (swarm.step() steps it on every replica at each commit)"
            )
        if (at := getattr(scheduler, "last_epoch", 0)) != 0:
            raise ConfigError(
                f"the scheduler is at step {at} before the job's first step (resumed from a checkpoint of your "
                "own?): unbroken counts the job's steps itself, from 0 for a new job, and resumes its own runs "
                "from their checkpoints (--checkpoint-dir). To start from weights of your own, load the model "
                "and optimizer before swarm.replicate() and give it a scheduler at step 0 (shift its schedule "
                "by your step if it must go on where it was)"
            )
        order: PassOrder | None = None
        dataset = data
        if isinstance(data, DataLoader):
            if data.batch_size is not None and data.batch_size != self.batch_size:
                raise ConfigError(
                    f"the DataLoader's batch_size is {data.batch_size} but the job's global batch is "
                    f"{self.batch_size}: make them equal (unbroken splits each global batch among the nodes)"
                )
            dataset, collate = data.dataset, collate or data.collate_fn
            if not isinstance(dataset, IterableDataset):
                order = LoaderOrder(data, seed=self.seed)
        if isinstance(dataset, IterableDataset) and not isinstance(dataset, Stream):
            dataset = IterableStream(dataset)
        return Job(
            name=self.name,
            model=lambda: model,
            optimizer=lambda _: optimizer,
            dataset=dataset,
            step=_own_loop,
            batch_size=self.batch_size,
            num_steps=self.num_steps,
            seed=self.seed,
            collate=collate or default_collate,
            scheduler=(lambda _: scheduler) if scheduler is not None else None,
            state=(lambda _: state) if state else None,
            order=order,
            loss_scale=loss_scale,
            before_update=_ignoring_arguments(before_update) if before_update is not None else None,
            after_step=_ignoring_arguments(after_step) if after_step is not None else None,
            shard=self._shard,
            args=self.args,
        )

    # ---------------------------------------------------------------- the loop

    def batches(
        self,
        data: Any,
        *,
        collate: Callable[[list[Any]], Any] | None = None,
        before_update: Hook | None = None,
        after_step: Hook | None = None,
        loss_scale: LossScale | None = None,
    ) -> Iterator[Any]:
        """This node's slice of each global step, collated, until the job is done; call
        `backward` and `step` once for each. The same samples come again when a step did
        not commit. Joins the group on the first call.

        ``data``: a DataLoader (its dataset, order and collate_fn; its batch_size must be
        the global batch), a map-style dataset, an IterableDataset or a `Stream`.
        ``before_update``: runs on every replica with the step's global gradient in each
        ``.grad``, just before the optimizer steps: clip there
        (``lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``).
        ``after_step``: runs on every replica right after each commit, before its digest,
        checkpoint and any state transfer to a joiner: update replicated state there
        (``lambda: ema.update(model)``), not after ``if swarm.step():``, which a joiner that
        received the state of that step never runs.
        ``loss_scale``: float16 loss scaling for the group (``LossScale.like(scaler)`` for the
        script's ``torch.amp.GradScaler``; drop its ``scale``, ``step`` and ``update`` calls)."""
        job = self._job(data, collate, before_update, after_step, loss_scale)
        if self.config.role not in (Preference.AUTO, Preference.TRAINER):
            raise ConfigError(
                f"--role {self.config.role.value}: a node running its own loop trains (validators and standbys "
                "need a Job, whose loss they run on their own): use role trainer or auto"
            )
        config = dataclasses.replace(self.config, role=Preference.TRAINER)
        rng = torch.random.get_rng_state()  # building the Job seeds torch: the script's stream goes on
        node = Node(job, config, self.faults, own_loop=True)
        torch.random.set_rng_state(rng)
        self.node = node
        hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in node.replica.params]  # type: ignore[no-untyped-call]
        with node.session():
            self._steps = steps = node.steps()
            try:
                sl: Slice | None = next(steps)
                while sl is not None:
                    protocol = node.protocol
                    assert protocol is not None
                    protocol.prepare(sl)
                    if not sl.indices and node.zone is None:  # none of this step's samples are mine: a vote
                        sl = steps.send(0.0)
                        continue
                    # A sharded member without samples runs the step's first at weight zero: every
                    # member's forward and backward gather and sum the zone's blocks in step.
                    batch = job.collate(job.samples(sl.indices or node.data.indices(sl.step, 0, 1)))
                    self._current, self._next, self._loss = sl, None, 0.0
                    self._backwards = self._stray = 0
                    self._computing_since = time.perf_counter()
                    yield batch
                    if self._current is not None:
                        raise ConfigError("call swarm.step() once for every batch of swarm.batches()")
                    sl = self._next
            except StopIteration as stop:
                self.result = stop.value
                if self.result is not None and self.result.outcome == "job-finished":
                    raise NotFinal(self.result.step) from None
            finally:
                steps.close()  # a step left in flight by an exception undoes itself
                for hook in hooks:
                    hook.remove()

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._stray += 1

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss being the mean over this batch: weighted by this
        node's share of the global batch, so the summed gradient is the mean over B."""
        sl = self._current
        if sl is None:
            raise ConfigError("swarm.backward(loss) is for the batch swarm.batches() just gave")
        assert self.node is not None
        if self._backwards and self.node.zone is not None:
            raise ConfigError(
                "a sharded zone takes one swarm.backward(loss) per batch: every member sums the zone's blocks "
                "once per step, in step with the others"
            )
        self._in_backward = True
        try:
            (loss * (sl.weight * self.node.loss_scale)).backward()  # type: ignore[no-untyped-call]
        finally:
            self._in_backward = False
        self._backwards += 1
        self._loss += float(loss.detach()) * sl.weight

    def step(self) -> bool:
        """Reduce this step's gradient with the group's, vote, and on commit apply it (the
        optimizer, then the scheduler, on every replica). True iff the step committed (a
        peer's failure is not raised: the step is retried in the next epoch).

        Raises:
            ConfigError: out of order (no `backward` for this batch), a gradient computed
                outside `backward` (``loss.backward()``: not weighted by this node's share),
                or the loop stepped the scheduler itself.
        """
        sl, steps, node = self._current, self._steps, self.node
        if sl is None or steps is None or node is None:
            raise ConfigError("swarm.step() comes after swarm.backward(loss), once per batch of swarm.batches()")
        if self._stray:
            raise ConfigError(
                "a gradient was computed outside swarm.backward(loss) (loss.backward()?): it would go into the "
                "step unweighted by this node's share of the global batch; call swarm.backward(loss) instead"
            )
        if not self._backwards:
            raise ConfigError(
                "swarm.step() without swarm.backward(loss) for this batch: it would commit no gradient "
                "for these samples; call swarm.backward(loss) first"
            )
        node.meter.observe(sl.share, 1, time.perf_counter() - self._computing_since)
        self._current = None
        stepped = getattr(node.state.scheduler, "last_epoch", node.state.step)
        if stepped != node.state.step:  # it steps once per commit, here: someone else stepped it
            raise ConfigError(
                f"the scheduler is at step {stepped} but the group committed {node.state.step} steps: "
                "remove sched.step() from your loop (swarm.step() steps it on every replica when a step commits)"
            )
        try:
            self._next = steps.send(self._loss)
        except StopIteration as stop:
            self.result, self._next = stop.value, None
        # Applied here (not received from a peer after a failed fence) and not rolled back since.
        return node.applied_step == sl.step and node.state.step > sl.step

    # ---------------------------------------------------------------- where we are

    @property
    def global_step(self) -> int:
        """Steps the group committed (this node's view)."""
        return self.node.state.step if self.node is not None else 0

    @property
    def loss(self) -> float:
        """The global batch's mean loss at the last committed step (NaN before the first)."""
        return self.node.last_loss if self.node is not None else math.nan

    @property
    def rank(self) -> int:
        """This node's rank in the current epoch (0: one node, for work only one should do)."""
        node = self.node
        return node.group.rank if node is not None and node.group is not None else 0

    @property
    def size(self) -> int:
        """Members of the current epoch."""
        node = self.node
        return node.group.size if node is not None and node.group is not None else 1

    def request_leave(self) -> None:
        """Leave the group after the step in flight (what SIGTERM does): `batches` then ends."""
        if self.node is not None:
            self.node.request_leave()
