"""Steady-state step time: unbroken vs plain torch DDP on gloo, side by side.

    python bench/steady_state.py                      # 3 interleaved repeats, ~2 min on 2 cores
    python bench/steady_state.py --repeats 7 --steps 400

Both sides run the same job (``bench/jobs.py``, default the ~0.67M-parameter MLP), the same
global batch B split equally over the same number of processes (``--nodes``, 3 by default), one forward/backward,
one gradient all-reduce and one optimizer step per step, OMP_NUM_THREADS=1 everywhere:

- unbroken: a real coordinator and ``--nodes`` node subprocesses on loopback
  (`unbroken.testing.LocalCluster`), once per ``--bucket-mb`` value (gradient buckets
  summed while backward runs; 0: the gradient summed whole after it); step time = gap
  between consecutive ``commit`` lines of a node's commit log (wall-clock "t"), after
  ``--warmup`` steps, pooled over nodes.
- DDP: ``--nodes`` ranks of ``bench/ddp_worker.py`` (DistributedDataParallel, gloo, its
  default 25 MB buckets all-reduced during backward); each
  rank logs a line after every optimizer step; step time is computed the same way.

Runs alternate (unbroken, DDP, DDP, unbroken, ...) so drift on a shared machine hits both.
The figure is the ratio of median step times, ours / DDP (the project's target: <= 1.10).

``--malloc system,kept`` runs unbroken with malloc as it is and with ``UNBROKEN_MALLOC=kept``
(the process keeps the memory it frees: `unbroken.train.memory`); ``--ddp-malloc
system,kept`` does the same for DDP (the first DDP variant is the baseline): how much of a
difference is the allocator's, on either side.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jobs
from common import DDPRun, ProgressLine, fmt, median, print_command, print_table, ratio, step_times, write_results
from unbroken.testing import LocalCluster


def run_unbroken(args: argparse.Namespace, workdir: Path, bucket_mb: str, malloc: str) -> list[float]:
    env = jobs.env_for(args.steps, args.batch) | {"UNBROKEN_MALLOC": malloc}
    ref, coordinator = jobs.job_ref(args.model), ["--bucket-mb", bucket_mb]
    with LocalCluster(ref, workdir, env=env, min_nodes=args.nodes, coordinator_args=coordinator) as c:
        c.start_coordinator()
        for i in range(args.nodes):
            c.start_node(f"n{i}")
        codes = c.wait_exit(timeout=args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"unbroken run failed: {codes}\n{c.diagnostics()}")
        gaps: list[float] = []
        for n in c.nodes.values():
            gaps += step_times(n.entries(), args.warmup)
        return gaps


def run_ddp(args: argparse.Namespace, workdir: Path, malloc: str) -> list[float]:
    env = jobs.env_for(args.steps, args.batch)
    extra = ["--keep-freed-memory"] if malloc == "kept" else []
    with DDPRun(args.model, args.nodes, workdir, env, timeout_s=args.timeout, extra=extra) as d:
        codes = d.wait_exit(range(args.nodes), args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"DDP run failed: {codes}\n{d.stderr(0)}")
        gaps: list[float] = []
        for r in range(args.nodes):
            gaps += step_times(d.entries(r), args.warmup)
        return gaps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of each system, interleaved")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument("--warmup", type=int, default=30, help="steps left out at the start of each run")
    p.add_argument("--nodes", type=int, default=3, help="processes on each side")
    p.add_argument("--batch", type=int, default=96, help="global batch B (divisible by --nodes)")
    p.add_argument("--model", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    p.add_argument(
        "--bucket-mb",
        default="25",
        help="unbroken's gradient buckets (the coordinator's --bucket-mb), comma-separated for a run of each: "
        "25,0 sets buckets summed during backward beside the gradient summed whole after it",
    )
    p.add_argument("--malloc", default="system", help="unbroken malloc, a run of each: kept, system")
    p.add_argument("--ddp-malloc", default="system", help="DDP's malloc, the same way (the first is the baseline)")
    args = p.parse_args()
    buckets = args.bucket_mb.split(",")
    mallocs, ddp_mallocs = list(dict.fromkeys(args.malloc.split(","))), list(dict.fromkeys(args.ddp_malloc.split(",")))
    if not set(mallocs) | set(ddp_mallocs) <= {"kept", "system"}:
        p.error("--malloc and --ddp-malloc take kept and system")
    ours = [f"unbroken:{b}:{m}" for b in buckets for m in mallocs]
    ddps = [f"ddp:{m}" for m in ddp_mallocs]
    systems = ours + ddps
    if args.batch % args.nodes:
        p.error("--batch must be divisible by --nodes (DDP splits it equally)")
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3")
    print_command()
    n_params = jobs.num_params(args.model)
    print(f"model {args.model} ({n_params:,} parameters), B={args.batch}, {args.nodes} processes per side, "
          f"{args.steps} steps per run (first {args.warmup} left out), OMP_NUM_THREADS=1", flush=True)  # fmt: skip

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-steady-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    results: dict[str, list[float]] = {s: [] for s in systems}
    per_run: dict[str, list[float]] = {s: [] for s in systems}
    progress = ProgressLine(len(systems) * args.repeats)
    try:
        for rep in range(args.repeats):
            order = systems if rep % 2 == 0 else systems[::-1]
            for system in order:
                progress.update(f"repeat {rep + 1}/{args.repeats}: {system} running")
                t0 = time.monotonic()
                workdir = root / f"{system.replace(':', '-')}-{rep}"
                kind, _, rest = system.partition(":")
                if kind == "ddp":
                    gaps = run_ddp(args, workdir, rest)
                else:
                    bucket_mb, _, malloc = rest.partition(":")
                    gaps = run_unbroken(args, workdir, bucket_mb, malloc)
                results[system] += gaps
                per_run[system].append(median(gaps) or float("nan"))
                progress.update(
                    f"repeat {rep + 1}/{args.repeats}: {system} median step {1e3 * (median(gaps) or 0):.2f} ms "
                    f"({time.monotonic() - t0:.0f} s)",
                    advance=1,
                )
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()

    base = ddps[0]
    ddp = median(per_run[base])

    def label(system: str) -> str:
        kind, _, rest = system.partition(":")
        if kind == "ddp":
            return f"plain DDP, gloo, its own buckets, {rest} malloc" + (" (baseline)" if system == base else "")
        bucket_mb, _, malloc = rest.partition(":")
        return f"unbroken ({args.nodes} nodes, --bucket-mb {bucket_mb}, {malloc} malloc)"

    rows = []
    for system in systems:
        med = median(per_run[system])
        all_gaps = sorted(results[system])
        p90 = all_gaps[int(0.9 * (len(all_gaps) - 1))] if all_gaps else None
        rows.append([
            label(system),
            fmt(med and med * 1e3, " ms", 2),
            fmt(p90 and p90 * 1e3, " ms", 2),
            fmt(med and 1 / med, "", 1),
            fmt(med and args.batch / med, "", 0),
            ", ".join(f"{x * 1e3:.2f}" for x in per_run[system]),
            ratio(med, ddp),
        ])  # fmt: skip
    print_table(
        f"Steady-state step time, {args.model} MLP ({n_params / 1e6:.2f}M params), B={args.batch}, "
        f"{args.nodes} processes, medians over {args.repeats} runs",
        ["system", "median step", "p90 step", "steps/s", "samples/s", "per-run medians (ms)", "vs DDP"],
        rows,
        caption="; ".join(
            f"{label(s)}: / DDP = {ratio(median(per_run[s]), ddp, 3)} (per run "
            + ", ".join(f"{a / b:.3f}" for a, b in zip(per_run[s], per_run[base], strict=True))
            + ")"
            for s in systems
            if s != base
        )
        + " (target for ours <= 1.10)",
    )


if __name__ == "__main__":
    main()
    write_results()
