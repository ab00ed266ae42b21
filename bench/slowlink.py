"""Slow links between zones: inter-zone bytes, time and final loss per codec, same sample budget.

    python bench/slowlink.py                          # 6 configurations, 1 repeat, ~5 min on 2 cores
    python bench/slowlink.py --repeats 2              # medians over 2 interleaved repeats, ~8 min
    python bench/slowlink.py --balance weights        # equal shares: no live rebalancing
    python bench/slowlink.py --codecs none,int8,bf16,topk:0.05 --latency-ms 50 --mbit 20

Two zones of two nodes each (a1 a2 in zone A, b1 b2 in zone B; a1 and b1 join first, so
they lead their zones), the ~0.67M-parameter MLP of ``bench/jobs.py`` (2.66 MB of float32
gradient per exchange), global batch B, ``--steps`` steps: every configuration processes
the same B x steps samples in the same order. The optimizer is Adam by default (``--opt``):
with the job's SGD (lr 0.01) the held-out loss is still falling steeply at 300 steps, while
Adam's levels off from ~250 (0.79 at 250, 0.78 at 300, 0.77 at 400 in a plain loop). Each step is a two-level reduction
(`unbroken.comm.reduce`): zone all-reduce over loopback, an exchange between the zone
leaders compressed by the coordinator's ``--codec``, a broadcast in each zone.

The inter-zone link (``--latency-ms`` one way, i.e. half the round trip, and ``--mbit``)
is emulated in-process by the nodes (``unbroken node --link-latency-ms --link-mbit``):
before the leaders' all-gather each waits latency + payload x 8 / bandwidth per inter-zone
hop; the bytes themselves cross loopback. This kernel has no ``tc netem``, so the
emulation is not the kernel's queueing (no TCP slow start, loss or jitter).

Per configuration:

- inter-zone bytes per sample: the sum over the zone leaders of what each sent between
  zones, per commit (``wire.inter`` in the commit logs), over all committed steps, divided
  by the samples processed (B x steps).
- time per sample: steady state, ``(t[k1] - t[k0]) / (B * (k1 - k0))`` from k0 =
  ``--warmup`` to the last step; t[k] is the median over the 4 nodes of the time their
  compute of step k ended (its ``contrib`` line: DiLoCo commits a round's steps together,
  one round late with ``+overlap``), so each exchange's wait is counted where it stops
  compute.
- final loss: the held-out cross-entropy (``bench/jobs.py:heldout_loss``, 2048 fresh
  samples with the training set's labelling) of a1's final state (replicas are identical),
  and the training loss: median of the last ``--tail`` commit losses.

Ratios are against sync uncompressed (codec ``none``) of the same invocation: bytes cut
(target for int8: >= 3.9x), held-out loss (target: within 3%), time per sample. Runs are
interleaved, their order rotating each repeat; figures are medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, write_results
from unbroken.testing import LocalCluster

MODEL = "small"
ZONES = {"A": ["a1", "a2"], "B": ["b1", "b2"]}
LABELS = {
    "none": "sync uncompressed",
    "fp16": "sync fp16",
    "bf16": "sync bf16",
    "int8": "sync int8",
    "int4": "sync int4 (error feedback)",
    "int2": "sync int2 (ternary, error feedback)",
    "int1": "sync int1 (sign, error feedback)",
}
INT8_TARGET = 3.9
DILOCO_TARGET = 1000.0
LOSS_TARGET = 0.03


def split(config: str) -> tuple[int, str, bool]:
    """``diloco:H+CODEC[+overlap]`` -> (H, CODEC, overlap); a plain codec -> (0, codec,
    False): synchronous."""
    if not config.startswith("diloco"):
        return 0, config, False
    head, _, rest = config.partition("+")
    codec, _, flag = rest.partition("+")
    _, _, h = head.partition(":")
    return int(h or 50), codec or "none", flag == "overlap"


def label(codec: str) -> str:
    h, inner, overlap = split(codec)
    if h:
        late = ", applied a round late" if overlap else ""
        return f"DiLoCo (H={h}{late}) + {label(inner).removeprefix('sync ')}"
    if codec.startswith("topk"):
        _, _, r = codec.partition(":")
        return f"sync top-k ({float(r or 0.01):.0%} of elements, error feedback)"
    return LABELS.get(codec, f"sync {codec}")


# ------------------------------------------------------------------- one run


def run_config(args: argparse.Namespace, workdir: Path, codec: str) -> dict[str, Any]:
    env = jobs.env_for(args.steps, args.batch, opt=args.opt, samples=args.samples)
    link = ["--link-latency-ms", f"{args.latency_ms:g}", "--link-mbit", f"{args.mbit:g}"]
    h, inner, overlap = split(codec)
    coord = ["--codec", inner, "--balance", args.balance]
    if h:
        coord += ["--mode", "diloco", "--inner-steps", str(h)] + (["--outer-overlap"] if overlap else [])
        coord += ["--outer-lr", f"{args.outer_lr:g}", "--outer-momentum", f"{args.outer_momentum:g}"]
    with LocalCluster(jobs.job_ref(MODEL), workdir, env=env, min_nodes=4, coordinator_args=coord, node_args=link) as c:
        c.start_coordinator()

        def joined(names: list[str]) -> Any:
            return lambda: {m["name"] for m in c.state()["members"]} >= set(names)

        leaders = [names[0] for names in ZONES.values()]
        for i, name in enumerate(leaders):  # join order makes them the leaders
            c.start_node(name, extra=["--zone", name[0].upper()])
            c.wait_for(joined(leaders[: i + 1]), 60, f"{name} to join")
        for names in ZONES.values():
            for name in names[1:]:
                c.start_node(name, extra=["--zone", name[0].upper()])
        codes = c.wait_exit(timeout=args.timeout)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"{codec}: run failed: {codes}\n{c.diagnostics()}")
        entries = {name: n.entries() for name, n in c.nodes.items()}
        model = jobs.MLP(*jobs.SHAPES[MODEL])
        model.load_state_dict(torch.load(c.nodes["a1"].final_state, weights_only=True)["model"])
        out = analyse(args, entries, jobs.heldout_loss(MODEL, model, args.samples, args.heldout))
        out["rebalances"] = sum(
            1 for e in c.events() if e.get("kind") == "epoch" and "rebalance" in str(e.get("reason", ""))
        )
        return out


def analyse(args: argparse.Namespace, entries: dict[str, list[dict[str, Any]]], heldout: float) -> dict[str, Any]:
    commits = {name: [e for e in es if e.get("kind") == "commit"] for name, es in entries.items()}
    # When each step's compute ended (a node's last attempt at it): DiLoCo commits a round's
    # steps together, and one round late with --outer-overlap, so commit times would credit
    # a round's work to the moment it is applied.
    per_step: dict[int, list[float]] = {}
    for es in entries.values():
        ends = {int(e["step"]): float(e["t"]) for e in es if e.get("kind") == "contrib"}
        for k, t in ends.items():
            per_step.setdefault(k, []).append(t)
    times = {k: statistics.median(v) for k, v in sorted(per_step.items())}
    steps = max(len({int(e["step"]) for e in cs}) for cs in commits.values())
    last = max(times)
    k0 = min((k for k in times if k >= args.warmup), default=args.warmup)
    sps = (times[last] - times[k0]) / (args.batch * (last - k0)) if k0 in times and last > k0 else None
    inter = {name: sum(int(e.get("wire", {}).get("inter", 0)) for e in cs) for name, cs in commits.items()}
    exch = [int(e["wire"]["inter"]) for cs in commits.values() for e in cs if e.get("wire", {}).get("inter")]
    epochs = {e.get("epoch") for cs in commits.values() for e in cs if int(e["step"]) > k0}
    # training loss: one value per step (every node logs the same global loss)
    loss_by_step = {int(e["step"]): float(e["loss"]) for e in commits["a1"]}
    ordered = [loss_by_step[k] for k in sorted(loss_by_step)]
    return {
        "steps": steps,
        "bytes_per_sample": sum(inter.values()) / (args.batch * steps),
        "senders": sorted(n for n, b in inter.items() if b),
        "payload": median(exch),
        "s_per_sample": sps,
        "epochs": len(epochs),
        "heldout": heldout,
        "train_tail": statistics.median(ordered[-args.tail :]),
        "curve": loss_by_step,
    }


# ------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--codecs",
        default="none,int8,topk:0.01,diloco:50+int8,diloco:100+int2,diloco:50+int1+overlap",
        help="configurations, comma-separated ('none' first): inter-zone codecs of sync mode, or "
        "diloco:H+CODEC[+overlap] (+overlap: --outer-overlap)",
    )
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate")
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=0.5,
        help="DiLoCo's outer Nesterov momentum (0.9, the paper's, needs many more outer steps than this budget's 5)",
    )
    p.add_argument("--repeats", type=int, default=1, help="repeats of every configuration, interleaved")
    p.add_argument("--steps", type=int, default=250, help="steps of every run (the same sample budget for all)")
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the time per sample")
    p.add_argument("--batch", type=int, default=96, help="global batch B")
    p.add_argument("--opt", choices=["adam", "sgd"], default="adam", help="the job's optimizer (bench/jobs.py)")
    p.add_argument(
        "--balance", choices=["throughput", "weights"], default="throughput", help="the coordinator's --balance"
    )
    p.add_argument(
        "--samples",
        type=int,
        default=24000,
        help="training set size (default: the sample budget, each sample seen once, as in pretraining; a small set "
        "seen many times makes the held-out loss a measure of overfitting)",
    )
    p.add_argument("--heldout", type=int, default=2048, help="held-out samples for the final loss")
    p.add_argument("--tail", type=int, default=10, help="commit losses in the training-loss median")
    p.add_argument("--latency-ms", type=float, default=25.0, help="one-way inter-zone latency (half the RTT)")
    p.add_argument("--mbit", type=float, default=100.0, help="inter-zone bandwidth, Mbit/s")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if args.codecs[:1] != ["none"]:
        p.error("--codecs must start with 'none' (the baseline of every ratio)")
    if args.steps < args.warmup + 10:
        p.error("--steps must exceed --warmup by at least 10")
    if args.steps < args.tail:
        p.error("--steps must be at least --tail")
    return args


def main() -> None:
    args = parse_args()
    print_command()
    n_params = jobs.num_params(MODEL)
    fp32 = 4 * n_params
    print(
        f"model {MODEL} MLP ({n_params:,} parameters, {fp32 / 1e6:.2f} MB float32 gradient), {args.opt}, "
        f"B={args.batch}, "
        f"{args.steps} steps = {args.batch * args.steps:,} samples per run (time per sample after step "
        f"{args.warmup}); 2 zones x 2 nodes (A: a1 a2, B: b1 b2), inter-zone link {args.latency_ms:g} ms one way "
        f"(~{2 * args.latency_ms:g} ms round trip) and {args.mbit:g} Mbit/s, emulated in-process by the nodes "
        f"(this kernel has no tc netem): each inter-zone hop waits latency + payload x 8 / bandwidth, then the "
        f"bytes cross loopback; intra-zone links are plain loopback; OMP_NUM_THREADS=1, {len(ZONES) * 2} nodes "
        f"+ coordinator on this machine",
        flush=True,
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-slowlink-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    raw: dict[str, list[dict[str, Any]]] = {c: [] for c in args.codecs}
    progress = ProgressLine(args.repeats * len(args.codecs))
    try:
        for rep in range(args.repeats):
            k = rep % len(args.codecs)
            for codec in args.codecs[k:] + args.codecs[:k]:
                progress.update(f"repeat {rep + 1}/{args.repeats}: {codec} running")
                t0 = time.monotonic()
                r = run_config(args, root / f"{codec.replace(':', '_')}-{rep}", codec)
                raw[codec].append(r)
                note = (
                    f"{r['bytes_per_sample']:.0f} B/sample, {fmt(r['s_per_sample'] and 1e3 * r['s_per_sample'])} "
                    f"ms/sample, held-out loss {r['heldout']:.4f}"
                )
                progress.update(f"repeat {rep + 1}/{args.repeats}: {codec}: {note} ({time.monotonic() - t0:.0f} s)", 1)
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()
    report(args, raw)
    keys = ("bytes_per_sample", "s_per_sample", "heldout", "train_tail", "payload")
    write_results(
        {
            "codecs": {
                codec: {"label": label(codec)}
                | {k: median(r[k] for r in runs) for k in keys}
                | {"per_repeat": [{k: r[k] for k in keys} for r in runs]}
                for codec, runs in raw.items()
            }
        }
    )


def report(args: argparse.Namespace, raw: dict[str, list[dict[str, Any]]]) -> None:
    def med(codec: str, key: str) -> float | None:
        return median(r[key] for r in raw[codec])

    keys = ("bytes_per_sample", "s_per_sample", "heldout", "train_tail")
    base = args.codecs[0]
    b_bytes, b_time, b_held, b_train = (med(base, k) for k in keys)
    rows = []
    for codec in args.codecs:
        by, t, held, train = (med(codec, k) for k in keys)
        payload = med(codec, "payload")
        link_ms = 1e3 * (args.latency_ms / 1e3 + (payload or 0) * 8 / (args.mbit * 1e6))
        rows.append(
            [
                label(codec) + ("" if codec != base else " (baseline)"),
                fmt(by, "", 0),
                ratio(b_bytes, by, 2),
                fmt(payload and payload / 1e3, " kB", 1),
                fmt(link_ms, " ms", 1),
                fmt(t and 1e3 * t, " ms", 3),
                ratio(t, b_time, 2),
                fmt(held, "", 4),
                ratio(held, b_held, 3),
                fmt(train, "", 4),
                ratio(train, b_train, 3),
            ]
        )
    int8 = ratio(b_bytes, med("int8", "bytes_per_sample"), 2) if "int8" in raw else "-"
    dilocos = [c for c in args.codecs if split(c)[0]]
    diloco = ", ".join(f"{label(c)} {ratio(b_bytes, med(c, 'bytes_per_sample'), 0)}" for c in dilocos) or "-"
    diloco_time = ", ".join(f"{ratio(med(c, 's_per_sample'), b_time, 2)}" for c in dilocos) or "-"
    worst = [
        f"{c} {100 * (med(c, 'heldout') / b_held - 1):+.1f}%"  # type: ignore[operator]
        for c in args.codecs[1:]
        if b_held
    ]
    per_rep = "; ".join(
        f"{c}: " + ", ".join(fmt(r["s_per_sample"] and 1e3 * r["s_per_sample"], "", 3) for r in raw[c])
        for c in args.codecs
    )
    epochs = ", ".join(
        f"{c}: {'/'.join(str(r['epochs']) for r in raw[c])} ({'/'.join(str(r['rebalances']) for r in raw[c])})"
        for c in args.codecs
    )
    senders = sorted({s for c in args.codecs for r in raw[c] for s in r["senders"]})
    print_table(
        f"Two zones x 2 nodes, link {args.latency_ms:g} ms one way, {args.mbit:g} Mbit/s (emulated), "
        f"B={args.batch}, {args.steps} steps ({args.batch * args.steps:,} samples) per run, "
        f"medians over {args.repeats} repeats",
        [
            "configuration",
            "inter-zone B/sample",
            "bytes cut",
            "payload/exchange",
            "link wait/step",
            "time/sample",
            "time vs none",
            "held-out loss",
            "vs none",
            f"train loss (last {args.tail})",
            "vs none",
        ],
        rows,
        caption=(
            f"Bytes: sum over the zone leaders (senders seen: {', '.join(senders)}) of the bytes sent between zones, "
            f"over all {args.steps} steps, / samples. Payload/exchange: what one leader sends per step; link "
            f"wait/step: the emulation's wait for it ({args.latency_ms:g} ms + payload x 8 / {args.mbit:g} Mbit/s). "
            f"Time/sample: steady state after step {args.warmup}, per repeat (ms): {per_rep}. Epochs spanned by "
            f"that window (rebalances in the run, --balance {args.balance}): {epochs}. Held-out loss: "
            f"cross-entropy of the final state on {args.heldout} fresh samples. "
            f"Targets: int8 bytes cut >= {INT8_TARGET}x (got {int8}); DiLoCo bytes cut >= {DILOCO_TARGET:.0f}x "
            f"(got {diloco}) at a held-out loss no worse than sync's, with time/sample below sync's (got "
            f"{diloco_time} of uncompressed sync); held-out loss within {LOSS_TARGET:.0%} of uncompressed (got "
            f"{', '.join(worst) or '-'}). DiLoCo's loss column "
            f"is the mean training loss of each round (every step of a round is committed at its outer step)."
        ),
    )
    report_curve(args, raw)


def report_curve(args: argparse.Namespace, raw: dict[str, list[dict[str, Any]]]) -> None:
    """Training loss along the run (median of a window of commits), to see it has settled."""
    w = args.tail
    marks = sorted({max(w, round(args.steps * f)) for f in (0.1, 0.25, 0.5, 0.75, 1.0)})

    def at(curve: dict[int, float], k: int) -> float | None:
        vals = [curve[j] for j in range(k - w + 1, k + 1) if j in curve]
        return statistics.median(vals) if vals else None

    rows = [[label(c)] + [fmt(median(at(r["curve"], k) for r in raw[c]), "", 4) for k in marks] for c in args.codecs]
    print_table(
        f"Training loss along the run: median of the {w} commit losses up to step k (medians over repeats)",
        ["configuration"] + [f"k={k}" for k in marks],
        rows,
    )


if __name__ == "__main__":
    main()
