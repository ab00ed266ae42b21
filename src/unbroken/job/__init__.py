"""What a user hands to unbroken: the model, the data and the arithmetic of one job."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from unbroken.errors import ConfigError, JobLoadError
from unbroken.job.data import DataPlan, PassOrder, order_digest
from unbroken.job.scale import LossScale
from unbroken.job.stream import Stream, StreamPlan
from unbroken.state import layout


class Optimizers:
    """Several optimizers that step as one, each on the step's global gradient of its own
    parameters (a GAN's generator and discriminator, an actor and a critic), returned by
    `Job.optimizer` as a dict (or a list: named "0", "1", ...). Their states replicate together."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        seen: dict[int, str] = {}
        for name, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(f"Job.optimizer: {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer")
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ConfigError(
                            f"Job.optimizer: optimizers {seen[id(p)]!r} and {name!r} share a parameter: "
                            "it would be stepped twice per step; give each optimizer its own parameters"
                        )
                    seen[id(p)] = name
        self.optimizers = dict(optimizers)

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[name]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


AnyOptimizer = torch.optim.Optimizer | Optimizers
ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[nn.Module], Any]
SchedulerFactory = Callable[[Any], Any]
StateFactory = Callable[[nn.Module], dict[str, Any]]
LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class StepInfo:
    """What `Job.after_step` sees: a step every replica has just applied."""

    step: int
    """The committed step count (1 after the first step)."""
    loss: float
    """The step's loss over all B samples (DiLoCo: the round's last inner step)."""
    model: nn.Module
    optimizer: AnyOptimizer
    scheduler: Any
    """The job's scheduler, or None."""
    state: dict[str, Any]
    """The job's extra replicated state (`Job.state`), by name."""
    rank: int
    """This node's rank in the epoch: rank 0 is one node, for work only one should do."""
    size: int
    """Members of the epoch."""


@dataclass(frozen=True)
class Sharding:
    """How a job's state is sharded over the members of a zone (`Job.shard`): each member
    holds a contiguous range of the flat parameters, sized by the memory it offers
    (``--memory-limit``), with its gradient and optimizer state, plus a second copy of
    another member's range (`unbroken.state.shards`); a block's parameters are gathered just
    before its forward and its backward, and freed after (`unbroken.comm.sharded`)."""

    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    """The modules gathered as one, in the order the model calls them (``lambda model:
    model.layers``): one gather each, so the largest is what a member holds at once beyond
    its range. Default: the model's children that have parameters."""
    align: int = 1
    """Range boundaries fall on multiples of this many elements."""
    clip_norm: float | None = None
    """Clip the step's gradient to this global norm, as ``clip_grad_norm_(model.parameters(),
    clip_norm)`` does on the whole (its norm summed over every member's ranges): a sharded
    job's ``before_update`` cannot, no member holding the whole gradient."""

    def __post_init__(self) -> None:
        if self.align < 1:
            raise ConfigError(f"Sharding.align = {self.align} must be at least 1")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"Sharding.clip_norm = {self.clip_norm} must be a positive number")


@dataclass(frozen=True, kw_only=True)
class Job:
    """One training job: every node of a group runs the same `Job`.

    The runtime owns the loop. Step ``s`` consumes the samples at positions
    ``[s*B, (s+1)*B)`` of a seeded permutation of the dataset (a new permutation per pass),
    whichever nodes are up; each node computes the gradient of its slice, and the sum over
    nodes equals the gradient of the mean loss over all ``B`` samples.
    """

    name: str
    """Identifies the job on a coordinator; nodes of another job are refused."""
    model: ModelFactory
    """Builds the model. Must be deterministic given the seed set before it is called."""
    optimizer: OptimizerFactory
    """Builds the optimizer from the model (so parameter groups can be made from
    ``model.named_parameters()``): ``lambda model: torch.optim.AdamW(model.parameters())``;
    or several, as a dict by name (``{"G": Adam(model.G.parameters()), "D": ...}``): they
    step together on the step's gradient (`Optimizers`)."""
    dataset: Dataset[Any] | Stream
    """Map-style dataset (``__len__`` and ``__getitem__``) of training samples, read in a
    seeded permutation per pass; or a `Stream` read in its own order (an IterableDataset
    through ``IterableStream``, a directory of shards through ``ShardStream``, in
    `unbroken.job.stream`)."""
    loss: LossFn | None = None
    """``loss(model_output, target)`` returning the *mean* over the micro-batch, for a
    collated micro-batch of ``(inputs, targets)``; or give `step`."""
    step: StepFn | None = None
    """``step(model, batch)``: the micro-batch's mean loss, computed any way the model needs
    (``model(**batch).loss`` for a dict-in, loss-out model; under ``torch.autocast``),
    the general form of `loss`. The runtime calls ``backward`` on what it returns."""
    batch_size: int
    """Global batch size B, fixed whatever the number of nodes."""
    num_steps: int
    """Number of optimizer steps of the whole job."""
    seed: int = 0
    """Seeds model initialisation and the data order."""
    collate: Callable[[list[Any]], Any] = default_collate
    """Turns a list of samples into a micro-batch: ``(inputs, targets)`` for `loss`, anything for `step`."""
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None
    """Optional held-out evaluation, reported at the end of the job."""
    scheduler: SchedulerFactory | None = None
    """Builds a learning-rate scheduler on the optimizer (``lambda opt: LambdaLR(opt, f)``).
    It steps once per committed step, after the optimizer (DiLoCo: per inner step), and its
    state is replicated like the optimizer's: digested, sent to joiners, checkpointed."""
    state: StateFactory | None = None
    """Builds further replicated state from the model, by name (an EMA of the weights, a
    step counter): each value has ``state_dict()`` and ``load_state_dict()`` (a module, an
    optimizer, ...). Digested, sent to joiners and checkpointed with the model; change it
    only the same way on every replica (`after_step`)."""
    before_update: Callable[[nn.Module, AnyOptimizer], None] | None = None
    """Called on every replica with the step's global gradient in each parameter's
    ``.grad``, just before the optimizer steps: clip it here
    (``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``). Every replica sees the
    same gradient, so the same clipping keeps replicas identical."""
    after_step: Callable[[StepInfo], None] | None = None
    """Called on every replica after each committed step (DiLoCo: each outer step), before
    its digest and checkpoint: update `state` here (the same way everywhere), and evaluate
    or log every N steps where ``info.rank == 0``."""
    loss_scale: LossScale | None = None
    """Dynamic loss scaling for float16 autocast (``LossScale.like(torch.amp.GradScaler())``):
    the loss is scaled before backward, gradients unscaled before the all-reduce, and a step
    in which any member's gradient overflowed is committed without an optimizer update,
    on every replica, as GradScaler skips it (`unbroken.job.scale`)."""
    order: PassOrder | None = None
    """The order a map-style dataset is read in, pass by pass: ``order(k)`` is pass k's
    dataset indices, the same on every call and every node (``LoaderOrder(loader)`` reads a
    DataLoader's, sampler, generator and ``drop_last`` included). Default: a permutation
    seeded by `seed` per pass. Its first pass is part of `identity`."""
    shard: Sharding | None = None
    """Shard the state over the members instead of replicating it (`Sharding`): a model
    whose parameters, gradients and optimizer state exceed one node's memory trains on
    several (``unbroken node --shard`` sets it on a job that does not)."""
    args: tuple[str, ...] = field(default=(), compare=False)
    """The job's command-line arguments (``unbroken node job.py:make -- --lr 3e-4`` calls
    ``make(["--lr", "3e-4"])``); part of `identity`, so nodes given others are refused."""

    def __post_init__(self) -> None:
        if (self.loss is None) == (self.step is None):
            raise ConfigError(
                "Job: give loss= (loss(model(inputs), targets) for batches of (inputs, targets)) or "
                "step= (step(model, batch) returning the loss, for any other batch), one of them"
            )
        if not self.name or len(self.name) > 128:
            raise ConfigError("Job.name must be a non-empty string of at most 128 characters")
        if self.batch_size < 1:
            raise ConfigError(f"Job.batch_size = {self.batch_size} must be at least 1")
        if self.num_steps < 1:
            raise ConfigError(f"Job.num_steps = {self.num_steps} must be at least 1")
        if isinstance(self.dataset, Stream):
            if self.order is not None:
                raise ConfigError("Job.order is for a map-style dataset: a stream is read in its own order")
            return
        if isinstance(self.dataset, IterableDataset) or not hasattr(self.dataset, "__len__"):
            raise ConfigError(
                f"Job.dataset is a {type(self.dataset).__name__} without a length: read it as a stream, "
                "dataset=IterableStream(it) (from unbroken.train.stream), or give a map-style dataset"
            )
        if len(self.dataset) < 1:
            raise ConfigError("Job.dataset is empty: it needs at least one sample")
        if self.order is not None and self.num_samples < 1:
            raise ConfigError("Job.order's first pass is empty (drop_last with fewer samples than one batch?)")

    @property
    def num_samples(self) -> int:
        """Samples per pass of a map-style dataset (0 for a stream)."""
        if isinstance(self.dataset, Stream):
            return 0
        if self.order is not None:
            return len(self.order(0))
        return len(self.dataset)  # type: ignore[arg-type]

    def plan(self) -> DataPlan | StreamPlan:
        """Which positions each step's slice reads (`samples` turns them into samples)."""
        if isinstance(self.dataset, Stream):
            return StreamPlan(self.batch_size)
        return DataPlan(self.num_samples, self.batch_size, self.seed, self.order)

    def samples(self, indices: list[int]) -> list[Any]:
        """The samples at ``indices`` of `plan` (a stream's are consecutive positions)."""
        if not isinstance(self.dataset, Stream):
            return [self.dataset[i] for i in indices]
        out: list[Any] = []
        start = 0
        for k in range(1, len(indices) + 1):  # each run of consecutive positions in one read
            if k == len(indices) or indices[k] != indices[k - 1] + 1:
                out += self.dataset.read(indices[start], k - start)
                start = k
        return out

    def identity(self, optimizer: AnyOptimizer | None = None) -> str:
        """A short hash of what must match across nodes besides the model itself (of
        `identity_spec`: with ``optimizer``, its hyperparameters as built too)."""
        return hashlib.blake2b(
            json.dumps(self.identity_spec(optimizer), sort_keys=True).encode(), digest_size=8
        ).hexdigest()

    def identity_spec(self, optimizer: AnyOptimizer | None = None) -> dict[str, Any]:
        """What must match across nodes besides the model itself, readable (a refusal names
        the fields that differ); with ``optimizer``, each group's hyperparameters as the
        job's code built them (a node whose code sets another learning rate is another job)."""
        spec: dict[str, Any] = {
            "name": self.name,
            "batch_size": self.batch_size,
            "num_steps": self.num_steps,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }
        if isinstance(self.dataset, Stream):
            spec["stream"] = self.dataset.identity()
        if self.order is not None:
            spec["order"] = order_digest(self.order)
        if self.loss_scale is not None:
            spec["loss_scale"] = dataclasses.asdict(self.loss_scale)
        if self.args:
            spec["args"] = list(self.args)
        if self.shard is not None:
            spec["shard"] = {"align": self.shard.align, "clip_norm": self.shard.clip_norm}
        if optimizer is not None:
            spec["optimizer"] = hyperparameters(optimizer)
        return spec

    def microbatch_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The mean loss of one collated micro-batch (`step`, or `loss` of the model's output)."""
        if self.step is not None:
            return self.step(model, batch)
        assert self.loss is not None
        try:
            if isinstance(batch, Mapping):
                raise TypeError("a mapping")
            inputs, targets = batch
        except (TypeError, ValueError):
            raise ConfigError(
                f"Job.loss needs batches of (inputs, targets); collate made a {type(batch).__name__}: "
                "give step=lambda model, batch: ... (e.g. model(**batch).loss) instead of loss="
            ) from None
        return self.loss(model(inputs), targets)

    def build(self) -> tuple[nn.Module, AnyOptimizer]:
        torch.manual_seed(self.seed)
        model = self.model()
        try:
            optimizer = self.optimizer(model)
        except TypeError as exc:
            if "not iterable" not in str(exc):
                raise
            raise ConfigError(
                f"Job.optimizer({type(model).__name__}) failed ({exc}): the optimizer factory receives "
                "the model, not its parameters: write optimizer=lambda model: "
                "torch.optim.SGD(model.parameters(), lr=...)"
            ) from None
        if isinstance(optimizer, (list, tuple)):
            optimizer = {str(i): opt for i, opt in enumerate(optimizer)}
        if isinstance(optimizer, Mapping):
            return model, Optimizers(optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"Job.optimizer returned a {type(optimizer).__name__}: give a torch.optim.Optimizer, "
                "or several as a dict by name"
            )
        return model, optimizer

    def build_scheduler(self, optimizer: AnyOptimizer) -> Any:
        if self.scheduler is None:
            return None
        scheduler = self.scheduler(optimizer)
        _check_stateful("Job.scheduler", "the scheduler", scheduler, "step")
        return scheduler

    def build_state(self, model: nn.Module) -> dict[str, Any]:
        if self.state is None:
            return {}
        state = self.state(model)
        if not isinstance(state, dict) or not all(isinstance(k, str) and k for k in state):
            raise ConfigError("Job.state must return a dict of replicated state by name (non-empty strings)")
        for name, value in state.items():
            _check_stateful("Job.state", f"state {name!r}", value)
        return state


def _check_stateful(where: str, what: str, value: Any, *more: str) -> None:
    missing = [a for a in ("state_dict", "load_state_dict", *more) if not callable(getattr(value, a, None))]
    if missing:
        raise ConfigError(
            f"{where}: {what} is a {type(value).__name__} without {', '.join(missing)}(): replicated state "
            "must save and load itself (a module, an optimizer, a scheduler, or an object with both methods)"
        )
    try:
        layout.split(value.state_dict())
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{where}: {what}'s state_dict() cannot be sent to other nodes ({exc}): it may hold tensors, "
            "dicts, lists, tuples, strings, numbers, booleans and None"
        ) from None
    if "step" in more:
        try:
            inspect.signature(value.step).bind()
        except TypeError:
            raise ConfigError(
                f"{where}: {what}.step() needs arguments ({type(value).__name__}, e.g. a metric): the runtime "
                "steps the scheduler once per committed step with none; step it in after_step instead"
            ) from None
        except ValueError:
            pass


def load_job(ref: str, args: Sequence[str] = ()) -> Job:
    """Load a `Job` from ``path/to/file.py:attr`` or ``package.module:attr``.

    ``attr`` may name a `Job` or a function returning one: of no arguments, or of one, the
    job's command-line arguments (``args``, a list of strings, to parse with argparse).

    Raises:
        JobLoadError: ``ref`` is malformed, its file or module cannot be imported (the
            import's own error is in the message), or ``attr`` is missing or gives no `Job`.
    """
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise JobLoadError(f"job {ref!r} is not of the form FILE.py:ATTR or MODULE:ATTR")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise JobLoadError(f"job file {path} does not exist")
            mod_name = f"unbroken_job_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise JobLoadError(f"cannot import {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except JobLoadError:
        raise
    except Exception as exc:
        raise JobLoadError(f"importing {target!r} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise JobLoadError(f"{target!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if callable(obj) and not isinstance(obj, Job):
        accepts, wants_args = _positional(obj)
        if args and not accepts:
            raise JobLoadError(
                f"job arguments {list(args)} given, but {ref!r} takes none: write def {attr}(argv: list[str]) -> Job"
            )
        try:
            obj = obj(list(args)) if args or wants_args else obj()
        except SystemExit as exc:  # argparse refusing the arguments (it printed why)
            raise JobLoadError(f"{ref!r} refused its arguments {list(args)} (exit status {exc.code})") from None
        except Exception as exc:
            raise JobLoadError(
                f"calling {ref!r} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc().rstrip()}"
            ) from exc
    elif args:
        raise JobLoadError(
            f"job arguments {list(args)} given, but {ref!r} is a Job: make it a function "
            f"def {attr}(argv: list[str]) -> Job that parses them"
        )
    if not isinstance(obj, Job):
        raise JobLoadError(f"{ref!r} is a {type(obj).__name__}, not an unbroken.Job")
    return replace(obj, args=tuple(args)) if args else obj


def _positional(fn: Callable[..., Any]) -> tuple[bool, bool]:
    """Whether ``fn`` takes a positional argument, and whether it wants the job's arguments
    even when none were given (it requires one, or names it ``argv``/``args``: with
    ``argv=None`` argparse would read this process's own command line)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False, False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    accepts = bool(positional) or any(p.kind is p.VAR_POSITIONAL for p in params)
    first = positional[0] if positional else None
    wants = first is not None and (first.default is first.empty or first.name in ("argv", "args"))
    return accepts, wants


IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Optimizer options that choose a kernel, not the math: nodes on other devices may differ."""


def hyperparameters(optimizer: AnyOptimizer) -> list[dict[str, Any]] | dict[str, list[dict[str, Any]]]:
    """Each param group's hyperparameters without its parameters (learning rate, betas,
    weight decay...), as JSON values, for one optimizer or several by name; options
    that only choose a kernel are left out."""
    if isinstance(optimizer, Optimizers):
        return {name: _groups(opt) for name, opt in optimizer.optimizers.items()}
    return _groups(optimizer)


def _groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        kept: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params" or key in IMPLEMENTATION_FLAGS:
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (bool, int, float, str, type(None))) or (
                isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value)
            ):
                kept[key] = list(value) if isinstance(value, tuple) else value
        groups.append(kept)
    return groups
