"""``unbroken verify RUNDIR``: a finished job's logs checked against the promises.

    unbroken verify runs/job1                                   # what the logs alone show
    unbroken verify runs/job1 --job train.py:job -- --lr 3e-4   # and the data plan: each sample once
    unbroken verify runs/job1 --json                            # the verdict as JSON

RUNDIR holds the nodes' commit logs (``unbroken node --commit-log RUNDIR/NAME.jsonl``) and
the coordinator's event log (``unbroken coordinator --event-log RUNDIR/events.jsonl``), as
``unbroken demo --out``, ``unbroken chaos --out`` and `unbroken.testing.LocalCluster` leave
them. The check is the chaos soak's (`unbroken.testing.check_promises`), for any run: see
`unbroken.observe.judge` for what each promise means. Exit status: 0 when every promise
checked held, 1 when one was broken, 2 when the input cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from unbroken.observe.verdict import Evidence, Expect, Promise, Status, Verdict

TITLES = {
    Promise.STEPS: "steps",
    Promise.ONCE: "applied once",
    Promise.SAMPLES: "samples",
    Promise.REPLICAS: "replicas",
    Promise.FINAL: "final model",
    Promise.ROLLBACKS: "rollbacks",
    Promise.HALTS: "halts",
    Promise.QUARANTINES: "quarantines",
}
LABELS = {Status.OK: "OK", Status.VIOLATED: "VIOLATED", Status.NOTED: "NOTED", Status.NOT_CHECKED: "NOT CHECKED"}


def _evidence(e: Evidence) -> str:
    where = [f"{k} {v}" for k, v in (("node", e.node), ("step", e.step), ("epoch", e.epoch)) if v is not None]
    return f"{', '.join(where)}: {e.text}" if where else e.text


def render(verdict: Verdict, head: str, shown: int = 3) -> str:
    """The verdict for a reader: a line per promise, then up to ``shown`` pieces of evidence."""
    lines = [head]
    for c in verdict.checks:
        lines.append(f"{LABELS[c.status]:<11}  {TITLES[c.promise]:<12}  {c.summary}")
        for e in c.evidence[:shown]:
            lines.append(f"{'':<13}- {_evidence(e)}")
        if c.total > min(shown, len(c.evidence)):
            lines.append(f"{'':<13}  ... {c.total - min(shown, len(c.evidence))} more (--evidence N, --json)")
        if c.unchecked:
            lines.append(f"{'':<13}  not checked: {c.unchecked}")
    lines += [f"note: {n}" for n in verdict.notes]
    unchecked = [c for c in verdict.checks if c.status is Status.NOT_CHECKED]
    rest = f" ({len(unchecked)} not checked)" if unchecked else ""
    if verdict.ok:
        lines.append(f"verdict: OK, every promise checked held{rest}")
    else:
        broken = ", ".join(TITLES[c.promise] for c in verdict.violated)
        lines.append(f"verdict: VIOLATED: {broken}{rest}")
    return "\n".join(lines)


def _verify(args: argparse.Namespace) -> int:
    from unbroken.observe.rundir import verify

    expect = Expect()
    about = "no --job: the data plan is not checked"
    if args.job:
        from unbroken.job import load_job

        job = load_job(args.job, args.job_args)
        expect = Expect(num_steps=job.num_steps, batch_size=job.batch_size, plan=job.plan())
        about = f"job {args.job} ({job.num_steps} steps of {job.batch_size} samples)"
    rundir = Path(args.rundir)
    verdict, run = verify(rundir, expect, [Path(p) for p in args.event_log or []])
    if args.json:
        out: dict[str, Any] = {
            "rundir": str(rundir),
            "commit_logs": {node: str(log.path) for node, log in run.logs.items()},
            "event_logs": [str(p) for p in run.event_logs],
            "job": args.job,
        }
        print(json.dumps(out | verdict.to_json(), indent=2))
    else:
        events = ", ".join(p.name for p in run.event_logs) or "none"
        head = (
            f"unbroken verify {rundir}: {len(run.logs)} commit log{'s' if len(run.logs) > 1 else ''} "
            f"({', '.join(run.logs)}), "
            f"event log: {events}; {about}"
        )
        print(render(verdict, head, args.evidence))
    sys.stdout.flush()
    return 0 if verdict.ok else 1


def _checks_help() -> str:
    return ", ".join(TITLES[p] for p in Promise)


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser(
        "verify",
        help="check a finished job's commit logs and events against the promises",
        description=f"Checks {_checks_help()}; exits 0 when every promise checked held, 1 when one was broken, "
        "2 when the logs cannot be read.",
        formatter_class=fmt,
    )
    p.add_argument("rundir", help="the run's directory: the nodes' --commit-log files (NAME.jsonl) and the event log")
    p.add_argument(
        "--job",
        help="the job, as `unbroken node` takes it (FILE.py:ATTR or MODULE:ATTR; its arguments after --): "
        "its data plan, steps and batch size are then checked too",
    )
    p.add_argument("--event-log", action="append", help="the coordinator's --event-log, if not in RUNDIR (repeatable)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("--evidence", type=int, default=3, metavar="N", help="pieces of evidence shown per promise")
    p.set_defaults(func=_verify)
