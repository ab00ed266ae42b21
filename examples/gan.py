"""A GAN: two networks, two optimizers, one custom step.

The generator and the discriminator are updated together from each step's global gradient
(simultaneous updates): the step computes the discriminator's loss on real and generated
points, and the generator's loss through a discriminator whose parameters do not take that
gradient, and returns their sum. Each latent vector belongs to its sample (the dataset holds
pairs of a real point and a latent), so every node draws exactly what one process would.

    unbroken coordinator --port 29400 &
    unbroken node --coordinator 127.0.0.1:29400 examples/gan.py:make -- --steps 300
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from unbroken import Job

LATENT = 4


def ring(n: int, seed: int) -> TensorDataset:
    """Points on 8 Gaussian blobs around a circle, each with its own latent vector."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    points = torch.stack([angle.cos(), angle.sin()], 1) * 2 + 0.05 * torch.randn(n, 2, generator=g)
    return TensorDataset(points, torch.randn(n, LATENT, generator=g))


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(LATENT, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        self.D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
        self.delay_s = float(os.environ.get("UB_TEST_DELAY_MS", "0")) / 1000  # tests: signals land mid-step

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.G(z)


def gan_step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    real, z = batch
    fake = model(z)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    d_loss = F.binary_cross_entropy_with_logits(model.D(real), ones) + F.binary_cross_entropy_with_logits(
        model.D(fake.detach()), zeros
    )
    model.D.requires_grad_(False)  # the generator's loss moves the generator only
    try:
        g_loss = F.binary_cross_entropy_with_logits(model.D(fake), ones)
    finally:
        model.D.requires_grad_(True)
    return d_loss + g_loss


@torch.no_grad()
def coverage(model: nn.Module) -> dict[str, float]:
    """How far generated points lie from the ring, on average (0: on it)."""
    z = torch.randn(512, LATENT, generator=torch.Generator().manual_seed(99))
    radius = model.G(z).norm(dim=1)
    return {"ring_distance": (radius - 2).abs().mean().item()}


def make(argv: list[str]) -> Job:
    parser = argparse.ArgumentParser(prog="gan")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    return Job(
        name="gan",
        model=GAN,
        optimizer=lambda model: {
            "G": torch.optim.Adam(model.G.parameters(), lr=args.lr, betas=(0.5, 0.999)),
            "D": torch.optim.Adam(model.D.parameters(), lr=args.lr, betas=(0.5, 0.999)),
        },
        dataset=ring(4096, seed=1),
        step=gan_step,
        batch_size=64,
        num_steps=args.steps,
        seed=0,
        evaluate=coverage,
    )
