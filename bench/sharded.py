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
processes with a kill and a join (`bench/sharded_nodes.py`; 4 nodes in one zone with
``--short``, 2 zones of 3 nodes otherwise; ``--no-nodes`` skips it): the
kill, the promises and ``steps_lost`` of the last line are that run's (the engine-level ones
under ``engine``). The last line is one JSON object with these figures. This version keeps
shards on the CPU: ``--device cuda`` is refused (no NCCL path yet).
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


def loss_of(model: nn.Module, step: int, lo: int, hi: int, size: int) -> torch.Tensor:
    x, y = batch(step, lo, hi, size)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * ((hi - lo) / size)


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
    from unbroken.comm.sharded import ShardedModel
    from unbroken.errors import CollectiveFailed, EpochAborted
    from unbroken.state.shards import layout_for, plan

    torch.set_num_threads(1)
    try:
        store = TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
        members = [f"n{i}" for i in range(n)]
        me = members[rank]
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
        zone = ShardedModel(
            model, layout, me, ranks, gloo(store, "e0/", rank, n), scope, adamw,
            blocks=[model.embed, *model.layers, model.head],
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
                loss = loss_of(model, step, lo, hi, args.batch)
                if rank == victim and step == args.kill_step:
                    q.put(("kill", rank, time.time()))
                    q.close()
                    q.join_thread()  # the report is out before the process dies
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                zone.finish_backward()
                zone.step()
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
                continue  # the same step, the same samples
            commits.append(time.time())
            times.append(time.perf_counter() - t)
            step += 1
        # As numpy arrays: a tensor on a queue travels as a shared-memory handle, which the
        # parent cannot open once this process has exited.
        state = {k: v.numpy() for k, v in zone.full_state().items()}
        keep = rank == (1 if victim == 0 else 0)
        report = {"times": times, "commits": commits, "rss_mb": rss_mb(), "held": held, "numel": numel}
        q.put(("done", rank, report | {"state": state if keep else None}))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))


def fsdp2(rank: int, n: int, port: int, args: argparse.Namespace, q: Any, victim: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timedelta(seconds=30)
        )
        model = Model(args.dim, args.layers)
        for layer in [model.embed, *model.layers, model.head]:
            fully_shard(layer)
        fully_shard(model)
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
                loss_of(model, step, lo, hi, args.batch).backward()
                opt.step()
                opt.zero_grad()
            except Exception as exc:
                q.put(("died", rank, {"at": time.time(), "error": f"{type(exc).__name__}: {str(exc)[:160]}"}))
                return
            times.append(time.perf_counter() - t)
        q.put(("done", rank, {"times": times, "rss_mb": rss_mb()}))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(target: Any, args: argparse.Namespace, victim: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(target, r, args.nodes, port, args, q, victim)) for r in range(args.nodes)]
    for p in procs:
        p.start()
    out: dict[str, Any] = {"done": {}, "kill": None, "died": {}}
    expected = args.nodes - (1 if victim >= 0 else 0)
    deadline = time.monotonic() + args.timeout
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
            else:
                out[kind][rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def reference(args: argparse.Namespace, parts: int = 1) -> dict[str, torch.Tensor]:
    """One process on the whole batch; ``parts`` > 1 sums each step's gradient over that many
    slices, as the nodes do: how far that lands from ``parts=1`` is what float summation
    order alone does to this model under AdamW."""
    model = Model(args.dim, args.layers)
    opt = adamw([{"params": list(model.parameters())}])
    for step in range(args.steps):
        opt.zero_grad()
        for lo, hi in slices(parts, args.batch):
            loss_of(model, step, lo, hi, args.batch).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


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
    parser.add_argument("--node-steps", type=int, default=40, help="steps of the run through real nodes")
    parser.add_argument("--join-step", type=int, default=22, help="step at which a node joins that run")
    parser.add_argument("--no-nodes", action="store_true", help="skip the run through real nodes")
    args = parser.parse_args()
    if args.device != "cpu":
        sys.exit("bench/sharded.py: this version keeps shards on the CPU (gloo); --device cuda has no NCCL path yet")
    if args.short:
        args.nodes, args.steps, args.repeats, args.kill_step = 4, 20, 1, 10
    torch.set_num_threads(1)
    ref = reference(args)
    sliced = reference(args, args.nodes)
    order_only = max(float((v - sliced[k]).abs().max()) for k, v in ref.items())
    numel = sum(v.numel() for v in ref.values())
    ours_steps: list[float] = []
    theirs_steps: list[float] = []
    rss_ours: list[float] = []
    rss_theirs: list[float] = []
    held: list[int] = []
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}: ours ...", file=sys.stderr, flush=True)
        a = launch(ours, args, victim=-1)
        print(f"repeat {r + 1}/{args.repeats}: FSDP2 ...", file=sys.stderr, flush=True)
        b = launch(fsdp2, args, victim=-1)
        for d in a["done"].values():
            ours_steps += d["times"][args.warmup :]
            rss_ours.append(d["rss_mb"])
            held.append(d["held"])
        for d in b["done"].values():
            theirs_steps += d["times"][args.warmup :]
            rss_theirs.append(d["rss_mb"])
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
    kf = launch(fsdp2, args, victim=victim)
    died = [d["at"] - kf["kill"] for d in kf["died"].values()] if kf["kill"] else []
    state_bytes = 16 * numel
    held_bytes = 12 * max(held)  # parameters and two moments of everything it holds (grads: 4 more a held element)
    ours_med, theirs_med = statistics.median(ours_steps), statistics.median(theirs_steps)
    rows = [
        ("parameters", f"{numel:,}"),
        ("whole training state (16 B/param)", f"{state_bytes / 2**20:.1f} MB"),
        ("state held by the largest holder (params+moments+grads)", f"{16 * max(held) / 2**20:.1f} MB"),
        ("whole state / largest holder's", f"{state_bytes / (16 * max(held)):.2f}x"),
        (
            "steady step ours / FSDP2",
            f"{ours_med * 1e3:.1f} / {theirs_med * 1e3:.1f} ms = {ours_med / theirs_med:.2f}x",
        ),
        ("peak RSS per node ours / FSDP2", f"{max(rss_ours):.0f} / {max(rss_theirs):.0f} MB"),
        ("one process, summed in node slices vs whole (float order alone)", f"{order_only:.2e}"),
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
        "held_bytes_largest": held_bytes,
        "fsdp2_on_kill": "raised" if died else "no report",
    }
    if not args.no_nodes:
        print("sharded nodes: the reference run ...", file=sys.stderr, flush=True)
        zones = 1 if args.short else 2  # the full run: 2 zones of 3 nodes, each zone a sharded replica
        n = argparse.Namespace(
            nodes=args.nodes if args.short else 6, steps=args.node_steps, kill_step=args.kill_step,
            join_step=args.join_step, dim=args.dim, layers=args.layers, batch=args.batch, timeout=args.timeout,
            zones=zones,
        )  # fmt: skip
        node_ref, node_order = sharded_nodes.reference_model(sharded_nodes.job(sharded_nodes.job_args(n)), n.nodes)
        print("sharded nodes: the zone ...", file=sys.stderr, flush=True)
        r = sharded_nodes.run(n, node_ref, node_order)
        join_ratio = r["join_s"] / r["cold_start_s"]
        peaks, held_mb = r["peak_rss_mb"], r["held_state_mb_largest"]
        rows += [
            ("real nodes: SIGKILL -> next commit", f"{r['kill_to_next_commit_s']:.3f} s"),
            ("real nodes: promises (commit logs), buddies agree", f"{not r['promises']}, {r['buddies_agree']}"),
            ("real nodes: final model vs one process", f"{r['max_abs_diff']:.2e} (float order {node_order:.2e})"),
            ("real nodes: join spawn -> first commit / cold start", f"{r['join_s']:.2f} / {r['cold_start_s']:.2f} s"),
            ("real nodes: peak RSS per node", ", ".join(f"{k} {v:.0f} MB" for k, v in sorted(peaks.items()))),
            ("real nodes: state held by the largest holder / whole", f"{held_mb:.1f} / {r['whole_state_mb']:.1f} MB"),
        ]  # fmt: skip
        figures |= {
            "kill_to_next_commit_s": round(r["kill_to_next_commit_s"], 4),
            "steps_lost": args.node_steps - r["steps_committed"],
            "promises_kept": bool(r["promises_kept"] and engine["promises_kept"]),
            "join_over_cold_start": round(join_ratio, 3),
            "nodes_run_layout": f"{n.nodes} nodes in {zones} zone(s)",
            "nodes_run": {k: v for k, v in r.items() if k != "codes"},
            "engine": engine,
        }
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    write_results(series={"rows": rows, "figures": figures})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
