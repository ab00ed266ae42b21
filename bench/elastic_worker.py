"""One worker of the torchrun-elastic baseline (not run by hand: bench/goodput.py starts
``python -m torch.distributed.run ... bench/elastic_worker.py`` once per node).

What a user runs today to survive failures: plain ``DistributedDataParallel`` on gloo under
``torchrun --nnodes=MIN:MAX --max-restarts=N``, resuming from its own checkpoint. When any
worker fails (or a node leaves or joins), torchrun's agents stop every worker, meet again
(c10d rendezvous) and start them all anew; each new worker loads the last checkpoint and
redoes the steps since. Rank 0 writes the checkpoint every ``--every`` steps (synchronously,
atomically: a temporary file renamed), on the disk every node shares here.

Same `Job` as the other systems (``bench/jobs.py``): step s consumes the samples of step s,
rank r of W computing the slice ``[r*B/W, (r+1)*B/W)``. Each commit is a JSON line in
``--commit-log`` (appended: one file per node across restarts): ``{"t", "kind": "commit", "step"}``;
``ready`` (with the pid, the world size and the step resumed from) when a worker starts;
``error`` when a collective raises, after which the worker exits 3 and torchrun restarts it.

    python -m torch.distributed.run --nnodes=1:4 --nproc-per-node=1 --max-restarts=100 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT bench/elastic_worker.py \\
        --job small --ckpt /tmp/ckpt --commit-log n1.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import jobs
from unbroken.train.data import DataPlan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--ckpt", required=True, help="checkpoint directory, shared by every node")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--commit-log", required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="process-group (collective) timeout, seconds")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = jobs.JOBS[args.job]()
    B = job.batch_size
    if B % world:
        raise SystemExit(f"batch {B} is not divisible by the world size {world}: pick a batch every size divides")
    out = open(args.commit_log, "a", encoding="utf-8")  # noqa: SIM115

    def log(entry: dict[str, object]) -> None:
        out.write(json.dumps({"t": time.time(), "rank": rank, **entry}) + "\n")
        out.flush()

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    model, optimizer = job.build()
    ckpt = Path(args.ckpt) / "ckpt.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    ddp = DistributedDataParallel(model)
    share = B // world
    plan = DataPlan(job.num_samples, B, job.seed)
    log({"kind": "ready", "pid": os.getpid(), "world": world, "step": start})
    step = start
    try:
        for step in range(start, job.num_steps):
            inputs, targets = job.collate([job.dataset[i] for i in plan.indices(step, rank * share, share)])
            optimizer.zero_grad(set_to_none=True)
            job.loss(ddp(inputs), targets).backward()
            optimizer.step()
            log({"kind": "commit", "step": step + 1, "world": world})
            if rank == 0 and (step + 1) % args.every == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
    except Exception as exc:  # a lost peer: exit, and torchrun restarts the group from the checkpoint
        log({"kind": "error", "step": step, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        out.close()
        os._exit(3)  # the process group's destructor could block on the dead peer
    out.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
