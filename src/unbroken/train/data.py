"""Which samples each step consumes, independent of who is up.

The sample stream is the concatenation of passes over the dataset: seeded permutations by
default, or the order a DataLoader's sampler gives (`LoaderOrder`). Step ``s`` owns
positions ``[s*B, (s+1)*B)`` of that stream; a trainer with rank ``r`` takes the slice
``[offset_r, offset_r + share_r)`` of them. A retried step takes the same positions again,
so every sample is used exactly once per pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from unbroken.errors import ConfigError

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
    without loading a sample: its batch sampler's batches, flattened (so ``drop_last``
    holds), after the seed a DataLoader draws from its generator at the start of each pass
    (so a shuffling sampler sharing that generator draws what it would in a plain loop).
    A sampler can only be drawn in sequence: every pass drawn is kept."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        sampler = loader.sampler
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            raise ConfigError(
                "the DataLoader shuffles with the global random generator, so every node would read "
                "another order: give it a seeded one, DataLoader(..., shuffle=True, "
                "generator=torch.Generator().manual_seed(0))"
            )
        self.loader = loader
        self._passes: list[torch.Tensor] = []

    def __call__(self, data_pass: int) -> list[int]:
        loader = self.loader
        while len(self._passes) <= data_pass:
            if loader.generator is not None:
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
            if loader.batch_sampler is None:
                order = list(loader.sampler)
            else:
                order = [i for batch in loader.batch_sampler for i in batch]
            self._passes.append(torch.tensor(order, dtype=torch.int64))
        return self._passes[data_pass].tolist()  # type: ignore[no-any-return]


def order_digest(order: PassOrder) -> str:
    """A short hash of the first pass's order (nodes that would read another are refused)."""
    first = torch.tensor(list(order(0)), dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(first, digest_size=8).hexdigest()
