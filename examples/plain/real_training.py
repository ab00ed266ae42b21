"""A job written the way real training code is: AdamW parameter groups from

Plain PyTorch in one process: what ``examples/real_training.py`` ports to unbroken.

    python examples/plain/real_training.py
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

_g = torch.Generator().manual_seed(3)
X = torch.randn(480, 16, generator=_g)
Y = (X @ torch.randn(16, 4, generator=_g)).argmax(1)


class Net(nn.Module):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 4))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)  # so that a signal sent from outside lands mid-run
        return self.body(x)


class EMA(nn.Module):
    """An exponential moving average of the weights: replicated state the runtime does not know."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        self.decay = decay
        for name, p in model.named_parameters():
            self.register_buffer(name.replace(".", "_"), p.detach().clone())

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            self.get_buffer(name.replace(".", "_")).lerp_(p, 1 - self.decay)


def adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]  # biases and norms: no decay
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def warmup_cosine(warmup: int, total: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="features")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--clip", type=float, default=0.5)
    args = parser.parse_args(argv)
    delay = float(os.environ.get("UB_TEST_DELAY_MS", "10")) / 1000
    torch.manual_seed(5)
    model = Net(delay)
    opt = adamw(model, args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, args.steps))
    ema = EMA(model, 0.9)
    loader = DataLoader(TensorDataset(X, Y), batch_size=24, shuffle=True, generator=torch.Generator().manual_seed(5))
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            sched.step()
            ema.update(model)
            step += 1
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
