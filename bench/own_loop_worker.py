"""The own-loop side of ``bench/own_loop.py``: the same job as ``bench/jobs.py`` (model,
optimizer, data and their order), trained by a plain loop through `unbroken.join`. Run by
``unbroken run bench/own_loop_worker.py -- MODEL``."""

from __future__ import annotations

import sys

from torch.nn import functional as F

import jobs
import unbroken


def main() -> None:
    job = getattr(jobs, sys.argv[1] if len(sys.argv) > 1 else "small")()
    model, opt = job.build()
    swarm = unbroken.join(job=job.name, batch_size=job.batch_size, steps=job.num_steps, seed=job.seed)
    model, opt = swarm.replicate(model, opt)
    for x, y in swarm.batches(job.dataset):
        swarm.backward(F.cross_entropy(model(x), y))
        swarm.step()


if __name__ == "__main__":
    main()
