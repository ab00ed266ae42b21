"""Recovery time after a crash (SIGKILL) and a freeze (SIGSTOP): unbroken vs plain DDP.

    python bench/recovery.py                          # ~3 min on 2 cores
    python bench/recovery.py --repeats 5 --lease 0.5 --ddp-freeze-repeats 2

A 3-node job (``bench/jobs.py``, the ~0.67M-parameter MLP, B=96) runs on loopback and
node n2 injects a fault, deterministically, in the all-reduce of a given step
(``unbroken node ... --fault kill@allreduce:N`` / ``--fault stop@allreduce:N,stop@allreduce:M``):

- crash (a fresh job per repeat): fault -> detection (the coordinator's "failure" event,
  events.jsonl) and fault -> the survivors' next commit (first "commit" line after the
  fault line's "t" in the survivors' commit logs); target <= 1.0 s.
- freeze (one job, n2 freezes ``--repeats`` times, ``--stop-spacing`` steps apart; after
  each, the bench SIGCONTs it and it rejoins): fault -> detection (one heartbeat lease) and
  fault -> next survivor commit; target <= lease + 1 s.

Times are wall-clock ("t" of the victim's ``fault`` line vs. the survivors' ``commit`` lines
and the coordinator's event time), all on this one machine.

Baseline, in the same invocation: plain ``DistributedDataParallel`` on gloo, 3 ranks of
``bench/ddp_worker.py`` with the same job, rank 2 SIGKILLs / SIGSTOPs itself before the
backward pass (so its peers are in the gradient all-reduce) of the same step. Plain DDP
has no recovery: we report how long the survivors take to error out, and that training
stopped there. For the freeze the DDP process-group timeout is ``--ddp-timeout`` (10 s):
the survivors block until it expires.
"""

from __future__ import annotations

import argparse
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import jobs
from common import (
    DDPRun,
    ProgressLine,
    fmt,
    median,
    print_command,
    print_table,
    ratio,
    wait_until,
    write_results,
)
from unbroken.testing import LocalCluster

VICTIM = "n2"
NODES = ("n1", "n2", "n3")
DDP_VICTIM = 2
PLOT_WINDOW_S = 3.0  # commit times kept for bench/render.py's plot: this long either side of the fault


def _commit_times(entry_lists: list[list[dict[str, Any]]], t_f: float) -> list[float]:
    """Each committed step once (its first commit line), as seconds from the fault."""
    first: dict[int, float] = {}
    for entries in entry_lists:
        for e in entries:
            if e.get("kind") == "commit":
                step = int(e["step"])
                first[step] = min(first.get(step, e["t"]), e["t"])
    return sorted(round(t - t_f, 4) for t in first.values() if -PLOT_WINDOW_S <= t - t_f <= PLOT_WINDOW_S)


def _first(entries: list[dict[str, Any]], kind: str, after: float = float("-inf")) -> dict[str, Any] | None:
    return next((e for e in entries if e.get("kind") == kind and e["t"] > after), None)


def _measure(c: LocalCluster, victim: Any, survivors: list[Any], f: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Fault -> detection and fault -> the survivors' first commit in the epoch formed without the victim.

    The step in flight may still complete if the victim's share of the all-reduce left before the
    signal landed; that commit belongs to the old epoch and is not counted as the recovery.
    """
    t_f, fault_step = float(f["t"]), int(f["step"])
    contribs = [e for e in victim.entries() if e.get("kind") == "contrib" and e["t"] <= t_f]
    epoch = int(contribs[-1]["epoch"])

    def next_commit() -> dict[str, Any] | None:
        found = [
            next((e for e in s.entries() if e.get("kind") == "commit" and e["t"] > t_f and e["epoch"] > epoch), None)
            for s in survivors
        ]
        found = [e for e in found if e]
        return min(found, key=lambda e: e["t"]) if found else None

    try:
        commit = wait_until(next_commit, timeout, "a survivor's commit in a new epoch after the fault")
        failure = wait_until(
            lambda: next((e for e in c.events() if e["kind"] == "failure" and e["time"] >= t_f), None),
            timeout,
            "the coordinator's failure event",
        )
        recovery = wait_until(
            lambda: next((r for r in c.state().get("recoveries", []) if r["detected_at"] >= t_f), None),
            5.0,
            "the coordinator's recovery record",
        )
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}\n{c.diagnostics()}") from None
    # No step lost or applied twice: each survivor's committed steps run on without a gap.
    gapless = True
    for s in survivors:
        steps = [int(e["step"]) for e in s.entries() if e.get("kind") == "commit" and e["t"] <= commit["t"] + 1]
        gapless &= steps == list(range(steps[0], steps[0] + len(steps)))
    inflight_done = any(
        e.get("kind") == "commit" and e["epoch"] == epoch and int(e["step"]) == fault_step + 1
        for s in survivors
        for e in s.entries()
    )
    return {
        "detect": failure["time"] - t_f,
        "commit": commit["t"] - t_f,
        "commit_step": int(commit["step"]),
        "fault_step": fault_step,
        "retried": int(commit["step"]) == fault_step + 1,
        "inflight_done": inflight_done,
        "gapless": gapless,
        "coord_recovery": float(recovery["duration_s"]),
        "reason": failure["reason"],
        "commit_times": _commit_times([s.entries() for s in survivors], t_f),
    }


def _start(args: argparse.Namespace, workdir: Path, fault: str) -> LocalCluster:
    env = jobs.env_for(100_000, args.batch)
    c = LocalCluster(jobs.job_ref("small"), workdir, env=env, min_nodes=3, lease_s=args.lease)
    c.start_coordinator()
    for name in NODES:
        c.start_node(name, fault=fault if name == VICTIM else "")
    return c


def unbroken_kill(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One fresh 3-node unbroken job, one SIGKILL; the job is stopped once the recovery is measured."""
    c = _start(args, workdir, f"kill@allreduce:{args.fault_step}")
    try:
        victim = c.nodes[VICTIM]
        f = wait_until(lambda: _first(victim.entries(), "fault"), args.timeout, "the kill fault to fire")
        survivors = [c.nodes[n] for n in NODES if n != VICTIM]
        r = _measure(c, victim, survivors, f, args.timeout)
        # Measured; the survivors train on a moment longer only so that the plot shows them doing so.
        time.sleep(max(0.0, float(f["t"]) + PLOT_WINDOW_S - time.time()))
        r["commit_times"] = _commit_times([s.entries() for s in survivors], float(f["t"]))
        return r
    finally:
        c.close()


def unbroken_freezes(args: argparse.Namespace, workdir: Path, progress: ProgressLine) -> list[dict[str, Any]]:
    """One 3-node unbroken job; n2 SIGSTOPs itself ``--repeats`` times, ``--stop-spacing`` steps apart.

    After each freeze is measured the bench SIGCONTs n2: it finds itself expelled, rejoins as
    a new member and catches up from a peer (timed as "SIGCONT -> back in sync"), then
    freezes again at its next fault step.
    """
    stops = [args.fault_step + k * args.stop_spacing for k in range(args.repeats)]
    c = _start(args, workdir, ",".join(f"stop@allreduce:{s}" for s in stops))
    out: list[dict[str, Any]] = []
    try:
        victim = c.nodes[VICTIM]
        survivors = [c.nodes[n] for n in NODES if n != VICTIM]
        for k, step in enumerate(stops):
            progress.update(f"unbroken stop #{k + 1} (step {step})")

            def fault(k: int = k) -> dict[str, Any] | None:
                fs = [e for e in victim.entries() if e.get("kind") == "fault"]
                return fs[k] if len(fs) > k else None

            f = wait_until(fault, args.timeout, f"stop fault #{k + 1} to fire")
            t_f = float(f["t"])
            r = _measure(c, victim, survivors, f, args.timeout)
            t_cont = time.time()
            victim.signal(signal.SIGCONT)
            back = wait_until(lambda t_f=t_f: _first(victim.entries(), "sync", t_f), args.timeout, "n2 back in sync")
            r["rejoin"] = back["t"] - t_cont
            r["commit_times"] = _commit_times([s.entries() for s in survivors], t_f)
            out.append(r)
            progress.update(
                f"unbroken stop #{k + 1}: detect {r['detect'] * 1e3:.0f} ms, next commit {r['commit'] * 1e3:.0f} ms, "
                f"SIGCONT -> back in sync {r['rejoin']:.2f} s",
                advance=1,
            )
            if k + 1 < len(stops) and int(back["step"]) >= stops[k + 1]:
                raise RuntimeError(f"n2 came back at step {back['step']}, past its next fault step {stops[k + 1]}: "
                                   "raise --stop-spacing")  # fmt: skip
        return out
    finally:
        c.close()


def ddp_fault(args: argparse.Namespace, workdir: Path, sig: str, timeout_s: float) -> dict[str, Any]:
    """Plain DDP, 3 ranks, one fault; waits (bounded) for the survivors to error out."""
    total = args.fault_step + 200
    env = jobs.env_for(total, args.batch)
    with DDPRun("small", 3, workdir, env, timeout_s=timeout_s, faults={DDP_VICTIM: f"{sig}@{args.fault_step}"}) as d:
        f = wait_until(lambda: _first(d.entries(DDP_VICTIM), "fault"), args.timeout, "the DDP fault to fire")
        t_f = float(f["t"])
        ranks = [r for r in range(3) if r != DDP_VICTIM]
        codes = d.wait_exit(ranks, timeout_s + 30)
        out: dict[str, Any] = {"total": total, "fault_step": args.fault_step, "codes": codes}
        errors = [e for r in ranks for e in d.entries(r) if e["kind"] == "error"]
        out["error"] = min(e["t"] for e in errors) - t_f if errors else None
        out["error_msg"] = re.sub(r"\[/[^\]]*\]\s*", "", errors[0]["error"]) if errors else ""
        out["exit"] = max(d.exit_at[r] for r in ranks) - t_f if all(r in d.exit_at for r in ranks) else None
        # a commit line's "step" counts finished steps: step index N finishing logs N + 1
        out["after_commits"] = sum(
            1 for r in ranks for e in d.entries(r) if e["kind"] == "commit" and int(e["step"]) > args.fault_step
        )
        steps = [int(e["step"]) for r in ranks for e in d.entries(r) if e["kind"] == "commit"]
        out["last_step"] = max(steps, default=0)
        out["blocked_s"] = None if out["exit"] is not None else time.time() - t_f
        out["commit_times"] = _commit_times([d.entries(r) for r in ranks], t_f)
        return out


def _lost_note(runs: list[dict[str, Any]]) -> str:
    if not all(r["gapless"] for r in runs):
        return "GAP in survivors' commits: see logs"
    retried = sum(r["retried"] for r in runs)
    done = sum(r["inflight_done"] for r in runs)
    return f"0 lost, no gaps; in-flight step retried {retried}x, completed before the fault {done}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="unbroken crashes (fresh job each) and freezes (one job)")
    p.add_argument("--ddp-repeats", type=int, default=1, help="plain-DDP crash runs")
    p.add_argument("--ddp-freeze-repeats", type=int, default=1, help="plain-DDP freeze runs (each waits --ddp-timeout)")
    p.add_argument("--stop-spacing", type=int, default=100, help="steps between successive freezes of n2")
    p.add_argument("--fault-step", type=int, default=30, help="step in whose all-reduce the fault fires")
    p.add_argument("--lease", type=float, default=1.0, help="coordinator heartbeat lease, seconds")
    p.add_argument("--ddp-timeout", type=float, default=10.0, help="DDP process-group timeout for the freeze case")
    p.add_argument("--batch", type=int, default=96, help="global batch B")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds allowed for any one wait")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    print_command()
    print(f"model small ({jobs.num_params('small'):,} parameters), B={args.batch}, 3 processes, fault in step "
          f"{args.fault_step}; lease {args.lease} s; DDP freeze timeout {args.ddp_timeout} s; OMP_NUM_THREADS=1\n"
          f"unbroken: python -m unbroken node {jobs.job_ref('small')} --fault kill@allreduce:{args.fault_step} (n2)\n"
          f"DDP:      python bench/ddp_worker.py --job small --rank 2 --world 3 --fault kill@{args.fault_step}",
          flush=True)  # fmt: skip

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-recovery-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    runs: list[tuple[str, str, int]] = []
    for rep in range(max(args.repeats, args.ddp_repeats)):
        if rep < args.repeats:
            runs.append(("unbroken", "kill", rep))
        if rep < args.ddp_repeats:
            runs.append(("ddp", "kill", rep))
    runs.append(("unbroken", "stop", 0))
    runs += [("ddp", "stop", rep) for rep in range(args.ddp_freeze_repeats)]
    res: dict[tuple[str, str], list[dict[str, Any]]] = {}
    progress = ProgressLine(len(runs) - 1 + args.repeats)
    try:
        for system, sig, rep in runs:
            wd = root / f"{system}-{sig}-{rep}"
            if system == "unbroken" and sig == "stop":
                res[(system, sig)] = unbroken_freezes(args, wd, progress)
                continue
            progress.update(f"{system} {sig} #{rep + 1}")
            if system == "unbroken":
                r = unbroken_kill(args, wd)
                note = f"detect {r['detect'] * 1e3:.0f} ms, next commit {r['commit'] * 1e3:.0f} ms"
            else:
                r = ddp_fault(args, wd, sig, args.ddp_timeout if sig == "stop" else 60.0)
                note = f"survivors error after {fmt(r['error'], ' s')}, exit codes {r['codes']}"
            res.setdefault((system, sig), []).append(r)
            progress.update(f"{system} {sig} #{rep + 1}: {note}", advance=1)
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()

    def med(system: str, sig: str, key: str) -> float | None:
        return median(r.get(key) for r in res.get((system, sig), []))

    def ms(x: float | None) -> str:
        return fmt(x and x * 1e3, " ms", 0)

    # ---- crash
    uk, dk = res[("unbroken", "kill")], res[("ddp", "kill")]
    u_det, u_com = med("unbroken", "kill", "detect"), med("unbroken", "kill", "commit")
    u_rec = med("unbroken", "kill", "coord_recovery")
    d_err, d_exit = med("ddp", "kill", "error"), med("ddp", "kill", "exit")
    lost_note = _lost_note(uk)
    stopped = all(r["after_commits"] == 0 for r in dk)
    last, total = dk[0]["last_step"], dk[0]["total"]
    ddp_lost = f"run ended at step {last}: {total - last} of {total} steps never done" if stopped else "?"
    print_table(
        f"Crash: SIGKILL of 1 of 3 processes in the all-reduce of step {args.fault_step} — medians over "
        f"{len(uk)} (unbroken) / {len(dk)} (DDP) runs",
        ["measure", "unbroken", "plain DDP (gloo)", "ours / DDP"],
        [
            [
                "fault -> failure detected (coordinator) / survivors' collective error",
                ms(u_det),
                ms(d_err),
                ratio(u_det, d_err),
            ],
            [
                "fault -> survivors' next commit (new epoch, without the victim)",
                ms(u_com),
                "never (training stopped)",
                "-",
            ],
            ["coordinator recovery record (detected -> first commit)", ms(u_rec), "-", "-"],
            ["fault -> survivors' processes exited", "they keep training", ms(d_exit), "-"],
            [
                "steps lost",
                lost_note,
                ddp_lost,
                "-",
            ],
            ["per-run fault -> next commit (ours)", ", ".join(ms(r["commit"]) for r in uk), "", ""],
        ],
        caption=f"target fault -> next commit <= 1.0 s: {'met' if u_com is not None and u_com <= 1.0 else 'NOT met'}; "
        f"DDP survivors' error: {dk[0]['error_msg'][:110]!r}",
    )

    # ---- freeze
    us, ds = res[("unbroken", "stop")], res.get(("ddp", "stop"), [])
    s_det, s_com = med("unbroken", "stop", "detect"), med("unbroken", "stop", "commit")
    ds_err = med("ddp", "stop", "error")
    ds_exit = med("ddp", "stop", "exit")
    s_rej = med("unbroken", "stop", "rejoin")
    print_table(
        f"Freeze: SIGSTOP of 1 of 3 processes in an all-reduce (steps {', '.join(str(r['fault_step']) for r in us)}) — "
        f"lease {args.lease} s, DDP timeout {args.ddp_timeout} s — medians over {len(us)} (unbroken) / {len(ds)} (DDP)",
        ["measure", "unbroken", "plain DDP (gloo)", "ours / DDP"],
        [
            ["fault -> failure detected (unbroken: lease expiry)", ms(s_det), "none", "-"],
            [
                "fault -> survivors' next commit (ours) / survivors' timeout error (DDP)",
                ms(s_com),
                ms(ds_err),
                ratio(s_com, ds_err),
            ],
            ["next commit minus lease", ms(s_com and s_com - args.lease), "-", "-"],
            ["fault -> survivors' processes exited", "they keep training", ms(ds_exit), "-"],
            [
                "survivors' commits after the fault",
                "training continues: " + _lost_note(us),
                f"{sum(r['after_commits'] for r in ds)} (training stopped)" if ds else "-",
                "-",
            ],
            ["SIGCONT -> frozen node back in sync (rejoin + state transfer)", fmt(s_rej, " s", 2), "-", "-"],
            ["per-run fault -> next commit (ours)", ", ".join(ms(r["commit"]) for r in us), "", ""],
        ],
        caption=f"target fault -> next commit <= lease + 1 s = {args.lease + 1:.1f} s: "
        f"{'met' if s_com is not None and s_com <= args.lease + 1 else 'NOT met'}"
        + (f"; DDP survivors' error: {ds[0]['error_msg'][:110]!r}" if ds else ""),
    )
    write_results(
        {
            "commit_times": {
                "about": "each committed step's time, s from the fault, first run of each kind",
                **{f"{system} {sig}": rs[0]["commit_times"] for (system, sig), rs in res.items() if rs},
            },
            "runs": {f"{system} {sig}": rs for (system, sig), rs in res.items()},
        }
    )


if __name__ == "__main__":
    main()
