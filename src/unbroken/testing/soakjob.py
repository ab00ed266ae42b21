"""A small deterministic job for chaos soaks (`unbroken chaos`), shaped by the environment.

``UNBROKEN_SOAK_STEPS`` (default 1000) and ``UNBROKEN_SOAK_DELAY_MS`` (a sleep per forward
pass, default 20, so that signals land mid-step) change the run, not the math.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from unbroken.job import Job

_g = torch.Generator().manual_seed(11)
X = torch.randn(2048, 16, generator=_g)
Y = (X @ torch.randn(16, 4, generator=_g)).argmax(1)


class SoakMLP(nn.Module):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        out: torch.Tensor = self.net(x)
        return out


def job() -> Job:
    delay = float(os.environ.get("UNBROKEN_SOAK_DELAY_MS", "20")) / 1000
    return Job(
        name="unbroken-soak",
        model=lambda: SoakMLP(delay),
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        dataset=TensorDataset(X, Y),
        loss=F.cross_entropy,
        batch_size=32,
        num_steps=int(os.environ.get("UNBROKEN_SOAK_STEPS", "1000")),
        seed=3,
    )
