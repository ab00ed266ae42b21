"""Job definitions shared by the benchmarks (not a benchmark itself).

Two synthetic, fully deterministic MLP jobs:

- ``small``: 3 Linear layers 64 -> 768 -> 768 -> 32, 665,120 parameters (~0.67M).
- ``medium``: 3 Linear layers 256 -> 2048 -> 2048 -> 256, 5,247,232 parameters (~5.2M).
- ``large``: 3 Linear layers 1024 -> 6144 -> 6144 -> 1024, 50,344,960 parameters (~50M).

Each job is a function of no arguments, so a node loads it as ``bench/jobs.py:small``; the
shape of a run comes from environment variables, which `LocalCluster` passes to every node
and the DDP baseline passes to every rank, so both sides build the very same `Job`:

``UB_BENCH_STEPS``    number of optimizer steps (default 100000: benchmarks stop the run)
``UB_BENCH_BATCH``    global batch size B (default 96 for small, 12 for large)
``UB_BENCH_SAMPLES``  dataset size (default 4096)
``UB_BENCH_OPT``      ``sgd`` (momentum 0.9, the default) or ``adam``
``UB_BENCH_DELAY_MS`` a sleep per forward pass (default 0; only to slow a run on purpose)
``UB_BENCH_SAMPLE_MS`` a sleep per sample in each forward pass (default 0): a compute cost
                      proportional to the share that does not load the CPU (bench/hetero.py)
``UB_BENCH_BACKWARD`` the fraction of that sleep spent in backward instead (default 0; a
                      real model's backward costs about twice its forward: 0.67), each layer's
                      part in proportion to its parameters
``UB_BENCH_FREEZE``   the first N Linear layers are frozen (default 0): a fine-tune whose
                      backbone every node builds from the seed (bench/resync.py)

``heldout`` and ``heldout_loss`` give a held-out set from the same distribution (the same
label projection, fresh inputs) and the cross-entropy of a trained model on it; the bench
computes it from a node's ``--final-state`` (the jobs themselves carry no ``evaluate``, so
that no node takes a validator role).

``python bench/jobs.py`` prints the parameter counts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from unbroken import Job

SHAPES = {
    "small": (64, 768, 32),
    "medium": (256, 2048, 256),
    "large": (1024, 6144, 1024),
}
DEFAULT_BATCH = {"small": 96, "medium": 48, "large": 12}


class _Busy(torch.autograd.Function):
    """The identity, idling ``forward_s`` on the way forward and ``backward_s`` on the way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class MLP(nn.Module):
    def __init__(
        self,
        d_in: int,
        hidden: int,
        d_out: int,
        delay_s: float = 0.0,
        per_sample_s: float = 0.0,
        freeze: int = 0,
        backward: float = 0.0,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
        )
        for layer in [m for m in self.net if isinstance(m, nn.Linear)][:freeze]:
            layer.requires_grad_(False)
        self.delay_s = delay_s
        self.per_sample_s = per_sample_s
        self.backward = backward
        total = sum(p.numel() for p in self.parameters())
        self._parts = {
            id(m): sum(p.numel() for p in m.parameters()) / total for m in self.net if isinstance(m, nn.Linear)
        }
        """Each layer's part of the emulated compute: its parameters' (its FLOPs in an MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        if not self.per_sample_s:
            return self.net(x)
        if not self.backward:
            time.sleep(self.per_sample_s * len(x))
            return self.net(x)
        # As a real device spends it: each layer in proportion to its parameters, the share
        # ``backward`` of it in that layer's backward, which runs before the layer's
        # gradient is complete (so a bucket's sum can overlap the earlier layers' backward).
        cost = self.per_sample_s * len(x)
        for module in self.net:
            x = module(x)
            if isinstance(module, nn.Linear):
                part = cost * self._parts[id(module)]
                x = _Busy.apply(x, part * (1 - self.backward), part * self.backward)
        return x


def num_params(kind: str) -> int:
    d_in, h, d_out = SHAPES[kind]
    return d_in * h + h + h * h + h + h * d_out + d_out


def dataset(kind: str, num_samples: int) -> TensorDataset:
    """Deterministic synthetic classification data: inputs N(0,1), labels from a random projection."""
    d_in, _, d_out = SHAPES[kind]
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, d_in, generator=g)
    y = (x @ torch.randn(d_in, d_out, generator=g)).argmax(1)
    return TensorDataset(x, y)


def heldout(kind: str, num_samples: int = 4096, size: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` held-out samples labelled like ``dataset(kind, num_samples)``: the generator
    is replayed past the training inputs and the projection, then draws fresh inputs."""
    d_in, _, d_out = SHAPES[kind]
    g = torch.Generator().manual_seed(1234)
    torch.randn(num_samples, d_in, generator=g)  # the training inputs
    w = torch.randn(d_in, d_out, generator=g)
    x = torch.randn(size, d_in, generator=g)
    return x, (x @ w).argmax(1)


def heldout_loss(kind: str, model: MLP, num_samples: int = 4096, size: int = 2048) -> float:
    """Mean cross-entropy of ``model`` on `heldout` (no forward sleeps)."""
    x, y = heldout(kind, num_samples, size)
    with torch.no_grad():
        return float(F.cross_entropy(model.net(x), y).item())


def _optimizer(name: str):  # type: ignore[no-untyped-def]
    if name == "adam":
        return lambda model: torch.optim.Adam(model.parameters(), lr=1e-3)
    if name == "sgd":
        return lambda model: torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    raise ValueError(f"UB_BENCH_OPT={name!r}: use sgd or adam")


def make(kind: str) -> Job:
    d_in, hidden, d_out = SHAPES[kind]
    steps = int(os.environ.get("UB_BENCH_STEPS", "100000"))
    batch = int(os.environ.get("UB_BENCH_BATCH", str(DEFAULT_BATCH[kind])))
    samples = int(os.environ.get("UB_BENCH_SAMPLES", "4096"))
    opt = os.environ.get("UB_BENCH_OPT", "sgd")
    delay = float(os.environ.get("UB_BENCH_DELAY_MS", "0")) / 1000
    per_sample = float(os.environ.get("UB_BENCH_SAMPLE_MS", "0")) / 1000
    freeze = int(os.environ.get("UB_BENCH_FREEZE", "0"))
    backward = float(os.environ.get("UB_BENCH_BACKWARD", "0"))
    return Job(
        name=f"bench-{kind}",
        model=lambda: MLP(d_in, hidden, d_out, delay, per_sample, freeze, backward),
        optimizer=_optimizer(opt),
        dataset=dataset(kind, samples),
        loss=F.cross_entropy,
        batch_size=batch,
        num_steps=steps,
        seed=11,
    )


def small() -> Job:
    return make("small")


def medium() -> Job:
    return make("medium")


def large() -> Job:
    return make("large")


JOBS = {"small": small, "medium": medium, "large": large}


def job_ref(kind: str) -> str:
    """The ``FILE.py:ATTR`` reference a node is started with."""
    return f"{os.path.abspath(__file__)}:{kind}"


def env_for(
    steps: int,
    batch: int | None = None,
    opt: str = "sgd",
    samples: int = 4096,
    sample_ms: float = 0.0,
    backward: float = 0.0,
) -> dict[str, str]:
    env = {"UB_BENCH_STEPS": str(steps), "UB_BENCH_OPT": opt, "UB_BENCH_SAMPLES": str(samples)}
    if batch:
        env["UB_BENCH_BATCH"] = str(batch)
    if sample_ms:
        env["UB_BENCH_SAMPLE_MS"] = str(sample_ms)
    if backward:
        env["UB_BENCH_BACKWARD"] = str(backward)
    return env


def _count(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


if __name__ == "__main__":
    for kind in SHAPES:
        model = MLP(*SHAPES[kind])
        n = _count(model.parameters())
        assert n == num_params(kind)
        print(f"{kind:6s} {SHAPES[kind]}  {n:,} parameters ({n * 4 / 1e6:.1f} MB fp32)")
