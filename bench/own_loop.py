"""Own loop vs the Job loop: the overhead of keeping your own training loop, side by side.

    python bench/own_loop.py                      # 3 interleaved repeats, ~2 min on 2 cores
    python bench/own_loop.py --repeats 5 --steps 400

Both sides train the same job (``bench/jobs.py``: model, optimizer, data and its order, B)
on the same number of nodes (3) with a real coordinator on loopback, OMP_NUM_THREADS=1:

- Job loop: ``unbroken node bench/jobs.py:MODEL`` (the runtime computes each slice);
- own loop: ``unbroken run bench/own_loop_worker.py -- MODEL``, a plain loop through
  `unbroken.join` (``swarm.batches``, ``swarm.backward``, ``swarm.step``).

The coordinator splits B equally and never rebalances (``--balance weights``), so both sides
run the same shares. Step time is the gap between consecutive ``commit`` lines of a node's commit log, after
``--warmup`` steps, pooled over nodes; runs alternate (job, own, own, job, ...) so drift on
a shared machine hits both. The figure is the ratio of median step times, own ÷ Job
(target ≤ 1.02).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, step_times, write_results
from unbroken.testing import LocalCluster

WORKER = Path(__file__).parent / "own_loop_worker.py"


def run(system: str, args: argparse.Namespace, workdir: Path) -> list[float]:
    env = jobs.env_for(args.steps, args.batch)
    ref = jobs.job_ref(args.model) if system == "job" else str(WORKER)
    job_args = [args.model] if system == "own" else None
    # Equal shares on both sides, fixed: the loops are compared, not the planner's view of
    # them (the Job loop times its loss before joining, the own loop only its steps).
    coord = ["--balance", "weights"]
    with LocalCluster(ref, workdir, env=env, min_nodes=args.nodes, coordinator_args=coord) as c:
        c.start_coordinator()
        for i in range(args.nodes):
            c.start_node(f"n{i}", job_args=job_args)
        codes = c.wait_exit(timeout=args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"{system} run failed: {codes}\n{c.diagnostics()}")
        gaps: list[float] = []
        for n in c.nodes.values():
            gaps += step_times(n.entries(), args.warmup)
        return gaps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved")
    p.add_argument("--steps", type=int, default=300, help="steps per run")
    p.add_argument("--warmup", type=int, default=30, help="steps left out at the start of each run")
    p.add_argument("--nodes", type=int, default=3, help="nodes on each side")
    p.add_argument("--batch", type=int, default=96, help="global batch B")
    p.add_argument("--model", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3")
    print_command()
    print(
        f"model {args.model} ({jobs.num_params(args.model):,} parameters), B={args.batch}, {args.nodes} nodes per "
        f"side, {args.steps} steps per run (first {args.warmup} left out), OMP_NUM_THREADS=1",
        flush=True,
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-ownloop-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    per_run: dict[str, list[float]] = {"job": [], "own": []}
    pooled: dict[str, list[float]] = {"job": [], "own": []}
    progress = ProgressLine(2 * args.repeats)
    try:
        for rep in range(args.repeats):
            for system in ["job", "own"] if rep % 2 == 0 else ["own", "job"]:
                progress.update(f"repeat {rep + 1}/{args.repeats}: {system} loop running")
                t0 = time.monotonic()
                gaps = run(system, args, root / f"{system}{rep}")
                pooled[system] += gaps
                per_run[system].append(median(gaps) or float("nan"))
                progress.update(
                    f"repeat {rep + 1}/{args.repeats}: {system} loop median step {1e3 * (median(gaps) or 0):.2f} ms "
                    f"({time.monotonic() - t0:.0f} s)",
                    advance=1,
                )
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()
    own, job = median(per_run["own"]), median(per_run["job"])
    rows = []
    for system, label in (("own", "own loop (unbroken.join)"), ("job", "Job loop (baseline)")):
        med = median(per_run[system])
        gaps = sorted(pooled[system])
        p90 = gaps[int(0.9 * (len(gaps) - 1))] if gaps else None
        rows.append([
            label,
            fmt(med and med * 1e3, " ms", 2),
            fmt(p90 and p90 * 1e3, " ms", 2),
            fmt(med and args.batch / med, "", 0),
            ", ".join(f"{x * 1e3:.2f}" for x in per_run[system]),
            ratio(med, job),
        ])  # fmt: skip
    ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(per_run["own"], per_run["job"], strict=True))
    print_table(
        f"Own loop vs Job loop, {args.model} MLP, B={args.batch}, {args.nodes} nodes, medians over {args.repeats} runs",
        ["loop", "median step", "p90 step", "samples/s", "per-run medians (ms)", "vs Job loop"],
        rows,
        caption=f"ratio own/Job = {ratio(own, job, 3)} (target <= 1.02); per-run ratios: {ratios}",
    )


if __name__ == "__main__":
    main()
    write_results()
