"""Which samples each step consumes, independent of who is up.

The sample stream is the concatenation of seeded permutations of the dataset, one per
pass. Step ``s`` owns positions ``[s*B, (s+1)*B)`` of that stream; a trainer with rank
``r`` takes the slice ``[offset_r, offset_r + share_r)`` of them. A retried step takes the
same positions again, so every sample is used exactly once per pass.
"""

from __future__ import annotations

import torch


class DataPlan:
    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, data_pass: int) -> list[int]:
        perm = self._perms.get(data_pass)
        if perm is None:
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
