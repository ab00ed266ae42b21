"""Sharded zone (`unbroken.comm.sharded`) against plain FSDP2 (`fully_shard`), side by side.

    python bench/sharded.py --short            # 4 processes, about 2 minutes on 2 cores
    python bench/sharded.py --nodes 6 --steps 40 --repeats 3

Both sides train the same small transformer (pre-norm encoder layers, no float buffers) with
AdamW on the same global batch split evenly over ``--nodes`` processes on loopback gloo,
OMP_NUM_THREADS=1, one process per node:

- ours: `ShardedModel` over a `Layout` of ``--nodes`` members (uneven ranges when
  ``--weights`` says so), a buddy copy of every range, blocks = the embedding, each layer,
  the head. Then the same run again with one member SIGKILLed in the middle of step
  ``--kill-step`` (it kills itself after its forward, so the others are in a collective):
  the survivors see the collective fail, build a group of their own on a new store prefix,
  re-shard from the buddy copies (`unbroken.state.shards.plan`) and retry the step.
- FSDP2: `fully_shard` on every layer and the root over a gloo default group (the same
  processes' kind, a group of its own), the same model, data and optimizer; and the same
  kill, to say what becomes of it.

Printed: the steady step (median after ``--warmup``) of each and their ratio, each node's
peak RSS and the training state it holds against the whole state (parameters, gradients and
Adam's two moments: 16 bytes a parameter), the time from the kill to the survivors' next
committed step, steps lost, and whether the final model equals one process trained on the
whole batch (max abs difference). Then the same model through the whole runtime, real node
processes with a kill and ``--joins`` joins, each beside a cold start of the same node, the
median ratio and each side's phases printed (`bench/sharded_nodes.py`; 4 nodes in one zone
with ``--short``, 2 zones of 3 nodes otherwise; ``--no-nodes`` skips it): the
kill, the promises and ``steps_lost`` of the last line are that run's (the engine-level ones
under ``engine``). The last line is one JSON object with these figures.

``--device cuda`` (a GPU machine; refused where torch sees no CUDA device): each process
computes on ``cuda:RANK`` (modulo the GPUs there are). Ours places the zone as a node does
(`unbroken.comm.placement.place`): one GPU of one kind per process gives NCCL with the shards
on the device; several processes on one GPU (NCCL takes one rank per device) give gloo with
the shards on the CPU and each block staged to the GPU. The baseline is FSDP2 over NCCL with
the model on the device where every process has a GPU; on fewer GPUs it tries FSDP2 over
gloo on the device, and where gloo cannot, FSDP2 on the CPU (the table says which ran). A
kill under NCCL is seen when the victim's process ends (a node's coordinator sees its session
drop; NCCL itself would wait for its timeout): the bench's parent tells the survivors then.
The one-process reference runs on the same device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import resource
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.nn import functional as F

import sharded_nodes
from common import write_results
from sharded_nodes import CONTEXT, VOCAB, Model


def batch(step: int, lo: int, hi: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=g)[lo:hi]
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, step: int, lo: int, hi: int, size: int, device: str = "cpu") -> torch.Tensor:
    x, y = (t.to(device) for t in batch(step, lo, hi, size))
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * ((hi - lo) / size)


def device_of(rank: int, kind: str) -> torch.device:
    """Where ``rank`` computes: ``cuda:RANK`` modulo the GPUs there are, or the CPU."""
    return torch.device("cuda", rank % torch.cuda.device_count()) if kind == "cuda" else torch.device("cpu")


def placement_of(rank: int, n: int, kind: str) -> Any:
    """Where ``rank`` of ``n`` keeps its shards and computes, as a node's zone places itself
    (`unbroken.comm.placement.place`; every member on this machine)."""
    from unbroken.comm.placement import member_device, place

    members = {f"n{i}": member_device(device_of(i, kind)) for i in range(n)}
    return place(members, f"n{rank}", device_of(rank, kind))


def synchronize(device: torch.device) -> None:
    """A step's time includes its device work, not only its queueing (both sides alike)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_peak_mb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.0)


def gloo(store: Any, prefix: str, rank: int, size: int) -> Any:
    from torch._C._distributed_c10d import ProcessGroupGloo
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=30)
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, opts)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def slices(n: int, size: int) -> list[tuple[int, int]]:
    cuts = [size * i // n for i in range(n + 1)]
    return list(itertools.pairwise(cuts))


def worker(target: Any, rank: int, n: int, port: int, args: argparse.Namespace, q: Any, victim: int) -> None:
    """Run ``target`` and leave at once once its report is on its way: tearing down gloo
    groups at interpreter exit can abort the process before the queue is flushed."""
    import warnings

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    try:
        target(rank, n, port, args, q, victim)
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def ours(rank: int, n: int, port: int, args: argparse.Namespace, q: Any, victim: int) -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from unbroken.comm.group import EpochScope
    from unbroken.comm.nccl import build_nccl, nccl_environment
    from unbroken.comm.placement import Backend
    from unbroken.comm.sharded import ShardedModel
    from unbroken.errors import CollectiveFailed, EpochAborted
    from unbroken.state.shards import layout_for, plan

    torch.set_num_threads(1)
    try:
        device = device_of(rank, args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            nccl_environment()  # as a node does at its start
        store = TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
        members = [f"n{i}" for i in range(n)]
        me = members[rank]
        placement = placement_of(rank, n, args.device)
        weights = [int(w) for w in args.weights.split(",")] if args.weights else [1] * n
        model = Model(args.dim, args.layers)
        numel = sum(p.numel() for p in model.parameters())
        layout = layout_for(numel, dict(zip(members, weights, strict=True)))
        epoch = 0

        aborted = {"epoch": -1}

        def watch() -> None:
            # What the coordinator's urgent order does for a node: the first survivor to see a
            # collective fail tells the others, who leave whatever collective they wait in. A
            # thread watches the store, as a node's control thread its session: a wait checks a
            # flag (asking the store at every check cost 28 ms a step).
            watcher = TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=60))
            while True:
                e = epoch
                if aborted["epoch"] != e and watcher.check([f"abort/{e}"]):
                    aborted["epoch"] = e
                    scope.wake.set()
                time.sleep(0.02)

        def abort() -> EpochAborted | None:
            return EpochAborted("a peer failed") if aborted["epoch"] == epoch else None

        scope = EpochScope(threading.Event(), abort, 30.0)
        threading.Thread(target=watch, name="abort-watch", daemon=True).start()
        ranks = {m: i for i, m in enumerate(members)}

        def zone_group(over: Any) -> Any:
            """The zone's group for its gathers and sums: ``over`` (gloo), or NCCL built over it."""
            if placement.backend is not Backend.NCCL:
                return over
            return build_nccl(over, f"nccl{epoch}", ranks[me], len(ranks), device, scope)[0]

        world = gloo(store, "e0/", rank, n)
        zone = ShardedModel(
            model, layout, me, ranks, zone_group(world), scope, adamw,
            blocks=[model.embed, *model.layers, model.head], placement=placement,
        )  # fmt: skip
        held = sum(h.end - h.start for h in zone.holdings)
        commits: list[float] = []
        times: list[float] = []
        step = 0
        graves: list[Any] = []
        while step < args.steps:
            t = time.perf_counter()
            lo, hi = slices(len(members), args.batch)[members.index(me)]
            try:
                loss = loss_of(model, step, lo, hi, args.batch, str(device))
                if rank == victim and step == args.kill_step:
                    q.put(("kill", rank, time.time()))
                    q.close()
                    q.join_thread()  # the report is out before the process dies
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                zone.finish_backward()
                zone.step()
                synchronize(device)
            except (CollectiveFailed, EpochAborted):
                store.set(f"abort/{epoch}", "1")
                zone.abandon()
                lost = f"n{victim}"
                p = plan(zone.layout, lost={lost})
                members = [m for m in members if m != lost]
                epoch += 1
                ranks = {m: i for i, m in enumerate(members)}
                group = gloo(store, f"e{epoch}/", ranks[me], len(members))
                graves.append(zone.reshard(p, me, ranks, group, scope))  # dropped, it would wait 30 s
                if placement.backend is Backend.NCCL:  # the transfers ran on gloo; the step on NCCL
                    graves.append(zone.regroup(ranks, zone_group(group), scope))
                graves.append(world)
                world = group
                continue  # the same step, the same samples
            commits.append(time.time())
            times.append(time.perf_counter() - t)
            step += 1
        # As numpy arrays: a tensor on a queue travels as a shared-memory handle, which the
        # parent cannot open once this process has exited.
        state = {k: v.numpy() for k, v in zone.full_state().items()}
        keep = rank == (1 if victim == 0 else 0)
        report = {
            "times": times, "commits": commits, "rss_mb": rss_mb(), "held": held, "numel": numel,
            "gpu_peak_mb": gpu_peak_mb(device), "placement": placement.reason,
        }  # fmt: skip
        q.put(("done", rank, report | {"state": state if keep else None}))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))


def fsdp2(rank: int, n: int, port: int, args: argparse.Namespace, q: Any, victim: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    try:
        # args.baseline: "nccl" (a GPU each), "gloo@cuda" (gloo on the device), "gloo" (the CPU)
        device = device_of(rank, "cuda") if args.baseline != "gloo" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if args.baseline == "nccl" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=n, timeout=timedelta(seconds=30), device_id=device if args.baseline == "nccl" else None,
        )  # fmt: skip
        mesh = init_device_mesh(device.type, (n,))  # not the default's guess: a CPU run on a GPU machine too
        model = Model(args.dim, args.layers).to(device)
        for layer in [model.embed, *model.layers, model.head]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = adamw([{"params": list(model.parameters())}])
        times: list[float] = []
        lo, hi = slices(n, args.batch)[rank]
        for step in range(args.steps):
            t = time.perf_counter()
            if rank == victim and step == args.kill_step:
                q.put(("kill", rank, time.time()))
                q.close()
                q.join_thread()  # the report is out before the process dies
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                loss_of(model, step, lo, hi, args.batch, str(device)).backward()
                opt.step()
                opt.zero_grad()
                synchronize(device)
            except Exception as exc:
                q.put(("died", rank, {"at": time.time(), "error": f"{type(exc).__name__}: {str(exc)[:160]}"}))
                return
            times.append(time.perf_counter() - t)
        q.put(("done", rank, {"times": times, "rss_mb": rss_mb(), "gpu_peak_mb": gpu_peak_mb(device)}))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))


BASELINES = {
    "nccl": "FSDP2 over NCCL, the model on the GPUs (one a process)",
    "gloo@cuda": "FSDP2 over gloo, the model on the GPU (fewer GPUs than processes: NCCL takes one rank per device)",
    "gloo": "FSDP2 over gloo on the CPU",
}


def baseline_kind(args: argparse.Namespace) -> str:
    """FSDP2's run: NCCL where every process has a GPU of its own, else gloo (on the GPU)."""
    import torch.distributed as dist

    if args.device != "cuda":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= args.nodes and dist.is_nccl_available() else "gloo@cuda"


def describe_device(args: argparse.Namespace) -> str:
    if args.device != "cuda":
        return f"CPU ({os.cpu_count()} cores), {args.nodes} processes"
    gpus = torch.cuda.device_count()
    return f"{gpus} x {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}), {args.nodes} processes"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def baseline(args: argparse.Namespace) -> dict[str, Any]:
    """FSDP2's steady run; where gloo on the GPU cannot run it (an op without CUDA support),
    on the CPU instead (``args.baseline`` then says so)."""
    if args.baseline != "gloo@cuda":
        return launch(fsdp2, args, victim=-1)
    try:
        b = launch(fsdp2, args, victim=-1, timeout=120)
        why = "" if len(b["done"]) == args.nodes else "not every process finished in 120 s"
    except RuntimeError as exc:
        why = str(exc).strip().splitlines()[-1][:160]
    if not why:
        return b
    print(f"FSDP2 over gloo on the GPU failed ({why}): FSDP2 on the CPU instead", file=sys.stderr, flush=True)
    args.baseline = "gloo"
    return launch(fsdp2, args, victim=-1)


def tell_survivors(victim: Any, port: int, n: int) -> None:
    """What a node's coordinator does when a member's session drops: once the victim's process
    has ended, the survivors are told to leave the step (`abort/0`, the epoch they are in).
    Under gloo they have seen the collective fail first; under NCCL nothing else tells them."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    victim.join()
    try:
        TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=10)).set("abort/0", "1")
    except RuntimeError as exc:  # the survivors finished and took their store with them
        print(f"telling the survivors of the kill: {exc}", file=sys.stderr, flush=True)


def launch(target: Any, args: argparse.Namespace, victim: int, timeout: float | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(target, r, args.nodes, port, args, q, victim)) for r in range(args.nodes)]
    for p in procs:
        p.start()
    out: dict[str, Any] = {"done": {}, "kill": None, "died": {}}
    expected = args.nodes - (1 if victim >= 0 else 0)
    deadline = time.monotonic() + (timeout or args.timeout)
    try:
        while len(out["done"]) + len(out["died"]) < expected and time.monotonic() < deadline:
            try:
                kind, rank, payload = q.get(timeout=1.0)
            except Exception:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if kind == "kill":
                out["kill"] = payload
                if target is ours:
                    threading.Thread(target=tell_survivors, args=(procs[rank], port, args.nodes), daemon=True).start()
            else:
                out[kind][rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def reference(args: argparse.Namespace, parts: int = 1, placement: Any = None) -> dict[str, torch.Tensor]:
    """One process on the whole batch; ``parts`` > 1 sums each step's gradient over that many
    slices, as the nodes do: how far that lands from ``parts=1`` is what float summation
    order alone does to this model under AdamW. ``placement`` (ours' `Placement`, staged):
    the parameters and AdamW live on its shards' device and each slice computes on its
    compute device, its gradient copied back and summed there, as ours does; so the spread
    also holds what stepping on another device than the whole-batch run does to the bits."""
    device = device_of(0, args.device)
    model = Model(args.dim, args.layers).to(device)
    if placement is None or not placement.staged:
        opt = adamw([{"params": list(model.parameters())}])
        for step in range(args.steps):
            opt.zero_grad()
            for lo, hi in slices(parts, args.batch):
                loss_of(model, step, lo, hi, args.batch, str(device)).backward()
            opt.step()
        return {k: v.detach().cpu() for k, v in model.named_parameters()}
    named = dict(model.named_parameters())
    held = {k: v.detach().to(placement.shards, copy=True) for k, v in named.items()}
    opt = adamw([{"params": list(held.values())}])
    for step in range(args.steps):
        opt.zero_grad()
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(held[k])
        for lo, hi in slices(parts, args.batch):
            model.zero_grad()
            loss_of(model, step, lo, hi, args.batch, str(device)).backward()
            for k, p in named.items():
                assert p.grad is not None
                grad = p.grad.to(placement.shards, copy=True)
                held[k].grad = grad if held[k].grad is None else held[k].grad.add_(grad)
        opt.step()
    return {k: v.detach().cpu() for k, v in held.items()}


def describe_reference(args: argparse.Namespace, placement: Any) -> str:
    """Where the one-process reference ran, and its float-order spread."""
    device = device_of(0, args.device)
    spread = f"summed in {args.nodes} slices"
    if placement.staged:
        spread += f", AdamW on the {placement.shards.type.upper()} as ours"
    return f"on {device}, the whole batch; float-order spread: {spread}"


def nodes_run(
    args: argparse.Namespace, rows: list[tuple[str, str]], figures: dict[str, Any], engine: dict[str, Any]
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The same model through real node processes (`bench/sharded_nodes.py`): its rows and figures added."""
    print("sharded nodes: the reference run ...", file=sys.stderr, flush=True)
    zones = 1 if args.short else 2  # the full run: 2 zones of 3 nodes, each zone a sharded replica
    n = argparse.Namespace(
        nodes=args.nodes if args.short else 6, steps=args.node_steps, kill_step=args.kill_step,
        join_step=args.join_step, dim=args.dim, layers=args.layers, batch=args.batch, timeout=args.timeout,
        zones=zones, device=args.device, joins=args.joins,
    )  # fmt: skip
    node_ref, node_order = sharded_nodes.reference_model(sharded_nodes.job(sharded_nodes.job_args(n)), n.nodes)
    print("sharded nodes: the zone ...", file=sys.stderr, flush=True)
    r = sharded_nodes.run(n, node_ref, node_order)
    join_ratio = r["join_over_cold_start"]
    joins = r["joins"]
    medians = {
        what: tuple(statistics.median(j[side][what] for j in joins) for side in ("phases", "cold_phases"))
        for what in joins[0]["phases"]
    }
    each = ", ".join(f"{j['join_s'] / j['cold_start_s']:.2f}x" for j in joins)
    loads = ", ".join(j["load"].split(" on ")[0].split(" / ")[0] for j in joins)
    peaks, held_mb = r["peak_rss_mb"], r["held_state_mb_largest"]
    rows += [
        ("real nodes: SIGKILL -> next commit", f"{r['kill_to_next_commit_s']:.3f} s"),
        ("real nodes: promises (commit logs), buddies agree", f"{not r['promises']}, {r['buddies_agree']}"),
        ("real nodes: final model vs one process", f"{r['max_abs_diff']:.2e} (float order {node_order:.2e})"),
        (
            f"real nodes: join spawn -> first commit / cold start (median of {len(joins)}, load {loads})",
            f"{r['join_s']:.2f} / {r['cold_start_s']:.2f} s = {join_ratio:.2f}x "
            f"(each: {each})",
        ),
        (
            "real nodes: join phases, joiner / cold start (median s)",
            "; ".join(f"{what} {x:.2f} / {y:.2f}" for what, (x, y) in medians.items()),
        ),
        ("real nodes: peak RSS per node", ", ".join(f"{k} {v:.0f} MB" for k, v in sorted(peaks.items()))),
        ("real nodes: state held by the largest holder / whole", f"{held_mb:.1f} / {r['whole_state_mb']:.1f} MB"),
    ]  # fmt: skip
    figures |= {
        "kill_to_next_commit_s": round(r["kill_to_next_commit_s"], 4),
        "steps_lost": args.node_steps - r["steps_committed"],
        "promises_kept": bool(r["promises_kept"] and engine["promises_kept"]),
        "join_over_cold_start": round(join_ratio, 3),
        "join_phases_s": {what: {"joiner": round(x, 3), "cold_start": round(y, 3)} for what, (x, y) in medians.items()},
        "nodes_run_layout": f"{n.nodes} nodes in {zones} zone(s)",
        "nodes_run": {k: v for k, v in r.items() if k != "codes"},
        "engine": engine,
    }
    return rows, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--weights", default="", help="memory offered per node, e.g. 4,2,2,1 (default: equal)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--short", action="store_true", help="4 nodes, 20 steps, one repeat")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--node-steps", type=int, default=100, help="steps of the run through real nodes")
    parser.add_argument("--joins", type=int, default=3, help="joins measured in that run (the median is the figure)")
    parser.add_argument("--join-step", type=int, default=22, help="step at which a node joins that run")
    parser.add_argument("--no-nodes", action="store_true", help="skip the run through real nodes")
    args = parser.parse_args()
    if args.device not in ("cpu", "cuda"):
        sys.exit(f"bench/sharded.py: --device {args.device}: use cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            f"bench/sharded.py: --device cuda, but this torch ({torch.__version__}) sees no CUDA device: run it on a "
            "GPU machine with a CUDA build of torch, or with --device cpu"
        )
    args.baseline = baseline_kind(args)
    if args.short:
        args.nodes, args.steps, args.repeats, args.kill_step = 4, 20, 1, 10
    torch.set_num_threads(1)
    placement = placement_of(0, args.nodes, args.device)  # what ours will run (printed from its report too)
    ref = reference(args)
    sliced = reference(args, args.nodes, placement)
    order_only = max(float((v - sliced[k]).abs().max()) for k, v in ref.items())
    numel = sum(v.numel() for v in ref.values())
    ours_steps: list[float] = []
    theirs_steps: list[float] = []
    rss_ours: list[float] = []
    rss_theirs: list[float] = []
    held: list[int] = []
    gpu_ours: list[float] = []
    gpu_theirs: list[float] = []
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}: ours ...", file=sys.stderr, flush=True)
        a = launch(ours, args, victim=-1)
        print(f"repeat {r + 1}/{args.repeats}: FSDP2 ({args.baseline}) ...", file=sys.stderr, flush=True)
        b = baseline(args)
        for d in a["done"].values():
            ours_steps += d["times"][args.warmup :]
            rss_ours.append(d["rss_mb"])
            gpu_ours.append(d["gpu_peak_mb"])
            held.append(d["held"])
        for d in b["done"].values():
            theirs_steps += d["times"][args.warmup :]
            rss_theirs.append(d["rss_mb"])
            gpu_theirs.append(d["gpu_peak_mb"])
    full = a["done"][0]["state"]
    diff = max(float((torch.from_numpy(full[k]) - v).abs().max()) for k, v in ref.items())
    print("kill: ours ...", file=sys.stderr, flush=True)
    victim = 2
    k = launch(ours, args, victim=victim)
    killed_at = k["kill"]
    after = [min(c for c in d["commits"] if c > killed_at) for d in k["done"].values()]
    kill_to_commit = max(after) - killed_at
    survivors_state = next(d["state"] for d in k["done"].values() if d["state"] is not None)
    kill_diff = max(float((torch.from_numpy(survivors_state[key]) - v).abs().max()) for key, v in ref.items())
    committed = min(len(d["commits"]) for d in k["done"].values())
    print("kill: FSDP2 ...", file=sys.stderr, flush=True)
    kf = launch(fsdp2, args, victim=victim, timeout=90)  # NCCL survivors hang until its 30 s timeout
    died = [d["at"] - kf["kill"] for d in kf["died"].values()] if kf["kill"] else []
    state_bytes = 16 * numel
    held_bytes = 12 * max(held)  # parameters and two moments of everything it holds (grads: 4 more a held element)
    ours_med, theirs_med = statistics.median(ours_steps), statistics.median(theirs_steps)
    ran = a["done"][0]["placement"]
    rows = [
        ("device", describe_device(args)),
        ("ours: where the shards live, which backend", ran),
        ("FSDP2 baseline", BASELINES[args.baseline]),
        ("one-process reference", describe_reference(args, placement)),
        ("parameters", f"{numel:,}"),
        ("whole training state (16 B/param)", f"{state_bytes / 2**20:.1f} MB"),
        ("state held by the largest holder (params+moments+grads)", f"{16 * max(held) / 2**20:.1f} MB"),
        ("whole state / largest holder's", f"{state_bytes / (16 * max(held)):.2f}x"),
        (
            "steady step ours / FSDP2",
            f"{ours_med * 1e3:.1f} / {theirs_med * 1e3:.1f} ms = {ours_med / theirs_med:.2f}x",
        ),
        ("peak RSS per node ours / FSDP2", f"{max(rss_ours):.0f} / {max(rss_theirs):.0f} MB"),
        ("peak GPU memory per node ours / FSDP2", f"{max(gpu_ours):.0f} / {max(gpu_theirs):.0f} MB"),
        ("one process, summed in node slices (stepped as ours) vs whole", f"{order_only:.2e}"),
        ("final model vs one process (max abs diff)", f"{diff:.2e}"),
        ("SIGKILL -> survivors' next commit", f"{kill_to_commit:.3f} s"),
        ("steps committed after the kill run / asked", f"{committed} / {args.steps}"),
        ("with the kill: final model vs one process", f"{kill_diff:.2e}"),
        (
            "FSDP2 under the same kill",
            (f"every survivor raised within {max(died):.3f} s: " + next(iter(kf["died"].values()))["error"][:80])
            if died
            else "did not report",
        ),
    ]
    engine = {
        "kill_to_next_commit_s": round(kill_to_commit, 4),
        "steps_lost": args.steps - committed,
        "promises_kept": max(kill_diff, diff) <= 2 * order_only + 1e-6 and committed == args.steps,
        "max_abs_diff_vs_one_process": {"ours": diff, "ours_with_kill": kill_diff, "float_order": order_only},
    }
    figures: dict[str, Any] = {
        "state_over_node_budget": round(state_bytes / (16 * max(held)), 3),
        "nodes": args.nodes,
        **engine,
        "step_vs_fsdp2": round(ours_med / theirs_med, 3),
        "peak_rss_mb": {"ours": round(max(rss_ours)), "fsdp2": round(max(rss_theirs))},
        "peak_gpu_mb": {"ours": round(max(gpu_ours)), "fsdp2": round(max(gpu_theirs))},
        "device": describe_device(args),
        "placement": ran,
        "baseline": BASELINES[args.baseline],
        "reference": describe_reference(args, placement),
        "held_bytes_largest": held_bytes,
        "fsdp2_on_kill": "raised" if died else "no report",
    }
    if not args.no_nodes:
        try:
            rows, figures = nodes_run(args, rows, figures, engine)
        except Exception as exc:  # the engine's figures are still printed, with what failed
            traceback.print_exc()
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            rows.append(("real nodes: FAILED", error))
            figures |= {"nodes_run_error": error, "promises_kept": False, "engine": engine}
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    write_results(series={"rows": rows, "figures": figures})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
