"""Heterogeneous nodes: throughput-balanced shares vs an equal split vs the ideal, and live rebalancing.

    python bench/hetero.py                            # both scenarios, 3 repeats, ~5 min on 2 cores
    python bench/hetero.py --compute cpu              # real matrix compute instead of a per-sample sleep
    python bench/hetero.py --repeats 5 --steps 200 --scenario static

Slower devices are emulated with ``--throttle F`` (`unbroken.train.throttle`): after each
forward/backward that took ``t`` a process idles ``t * (1/F - 1)``, so it computes like a
device F times as fast. All processes run OMP_NUM_THREADS=1 on this machine, over loopback.

Compute cost (``--compute``):

- ``sleep`` (default): the ~0.67M-parameter MLP of ``bench/jobs.py`` plus a sleep of
  ``--sample-ms`` per sample in each forward pass (``UB_BENCH_SAMPLE_MS``), so that compute
  time is proportional to a node's share and three processes on a 2-core machine do not
  fight over the CPU (which would decide their speeds instead of ``--throttle``). With
  ``--backward-share F`` the fraction F of it is spent in backward instead, each layer's
  part in proportion to its parameters, as on a real device (F = 0.67): the gradient's
  buckets (``--bucket-mb``, the coordinator's) can then be summed while earlier layers'
  backward runs. With all of it in forward, backward takes about 1 % of the step and no sum
  overlaps anything.
- ``cpu``: the same MLP, real matrix compute only (a larger default batch, so that a step
  is not dominated by the all-reduce); CPU contention between the processes is part of
  every group figure, while the ideal is measured alone, without it.

A. Static: 3 nodes at relative speeds ``--speeds`` (default 1, 1/2, 1/4), global batch B.

- unbroken: a coordinator (``--balance throughput``, the default: shares by measured
  throughput) and 3 nodes (`unbroken.testing.LocalCluster`), ``--steps`` steps.
- equal split: plain data parallel on the same throttled processes, B/3 samples per rank
  (``bench/ddp_worker.py --throttle F``: forward/backward under ``ddp.no_sync()``, timed,
  idled as the emulated device, then one explicit gradient all-reduce), ``--ddp-steps``.
- ideal: the sum over the 3 speeds of one process's samples/s training alone at that speed
  (``bench/alone_worker.py``: a plain loop over the whole batch B, no communication),
  measured one at a time (one process, one speed after the other, each with a freshly
  built model) for ``--alone-seconds`` each after ``--alone-warmup`` steps.

Throughput is steady state from commit timestamps: ``B * (k1 - k0) / (t[k1] - t[k0])`` with
k0 = ``--warmup`` (past start-up, calibration and the first plan and its first
rebalance), k1 = the last step; t[k] is the median over nodes (ranks) of their commit time
of step k. Any replanning inside the window counts against unbroken (the table says how
many epochs the window spans).

B. Dynamic: 3 nodes at full speed; from step S = ``--slow-at`` one of them computes at
``--slow-factor`` (``--throttle 1,S:0.25``). Per step k the group's throughput is
``B / (t[k] - t[k-1])``; recovery is the number of steps after S until the median of a
sliding window of 3 steps (all after S) is within 10% of the new ideal (alone(1) * 2 +
alone(0.25)). Also: the throughput before (steps k0..S) and after (the second half of the
steps after S), each against its ideal, and the step of the coordinator's rebalance.

Runs are interleaved, their order rotating each repeat, so drift on a shared machine hits
all; the figures are medians over ``--repeats`` (ratios: of the medians, per repeat too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jobs
from common import (
    HERE,
    NODE_ENV,
    DDPRun,
    ProgressLine,
    fmt,
    median,
    print_command,
    print_table,
    ratio,
    read_jsonl,
    write_results,
)
from unbroken.testing import LocalCluster

MODEL = "small"
DEFAULT_BATCH = {"sleep": 90, "cpu": 960}
WITHIN = 0.10
"""Recovered: throughput within this fraction of the new ideal."""
WINDOW = 3
"""Steps in the sliding median of the dynamic scenario."""
CPU_CAVEAT = {
    "cpu": f" --compute cpu: the ideal is each speed measured alone, with a core to itself; the group's 3 "
    f"processes share {os.cpu_count()} cores here, so CPU contention lowers every group figure against it."
}


# ------------------------------------------------------------------- reading commit logs


def commit_times(logs: list[list[dict[str, Any]]]) -> dict[int, float]:
    """Step -> median over the logs of the wall-clock time it was committed."""
    per_step: dict[int, list[float]] = {}
    for entries in logs:
        for e in entries:
            if e.get("kind") == "commit":
                per_step.setdefault(int(e["step"]), []).append(float(e["t"]))
    return {k: statistics.median(v) for k, v in sorted(per_step.items())}


def window_rate(times: dict[int, float], batch: int, k0: int, k1: int) -> float | None:
    """Samples/s from step k0's commit to step k1's."""
    if k0 not in times or k1 not in times or k1 <= k0 or times[k1] <= times[k0]:
        return None
    return batch * (k1 - k0) / (times[k1] - times[k0])


def step_rates(times: dict[int, float], batch: int) -> dict[int, float]:
    """Step k -> B / (t[k] - t[k-1])."""
    return {k: batch / max(t - times[k - 1], 1e-9) for k, t in times.items() if k - 1 in times}


def shares_at(entries_by_node: dict[str, list[dict[str, Any]]], step: int) -> dict[str, int]:
    """Each node's share of (0-based) step ``step``, from its "contrib" lines."""
    out = {}
    for name, entries in entries_by_node.items():
        c = [e for e in entries if e.get("kind") == "contrib" and int(e["step"]) == step]
        if c:
            out[name] = len(c[-1]["indices"])
    return out


def shares_over_time(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    """Each node's share of every committed step and the group's samples/s, for bench/render.py's plot."""
    times = run["times"]
    t0 = times[min(times)]
    rates = step_rates(times, args.batch)
    shares: dict[str, list[int | None]] = {}
    for name, entries in run["entries"].items():
        by_step = {int(e["step"]): len(e["indices"]) for e in entries if e.get("kind") == "contrib"}
        # a "commit" line's step counts finished steps: step k's commit follows its contrib to step k - 1
        shares[name] = [by_step.get(k - 1) for k in times]
    return {
        "step": list(times),
        "t": [round(t - t0, 4) for t in times.values()],
        "samples_per_s": [round(r, 2) if (r := rates.get(k)) is not None else None for k in times],
        "shares": shares,
    }


# ------------------------------------------------------------------- runs


def env_for(args: argparse.Namespace, steps: int) -> dict[str, str]:
    sleep = args.compute == "sleep"
    return jobs.env_for(
        steps, args.batch, sample_ms=args.sample_ms if sleep else 0.0, backward=args.backward_share if sleep else 0.0
    )


def run_unbroken(args: argparse.Namespace, workdir: Path, throttles: list[str]) -> dict[str, Any]:
    env = env_for(args, args.steps)
    with LocalCluster(jobs.job_ref(MODEL), workdir, env=env, min_nodes=len(throttles)) as c:
        c.start_coordinator(extra=["--bucket-mb", str(args.bucket_mb)])
        for i, th in enumerate(throttles):
            c.start_node(f"n{i}", extra=["--throttle", th])
        codes = c.wait_exit(timeout=args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"unbroken run failed: {codes}\n{c.diagnostics()}")
        entries = {name: n.entries() for name, n in c.nodes.items()}
        return {"entries": entries, "times": commit_times(list(entries.values())), "events": c.events()}


def run_equal_split(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    world = len(args.speeds)
    env = env_for(args, args.ddp_steps)
    throttles = {r: str(f) for r, f in enumerate(args.speeds)}
    with DDPRun(MODEL, world, workdir, env, timeout_s=args.timeout, throttles=throttles) as d:
        codes = d.wait_exit(range(world), args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"equal-split run failed: {codes}\n{d.stderr(0)}")
        return {"times": commit_times([d.entries(r) for r in range(world)])}


def run_alone(args: argparse.Namespace, workdir: Path, factors: list[float]) -> dict[float, float]:
    """Samples/s of one process training alone at each speed, one speed after the other."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "alone.jsonl"
    cmd = [
        sys.executable, str(HERE / "alone_worker.py"), "--job", MODEL, "--log", str(log),
        "--warmup", str(args.alone_warmup), "--seconds", str(args.alone_seconds),
        *(a for f in factors for a in ("--throttle", str(f))),
    ]  # fmt: skip
    with open(workdir / "alone.err", "ab") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=err, env=dict(os.environ, **NODE_ENV, **env_for(args, 10**6)))
    try:
        code = proc.wait(args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    if code != 0:
        err_text = (workdir / "alone.err").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"alone run failed ({code}): {err_text}")
    entries = read_jsonl(log)
    out = {}
    for f in factors:
        times = commit_times([[e for e in entries if e.get("throttle") == str(f)]])
        rate = window_rate(times, args.batch, args.alone_warmup, max(times, default=0))
        if rate is None:
            raise RuntimeError(f"alone run at {f}: too few steps in {args.alone_seconds} s")
        out[f] = rate
    return out


# ------------------------------------------------------------------- analysis


def analyse_static(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    times = run["times"]
    last = max(times)
    epochs = {
        e.get("epoch")
        for entries in run["entries"].values()
        for e in entries
        if e.get("kind") == "commit" and args.warmup < int(e["step"]) <= last
    }
    gaps = [times[k] - times[k - 1] for k in times if k > args.warmup and k - 1 in times]
    return {
        "rate": window_rate(times, args.batch, args.warmup, last),
        "step_s": median(gaps),
        "epochs": len(epochs),
        "shares": shares_at(run["entries"], last - 1),
    }


def analyse_dynamic(args: argparse.Namespace, run: dict[str, Any], ideal_after: float) -> dict[str, Any]:
    times, S = run["times"], args.slow_at
    last = max(times)
    rates = step_rates(times, args.batch)
    after_from = S + (last - S) // 2
    out: dict[str, Any] = {
        "before": window_rate(times, args.batch, args.warmup, S),
        "after": window_rate(times, args.batch, after_from, last),
        "recover_steps": None,
        "recover_s": None,
        "settle_steps": None,
        "settle_s": None,
        "rebalance_step": None,
        "rebalances": 0,
    }

    def first_window(threshold: float) -> int | None:
        # windows [k-2, k] of steps committed after the change (step S+1 is the first slowed one)
        for k in range(S + WINDOW, last + 1):
            w = [rates.get(j) for j in range(k - WINDOW + 1, k + 1)]
            if all(x is not None for x in w) and statistics.median(w) >= threshold:  # type: ignore[type-var]
                return k
        return None

    k = first_window((1 - WITHIN) * ideal_after)
    if k is not None:
        out["recover_steps"], out["recover_s"] = k - S, times[k] - times[S]
    if out["after"]:
        k = first_window((1 - WITHIN) * out["after"])
        if k is not None:
            out["settle_steps"], out["settle_s"] = k - S, times[k] - times[S]
    replans = [
        e
        for e in run["events"]
        if e.get("kind") == "epoch" and "rebalance" in str(e.get("reason", "")) and int(e.get("step", -1)) >= S
    ]
    if replans:
        out["rebalance_step"], out["rebalances"] = replans[0]["step"], len(replans)
    out["shares_after"] = shares_at(run["entries"], last - 1)
    return out


# ------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compute", choices=["sleep", "cpu"], default="sleep", help="compute cost (see above)")
    p.add_argument("--scenario", choices=["both", "static", "dynamic"], default="both")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every run, interleaved (medians reported)")
    p.add_argument("--steps", type=int, default=130, help="steps of each unbroken run")
    p.add_argument("--warmup", type=int, default=30, help="steps left out at the start of each unbroken run")
    p.add_argument("--ddp-steps", type=int, default=45, help="steps of each equal-split run")
    p.add_argument("--ddp-warmup", type=int, default=5, help="steps left out at the start of each equal-split run")
    p.add_argument("--alone-seconds", type=float, default=4.0, help="timed seconds of each alone run")
    p.add_argument("--alone-warmup", type=int, default=2, help="steps left out at the start of each alone run")
    p.add_argument("--batch", type=int, help="global batch B, divisible by 3 (default 90; 960 with --compute cpu)")
    p.add_argument("--sample-ms", type=float, default=2.0, help="sleep per sample with --compute sleep")
    p.add_argument(
        "--backward-share",
        type=float,
        default=0.0,
        help="with --compute sleep, the fraction of the sleep spent in backward, layer by layer (0.67 as a real "
        "model's backward costs about twice its forward; 0: all in forward, where no sum can overlap it)",
    )
    p.add_argument(
        "--bucket-mb", type=float, default=25.0, help="unbroken's gradient buckets (the coordinator's --bucket-mb)"
    )
    p.add_argument("--speeds", default="1,0.5,0.25", help="static scenario: the nodes' speed factors")
    p.add_argument("--slow-at", type=int, help="dynamic scenario: the step S the slowdown starts (default 2/5 in)")
    p.add_argument("--slow-factor", type=float, default=0.25, help="dynamic scenario: the slowed node's factor")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    args.speeds = [float(x) for x in args.speeds.split(",")]
    args.batch = args.batch or DEFAULT_BATCH[args.compute]
    if args.batch % len(args.speeds):
        p.error(f"--batch must be divisible by {len(args.speeds)} (the equal split)")
    if not 0 <= args.backward_share <= 1:
        p.error(f"--backward-share {args.backward_share:g} must be between 0 and 1 (a fraction of the compute)")
    if args.slow_at is None:
        args.slow_at = max(args.warmup + 10, 2 * args.steps // 5)
    if args.steps <= args.warmup + 2 or args.ddp_steps <= args.ddp_warmup + 2:
        p.error("--steps (--ddp-steps) must exceed --warmup (--ddp-warmup) by at least 3")
    if not args.warmup < args.slow_at <= args.steps - 4 * WINDOW:
        p.error(f"--slow-at must lie between --warmup and --steps - {4 * WINDOW}")
    return args


def main() -> None:
    args = parse_args()
    print_command()
    n = len(args.speeds)
    static, dynamic = args.scenario in ("both", "static"), args.scenario in ("both", "dynamic")
    cost = (
        f"compute sleep: {args.sample_ms:g} ms sleep per sample"
        + (
            f", {args.backward_share:.0%} of it in backward, layer by layer"
            if args.backward_share
            else " in each forward pass"
        )
        + f" + the MLP's own compute; buckets of {args.bucket_mb:g} MB"
        if args.compute == "sleep"
        else f"compute cpu: real matrix compute only; {n} processes share this machine's {os.cpu_count()} cores, "
        "so CPU contention is part of every group figure (the ideal is measured alone, without it)"
    )
    print(
        f"model {MODEL} MLP ({jobs.num_params(MODEL):,} parameters), B={args.batch}, {n} nodes, {cost}; "
        f"unbroken {args.steps} steps per run (first {args.warmup} left out), equal split {args.ddp_steps} "
        f"(first {args.ddp_warmup} left out), alone {args.alone_seconds:g} s after {args.alone_warmup} steps; "
        f"OMP_NUM_THREADS=1",
        flush=True,
    )

    factors = sorted(set((args.speeds if static else []) + ([1.0, args.slow_factor] if dynamic else [])), reverse=True)
    runs: list[str] = ["alone"]
    if static:
        runs += ["unbroken-static", "equal-split"]
    if dynamic:
        runs += ["unbroken-dynamic"]
    slow_schedule = f"1,{args.slow_at}:{args.slow_factor}"
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-hetero-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    alone: dict[float, list[float]] = {f: [] for f in factors}
    raw: dict[str, list[dict[str, Any]]] = {"unbroken-static": [], "equal-split": [], "unbroken-dynamic": []}
    progress = ProgressLine(args.repeats * len(runs))
    try:
        for rep in range(args.repeats):
            order = runs[rep % len(runs) :] + runs[: rep % len(runs)]
            for name in order:
                progress.update(f"repeat {rep + 1}/{args.repeats}: {name} running")
                t0 = time.monotonic()
                wd = root / f"{name}-{rep}"
                if name == "alone":
                    rates = run_alone(args, wd, factors)
                    for f, rate in rates.items():
                        alone[f].append(rate)
                    note = ", ".join(f"at {f:g}: {rate:.0f}" for f, rate in rates.items()) + " samples/s"
                elif name == "unbroken-static":
                    raw[name].append(run_unbroken(args, wd, [str(f) for f in args.speeds]))
                    note = f"{fmt(analyse_static(args, raw[name][-1])['rate'], '', 0)} samples/s"
                elif name == "equal-split":
                    r = run_equal_split(args, wd)
                    r["rate"] = window_rate(r["times"], args.batch, args.ddp_warmup, max(r["times"]))
                    raw[name].append(r)
                    note = f"{fmt(r['rate'], '', 0)} samples/s"
                else:
                    throttles = ["1"] * (n - 1) + [slow_schedule]
                    raw[name].append(run_unbroken(args, wd, throttles))
                    note = "done"
                progress.update(f"repeat {rep + 1}/{args.repeats}: {name}: {note} ({time.monotonic() - t0:.0f} s)", 1)
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()

    if static:
        report_static(args, alone, raw)
    if dynamic:
        report_dynamic(args, alone, raw)
    series: dict[str, Any] = {"alone": {f"{f:g}": rates for f, rates in alone.items()}}
    if raw["unbroken-static"]:
        series["static"] = shares_over_time(args, raw["unbroken-static"][0])
    if raw["unbroken-dynamic"]:
        series["dynamic"] = shares_over_time(args, raw["unbroken-dynamic"][0]) | {
            "slow_at": args.slow_at,
            "slowed": f"n{len(args.speeds) - 1}",
            "slow_factor": args.slow_factor,
        }
    write_results(series)


def report_static(args: argparse.Namespace, alone: dict[float, list[float]], raw: dict[str, Any]) -> None:
    ideal_runs = [sum(alone[f][r] for f in args.speeds) for r in range(args.repeats)]
    ub = [analyse_static(args, run) for run in raw["unbroken-static"]]
    ub_rates = [a["rate"] for a in ub]
    eq_rates = [r["rate"] for r in raw["equal-split"]]
    eq_times = [r["times"] for r in raw["equal-split"]]
    eq_steps = [median(t[k] - t[k - 1] for k in t if k > args.ddp_warmup and k - 1 in t) for t in eq_times]
    ideal, ubm, eqm = median(ideal_runs), median(ub_rates), median(eq_rates)

    def per_run(xs: list[Any], digits: int = 0) -> str:
        return ", ".join(fmt(x, "", digits) for x in xs)

    speeds = ", ".join(f"{f:g}" for f in args.speeds)
    last_shares = ub[-1]["shares"] if ub else {}
    prop = [args.batch * median(alone[f]) / ideal for f in args.speeds] if ideal else []  # type: ignore[operator]
    rows = [
        [
            "unbroken (shares by measured throughput)",
            fmt(ubm, "", 0),
            fmt(median(a["step_s"] for a in ub) and 1e3 * median(a["step_s"] for a in ub), " ms", 1),  # type: ignore[operator]
            per_run(ub_rates),
            ratio(ubm, ideal),
            ratio(ubm, eqm),
        ],
        [
            f"equal split, plain DP ({args.batch // len(args.speeds)} samples per rank)",
            fmt(eqm, "", 0),
            fmt(median(eq_steps) and 1e3 * median(eq_steps), " ms", 1),  # type: ignore[operator]
            per_run(eq_rates),
            ratio(eqm, ideal),
            "1.00x",
        ],
        [
            "ideal = sum of the alone throughputs",
            fmt(ideal, "", 0),
            "-",
            per_run(ideal_runs),
            "1.00x",
            ratio(ideal, eqm),
        ],
    ]
    for f in args.speeds:
        rows.append([f"  alone at speed {f:g} (batch {args.batch})", fmt(median(alone[f]), "", 0),
                     fmt(1e3 * args.batch / median(alone[f]), " ms", 1), per_run(alone[f]), "-", "-"])  # type: ignore[operator]  # fmt: skip
    per_rep = ", ".join(f"{a / b:.3f}" for a, b in zip(ub_rates, ideal_runs, strict=True) if a is not None and b)
    print_table(
        f"A. Static: 3 nodes at speeds {speeds}, B={args.batch}, --compute {args.compute}, samples/s "
        f"(steady state), medians over {args.repeats} repeats",
        ["system", "samples/s", "median step", "per repeat", "vs ideal", "vs equal split"],
        rows,
        caption=(
            f"unbroken/ideal = {ratio(ubm, ideal, 3)} (target >= 0.90; per repeat {per_rep}); "
            f"unbroken/equal split = {ratio(ubm, eqm, 3)}. Unbroken's shares at its last step (last repeat): "
            + "/".join(str(last_shares.get(f"n{i}", "-")) for i in range(len(args.speeds)))
            + " (proportional to alone throughput: "
            + "/".join(f"{x:.1f}" for x in prop)
            + f"); epochs spanned by the measured window: {per_run([a['epochs'] for a in ub])}."
            + CPU_CAVEAT.get(args.compute, "")
        ),
    )


def report_dynamic(args: argparse.Namespace, alone: dict[float, list[float]], raw: dict[str, Any]) -> None:
    n = len(args.speeds)
    reps = range(len(raw["unbroken-dynamic"]))
    ideal_before = [n * alone[1.0][r] for r in reps]
    ideal_after = [(n - 1) * alone[1.0][r] + alone[args.slow_factor][r] for r in reps]
    res = [analyse_dynamic(args, run, ideal_after[r]) for r, run in enumerate(raw["unbroken-dynamic"])]

    def col(key: str) -> list[Any]:
        return [r[key] for r in res]

    def row(label: str, xs: list[Any], unit: str = "", digits: int = 0) -> list[str]:
        nums = [x for x in xs if x is not None]
        missing = len(xs) - len(nums)
        med = fmt(median(nums), unit, digits) if nums and missing <= len(xs) // 2 else "not reached"
        return [label, med, ", ".join(fmt(x, "", digits) if x is not None else "never" for x in xs)]

    ratio_before = [b / i if b else None for b, i in zip(col("before"), ideal_before, strict=True)]
    ratio_after = [a / i if a else None for a, i in zip(col("after"), ideal_after, strict=True)]
    S = args.slow_at
    rows = [
        row(f"throughput before (steps {args.warmup}..{S}), samples/s", col("before")),
        row("  ideal before (3 x alone at 1)", ideal_before),
        row("  before / ideal", ratio_before, "x", 3),
        row(f"throughput after (steps {S + (args.steps - S) // 2}..{args.steps}), samples/s", col("after")),
        row(f"  ideal after (2 x alone at 1 + alone at {args.slow_factor:g})", ideal_after),
        row("  after / ideal", ratio_after, "x", 3),
        row(f"steps after S until within {WITHIN:.0%} of the new ideal", col("recover_steps")),
        row("  seconds after S until then", col("recover_s"), " s", 2),
        row(f"steps after S until within {WITHIN:.0%} of the run's own 'after'", col("settle_steps")),
        row("  seconds after S until then", col("settle_s"), " s", 2),
        row("step of the coordinator's first rebalance after S", col("rebalance_step")),
        row("  rebalances after S (epoch changes)", col("rebalances")),
    ]
    last = res[-1]["shares_after"] if res else {}
    print_table(
        f"B. Dynamic: 3 nodes at speed 1, one slowed to {args.slow_factor:g} from step S={S} "
        f"(--throttle {'1,' + str(S) + ':' + str(args.slow_factor)}), B={args.batch}, --compute {args.compute}, "
        f"medians over {len(res)} repeats",
        ["metric", "median", "per repeat"],
        rows,
        caption=(
            f"Throughput per step = B / commit interval; recovery = first sliding median over {WINDOW} steps (all "
            f"after S) within {WITHIN:.0%} of the ideal. Shares at the last step (last repeat): "
            + "/".join(str(last.get(f"n{i}", "-")) for i in range(n))
            + f" (n{n - 1} is the slowed node)."
            + CPU_CAVEAT.get(args.compute, "")
        ),
    )


if __name__ == "__main__":
    main()
