"""A GAN: two networks, two optimizers, one custom step.

Plain PyTorch in one process: what ``examples/gan.py`` ports to unbroken.

    python examples/plain/gan.py
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gan")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = GAN()
    opts = [
        torch.optim.Adam(model.G.parameters(), lr=args.lr, betas=(0.5, 0.999)),
        torch.optim.Adam(model.D.parameters(), lr=args.lr, betas=(0.5, 0.999)),
    ]
    loader = DataLoader(ring(4096, seed=1), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    step = 0
    while step < args.steps:
        for batch in loader:
            loss = gan_step(model, batch)
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for opt in opts:
                opt.step()
            step += 1
            if step == args.steps:
                break
    print(coverage(model))


if __name__ == "__main__":
    main()
