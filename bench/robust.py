"""Robust aggregation: what ``--aggregate clip`` / ``trimmed`` cost, and what they buy.

    python bench/robust.py                  # 3 rules x (clean, flipping): ~3.5 min on 2 idle cores, ~5.5 loaded
    python bench/robust.py --repeats 3      # medians over 3 interleaved repeats, ~3x as long
    python bench/robust.py --rules mean,clip:3,trimmed:0.25 --opt sgd --workdir /tmp/ub-robust

Every run is the same job: the ~0.67M-parameter MLP of ``bench/jobs.py`` (665,120
parameters: 2.66 MB of float32 gradient), global batch B, ``--steps`` steps (the same B x
steps samples in the same order for every run), 4 nodes n0..n3 on loopback
(`unbroken.testing.LocalCluster`, OMP_NUM_THREADS=1), the coordinator's ``--balance
weights`` (every node ``--weight 1``: equal shares of B/4, fixed for the whole run) and
its ``--aggregate RULE`` for each rule of ``--rules``: ``mean`` (the baseline: one ring
all-reduce of the step's flat tensor), ``clip:2`` and ``trimmed:0.25`` (an all-gather of
every member's flat tensor, combined element-wise; `unbroken.comm.robust`). Each rule runs
twice per repeat:

- clean: four honest nodes; its held-out loss is what the rule costs in accuracy when
  nobody misbehaves.
- flipping: n3 starts with ``--fault flip@grad:F`` (``--flip-at``, default 5): from step F
  on it sends -10x its gradient every step (inside the guard's range, so nothing refuses
  it); its held-out loss is what the rule buys.

Per run:

- time/step: steady state, ``(t[k1] - t[k0]) / (k1 - k0)`` from k0 = ``--warmup`` to the
  last step k1; t[k] is the median over the 4 nodes of their commit time of step k (the
  commit logs' ``t``).
- sent/node/step: what a node sends per step by the runtime's own count (`Wire`: message
  sizes of gloo's ring algorithms; ring all-reduce 2(n-1)/n x the flat tensor, ring
  all-gather (n-1) x). The commit log's ``wire`` field is only written for a step that
  sent inter-zone bytes, so with one zone (this bench) the commit logs carry none; the
  bench instead polls the coordinator's ``/api/state`` every ``--poll`` s during the run,
  whose ``bytes_sent`` per member is the node's running total from its progress messages,
  and takes the least-squares slope of that total against the member's step over the
  steps past k0 (median over nodes). The step there comes from heartbeats, up to a step
  ahead of the byte total: the slope is exact to within about 1%.
- written/node/step (OS): the same slope for ``wchar`` in ``/proc/PID/io`` (every byte the
  node process handed to write/send system calls: gloo's sockets, plus a few hundred bytes
  per step of logs and control messages): an independent check of the runtime's count.
- held-out loss: the cross-entropy of n0's final state (``bench/jobs.py:heldout_loss``,
  ``--heldout`` fresh samples with the training set's labelling); every run also checks
  that all 4 final states are identical (n3 included: it applies the combined step too).
- progress kept: ``(L0 - L) / (L0 - L_mean,clean)`` with L0 the untrained model's held-out
  loss: the share of the clean mean's improvement a flipping run keeps ("none" when it
  ends worse than the untrained model).

Time and bytes are the COST: medians over the clean and the flipping runs of a rule together
(the flip changes values, not work or sizes: two samples per repeat). Held-out losses are
the BENEFIT. Ratios are ours / baseline: time and bytes against ``mean``, losses against
``mean`` clean. Runs are interleaved (clean in rule order, then flipping in reverse, so
that a drift of the machine's load hits every rule alike), the order rotating each repeat;
figures are medians over ``--repeats``. Losses vary little between repeats (fixed seeds;
only the join order, hence the ranks' summation order, changes: ~1% on a flipping run's
loss seen), times a lot. Other benchmarks and tests may be
running on this machine at the same time: absolute times are noisy, read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, write_results
from unbroken.comm.reduce import VOTE_SLOTS
from unbroken.errors import ConfigError
from unbroken.specs import parse_rule
from unbroken.testing import LocalCluster

MODEL = "small"
NODES = ["n0", "n1", "n2", "n3"]
BAD = "n3"
EXTRA = VOTE_SLOTS
"""Slots after the gradient in the step's flat tensor (vote, samples, switch, loss, overflow),
then one gradient-norm slot per member (`unbroken.train.step`)."""


# ------------------------------------------------------------------- one run


def proc_wchar(pid: int) -> int | None:
    """Bytes the process has passed to write-like system calls so far (``/proc/PID/io``)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return None


def run_config(
    args: argparse.Namespace, workdir: Path, rule: str, flip: bool, progress: ProgressLine
) -> dict[str, Any]:
    env = jobs.env_for(args.steps, args.batch, opt=args.opt, samples=args.samples)
    coord = ["--aggregate", rule, "--balance", "weights"]
    what = f"{rule} {'flipping' if flip else 'clean'}"
    # name -> [(step, runtime's byte total, OS wchar)], sampled during the run
    polls: dict[str, list[tuple[int, int, int | None]]] = {n: [] for n in NODES}
    with LocalCluster(jobs.job_ref(MODEL), workdir, env=env, min_nodes=len(NODES), coordinator_args=coord) as c:
        c.start_coordinator()
        for name in NODES:
            c.start_node(name, fault=f"flip@grad:{args.flip_at}" if flip and name == BAD else "")
        deadline = time.monotonic() + args.timeout
        last_note = 0.0
        while any(n.proc.poll() is None for n in c.nodes.values()):
            failed = {name: n.proc.poll() for name, n in c.nodes.items() if n.proc.poll() not in (None, 0)}
            if failed:
                raise RuntimeError(f"{what}: node(s) failed: {failed}\n{c.diagnostics()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not finished within {args.timeout:g} s\n{c.diagnostics()}")
            wchar = {name: proc_wchar(n.proc.pid) for name, n in c.nodes.items()}
            try:
                members = c.state()["members"]
            except OSError:
                members = []
            for mem in members:
                if mem["name"] in polls:
                    sent = int(mem["bytes_sent"]["intra_zone"]) + int(mem["bytes_sent"]["inter_zone"])
                    polls[mem["name"]].append((int(mem["step"]), sent, wchar.get(mem["name"])))
            now = time.monotonic()
            if members and (progress.tty or now - last_note >= 15):
                step = min(int(mem["step"]) for mem in members)
                progress.update(
                    f"{what}: " + (f"step {step}/{args.steps}" if step else f"{len(members)} nodes starting")
                )
                last_note = now
            time.sleep(args.poll)
        codes = c.wait_exit(timeout=30)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"{what}: run failed: {codes}\n{c.diagnostics()}")
        entries = {name: n.entries() for name, n in c.nodes.items()}
        states = {name: torch.load(n.final_state, weights_only=True)["model"] for name, n in c.nodes.items()}
        refusals = sum(1 for e in c.events() if e.get("kind") == "bad-gradient")
    model = jobs.MLP(*jobs.SHAPES[MODEL])
    model.load_state_dict(states["n0"])
    fired = any(e.get("kind") == "fault" and e.get("signal") == "flip" for e in entries[BAD])
    if flip and not fired:
        raise RuntimeError(f"{what}: {BAD} logged no flip fault")
    return {
        **analyse(args, entries, polls),
        "heldout": jobs.heldout_loss(MODEL, model, args.samples, args.heldout),
        "identical": all(
            all(torch.equal(states["n0"][k], s[k]) for k in states["n0"]) and s.keys() == states["n0"].keys()
            for s in states.values()
        ),
        "fired": fired,
        "refusals": refusals,
    }


def slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of y against x (None with fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    return statistics.linear_regression([x for x, _ in points], [y for _, y in points]).slope


def analyse(
    args: argparse.Namespace,
    entries: dict[str, list[dict[str, Any]]],
    polls: dict[str, list[tuple[int, int, int | None]]],
) -> dict[str, Any]:
    per_step: dict[int, list[float]] = {}
    for es in entries.values():
        for e in es:
            if e.get("kind") == "commit":
                per_step.setdefault(int(e["step"]), []).append(float(e["t"]))
    times = {k: statistics.median(v) for k, v in sorted(per_step.items())}
    k0, k1 = args.warmup, max(times, default=0)
    step_s = (times[k1] - times[k0]) / (k1 - k0) if k0 in times and k1 > k0 else None
    epochs = {
        e.get("epoch") for es in entries.values() for e in es if e.get("kind") == "commit" and int(e["step"]) > k0
    }

    start: int = args.warmup
    end: int = args.steps

    def in_window(step: int) -> bool:
        return start <= step < end  # a finished node's totals stop moving

    sent = [slope([(s, b) for s, b, _ in ps if in_window(s)]) for ps in polls.values()]
    wrote = [slope([(s, w) for s, _, w in ps if in_window(s) and w is not None]) for ps in polls.values()]
    losses = {int(e["step"]): float(e["loss"]) for e in entries["n0"] if e.get("kind") == "commit"}
    return {
        "steps": len(times),
        "step_s": step_s,
        "epochs": len(epochs),
        "sent": median(sent),
        "wrote": median(wrote),
        "polls": min(sum(1 for s, _, _ in ps if in_window(s)) for ps in polls.values()),
        "train_last": losses[max(losses)] if losses else None,
    }


def untrained_heldout(args: argparse.Namespace) -> float:
    """Held-out loss of the job's initial model (the same seed as every node's)."""
    model, _ = jobs.JOBS[MODEL]().build()
    assert isinstance(model, jobs.MLP)
    return jobs.heldout_loss(MODEL, model, args.samples, args.heldout)


# ------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rules", default="mean,clip:2,trimmed:0.25", help="--aggregate rules, comma-separated, mean first")
    p.add_argument("--repeats", type=int, default=1, help="repeats of every run, interleaved (medians reported)")
    p.add_argument("--steps", type=int, default=150, help="steps of every run (the same sample budget for all)")
    p.add_argument("--warmup", type=int, default=20, help="steps left out of time and bytes per step")
    p.add_argument("--batch", type=int, default=96, help="global batch B (divisible by 4: equal shares)")
    p.add_argument("--opt", choices=["adam", "sgd"], default="adam", help="the job's optimizer (bench/jobs.py)")
    p.add_argument("--flip-at", type=int, default=5, help="the flipping node's first bad step (flip@grad:F)")
    p.add_argument("--samples", type=int, default=4096, help="training set size")
    p.add_argument("--heldout", type=int, default=2048, help="held-out samples for the final loss")
    p.add_argument("--poll", type=float, default=0.25, help="seconds between samples of bytes sent")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    args.rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    if args.rules[:1] != ["mean"]:
        p.error("--rules must start with 'mean' (the baseline of every ratio)")
    for r in args.rules:
        try:
            parse_rule(r)
        except ConfigError as exc:
            p.error(str(exc))
    if args.batch % len(NODES):
        p.error(f"--batch must be divisible by {len(NODES)} (equal shares)")
    if args.steps < args.warmup + 20:
        p.error("--steps must exceed --warmup by at least 20")
    if not 0 <= args.flip_at < args.steps:
        p.error("--flip-at must be a step of the run")
    return args


def main() -> None:
    args = parse_args()
    print_command()
    n_params = jobs.num_params(MODEL)
    print(
        f"model {MODEL} MLP ({n_params:,} parameters, {4 * n_params / 1e6:.2f} MB float32 gradient), {args.opt}, "
        f"B={args.batch}, {args.steps} steps = {args.batch * args.steps:,} samples per run (time and bytes per "
        f"step after step {args.warmup}); {len(NODES)} nodes on loopback, --balance weights (equal shares of "
        f"{args.batch // len(NODES)}), OMP_NUM_THREADS=1; rules {', '.join(args.rules)}, each clean and with "
        f"{BAD} flipping from step {args.flip_at} (flip@grad:{args.flip_at})",
        flush=True,
    )
    # clean in rule order, then flipping in reverse: every rule's mean position is the same, so a
    # linear drift of the machine's load hits all rules alike
    configs = [(rule, False) for rule in args.rules] + [(rule, True) for rule in reversed(args.rules)]
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-robust-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    raw: dict[tuple[str, bool], list[dict[str, Any]]] = {cfg: [] for cfg in configs}
    progress = ProgressLine(args.repeats * len(configs))
    try:
        for rep in range(args.repeats):
            k = rep % len(configs)
            for rule, flip in configs[k:] + configs[:k]:
                what = f"repeat {rep + 1}/{args.repeats}: {rule} {'flipping' if flip else 'clean'}"
                progress.update(f"{what} running")
                t0 = time.monotonic()
                wd = root / f"{rule.replace(':', '_')}-{'flip' if flip else 'clean'}-{rep}"
                r = run_config(args, wd, rule, flip, progress)
                raw[(rule, flip)].append(r)
                note = (
                    f"{fmt(r['step_s'] and 1e3 * r['step_s'], ' ms', 1)}/step, "
                    f"{fmt(r['sent'] and r['sent'] / 1e6, ' MB', 2)} sent/node/step, held-out loss {r['heldout']:.4g}"
                )
                progress.update(f"{what}: {note} ({time.monotonic() - t0:.0f} s)", 1)
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()
    report(args, raw, untrained_heldout(args))


def times_x(a: float | None, b: float | None) -> str:
    """``ratio`` that stays readable when a diverged run's loss is orders of magnitude off."""
    if a is None or b is None or b == 0 or abs(a / b) < 100:
        return ratio(a, b, 3)
    return f"{a / b:.3g}x"


def report(args: argparse.Namespace, raw: dict[tuple[str, bool], list[dict[str, Any]]], start: float) -> None:
    def med(rule: str, key: str, flips: tuple[bool, ...] = (False, True)) -> float | None:
        return median(r[key] for flip in flips for r in raw[(rule, flip)])

    base_t, base_b = med("mean", "step_s"), med("mean", "sent")
    base_l = med("mean", "heldout", (False,))
    flat = jobs.num_params(MODEL) + EXTRA + len(NODES)
    rows = []
    for rule in args.rules:
        t, sent, wrote = med(rule, "step_s"), med(rule, "sent"), med(rule, "wrote")
        clean, bad = med(rule, "heldout", (False,)), med(rule, "heldout", (True,))
        kept = (start - bad) / (start - base_l) if bad is not None and base_l is not None and start != base_l else None
        rows.append(
            [
                rule + (" (baseline)" if rule == "mean" else ""),
                fmt(t and 1e3 * t, " ms", 1),
                ratio(t, base_t),
                fmt(sent and sent / 1e6, " MB", 3),
                ratio(sent, base_b),
                fmt(wrote and wrote / 1e6, " MB", 3),
                fmt(clean, "", 4),
                times_x(clean, base_l),
                fmt(bad, "", 4 if bad is not None and bad < 100 else 0),
                times_x(bad, base_l),
                "-" if kept is None else f"{100 * kept:.0f}%" if kept >= 0 else "none",
            ]
        )

    per_run = "; ".join(
        f"{rule}: "
        + ", ".join(
            "/".join(
                fmt(r["step_s"] and 1e3 * r["step_s"], "", 1) for r in (raw[(rule, False)][i], raw[(rule, True)][i])
            )
            for i in range(len(raw[(rule, False)]))
        )
        for rule in args.rules
    )
    runs = [r for rs in raw.values() for r in rs]
    fired = sum(1 for (_, flip), rs in raw.items() if flip for r in rs if r["fired"])
    flips = sum(len(rs) for (_, flip), rs in raw.items() if flip)
    epochs = sorted({r["epochs"] for r in runs})
    print_table(
        f"Robust aggregation, {len(NODES)} nodes on loopback, B={args.batch} (equal shares), {args.steps} steps "
        f"({args.batch * args.steps:,} samples) per run, {args.opt}, medians over {args.repeats} repeats",
        [
            "--aggregate",
            "time/step",
            "vs mean",
            "sent/node/step",
            "vs mean",
            "written (OS)",
            "held-out loss, clean",
            "vs mean",
            f"held-out loss, {BAD} flipping",
            "vs mean clean",
            "progress kept",
        ],
        rows,
        caption=(
            f"Cost (clean and flipping runs pooled: the flip changes values, not work or sizes): time/step = steady "
            f"state after step {args.warmup} (ms per repeat, clean/flipping: {per_run}; epochs in the window: "
            f"{'/'.join(map(str, epochs))}); sent = the runtime's byte count (flat tensor {flat:,} float32: ring "
            f"all-reduce 2(n-1)/n x, all-gather (n-1) x), written = the node's write system calls (/proc/PID/io "
            f"wchar); medians over the nodes. Benefit: held-out cross-entropy of n0's final state on "
            f"{args.heldout} fresh samples; the untrained model scores {start:.4f}; progress kept = (untrained - "
            f"loss) / (untrained - mean clean), none: worse than untrained. Checks: flip fired in {fired}/{flips} "
            f"flipping runs, guard refusals {sum(r['refusals'] for r in runs)}, all 4 final states identical in "
            f"{sum(1 for r in runs if r['identical'])}/{len(runs)} runs. Other jobs share this 2-core machine: "
            f"absolute times are noisy, read the ratios."
        ),
    )


if __name__ == "__main__":
    main()
    write_results()
