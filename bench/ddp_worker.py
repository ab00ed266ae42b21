"""One rank of the plain-DDP baseline (not run by hand: `common.run_ddp` starts it).

Plain ``torch.nn.parallel.DistributedDataParallel`` on gloo/CPU, the same `Job` as the
unbroken nodes (``bench/jobs.py``): same model, optimizer, data and global batch B; rank r
of W computes the slice ``[r*B/W, (r+1)*B/W)`` of step s's samples (the same samples
unbroken's DataPlan assigns), then one forward/backward (DDP all-reduces the gradients
during backward) and one optimizer step.

With ``--throttle F`` (or a schedule ``F,STEP:F,...``, as a node's ``--throttle``) the rank
emulates a device F times as fast, the way an unbroken node does (`unbroken.train.throttle`):
forward/backward run under ``ddp.no_sync()`` (no all-reduce hooked into backward, so its
time is the compute alone), that time ``t`` is measured and the rank idles ``t * (1/F - 1)``
more; then the gradients are flattened into one tensor, summed with an explicit
``dist.all_reduce``, divided by the world size, copied back, and ``optimizer.step()`` runs.
So the idle lands on compute only, never on communication, as on a slower device. The
split stays equal (B/W per rank): the faster ranks wait for the slowest at the all-reduce.
Without ``--throttle`` the rank runs plain DDP as above (all-reduce during backward).
With ``--keep-freed-memory`` the process's malloc keeps the memory it frees, as an unbroken
node's does (`unbroken.train.memory`): how much of a difference is the allocator's.

It writes JSON lines like a node's commit log: ``{"t", "kind": "commit", "step"}`` after
each step, ``{"kind": "fault"}`` before an injected fault fires, and ``{"kind": "error"}``
when a collective raises (after which the rank exits with status 3: plain DDP cannot go
on without the lost peer).

    python bench/ddp_worker.py --job small --rank 0 --world 3 --store-port P --log r0.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import jobs
from unbroken.train.data import DataPlan
from unbroken.train.memory import keep_freed_memory
from unbroken.train.throttle import parse_throttle


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--job", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store-host", default="127.0.0.1")
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--timeout", type=float, default=60.0, help="process-group (collective) timeout, seconds")
    p.add_argument("--fault", default="", help="kill@STEP or stop@STEP: signal self before STEP's backward")
    p.add_argument("--throttle", default="", help="emulate a slower device: F or F,STEP:F,... (see above)")
    p.add_argument("--keep-freed-memory", action="store_true", help="malloc as an unbroken node's (see above)")
    args = p.parse_args()
    if args.keep_freed_memory and not keep_freed_memory(default=True):
        p.error("--keep-freed-memory: not in force here (glibc only, and not with UNBROKEN_MALLOC=system)")
    throttle = parse_throttle(args.throttle) if args.throttle else None
    if throttle is not None and args.fault:
        p.error("--fault is not supported together with --throttle")

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = jobs.JOBS[args.job]()
    out = open(args.log, "a", encoding="utf-8")  # noqa: SIM115

    def log(entry: dict[str, object]) -> None:
        out.write(json.dumps({"t": time.time(), "rank": args.rank, **entry}) + "\n")
        out.flush()

    fault_sig, fault_step = None, -1
    if args.fault:
        name, _, step = args.fault.partition("@")
        fault_sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[name]
        fault_step = int(step)

    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore(args.store_host, args.store_port, args.world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    model, optimizer = job.build()
    ddp = DistributedDataParallel(model)
    B = job.batch_size
    if B % args.world:
        raise SystemExit(f"batch {B} is not divisible by world {args.world}")
    share = B // args.world
    plan = DataPlan(job.num_samples, B, job.seed)
    log({"kind": "ready"})
    step = 0
    try:
        for step in range(job.num_steps):
            indices = plan.indices(step, args.rank * share, share)
            inputs, targets = job.collate([job.dataset[i] for i in indices])
            optimizer.zero_grad(set_to_none=True)
            if throttle is not None:
                loss = _throttled_step(ddp, job, inputs, targets, throttle, step, args.world)
                optimizer.step()
                log({"kind": "commit", "step": step + 1, "loss": float(loss.detach())})
                continue
            loss = job.loss(ddp(inputs), targets)
            if step == fault_step and fault_sig is not None:
                log({"kind": "fault", "signal": args.fault.split("@")[0], "step": step, "pid": os.getpid()})
                os.kill(os.getpid(), fault_sig)
            loss.backward()
            optimizer.step()
            log({"kind": "commit", "step": step + 1, "loss": float(loss.detach())})
    except Exception as exc:  # plain DDP: a lost peer ends the run
        log({"kind": "error", "step": step, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        out.close()
        os._exit(3)  # the process group's destructor could block on the dead peer
    log({"kind": "final", "step": job.num_steps})
    out.close()
    dist.destroy_process_group()
    return 0


def _throttled_step(ddp, job, inputs, targets, throttle, step, world):  # type: ignore[no-untyped-def]
    """Forward/backward without DDP's hooks, idle as the emulated device, then one explicit all-reduce."""
    with ddp.no_sync():
        start = time.perf_counter()
        loss = job.loss(ddp(inputs), targets)
        loss.backward()
        throttle.stretch(time.perf_counter() - start, step)
    params = [q for q in ddp.parameters() if q.requires_grad]
    for q in params:
        if q.grad is None:
            q.grad = torch.zeros_like(q)
    flat = torch.cat([q.grad.reshape(-1) for q in params])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for q in params:
        n = q.numel()
        q.grad.copy_(flat[offset : offset + n].view_as(q))
        offset += n
    return loss


if __name__ == "__main__":
    sys.exit(main())
