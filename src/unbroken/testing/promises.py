"""Check the promises of docs/design.md from the nodes' commit logs.

Each node appends JSON lines: ``contrib`` (its slice of a step, before the all-reduce),
``commit`` (after the optimizer step; ``step`` is the new committed step), ``sync`` (state
received from a peer), ``restore`` (state loaded from a checkpoint) and ``final``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken.job import Job, StepInfo
from unbroken.observe.judge import judge
from unbroken.observe.verdict import Expect, Promise
from unbroken.state.snapshot import TrainState
from unbroken.train.step import slice_seed


@dataclass
class PromiseReport:
    steps: int
    committed_in: dict[int, int] = field(default_factory=dict)
    """For each step index s (0-based), the epoch in which it was committed."""
    final_digests: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    rollbacks: list[str] = field(default_factory=list)
    """What made the group redo committed steps, allowed or not: failed audits' rollbacks,
    restarts from a checkpoint (with how many steps they redid), and committed steps lost
    with the only members that held them (`unbroken.observe.judge`). Not problems: a job
    whose every holder of its newest state died loses the steps since its newest checkpoint."""

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
    """Check gapless commits, one commit epoch per step, equal digests and exactly-once data.

    The check of `unbroken verify` (`unbroken.observe.judge`), on logs in memory: each node's
    entries, in any order (they are sorted by their time ``t``).

    Raises:
        ConfigError: an entry is not one a node writes (a kind no node writes is an error
            here, not a line passed over).
    """
    entries = {node: sorted(log, key=lambda e: e.get("t", 0.0)) for node, log in logs.items()}
    expect = Expect(num_steps=job.num_steps, batch_size=job.batch_size, plan=job.plan(), finishers=finishers)
    verdict = judge({node: functools.partial(list, log) for node, log in entries.items()}, expect, legacy=True)
    return PromiseReport(
        steps=job.num_steps,
        committed_in=verdict.committed_in,
        final_digests=verdict.final_digests,
        problems=verdict.problems,
        rollbacks=[e.text for c in verdict.checks if c.promise is Promise.ROLLBACKS for e in c.evidence],
    )


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
