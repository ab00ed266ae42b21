"""One process training alone: the "ideal" reference of bench/hetero.py (not run by hand).

A plain single-process training loop over a `Job` of ``bench/jobs.py``: no process group,
no communication. Each step takes the whole global batch B (the samples `DataPlan` gives
step s), runs one forward/backward, idles as an emulated slower device would (``--throttle``,
the same `unbroken.train.throttle.Throttle` the nodes use: ``t * (1/F - 1)`` after a
forward/backward that took ``t``), and one optimizer step. Its samples/s is the throughput
of a device of that speed measured alone; the sum over a group's devices is the most that
group could do with perfect balance and free communication.

It runs ``--warmup`` steps, then as many as fit in ``--seconds``, writing a JSON line
``{"t", "kind": "commit", "step", "throttle"}`` after each step, like a node's commit log.
``--throttle`` may be repeated: the speeds are then measured one after the other, each from
a freshly built model and optimizer (one process start for all of them).

    python bench/alone_worker.py --job small --throttle 1 --throttle 0.25 --log alone.jsonl --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import jobs
from unbroken.train.data import DataPlan
from unbroken.train.throttle import parse_throttle


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--throttle", action="append", help="speed factor F (0 < F <= 1) or a schedule F,STEP:F,...; "
                   "repeatable: measured one after the other (default: 1)")  # fmt: skip
    p.add_argument("--log", required=True)
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    p.add_argument("--seconds", type=float, default=5.0, help="keep stepping this long after the warm-up")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = jobs.JOBS[args.job]()
    B = job.batch_size
    plan = DataPlan(job.num_samples, B, job.seed)
    with open(args.log, "a", encoding="utf-8") as out:
        for spec in args.throttle or ["1"]:
            throttle = parse_throttle(spec)
            model, optimizer = job.build()
            model.train()

            def log(entry: dict[str, object], spec: str = spec) -> None:
                out.write(json.dumps({"t": time.time(), "throttle": spec, **entry}) + "\n")
                out.flush()

            log({"kind": "ready"})
            timed_from = time.monotonic() if args.warmup <= 0 else None
            step = 0
            for step in range(job.num_steps):
                inputs, targets = job.collate([job.dataset[i] for i in plan.indices(step, 0, B)])
                optimizer.zero_grad(set_to_none=True)
                start = time.perf_counter()
                loss = job.loss(model(inputs), targets)
                loss.backward()
                throttle.stretch(time.perf_counter() - start, step)
                optimizer.step()
                log({"kind": "commit", "step": step + 1, "loss": float(loss.detach())})
                if step + 1 == args.warmup:
                    timed_from = time.monotonic()
                if timed_from is not None and time.monotonic() - timed_from >= args.seconds:
                    break
            log({"kind": "final", "step": step + 1})
    return 0


if __name__ == "__main__":
    sys.exit(main())
