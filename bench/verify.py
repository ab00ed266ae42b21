"""Checking the work: what a validator's checks cost the trainers, and how soon one catches a
trainer that computes wrongly (`unbroken.train.checks`, `unbroken.control.checks`).

    python bench/verify.py                # 3 repeats of the cost runs, 3 of each detection: ~10 min on 2 cores
    python bench/verify.py --short        # 1 repeat each, shorter runs: ~3 min
    python bench/verify.py --workdir /tmp/ub-verify --repeats 5

Every run is the ``small`` MLP of ``bench/jobs.py`` (665,120 parameters: a 2.66 MB float32
gradient), global batch B = 96, SGD, ``--balance weights`` (equal shares of 32 for the
three trainers t0..t2, fixed), nodes on loopback (`unbroken.testing.LocalCluster`,
OMP_NUM_THREADS=1), all on this machine's cores: a validator's recomputation takes CPU from
the trainers here, which it would not on a machine of its own (a weak node's). So most of a
slice's compute is emulated, ``--sample-ms`` per sample (a sleep in each forward pass, as in
``bench/hetero.py``: a trainer's slice of 32 is 16 ms at the default 0.5), on top of the
MLP's real forward and backward; the validator recomputes the same (sleeps included). The
extra node runs ``--throttle`` ``--validator-throttle`` (default 0.5: half the trainers' speed).

COST (``--steps`` steps each, the three interleaved, the order rotating each repeat):

- trainers (the baseline): t0..t2 alone;
- + standby: a fourth member ``--role standby`` (it joins every all-reduce, checks nothing);
- + validator: that member ``--role validator``: the trainers commit to each slice (a digest
  of its gradient, parameter by parameter, as it goes out) and the validator recomputes
  randomly chosen slices bit for bit, on a thread beside its step loop.

Figures: the trainers' time per step in the steady state, ``(t[k1] - t[k0]) / (k1 - k0)``
from k0 = ``--warmup`` to the last step, t[k] the median over the trainers of their commit
time of step k (absolute, and as ratios: + validator against trainers, and against +
standby, which leaves only the checking); the checks the validator made (per 100 steps), and
the time its recomputations took; and, measured in this process, what committing costs a
trainer per step (the digests of a 665,120-float gradient), against the trainers' step.

DETECTION (``--detect-repeats`` of each fault, ``--detect-steps`` steps at most): the three
trainers and the validator, t2 faulty from step F = ``--fault-at``: ``shrink@grad:F`` (its
gradient x 0.9 from F on) or ``shift@data:F`` (it reads the samples of its slice of the
next step from F on). Nothing else flags either (the norms are ordinary). Figures:
committed steps of wrong work until the validator's first finding (the checked step - F + 1),
until the bench (the group's committed step when two members' findings named t2, - F), and
the seconds from the fault to each; the checks the validator made in between. A run stops
once t2 is benched. Absolute times are noisy here (other work shares these 2 cores): read
the ratios and the step counts.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, write_results
from unbroken.testing import LocalCluster
from unbroken.train.commitment import GradientDigest

MODEL = "small"
TRAINERS = ["t0", "t1", "t2"]
EXTRA = "x"
BAD = "t2"
SETUPS = ["trainers", "+ standby", "+ validator"]
FAULTS = ["shrink", "shift"]
PHASE = {"shrink": "grad", "shift": "data"}


def cluster(args: argparse.Namespace, workdir: Path, steps: int) -> LocalCluster:
    env = jobs.env_for(steps, args.batch, opt="sgd", sample_ms=args.sample_ms)
    return LocalCluster(jobs.job_ref(MODEL), workdir, env=env, min_nodes=3, coordinator_args=["--balance", "weights"])


def start(c: LocalCluster, args: argparse.Namespace, extra: str | None, fault: str = "") -> None:
    c.start_coordinator()
    for name in TRAINERS:
        c.start_node(name, fault=fault if name == BAD else "")
    if extra is not None:
        c.start_node(EXTRA, extra=["--role", extra, "--throttle", str(args.validator_throttle)])


def commit_times(entries: dict[str, list[dict[str, Any]]], names: list[str]) -> dict[int, float]:
    per_step: dict[int, list[float]] = {}
    for name in names:
        for e in entries[name]:
            if e.get("kind") == "commit":
                per_step.setdefault(int(e["step"]), []).append(float(e["t"]))
    return {k: statistics.median(v) for k, v in sorted(per_step.items())}


# ------------------------------------------------------------------- cost


def run_cost(args: argparse.Namespace, workdir: Path, setup: str) -> dict[str, Any]:
    extra = {"trainers": None, "+ standby": "standby", "+ validator": "validator"}[setup]
    with cluster(args, workdir, args.steps) as c:
        start(c, args, extra)
        codes = c.wait_exit(timeout=args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"{setup}: run failed: {codes}\n{c.diagnostics()}")
        entries = {name: n.entries() for name, n in c.nodes.items()}
        found = [e for e in c.events() if e.get("kind") in ("check", "bad-work")]
    times = commit_times(entries, TRAINERS)
    k0, k1 = args.warmup, max(times)
    checks = [e for e in entries.get(EXTRA, []) if e.get("kind") == "check" and e.get("digest")]
    skipped = [e for e in entries.get(EXTRA, []) if e.get("kind") == "check" and not e.get("digest")]
    return {
        "step_s": (times[k1] - times[k0]) / (k1 - k0),
        "checks": len(checks),
        "skipped": len(skipped),
        "check_s": median(float(e["seconds"]) for e in checks),
        "found": len(found),
        "digests": {e.get("digest") for n in TRAINERS for e in entries[n] if e.get("kind") == "final"},
    }


def commit_cost(repeats: int = 50) -> float:
    """Seconds a trainer spends per step on its commitment: digests of the gradient's
    parameters (in the model's 6 pieces) and of its 32 positions."""
    model = jobs.MLP(*jobs.SHAPES[MODEL])
    numels = [p.numel() for p in model.parameters()]
    grad = torch.randn(sum(numels))
    digest = GradientDigest(numels)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        digest.reset()
        digest.add(0, grad)
        digest.commitment(list(range(32)))
        best = min(best, time.perf_counter() - t)
    return best


# ------------------------------------------------------------------- detection


def run_detection(args: argparse.Namespace, workdir: Path, fault: str) -> dict[str, Any]:
    F = args.fault_at
    with cluster(args, workdir, args.detect_steps) as c:
        start(c, args, "validator", f"{fault}@{PHASE[fault]}:{F}")
        deadline = time.monotonic() + args.timeout
        benched: dict[str, Any] | None = None
        while benched is None and time.monotonic() < deadline:
            if all(n.proc.poll() is not None for n in c.nodes.values()):
                break
            benched = next((e for e in c.events() if e.get("kind") == "bad-work"), None)
            time.sleep(0.1)
        events = c.events()
        entries = {name: n.entries() for name, n in c.nodes.items()}
    fired = next((e for e in entries[BAD] if e.get("kind") == "fault"), None)
    if fired is None:
        raise RuntimeError(f"{fault}: {BAD} logged no fault")
    times = commit_times(entries, TRAINERS)
    found = next((e for e in events if e.get("kind") == "check" and "differs" in e.get("reason", "")), None)
    found_step = int(re.search(r"slice of step (\d+)", found["reason"]).group(1)) if found else None  # type: ignore[union-attr]
    t_fault = times.get(F, float(fired["t"]))
    t_found = next((float(e["t"]) for e in entries[EXTRA] if e.get("kind") == "check" and e.get("step") == found_step
                    and e.get("trainer", "").startswith(BAD)), None)  # fmt: skip
    bench_step = int(benched["step"]) if benched else None
    t_bench = times.get(bench_step) if bench_step is not None else None
    checks = [e for e in entries[EXTRA] if e.get("kind") == "check" and e.get("digest")]
    before = [e for e in checks if bench_step is None or int(e["step"]) < bench_step]
    honest = [e for e in events if e.get("kind") in ("check", "bad-work") and not e["reason"].startswith(BAD)]
    return {
        "found": None if found_step is None else found_step - F + 1,
        "benched": None if bench_step is None else bench_step - F,
        "found_s": None if t_found is None else t_found - t_fault,
        "benched_s": None if t_bench is None else t_bench - t_fault,
        "checks": len([e for e in before if int(e["step"]) >= F]),
        "of_bad": len([e for e in before if int(e["step"]) >= F and e["trainer"].startswith(BAD)]),
        "honest_named": len(honest),
    }


# ------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="one repeat of everything, shorter runs")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each cost run (interleaved; medians; 0: none)")
    p.add_argument("--detect-repeats", type=int, default=3, help="repeats of each detection run")
    p.add_argument("--steps", type=int, default=400, help="steps of a cost run")
    p.add_argument("--warmup", type=int, default=50, help="steps left out of the time per step")
    p.add_argument("--detect-steps", type=int, default=1000, help="steps at most of a detection run")
    p.add_argument("--fault-at", type=int, default=30, help="the faulty trainer's first wrong step F")
    p.add_argument("--batch", type=int, default=96, help="global batch B (divisible by 3)")
    p.add_argument("--validator-throttle", type=float, default=0.5, help="the extra node's --throttle")
    p.add_argument("--sample-ms", type=float, default=0.5, help="emulated compute per sample (a sleep; 0: none)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    if args.short:
        args.repeats, args.detect_repeats, args.steps, args.warmup = 1, 1, 200, 40
    if args.batch % len(TRAINERS):
        p.error(f"--batch must be divisible by {len(TRAINERS)}")
    if args.steps < args.warmup + 50:
        p.error("--steps must exceed --warmup by at least 50")
    return args


def main() -> None:
    args = parse_args()
    print_command()
    n = jobs.num_params(MODEL)
    print(
        f"model {MODEL} MLP ({n:,} parameters, {4 * n / 1e6:.2f} MB float32 gradient), SGD, B={args.batch}, "
        f"{len(TRAINERS)} trainers with equal shares of {args.batch // len(TRAINERS)} (--balance weights), "
        f"{args.sample_ms:g} ms/sample of emulated compute (a sleep), the extra node at --throttle "
        f"{args.validator_throttle:g}, all on loopback on this machine's cores, "
        f"OMP_NUM_THREADS=1; cost runs of {args.steps} steps (time per step after step {args.warmup}), "
        f"detection from step {args.fault_at}",
        flush=True,
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-verify-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    cost: dict[str, list[dict[str, Any]]] = {s: [] for s in SETUPS}
    detect: dict[str, list[dict[str, Any]]] = {f: [] for f in FAULTS}
    progress = ProgressLine(args.repeats * len(SETUPS) + args.detect_repeats * len(FAULTS))
    try:
        for rep in range(args.repeats):
            k = rep % len(SETUPS)
            for setup in SETUPS[k:] + SETUPS[:k]:
                progress.update(f"cost {rep + 1}/{args.repeats}: {setup}")
                r = run_cost(args, root / f"cost-{setup.strip('+ ')}-{rep}", setup)
                cost[setup].append(r)
                progress.update(f"cost {rep + 1}/{args.repeats}: {setup}: {1e3 * r['step_s']:.2f} ms/step", 1)
        for rep in range(args.detect_repeats):
            for fault in FAULTS:
                progress.update(f"detection {rep + 1}/{args.detect_repeats}: {fault}")
                r = run_detection(args, root / f"detect-{fault}-{rep}", fault)
                detect[fault].append(r)
                progress.update(f"detection {rep + 1}/{args.detect_repeats}: {fault}: {r}", 1)
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()
    report(args, cost, detect, commit_cost())


def report(
    args: argparse.Namespace,
    cost: dict[str, list[dict[str, Any]]],
    detect: dict[str, list[dict[str, Any]]],
    commit_s: float,
) -> None:
    def med(setup: str, key: str) -> float | None:
        return median(r[key] for r in cost[setup])

    base, standby = med("trainers", "step_s"), med("+ standby", "step_s")
    if args.repeats:
        cost_table(args, cost, med, base, standby, commit_s)
    else:
        print(f"(no cost runs) committing, measured here: {1e6 * commit_s:.0f} us a step")
    if args.detect_repeats:
        detection_table(args, detect)


def cost_table(
    args: argparse.Namespace,
    cost: dict[str, list[dict[str, Any]]],
    med: Any,
    base: float | None,
    standby: float | None,
    commit_s: float,
) -> None:
    rows = []
    for setup in SETUPS:
        t = med(setup, "step_s")
        checks = med(setup, "checks")
        per_100 = None if checks is None or setup != "+ validator" else 100 * checks / (args.steps - 1)
        rows.append(
            [
                setup + (" (baseline)" if setup == "trainers" else ""),
                fmt(t and 1e3 * t, " ms", 2),
                ratio(t, base, 3),
                ratio(t, standby, 3) if setup != "trainers" else "-",
                fmt(per_100, "", 1) if per_100 is not None else "-",
                fmt(med(setup, "check_s") and 1e3 * med(setup, "check_s"), " ms", 1)  # type: ignore[operator]
                if setup == "+ validator"
                else "-",
                str(sum(r["found"] for r in cost[setup])),
            ]
        )
    per_run = "; ".join(f"{s}: " + ", ".join(f"{1e3 * r['step_s']:.2f}" for r in cost[s]) for s in SETUPS)
    identical = all(len(r["digests"]) == 1 for rs in cost.values() for r in rs)
    share = f" = {100 * commit_s / base:.2f}% of the baseline's step" if base else ""
    print_table(
        f"COST: trainers' time per step (medians of {args.repeats})",
        ["setup", "time/step", "vs trainers", "vs + standby", "checks/100 steps", "a check took", "events"],
        rows,
        caption=(
            f"per run (ms/step): {per_run}. Trainers' final states identical in every run: {identical}. "
            f"Committing, measured here: {1e6 * commit_s:.0f} us a step{share}. "
            "'events': check or bad-work events (an honest group: none)."
        ),
    )


def detection_table(args: argparse.Namespace, detect: dict[str, list[dict[str, Any]]]) -> None:
    rows = []
    for fault in FAULTS:
        rs = detect[fault]

        def span(key: str, rs: list[dict[str, Any]] = rs) -> str:
            vals = [r[key] for r in rs if r[key] is not None]
            if not vals:
                return "-"
            shown = fmt(median(vals), "", 1 if isinstance(vals[0], float) else 0)
            return shown + (f" ({min(vals):g}-{max(vals):g})" if len(vals) > 1 else "")

        caught = sum(1 for r in rs if r["benched"] is not None)
        rows.append(
            [
                f"{fault}@{PHASE[fault]}:{args.fault_at}",
                f"{caught}/{len(rs)}",
                span("found"),
                span("benched"),
                fmt(median(r["found_s"] for r in rs), " s", 2),
                fmt(median(r["benched_s"] for r in rs), " s", 2),
                span("checks"),
                span("of_bad"),
                str(sum(r["honest_named"] for r in rs)),
            ]
        )
    print_table(
        f"DETECTION: one validator, {len(TRAINERS)} trainers, {BAD} wrong from step {args.fault_at} "
        f"(medians of {args.detect_repeats}, range)",
        [
            "fault",
            "benched",
            "steps to 1st finding",
            "steps to bench",
            "to finding",
            "to bench",
            "checks meanwhile",
            f"of {BAD}",
            "honest named",
        ],
        rows,
        caption=(
            "steps: committed steps of wrong work (to the first finding: the checked step - F + 1; to the bench: "
            "the group's step when it was named - F). A finding is one member's word: a second member (here a "
            "trainer, recomputing on its own step loop) checks again before the trainer is named and benched."
        ),
    )


if __name__ == "__main__":
    main()
    write_results()
