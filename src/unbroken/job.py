"""What a user hands to unbroken: the model, the data and the arithmetic of one job."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from unbroken.errors import ConfigError, JobLoadError

ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
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
    """Builds the optimizer from the model's parameters."""
    dataset: Dataset[Any]
    """Map-style dataset (``__len__`` and ``__getitem__``) of training samples."""
    loss: LossFn
    """``loss(model_output, target)`` returning the *mean* over the micro-batch."""
    batch_size: int
    """Global batch size B, fixed whatever the number of nodes."""
    num_steps: int
    """Number of optimizer steps of the whole job."""
    seed: int = 0
    """Seeds model initialisation and the data order."""
    collate: Callable[[list[Any]], Any] = default_collate
    """Turns a list of samples into ``(inputs, targets)``."""
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None
    """Optional held-out evaluation, reported at the end of the job."""

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 128:
            raise ConfigError("Job.name must be a non-empty string of at most 128 characters")
        if self.batch_size < 1:
            raise ConfigError(f"Job.batch_size = {self.batch_size} must be at least 1")
        if self.num_steps < 1:
            raise ConfigError(f"Job.num_steps = {self.num_steps} must be at least 1")
        if len(self.dataset) < 1:  # type: ignore[arg-type]
            raise ConfigError("Job.dataset is empty: it needs at least one sample")

    @property
    def num_samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def identity(self) -> str:
        """A short hash of what must match across nodes besides the model itself."""
        spec = {
            "name": self.name,
            "batch_size": self.batch_size,
            "num_steps": self.num_steps,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }
        return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=8).hexdigest()

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(self.seed)
        model = self.model()
        return model, self.optimizer(model.parameters())


def load_job(ref: str) -> Job:
    """Load a `Job` from ``path/to/file.py:attr`` or ``package.module:attr``.

    ``attr`` may name a `Job` or a function of no arguments returning one.
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
        try:
            obj = obj()
        except Exception as exc:
            raise JobLoadError(f"calling {ref!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, Job):
        raise JobLoadError(f"{ref!r} is a {type(obj).__name__}, not an unbroken.Job")
    return obj
