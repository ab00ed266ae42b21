"""One replica of the torchft 0.2.0 baseline (not run by hand: bench/goodput.py starts it).

torchft's own recipe (its ``train_ddp.py``), on the same `Job` as the other systems
(``bench/jobs.py``): a replica group of one process, ``torchft.Manager`` with a
``torchft.ProcessGroupGloo`` and the lighthouse given by ``--lighthouse``; the gradients
averaged over the replicas in the step's quorum by ``manager.allreduce`` and the optimizer
stepped only when ``manager.should_commit()``. Not through ``torchft.DistributedDataParallel``:
in 0.2.0 its comm hook fails an ``assert fut._fut`` (torchft/ddp.py) when the all-reduce
fails, so the replicas that outlive a peer crash with it; ``manager.allreduce(...).wait()``
reports the error to the Manager instead (the step is not committed and is tried again with
the next quorum), which is what torchft means to do. A replica
that starts (or comes back) gets the live state from a peer through the Manager's
checkpoint transport (HTTP), as torchft does; no disk checkpoint.

As in torchft, each replica trains on its own shard: ``--batch`` samples per step whoever
else is up, so a step's batch is ``--batch`` times the replicas in its quorum, and the
samples of a replica that is down are not trained on. The Manager counts the batches
committed (``batches_committed``: one per replica per committed step); each commit is a
JSON line in ``--log``: ``{"t", "kind": "commit", "step", "batches", "participants"}``.
The replica hosts its own TCPStore (its group's store: a group of one process).

    torchft_lighthouse --min_replicas 1 --bind [::]:29510 &
    python bench/torchft_worker.py --replica 0 --lighthouse http://127.0.0.1:29510 --log r0.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo

import jobs
from unbroken.train.data import DataPlan

SLOTS = 8
"""Distinct data shards (a replica's is its id modulo this): more than ever run at once."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--replica", type=int, required=True, help="this replica's id (a new one for a replacement)")
    p.add_argument("--batch", type=int, required=True, help="samples per replica per step")
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address, http://HOST:PORT")
    p.add_argument("--log", required=True)
    p.add_argument("--timeout", type=float, default=5.0, help="collective timeout, seconds (train_ddp.py's)")
    p.add_argument("--manager-timeout", type=float, default=30.0, help="Manager's timeout, seconds (train_ddp.py's)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = jobs.JOBS[args.job]()
    out = open(args.log, "a", encoding="utf-8")  # noqa: SIM115

    def log(entry: dict[str, object]) -> None:
        out.write(json.dumps({"t": time.time(), "replica": args.replica, **entry}) + "\n")
        out.flush()

    model, optimizer = job.build()

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"goodput_{args.replica}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        timeout=timedelta(seconds=args.manager_timeout),
    )
    params = [q for q in model.parameters() if q.requires_grad]
    plan = DataPlan(job.num_samples, args.batch * SLOTS, job.seed)
    slot = args.replica % SLOTS
    log({"kind": "ready", "pid": os.getpid()})
    while manager.current_step() < job.num_steps:
        step = manager.current_step()
        inputs, targets = job.collate([job.dataset[i] for i in plan.indices(step, slot * args.batch, args.batch)])
        manager.start_quorum()  # what torchft.Optimizer.zero_grad does
        optimizer.zero_grad(set_to_none=True)
        job.loss(model(inputs), targets).backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params if q.grad is not None])
        manager.allreduce(flat).wait()  # the mean over the quorum; an error is the Manager's to handle
        offset = 0
        for q in params:
            assert q.grad is not None
            q.grad.copy_(flat[offset : offset + q.numel()].view_as(q))
            offset += q.numel()
        if manager.should_commit():
            optimizer.step()
            log({"kind": "commit", "step": manager.current_step(), "batches": manager.batches_committed(),
                 "participants": manager.num_participants()})  # fmt: skip
    out.close()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
