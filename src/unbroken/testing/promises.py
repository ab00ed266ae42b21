"""Check the promises of DESIGN.md §1 from the nodes' commit logs.

Each node appends JSON lines: ``contrib`` (its slice of a step, before the all-reduce),
``commit`` (after the optimizer step; ``step`` is the new committed step), ``sync`` (state
received from a peer), ``restore`` (state loaded from a checkpoint) and ``final``.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken.events import Entry
from unbroken.job import Job, StepInfo
from unbroken.state.snapshot import TrainState
from unbroken.train.step import slice_seed


@dataclass
class PromiseReport:
    steps: int
    committed_in: dict[int, int] = field(default_factory=dict)
    """For each step index s (0-based), the epoch in which it was committed."""
    final_digests: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def assert_ok(self) -> None:
        if self.problems:
            raise AssertionError("broken promises:\n  " + "\n  ".join(self.problems[:20]))


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (jobs shaped by the environment are built
    here exactly as the nodes built them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_promises(logs: Mapping[str, Iterable[dict[str, Any]]], job: Job, *, finishers: int = 1) -> PromiseReport:
    """Check gapless commits, one commit epoch per step, equal digests and exactly-once data."""
    T, B = job.num_steps, job.batch_size
    report = PromiseReport(steps=T)
    contribs: dict[tuple[int, int], list[list[int]]] = defaultdict(list)
    digests: dict[int, dict[str, str]] = defaultdict(dict)
    merged = sorted(((e.get("t", 0.0), node, e) for node, entries in logs.items() for e in entries), key=lambda x: x[0])
    # A member that applied a step the others' all-reduce lost (a peer crashed between
    # them), and then died itself, or was expelled (frozen, cut off) and came back as a new
    # member, before it took part in any later epoch, took that step with it: it was the
    # group's step in flight, which the survivors commit again with the same samples (the
    # step was whole: every vote and sample was in it).
    vanished = _vanished(merged)
    committers: dict[tuple[int, int], set[str]] = defaultdict(set)
    digest_epochs: dict[tuple[int, str], int] = {}
    last: dict[str, int] = {}
    restores: list[tuple[float, int]] = []
    commit_times: dict[int, tuple[float, int]] = {}
    for _, node, e in merged:
        kind = Entry(e["kind"])  # a kind no node writes is an error here, not a line passed over
        if kind is Entry.CONTRIB:
            contribs[(e["epoch"], e["step"])].append(e["indices"])
        elif kind is Entry.RESTORE:
            # The allowed rollbacks: every node died and the group resumed from a checkpoint,
            # or a failed consistency audit took the group back to its last audited state.
            restores.append((e["t"], e["step"]))
            for s in [s for s in digests if s > e["step"]]:
                del digests[s]
            last[node] = e["step"]
            digests[e["step"]][f"{node}:restore"] = e["digest"]
        elif kind is Entry.SYNC:
            last[node] = e["step"]
            digests[e["step"]][f"{node}:sync"] = e["digest"]
        elif kind is Entry.COMMIT:
            s = e["step"] - 1
            if node in last and e["step"] != last[node] + 1:
                report.problems.append(f"{node} committed step {e['step']} right after step {last[node]}")
            last[node] = e["step"]
            prev = commit_times.get(s)
            committers[(s, e["epoch"])].add(node)
            if prev is not None and prev[1] != e["epoch"]:
                rolled_back = any(prev[0] < t < e["t"] and r <= s for t, r in restores)
                gone = committers[(s, prev[1])]
                died_with_it = all((n, s) in vanished for n in gone)
                if died_with_it:
                    for t_step in [t for t in digests if t > s]:
                        for n in gone:
                            if digest_epochs.get((t_step, n)) == prev[1]:
                                digests[t_step].pop(n, None)
                elif not rolled_back:
                    report.problems.append(f"step {s + 1} committed in epoch {prev[1]} and again in epoch {e['epoch']}")
            if prev is None or prev[1] != e["epoch"]:
                commit_times[s] = (e["t"], e["epoch"])
                report.committed_in[s] = e["epoch"]
            if "digest" in e:
                digests[e["step"]][node] = e["digest"]
                digest_epochs[(e["step"], node)] = e["epoch"]
        elif kind is Entry.FINAL:
            report.final_digests[node] = e["digest"]
            if e["step"] != T:
                report.problems.append(f"{node} finished at step {e['step']}, not {T}")
        elif kind is Entry.EXPELLED:
            last.pop(node, None)
    missing = [s + 1 for s in range(T) if s not in report.committed_in]
    if missing:
        report.problems.append(f"steps never committed: {missing[:10]}{'...' if len(missing) > 10 else ''}")
    for step, by_node in sorted(digests.items()):
        if len(set(by_node.values())) > 1:
            report.problems.append(f"replicas differ after step {step}: {by_node}")
    if len(set(report.final_digests.values())) > 1:
        report.problems.append(f"final digests differ: {report.final_digests}")
    if len(report.final_digests) < finishers:
        report.problems.append(f"only {len(report.final_digests)} nodes finished, expected {finishers}")
    plan = job.plan()
    for s, epoch in sorted(report.committed_in.items()):
        slices = contribs.get((epoch, s), [])
        got = sorted(i for sl in slices for i in sl)
        want = sorted(plan.indices(s, 0, B))
        if got != want:
            report.problems.append(
                f"step {s + 1} (epoch {epoch}) consumed {len(got)} samples from {len(slices)} slices; "
                f"expected exactly the {B} planned ones"
            )
    return report


def reference_state(job: Job, steps: int | None = None) -> dict[str, torch.Tensor]:
    """Train the job in one process with the full batch B; returns the model state."""
    model: dict[str, torch.Tensor] = reference_tree(job, steps)["model"]
    return model


def reference_tree(
    job: Job, steps: int | None = None, parts: int = 1, losses: list[float] | None = None
) -> dict[str, Any]:
    """Train the job in one process with the full batch B, with its scheduler, extra state
    and hooks; returns what a node's final state holds (model, optimizer, scheduler, extra).
    ``parts`` > 1 sums each step's gradient over that many slices of B, as nodes do: how far
    that lands from ``parts=1`` is how far float summation order alone moves the job.
    ``losses`` gets each step's loss over B, as nodes log it at each commit."""
    model, optimizer = job.build()
    state = TrainState(model, optimizer, scheduler=job.build_scheduler(optimizer), extra=job.build_state(model))
    plan = job.plan()
    for step in range(steps if steps is not None else job.num_steps):
        indices = plan.indices(step, 0, job.batch_size)
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(slice_seed(job.seed, step, 0))
        loss = torch.zeros(())
        n = len(indices)
        for part in [indices[k * n // parts : (k + 1) * n // parts] for k in range(parts)]:
            mean = job.microbatch_loss(model, job.collate(job.samples(part)))
            (mean * (len(part) / job.batch_size)).backward()  # type: ignore[no-untyped-call]
            loss = loss + mean.detach() * (len(part) / job.batch_size)
        if job.before_update is not None:
            job.before_update(model, optimizer)
        optimizer.step()
        if state.scheduler is not None:
            state.scheduler.step()
        state.step = step + 1
        if losses is not None:
            losses.append(float(loss))
        if job.after_step is not None:
            job.after_step(StepInfo(state.step, float(loss), model, optimizer, state.scheduler, state.extra, 0, 1))
    return state.capture()


def _vanished(merged: list[tuple[float, str, dict[str, Any]]]) -> set[tuple[str, int]]:
    """(node, step) for each step a node committed and then died or was expelled with,
    before it logged anything of a later epoch (its state never reached another member)."""
    out: set[tuple[str, int]] = set()
    pending: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for _, node, e in merged:
        kind, epoch = Entry(e["kind"]), e.get("epoch")
        if kind is Entry.EXPELLED:
            out.update((node, s) for s, _ in pending.pop(node, []))
        elif epoch is not None:
            pending[node] = [(s, ep) for s, ep in pending[node] if ep >= int(epoch)]
            if kind is Entry.COMMIT:
                pending[node].append((e["step"] - 1, int(epoch)))
    out.update((node, s) for node, steps in pending.items() for s, _ in steps)
    return out
