"""Held-out quality of DiLoCo's outer step applied at once and one round late, replayed in one process.

    python bench/diloco_late.py                 # 6 seeds each, about a minute of one core
    python bench/diloco_late.py --seeds 20

The integration tests' job (``tests/jobs/mlp.py``: a 16-64-4 MLP on 600 samples, SGD lr
0.05 momentum 0.9 inside a zone) in two zones of 15 samples a step, ``--rounds`` rounds of
``--inner-steps``, the outer step of ``unbroken.train.diloco``: SGD with Nesterov momentum
(``--outer-lr``, ``--outer-momentum``, the mode's defaults) on the zones' mean progress. Applied
late (``--outer-overlap``), a round's progress is applied at the next round's end and each zone
starts the next round from the anchor plus its own progress; the last two are applied at the
end. No process, no fault, no codec: the math alone, on samples drawn per seed (not the job's
data plan), to show how far the final anchor's held-out figures spread from that alone.

Prints per mode the held-out cross-entropy and accuracy of the final anchor over the seeds,
beside the synchronous reference's (the same job in one process, ``unbroken.testing``). The
integration test ``test_rounds_applied_late_keep_every_promise_through_a_kill_and_a_join``
takes its bound from this spread.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from unbroken.specs import OUTER_LR, OUTER_MOMENTUM
from unbroken.testing import reference_state


def _tests_job() -> ModuleType:
    """``tests/jobs/mlp.py``, the integration tests' job (bench/ has a jobs module of its own)."""
    path = Path(__file__).resolve().parent.parent / "tests" / "jobs" / "mlp.py"
    spec = importlib.util.spec_from_file_location("tests_jobs_mlp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mlp = _tests_job()


def heldout(model: nn.Module) -> tuple[float, float]:
    """Held-out cross-entropy and accuracy."""
    with torch.no_grad():
        out = model(mlp.X_HELD_OUT)
        return F.cross_entropy(out, mlp.Y_HELD_OUT).item(), (out.argmax(1) == mlp.Y_HELD_OUT).float().mean().item()


def replay(late: bool, seed: int, rounds: int, inner: int, lr: float, momentum: float) -> tuple[float, float]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    anchor = [nn.Parameter(p.detach().clone()) for p in base.parameters()]
    outer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
    zones = [copy.deepcopy(base) for _ in range(2)]
    inners = [torch.optim.SGD(z.parameters(), lr=0.05, momentum=0.9) for z in zones]

    def apply(delta: list[torch.Tensor]) -> None:
        for a, d in zip(anchor, delta, strict=True):
            a.grad = d
        outer.step()

    in_flight: list[torch.Tensor] | None = None
    starts = [[p.detach().clone() for p in z.parameters()] for z in zones]
    for k in range(rounds):
        for _ in range(inner):
            for z, opt in zip(zones, inners, strict=True):
                idx = torch.randint(0, len(mlp.X), (15,), generator=g)
                loss = F.cross_entropy(z(mlp.X[idx]), mlp.Y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        progress = [
            [s - p.detach() for s, p in zip(st, z.parameters(), strict=True)]
            for st, z in zip(starts, zones, strict=True)
        ]
        delta = [(a + b) / 2 for a, b in zip(*progress, strict=True)]
        with torch.no_grad():
            if late:
                if in_flight is not None:
                    apply(in_flight)
                in_flight = delta
                if k == rounds - 1:
                    apply(in_flight)
                for z, own in zip(zones, progress, strict=True):
                    for p, a, d in zip(z.parameters(), anchor, own, strict=True):
                        p.copy_(a - d)
            else:
                apply(delta)
                for z in zones:
                    for p, a in zip(z.parameters(), anchor, strict=True):
                        p.copy_(a)
        starts = [[p.detach().clone() for p in z.parameters()] for z in zones]
    with torch.no_grad():
        for p, a in zip(base.parameters(), anchor, strict=True):
            p.copy_(a)
    return heldout(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--outer-lr", type=float, default=OUTER_LR)
    ap.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM)
    args = ap.parse_args()
    os.environ["UB_TEST_EVAL"] = "1"
    job = mlp.make(args.rounds * args.inner_steps, delay_ms=0.0)
    for label, steps in (("untrained", 0), ("sync (one process)", job.num_steps)):
        model = job.model()
        model.load_state_dict(reference_state(job, steps=steps))
        ce, acc = heldout(model.net)
        print(f"{label:>20}: held-out cross-entropy {ce:.2f}, accuracy {acc:.2f}")
    for late in (False, True):
        settings = (args.rounds, args.inner_steps, args.outer_lr, args.outer_momentum)
        runs = [replay(late, seed, *settings) for seed in range(args.seeds)]
        ces, accs = [r[0] for r in runs], [r[1] for r in runs]
        print(
            f"{'diloco, ' + ('late' if late else 'at once'):>20}: held-out cross-entropy "
            f"{min(ces):.2f} to {max(ces):.2f} (median {statistics.median(ces):.2f}), "
            f"accuracy {min(accs):.2f} to {max(accs):.2f} over {args.seeds} seeds"
        )


if __name__ == "__main__":
    main()
