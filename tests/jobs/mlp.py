"""A small deterministic job for integration tests.

``UB_TEST_STEPS`` and ``UB_TEST_DELAY_MS`` (a sleep per forward pass, so that signals sent
from outside land mid-run) shape it; the math does not depend on either. With
``UB_TEST_PACE_FILE``, that sleep lasts only while the file it names exists (a test removes
it once what needed a slow run is done: `integration.helpers.Pace`). ``UB_TEST_SAMPLE_MS``
adds a sleep per sample: a compute cost proportional to the share, without loading the CPU.
``UB_TEST_BATCH`` sets B; ``UB_TEST_EVAL=1`` adds a held-out evaluation. ``UB_TEST_HIDDEN``
and ``UB_TEST_NAME`` make a mismatching model or another job, for refusal tests;
``UB_TEST_BATCHNORM=1`` adds a BatchNorm layer (running statistics are buffers);
``UB_TEST_NAN_AT=STEP`` puts NaN in every sample of that step (whoever computes it);
``UB_TEST_BACKBONE=W`` puts a frozen backbone of width W in front (a fine-tune: only the
head trains, and every node builds the same backbone from the seed). ``UB_TEST_SHARD=1``
shards the state over the members (`Job.shard`), a block per layer.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset, default_collate

from unbroken import Job, Sharding
from unbroken.train.data import DataPlan

_g = torch.Generator().manual_seed(1)
X = torch.randn(600, 16, generator=_g)
_W = torch.randn(16, 4, generator=_g)
Y = (X @ _W).argmax(1)
X_HELD_OUT = torch.randn(200, 16, generator=_g)
Y_HELD_OUT = (X_HELD_OUT @ _W).argmax(1)


def evaluate(model: nn.Module) -> dict[str, float]:
    """Held-out cross-entropy (``UB_TEST_EVAL=1`` gives the job this evaluation)."""
    net = model.net if isinstance(model, SlowMLP) else model  # no sleeps: evaluation is not the test's clock
    return {"heldout_loss": F.cross_entropy(net(X_HELD_OUT), Y_HELD_OUT).item()}


class SlowMLP(nn.Module):
    def __init__(
        self, delay_s: float, hidden: int = 64, batchnorm: bool = False, per_sample_s: float = 0.0, backbone: int = 0
    ) -> None:
        super().__init__()
        norm: nn.Module = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        front: list[nn.Module] = []
        if backbone:
            front = [nn.Linear(16, backbone), nn.Tanh(), nn.Linear(backbone, 16)]
            for layer in front:
                layer.requires_grad_(False)
        self.net = nn.Sequential(*front, nn.Linear(16, hidden), norm, nn.Tanh(), nn.Linear(hidden, 4))
        self.delay_s = delay_s
        self.per_sample_s = per_sample_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delay_s = self.delay_s if self.delay_s and _paced() else 0.0
        if delay_s or self.per_sample_s:
            time.sleep(delay_s + self.per_sample_s * len(x))
        return self.net(x)


def _paced() -> bool:
    path = os.environ.get("UB_TEST_PACE_FILE")
    return not path or os.path.exists(path)


def make(steps: int | None = None, delay_ms: float | None = None) -> Job:
    steps = steps or int(os.environ.get("UB_TEST_STEPS", "40"))
    delay = (delay_ms if delay_ms is not None else float(os.environ.get("UB_TEST_DELAY_MS", "20"))) / 1000
    hidden = int(os.environ.get("UB_TEST_HIDDEN", "64"))  # a different model, for refusal tests
    batchnorm = os.environ.get("UB_TEST_BATCHNORM") == "1"  # buffers updated by forward passes
    per_sample = float(os.environ.get("UB_TEST_SAMPLE_MS", "0")) / 1000
    backbone = int(os.environ.get("UB_TEST_BACKBONE", "0"))
    batch_size = int(os.environ.get("UB_TEST_BATCH", "30"))
    dataset, loss, collate = TensorDataset(X, Y), F.cross_entropy, None
    nan_at = os.environ.get("UB_TEST_NAN_AT")
    if nan_at:
        poisoned = X.clone()
        poisoned[DataPlan(len(X), batch_size, 7).indices(int(nan_at), 0, batch_size)] = float("nan")
        dataset = TensorDataset(poisoned, Y)
    bumps = os.environ.get("UB_TEST_LOSS_BUMP")  # "STEP:VALUE,...": the loss *reported* at STEP (samples seen once)
    if bumps:  # jumps by VALUE (nan: not finite); a constant, so the gradients stay as they were
        bump = torch.zeros(len(X))
        plan = DataPlan(len(X), batch_size, 7)
        for part in bumps.split(","):
            at, _, value = part.partition(":")
            bump[plan.indices(int(at), 0, batch_size)] = float(value)
        dataset, loss, collate = TensorDataset(X, torch.stack([Y.double(), bump.double()], 1)), _bumped, _collate
    return Job(
        name=os.environ.get("UB_TEST_NAME", "test-mlp"),
        model=lambda: SlowMLP(delay, hidden, batchnorm, per_sample, backbone),
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        dataset=dataset,
        loss=loss,
        collate=collate or default_collate,
        batch_size=batch_size,
        num_steps=steps,
        seed=7,
        evaluate=evaluate if os.environ.get("UB_TEST_EVAL") == "1" else None,
        shard=Sharding(blocks=lambda model: list(model.net)) if os.environ.get("UB_TEST_SHARD") == "1" else None,
    )


def _collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in samples]), torch.stack([t for _, t in samples])


def _bumped(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets[:, 0].long()) + targets[:, 1].float().mean()


job = make
