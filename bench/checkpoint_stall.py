"""What a checkpoint costs the step: step time with checkpoints every few steps vs none.

    python bench/checkpoint_stall.py                        # ~50M params, 2 nodes, whole files and fragments
    python bench/checkpoint_stall.py --model small --steps 200 --every 10

Same job, same samples, side by side in one invocation: ``--nodes`` (2) on loopback train the
``--model`` MLP of ``bench/jobs.py`` (``large``: ~50M parameters, SGD with momentum: the
state is 400 MB) for ``--steps`` steps, without checkpoints (the baseline), with whole
checkpoints every ``--every`` steps (rank 0 captures the state at the step boundary and a
background thread writes it), and with erasure-coded fragments (``--fragments 1,1``: every
node captures, packs and encodes the state in the background and writes its own fragment),
and, for the consistency audit's cost, with ``--audit-every`` the same period and no
checkpoints (every trainer digests its state, the digests are all-gathered, and the state
is copied in memory as the point a failed audit comes back to).

Per configuration: the median step time (gaps between consecutive commits after
``--warmup``), the median of the steps that took a checkpoint (the capture happens in them:
the capture happens right after a commit, so it lands in the gap to the next one: the
stall), and their ratios to the baseline. The background write competes for the same
2 cores, so the steps after a checkpoint slow down too: the mean step time is reported as
well. The warm-up (15 steps, about 8 s of the large model) leaves out the start-up; the
first checkpoint (step ``--every``), whose buffers every later one reuses, is reported on
its own, whether or not it falls in the warm-up.
Medians over ``--repeats`` interleaved repeats.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, write_results
from unbroken.testing import LocalCluster


def run(args: argparse.Namespace, workdir: Path, config: str) -> dict[str, Any]:
    env = jobs.env_for(args.steps, opt="sgd")
    coord = ["--balance", "weights", "--audit-every", str(args.every) if config == "audit" else "0"]
    node_args: list[str] = []
    if config in ("whole", "fragments"):
        node_args = ["--checkpoint-every", str(args.every)]
    if config == "fragments":
        coord += ["--fragments", "1,1"]
    with LocalCluster(jobs.job_ref(args.model), workdir, env=env, min_nodes=args.nodes, coordinator_args=coord) as c:
        c.start_coordinator()
        for i in range(args.nodes):
            extra = ["--checkpoint-dir", str(workdir / f"ckpt{i}")] if node_args else []
            c.start_node(f"n{i}", extra=[*node_args, *extra])
        codes = c.wait_exit(timeout=args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"{config}: run failed: {codes}\n{c.diagnostics()}")
        commits = [e for e in c.nodes["n0"].entries() if e.get("kind") == "commit"]
        # A checkpoint still being written when the next is due skips that one: it costs
        # nothing, so only the steps whose checkpoint started count as checkpoint steps.
        started = {int(mt.group(1)) for e in c.events() if e["kind"] == "checkpoint"
                   if (mt := re.search(r"of step (\d+) being written", e.get("reason", "")))}  # fmt: skip
    gaps: dict[int, float] = {}
    for a, b in itertools.pairwise(commits):
        if b["step"] == a["step"] + 1 and b["step"] > args.warmup:
            gaps[b["step"]] = b["t"] - a["t"]
    due = list(range(args.every, args.steps, args.every))
    # The checkpoints that started (audits are never skipped: the schedule's).
    marks = started if config in ("whole", "fragments") else set(due)
    # The state is captured right after step s is committed: the stall lands in the gap to s + 1.
    with_ckpt = [g for s, g in gaps.items() if config != "none" and s - 1 in marks]
    first = next((b["t"] - a["t"] for a, b in itertools.pairwise(commits) if b["step"] == args.every + 1), None)
    med, mean = statistics.median(gaps.values()), statistics.fmean(gaps.values())
    ckpt = statistics.median(with_ckpt) if with_ckpt else None
    offsets: dict[int, list[float]] = {}
    for s, g in gaps.items():
        # Counted from the last one that started (the schedule's where none is taken)
        last = max((k for k in marks if k < s), default=None)
        if last is not None and s - 1 - last < args.every:
            offsets.setdefault(s - 1 - last, []).append(g / med)
    return {
        "by_offset": {o: statistics.median(v) for o, v in sorted(offsets.items())},
        "written": f"{len(started & set(due))}/{len(due)}" if config in ("whole", "fragments") else None,
        "median": med,
        "mean": mean,
        "ckpt_steps": ckpt,
        "first": first if config in ("whole", "fragments") else None,
        # Within the run: the machine's speed drifts by 10 % between runs minutes apart.
        "mean_in_run": mean / med,
        "ckpt_in_run": ckpt / med if ckpt is not None else None,
        # for bench/render.py's plot: every measured gap, and the steps a checkpoint (audit) started at
        "gaps": {int(s): round(g, 5) for s, g in gaps.items()},
        "marks": sorted(int(k) for k in marks) if config != "none" else [],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(jobs.JOBS), default="large")
    p.add_argument("--steps", type=int, default=80, help="steps per run")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--warmup", type=int, default=15, help="steps left out at the start")
    p.add_argument("--repeats", type=int, default=1, help="repeats of every configuration, interleaved")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one run")
    p.add_argument("--nodes", type=int, default=2, help="nodes (1 on 2 cores: the capture has a core of its own)")
    p.add_argument("--configs", default="none,whole,fragments,audit", help="which configurations, comma-separated")
    args = p.parse_args()
    print_command()
    configs = [c for c in args.configs.split(",") if c]
    if configs[0] != "none" or not set(configs) <= {"none", "whole", "fragments", "audit"}:
        p.error("--configs: none first, then any of whole, fragments, audit")
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    progress = ProgressLine(args.repeats * len(configs))
    with tempfile.TemporaryDirectory(prefix="ub-ckpt-") as tmp:
        try:
            for rep in range(args.repeats):
                for config in configs[rep % len(configs) :] + configs[: rep % len(configs)]:
                    progress.update(f"repeat {rep + 1}/{args.repeats}: {config} running")
                    r = run(args, Path(tmp) / f"{config}-{rep}", config)
                    raw[config].append(r)
                    progress.update(
                        f"repeat {rep + 1}/{args.repeats}: {config}: median step {1e3 * r['median']:.0f} ms", 1
                    )
        finally:
            progress.close()
    base = median(r["median"] for r in raw["none"])
    base_mean = median(r["mean"] for r in raw["none"])
    base_in_run = median(r["mean_in_run"] for r in raw["none"])
    rows = []
    for config in configs:
        med = median(r["median"] for r in raw[config])
        mean = median(r["mean"] for r in raw[config])
        stall = median(r["ckpt_steps"] for r in raw[config]) if config != "none" else None
        first = median(r["first"] for r in raw[config]) if config in ("whole", "fragments") else None
        mean_in_run = median(r["mean_in_run"] for r in raw[config])
        ckpt_in_run = median(r["ckpt_in_run"] for r in raw[config]) if config != "none" else None
        rows.append(
            [
                config if config != "none" else "none (baseline)",
                fmt(med and 1e3 * med, " ms", 1),
                ratio(med, base),
                fmt(mean and 1e3 * mean, " ms", 1),
                ratio(mean, base_mean),
                fmt(stall and 1e3 * stall, " ms", 1),
                ratio(stall, base),
                fmt(first and 1e3 * first, " ms", 1),
                ratio(first, base),
                ratio(mean_in_run, base_in_run),
                ratio(ckpt_in_run, 1.0),
                ", ".join(r["written"] for r in raw[config]) if config in ("whole", "fragments") else "-",
            ]
        )
    n_params = jobs.num_params(args.model)
    print_table(
        f"Checkpoint stall: {args.model} MLP ({n_params / 1e6:.1f}M params), {args.nodes} node(s), {args.steps} steps, "
        f"checkpoint every {args.every}, medians over {args.repeats} repeats",
        [
            "checkpoints",
            "median step",
            "vs none",
            "mean step",
            "vs none",
            "step with a checkpoint",
            "vs none",
            "first checkpoint",
            "vs none",
            "mean ÷ median, vs none",
            "checkpoint step ÷ median",
            "written / due, per run",
        ],
        rows,
        caption="whole: rank 0 captures, a thread writes ckpt-N.pt; fragments: every node captures, packs, "
        "encodes (zfec, k=1 m=1) and writes its fragment in a thread; audit: no checkpoints, a consistency audit "
        "(digest all-gather + an in-memory copy to come back to) every N steps instead. 'Step with a checkpoint': "
        "the gap after the commit that triggered it (it includes the capture); 'first checkpoint': the same for the "
        "first one, whose buffers (reused by the later ones) are laid out ahead. The last two columns compare "
        "within each run (the machine's speed drifts by about 10 % between runs): its mean step over its median "
        "step, as a ratio to the baseline's, and its checkpoint steps over its median step. A checkpoint due while the "
        "last is still being written is skipped (written / due): only the steps whose checkpoint started count.",
    )
    # Where the cost lands: the capture in the first gap, the write in the ones after it.
    print("Each gap over its run's median step, by commits since the checkpoint's (medians over repeats):")
    by_offset: dict[str, dict[str, float | None]] = {}
    for config in configs:
        row = [[r["by_offset"][o] for r in raw[config] if o in r["by_offset"]] for o in range(args.every)]
        print(f"  {config:>9}: " + " ".join(f"+{o + 1} {median(x):.2f}" for o, x in enumerate(row) if x))
        by_offset[config] = {f"+{o + 1}": median(x) for o, x in enumerate(row) if x}
    write_results(
        {
            "every": args.every,
            "warmup": args.warmup,
            "by_offset": by_offset,
            "step_times": {c: {"gaps": rs[0]["gaps"], "marks": rs[0]["marks"]} for c, rs in raw.items() if rs},
        }
    )


if __name__ == "__main__":
    main()
