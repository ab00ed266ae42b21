"""float16 mixed precision with dynamic loss scaling, as ``torch.amp.GradScaler`` does it,
for the whole group: a step in which any node's scaled gradient overflowed is skipped by
every replica (committed, without an optimizer update), and the scale moves the same way
everywhere (`unbroken.train.scale`).

    unbroken node examples/mixed_precision.py:make -- --steps 200
    python examples/mixed_precision.py --steps 200     # the plain GradScaler loop, one process
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from unbroken import Job
from unbroken.train.scale import LossScale

_g = torch.Generator().manual_seed(11)
X = torch.randn(960, 32, generator=_g)
Y = (X @ torch.randn(32, 8, generator=_g)).argmax(1)
TRAIN, HELDOUT = TensorDataset(X[:768], Y[:768]), (X[768:], Y[768:])
B = 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Net(nn.Module):
    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 8))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)  # so that a signal sent from outside lands mid-run
        return self.body(x)


def scaler() -> torch.amp.GradScaler:
    # A large first scale: the first steps overflow float16 and are skipped, as they would be.
    return torch.amp.GradScaler(DEVICE, init_scale=2.0**24, growth_interval=20)


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    with torch.autocast(DEVICE, dtype=torch.float16):
        return F.cross_entropy(model(x), y)


def heldout(model: nn.Module) -> dict[str, float]:
    with torch.no_grad():
        return {"heldout_loss": float(F.cross_entropy(model(HELDOUT[0]), HELDOUT[1]))}


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mixed_precision")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args(argv)


def make(argv: list[str]) -> Job:
    args = _args(argv)
    delay = float(os.environ.get("UB_TEST_DELAY_MS", "0")) / 1000
    return Job(
        name="mixed-precision",
        model=lambda: Net(delay),
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        dataset=TRAIN,
        step=step,
        loss_scale=LossScale.like(scaler()),
        evaluate=heldout,
        batch_size=B,
        num_steps=args.steps,
        seed=3,
    )


def plain(argv: list[str] | None = None, parts: int = 1) -> tuple[nn.Module, list[bool], list[float]]:
    """The same training as one process with GradScaler, accumulating each batch's gradient
    over ``parts`` micro-batches: the model, which steps it skipped, and the losses. (float16
    rounds each part's summed gradient: whether a step overflows depends on the split.)"""
    args = _args(argv)
    job = make(argv or [])
    model, opt = job.build()
    plan = job.plan()
    gs = scaler()
    skipped, losses = [], []
    for s in range(args.steps):
        indices = plan.indices(s, 0, B)
        opt.zero_grad()
        total = 0.0
        for k in range(parts):
            part = indices[k * B // parts : (k + 1) * B // parts]
            loss = step(model, job.collate(job.samples(part))) * (len(part) / B)
            total += float(loss.detach())
            gs.scale(loss).backward()
        losses.append(total)
        before = gs.get_scale()
        gs.step(opt)
        gs.update()
        skipped.append(gs.get_scale() < before)
    return model, skipped, losses


if __name__ == "__main__":
    net, skips, _ = plain()
    print(f"held-out loss {heldout(net)['heldout_loss']:.4f}; {sum(skips)} of {len(skips)} steps skipped")
