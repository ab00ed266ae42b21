"""Which samples each step consumes, independent of who is up.

The sample stream is the concatenation of passes over the dataset: seeded permutations by
default, or the order a DataLoader's sampler gives (`LoaderOrder`). Step ``s`` owns
positions ``[s*B, (s+1)*B)`` of that stream; a trainer with rank ``r`` takes the slice
``[offset_r, offset_r + share_r)`` of them. A retried step takes the same positions again,
so every sample is used exactly once per pass.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from unbroken.errors import ConfigError

KEPT = 4
"""Passes a `LoaderOrder` keeps whole (a retry or rollback reads them again)."""

PassOrder = Callable[[int], Sequence[int]]
"""Pass k's order of dataset indices (the same every time it is asked: `LoaderOrder`)."""


class DataPlan:
    def __init__(self, num_samples: int, batch_size: int, seed: int, order: PassOrder | None = None) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.order = order
        self._perms: dict[int, list[int]] = {}

    def _perm(self, data_pass: int) -> list[int]:
        perm = self._perms.get(data_pass)
        if perm is None:
            if self.order is not None:
                perm = list(self.order(data_pass))
                if len(perm) != self.num_samples:
                    raise ConfigError(
                        f"pass {data_pass} of the data order has {len(perm)} indices, not {self.num_samples}: "
                        "every pass must read the same number of samples"
                    )
            else:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + data_pass)
                perm = torch.randperm(self.num_samples, generator=g).tolist()
            self._perms = {data_pass: perm}
        return perm

    def indices(self, step: int, offset: int, count: int) -> list[int]:
        """Dataset indices for positions ``[step*B + offset, step*B + offset + count)``."""
        if not 0 <= offset <= offset + count <= self.batch_size:
            raise ValueError(f"slice [{offset}, {offset + count}) is outside a batch of {self.batch_size}")
        out = []
        for pos in range(step * self.batch_size + offset, step * self.batch_size + offset + count):
            data_pass, i = divmod(pos, self.num_samples)
            out.append(self._perm(data_pass)[i])
        return out


class LoaderOrder:
    """The order iterating a map-style DataLoader reads its dataset in, pass after pass,
    without loading a sample: its batch sampler's batches, flattened (so ``drop_last`` drops
    the same samples; without it, passes run into each other and no batch is short), after
    the seed a DataLoader draws from its generator at the start of each pass (so a shuffling
    sampler sharing that generator draws what it does in a plain loop).

    A sampler that draws from torch's, Python's or numpy's global generator draws under one
    seeded from ``seed`` and the pass, so that every node reads the same order whatever its
    own code drew before. A pass is drawn from the state its torch generators had when that
    pass began (kept per pass, a few KB): any pass can be drawn again; the last `KEPT` are
    kept whole."""

    def __init__(self, loader: DataLoader[Any], seed: int = 0) -> None:
        sampler = loader.sampler
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            raise ConfigError(
                "the DataLoader shuffles with the global random generator, so every node would read "
                "another order: give it a seeded one, DataLoader(..., shuffle=True, "
                "generator=torch.Generator().manual_seed(0))"
            )
        self.loader = loader
        self.seed = seed
        self._generators = [g for g in {id(x): x for x in self._owned_generators()}.values()]
        self._states: list[list[torch.Tensor]] = []
        """Each pass's starting state of the generators the loader draws from."""
        self._recent: dict[int, list[int]] = {}

    def _owned_generators(self) -> list[torch.Generator]:
        """The torch generators the loader's sampling draws from, samplers nested in batch
        samplers included (a sampler's own numpy or random generator cannot be replayed:
        then only the last `KEPT` passes can be asked again)."""
        loader = self.loader
        places = [loader, loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)]
        # A sampler may be any iterable (a list of indices, which PyTorch allows): no attributes.
        owners = [vars(x) for x in places if x is not None and hasattr(x, "__dict__")]
        return [g for fields in owners for g in fields.values() if isinstance(g, torch.Generator)]

    def __call__(self, data_pass: int) -> list[int]:
        if data_pass in self._recent:
            return self._recent[data_pass]
        while len(self._states) <= data_pass:  # a pass's start is the end of the one before
            if self._states:
                self._draw(len(self._states) - 1)
            else:
                self._states.append([g.get_state() for g in self._generators])
        order = self._draw(data_pass)
        self._recent = {k: v for k, v in self._recent.items() if k >= data_pass - KEPT + 1} | {data_pass: order}
        return order

    def _draw(self, data_pass: int) -> list[int]:
        """Pass ``data_pass``, from its starting state; records where the next one starts."""
        loader = self.loader
        for g, state in zip(self._generators, self._states[data_pass], strict=True):
            g.set_state(state)
        seed = self.seed * 1_000_003 + data_pass
        python_state = random.getstate()
        numpy = sys.modules.get("numpy")
        numpy_state = numpy.random.get_state() if numpy is not None else None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            if numpy is not None:
                numpy.random.seed(seed % 2**32)
            persistent = loader.persistent_workers and loader.num_workers > 0
            if loader.generator is not None and (data_pass == 0 or not persistent):
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
            if loader.batch_sampler is None:
                order = [int(i) for i in loader.sampler]
            else:
                order = [int(i) for batch in loader.batch_sampler for i in batch]
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        if len(self._states) == data_pass + 1:
            self._states.append([g.get_state() for g in self._generators])
        return order


def order_digest(order: PassOrder) -> str:
    """A short hash of the first pass's order (nodes that would read another are refused)."""
    first = torch.tensor(list(order(0)), dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(first, digest_size=8).hexdigest()
