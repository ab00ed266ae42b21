"""A sharded zone of real node processes (`unbroken node --shard`): kill, join, memory, promises.

    python bench/sharded_nodes.py                 # 4 nodes, 3 joins, about 3 minutes on 2 quiet cores
    python bench/sharded_nodes.py --steps 60 --dim 384

`bench/sharded.py` runs this after its engine-level comparison with FSDP2 (``--short`` too)
and merges the figures into its last line. Here the whole runtime runs: a coordinator and
``--nodes`` node processes on loopback (gloo, OMP_NUM_THREADS=1), the transformer of
`bench/sharded.py` as a `Job` with ``Sharding`` (a block per layer), AdamW, B = ``--batch``:

- with ``--zones Z`` the nodes are split into Z zones, each a sharded replica (the full run of
  `bench/sharded.py`: 2 zones of 3 nodes);
- a kill: node n2 SIGKILLs itself in the all-reduce of step ``--kill-step``; measured from
  the fault line in its log to the survivors' next commit (the epoch change, the layout
  exchange, the re-shard from the buddy copies and the retried step);
- joins: from step ``--join-step``, ``--joins`` new nodes one after another, each measured
  from its spawn to its first commit against the same node cold-starting a 1-node sharded job
  on a fresh coordinator, spawned at the same moment (both start under the zone's load; a cold
  start after the zone finished had the machine to itself and made joins look twice as
  slow). Each joiner leaves (SIGTERM) once it committed, so every join meets the zone the
  first did. The figure is the median of the ratios; each side's time is cut into `PHASES`
  by the milestones its first commit carries (`Records.mark`): import, model, hello,
  admission, the epoch's group (for a joiner, the zone's step boundary), the replicated
  state, the zone's reports, its ranges, the first step. Spawned processes import torch
  each: on a loaded machine that phase alone varies by seconds between the two sides;
- the promises (`unbroken.testing.check_promises` on every node's commit log), every range's
  two holders ending with the same digest, and the model put together from the finished
  nodes' ranges against one process trained on the whole batch;
- each node's peak RSS (``VmHWM``, sampled while it runs) and the state it holds.

``--device cuda`` runs every node with ``--device cuda`` (on one GPU: its zone places the
shards on the CPU and stages each block to the GPU, `unbroken.comm.placement`); refused where
torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from unbroken import Job, Sharding

VOCAB, CONTEXT = 256, 32
SPARE_STEPS = 5
"""Another join starts only while the job has the steps the longest join so far took (from
the wait before its spawn to its joiner's leave) and these to spare."""


class Model(nn.Module):
    """A small pre-norm transformer without float buffers (what a sharded zone takes)."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens = batch[0]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def job(argv: list[str]) -> Job:
    """``--steps N --dim D --layers L --batch B``: the sharded transformer job (every node the same)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args(argv)
    tokens = torch.randint(0, VOCAB, (4096, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    return Job(
        name="sharded-bench",
        model=lambda: Model(a.dim, a.layers),
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
        dataset=TensorDataset(tokens),
        step=_loss,
        batch_size=a.batch,
        num_steps=a.steps,
        shard=Sharding(blocks=lambda model: [model.embed, *model.layers, model.head]),
        args=tuple(argv),
    )


class PeakMemory:
    """Each process's ``VmHWM`` (peak RSS), sampled on a thread until `stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def add(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for name, pid in list(self.pids.items()):
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                kb = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM")), 0)
                self.peak[name] = max(self.peak.get(name, 0.0), kb / 1024)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(2)
        return self.peak


PHASES = (
    ("start", "began", "import"),
    ("began", "built", "model"),
    ("built", "welcomed", "hello"),
    ("welcomed", "ordered", "admitted"),
    ("ordered", "formed", "group"),
    ("formed", "synced", "state"),
    ("synced", "reported", "zone's reports"),
    ("reported", "resharded", "ranges"),
    ("resharded", "commit", "first step"),
)
"""A node's way from its spawn to its first commit, by the milestones its first commit's
entry carries (`Records.mark`): (from, to, what the time between them is)."""


def _first_commit(node: Any) -> dict[str, Any] | None:
    return next((e for e in node.entries() if e["kind"] == "commit"), None)


def timeline(spawned: float, first: dict[str, Any]) -> dict[str, float]:
    """Seconds of each of `PHASES` (a milestone not reached counts with the next phase)."""
    at = {"start": spawned, **first.get("timeline", {}), "commit": first["t"]}
    out, last = {}, spawned
    for _, end, what in PHASES:
        t = at.get(end, last)
        out[what], last = t - last, t
    return out


def cold_start(
    root: Path, job_ref: str, args: list[str], timeout: float, node_args: list[str]
) -> tuple[Any, Callable[[], tuple[float, dict[str, float]]]]:
    """One node alone in a fresh sharded job: its coordinator started now; the second value
    spawns the node and returns spawn -> first commit and its phases (called beside the
    joiner's spawn, so both start under the same load). The first value is the cluster, for
    the caller to close."""
    from common import wait_until
    from unbroken.testing import LocalCluster

    c = LocalCluster(job_ref, root, min_nodes=1, node_args=node_args)
    c.start_coordinator()

    def spawn() -> tuple[float, dict[str, float]]:
        t0 = time.time()
        node = c.start_node("cold", extra=["--shard"], job_args=args)
        first = wait_until(lambda: _first_commit(node), timeout, "the cold node's first commit")
        return float(first["t"]) - t0, timeline(t0, first)

    return c, spawn


def join_once(
    c: Any,
    name: str,
    zone: list[str],
    cold: tuple[Any, Callable[[], tuple[float, dict[str, float]]]],
    a: Any,
    leave: bool,
) -> dict[str, Any]:
    """``name`` spawned into the zone beside a cold start spawned at the same moment; once it
    committed, it leaves again (SIGTERM, where ``leave``), so that every join meets the zone
    as the first did.
    Both sides' spawn -> first commit and phases, and the zone's wait for its step boundary
    (the joiner's order -> the last member of the zone in the joiner's epoch)."""
    from common import wait_until

    cluster, spawn_cold = cold
    with cluster, ThreadPoolExecutor(1) as pool:
        cold_run = pool.submit(spawn_cold)
        t0 = time.time()
        joiner = c.start_node(name, extra=zone, job_args=job_args(a))
        first = wait_until(lambda: _first_commit(joiner), a.timeout, f"{name}'s first commit")
        cold_s, cold_phases = cold_run.result()
    if leave:
        joiner.signal(signal.SIGTERM)
        joiner.wait(a.timeout)
    epoch, ordered = first["epoch"], first.get("timeline", {}).get("ordered", t0)
    others = [e for n in c.nodes.values() if n is not joiner for e in n.entries()]
    switched = [e["t"] for e in others if e["kind"] == "epoch" and e["epoch"] == epoch]
    return {
        "join_s": float(first["t"]) - t0,
        "cold_start_s": cold_s,
        "phases": timeline(t0, first),
        "cold_phases": cold_phases,
        "zone_switch_s": max(switched) - ordered if switched else None,
    }


def load() -> str:
    """The machine's load averages (1, 5, 15 min) and its cores, as printed with a figure."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"


class Diagnostics:
    """On a failure, prints the end of every node's log before their directory is removed."""

    def __init__(self) -> None:
        self.clusters: list[Any] = []

    def __enter__(self) -> Diagnostics:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is not None:
            for cluster in self.clusters:
                print(cluster.diagnostics(), file=sys.stderr, flush=True)


def run(a: argparse.Namespace, reference: dict[str, torch.Tensor], float_order: float) -> dict[str, Any]:
    """The zone's run with a kill and a join; the figures, by name (on a failure, the end of
    each node's log is printed)."""
    from unbroken.testing import LocalCluster, check_promises
    from unbroken.train.sharding import assemble_files

    ref = f"{Path(__file__).resolve()}:job"
    args = job_args(a)
    device = ["--device", getattr(a, "device", "cpu")]
    with (
        tempfile.TemporaryDirectory(prefix="ub-sharded-") as tmp,
        LocalCluster(ref, Path(tmp) / "zone", min_nodes=a.nodes, node_args=["--digest-every", "1", *device]) as c,
        Diagnostics() as diagnostics,
    ):
        diagnostics.clusters.append(c)
        root = Path(tmp)
        c.start_coordinator()
        zones = getattr(a, "zones", 1)
        for i in range(1, a.nodes + 1):
            fault = f"kill@allreduce:{a.kill_step}" if i == 2 else ""
            where = ["--zone", f"z{(i - 1) * zones // a.nodes}"] if zones > 1 else []
            c.start_node(f"n{i}", fault=fault, extra=where, job_args=args)
        peak = PeakMemory({name: n.proc.pid for name, n in c.nodes.items()})
        c.wait_step(a.join_step, timeout=a.timeout)
        joins: list[dict[str, Any]] = []
        stayed, longest, count = 0, 0, getattr(a, "joins", 1)
        for i in range(count):
            if (at := c.max_committed()) + longest + SPARE_STEPS > a.steps:
                print(f"sharded nodes: {i} joins: too few steps left for another", file=sys.stderr, flush=True)
                break
            cold = cold_start(root / f"cold{i}", ref, args, a.timeout, device)
            diagnostics.clusters.append(cold[0])
            c.wait_step(c.max_committed() + 2, timeout=a.timeout)  # the zone back at its pace
            print(f"sharded nodes: join {i + 1}, and a cold start beside it ...", file=sys.stderr, flush=True)
            last = i == count - 1  # stays to the end: a joiner finishes with the others' model
            where = ["--zone", "z0"] if zones > 1 else []
            joins.append(join_once(c, f"joiner{i}", where, cold, a, leave=not last) | {"load": load()})
            peak.add(f"joiner{i}", c.nodes[f"joiner{i}"].proc.pid)
            stayed += last
            longest = max(longest, c.max_committed() - at)
        codes = c.wait_exit(timeout=a.timeout)
        peaks = peak.stop()
        logs = {name: n.entries() for name, n in c.nodes.items()}
        victim = logs["n2"]
        fault_t = next((e["t"] for e in victim if e["kind"] == "fault"), None)
        after = [e["t"] for entries in logs.values() for e in entries if e["kind"] == "commit"]
        kill_to_commit = min(t for t in after if fault_t is not None and t > fault_t) - fault_t if fault_t else None
        job_ = job(args)
        report = check_promises(logs, job_, finishers=a.nodes - 1 + stayed)  # n2 was killed
        finals = [e for entries in logs.values() for e in entries if e["kind"] == "final"]
        digests: dict[str, set[str]] = {}
        for e in finals:
            for span, d in e.get("ranges", {}).items():
                digests.setdefault(span, set()).add(d)
        held = max((sum(int(b) - int(x) for x, b in (s.split("-") for s in e["ranges"])) for e in finals), default=0)
        model = assemble_files([n.final_state for n in c.nodes.values() if n.final_state.exists()])
        diff = max(float((model[k] - v).abs().max()) for k, v in reference.items())
        numel = sum(v.numel() for v in reference.values())
        kept = report.ok and all(len(d) == 1 for d in digests.values()) and diff <= 10 * float_order + 1e-5
        return {
            "codes": codes,
            "kill_to_next_commit_s": kill_to_commit,
            "promises": report.problems[:5],
            "buddies_agree": all(len(d) == 1 for d in digests.values()),
            "max_abs_diff": diff,
            "promises_kept": kept,
            "joins": joins,
            "join_s": statistics.median(j["join_s"] for j in joins),
            "cold_start_s": statistics.median(j["cold_start_s"] for j in joins),
            "join_over_cold_start": statistics.median(j["join_s"] / j["cold_start_s"] for j in joins),
            "peak_rss_mb": peaks,
            "held_state_mb_largest": 16 * held / 2**20,
            "whole_state_mb": 16 * numel / 2**20,
            "steps_committed": len({e["step"] for entries in logs.values() for e in entries if e["kind"] == "commit"}),
        }


def reference_model(j: Job, parts: int) -> tuple[dict[str, torch.Tensor], float]:
    """One process trained on the whole batch, and how far summing each step's gradient in
    ``parts`` slices moves it (float order alone: what the zone may differ by)."""
    from unbroken.testing.promises import reference_tree

    whole: dict[str, torch.Tensor] = reference_tree(j)["model"]
    sliced = reference_tree(j, parts=parts)["model"]
    return whole, max(float((v - sliced[k]).abs().max()) for k, v in whole.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--join-step", type=int, default=22)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--zones", type=int, default=1, help="zones the nodes are split into (each a sharded replica)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="every node's --device")
    p.add_argument("--joins", type=int, default=3, help="joins measured one after another (the median is the figure)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench/sharded_nodes.py: --device cuda, but this torch ({torch.__version__}) sees no CUDA device")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    reference, float_order = reference_model(job(job_args(a)), a.nodes)
    print(json.dumps(run(a, reference, float_order)))


def job_args(a: argparse.Namespace) -> list[str]:
    return ["--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers), "--batch", str(a.batch)]


if __name__ == "__main__":
    main()
