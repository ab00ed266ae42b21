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

The global batch is ``--batch`` samples a step, whoever is up, as in the other systems (not
torchft's default, where each replica trains a fixed batch on its own shard and a step's batch
grows with the replicas): once the step's quorum is known, the participant of rank r of P
trains the r-th of P parts of the step's ``--batch`` samples (`unbroken.train.data.DataPlan`,
the plan the others use; the first ``B % P`` parts one sample larger), and
``manager.allreduce``'s mean over the participants is the batch's mean gradient (exactly so
where P divides B, as bench/goodput.py's B=120 does for up to 5 replicas). A replica that
heals this step is no participant: it computes nothing and joins the all-reduce with zeros
(torchft's own rule). Its step counter is the committed steps, so a failed step is tried
again with the same samples. Each commit is a JSON line in ``--log``:
``{"t", "kind": "commit", "step", "samples", "participants"}``.
The replica hosts its own TCPStore (its group's store: a group of one process).

    torchft_lighthouse --min_replicas 1 --bind [::]:29510 &
    python bench/torchft_worker.py --replica 0 --batch 120 --lighthouse http://127.0.0.1:29510 --log r0.jsonl
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--replica", type=int, required=True, help="this replica's id (a new one for a replacement)")
    p.add_argument("--batch", type=int, required=True, help="global batch: samples per step across the quorum")
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
    numel = sum(q.numel() for q in params)
    plan = DataPlan(job.num_samples, args.batch, job.seed)
    log({"kind": "ready", "pid": os.getpid()})
    while manager.current_step() < job.num_steps:
        step = manager.current_step()
        manager.start_quorum()  # what torchft.Optimizer.zero_grad does
        optimizer.zero_grad(set_to_none=True)
        rank, participants = manager.participating_rank(), manager.num_participants()
        if rank is None or participants == 0:
            flat = torch.zeros(numel)  # healing: torchft zeroes its part of the all-reduce
        else:
            start, count = share(args.batch, participants, rank)
            inputs, targets = job.collate([job.dataset[i] for i in plan.indices(step, start, count)])
            job.loss(model(inputs), targets).backward()
            flat = torch.cat([q.grad.reshape(-1) for q in params if q.grad is not None])
        manager.allreduce(flat).wait()  # the mean over the quorum; an error is the Manager's to handle
        offset = 0
        for q in params:
            q.grad = flat[offset : offset + q.numel()].view_as(q).clone()
            offset += q.numel()
        if manager.should_commit():
            optimizer.step()
            log({"kind": "commit", "step": manager.current_step(), "samples": args.batch,
                 "participants": manager.num_participants()})  # fmt: skip
    out.close()
    manager.shutdown(wait=False)
    return 0


def share(batch: int, parts: int, rank: int) -> tuple[int, int]:
    """Where rank ``rank``'s part of ``batch`` samples split in ``parts`` starts, and its size
    (the first ``batch % parts`` parts one sample larger)."""
    small, extra = divmod(batch, parts)
    return rank * small + min(rank, extra), small + (rank < extra)


if __name__ == "__main__":
    sys.exit(main())
