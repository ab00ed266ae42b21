"""The promise checker: a step applied by a member that died before anyone else applied it
was the step in flight; a step applied twice by live members is a broken promise."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from unbroken.job import Job
from unbroken.testing import check_promises

B, T = 4, 3
JOB = Job(
    name="p", model=lambda: nn.Linear(1, 1), optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    dataset=TensorDataset(torch.zeros(40, 1), torch.zeros(40, 1)), loss=nn.functional.mse_loss,
    batch_size=B, num_steps=T,
)  # fmt: skip
PLAN = JOB.plan()


def step(t: float, epoch: int, s: int, digest: str, share: tuple[int, int] = (0, B)) -> list[dict[str, Any]]:
    """A contribution to step s (0-based) and its commit, as a node logs them."""
    offset, count = share
    return [
        {"t": t, "kind": "contrib", "epoch": epoch, "step": s, "indices": PLAN.indices(s, offset, count)},
        {"t": t + 0.01, "kind": "commit", "epoch": epoch, "step": s + 1, "digest": digest},
    ]


def final(t: float, digest: str) -> dict[str, Any]:
    return {"t": t, "kind": "final", "step": T, "digest": digest}


def test_a_step_applied_only_by_a_member_that_then_died_is_the_step_in_flight() -> None:
    survivor = [*step(1, 1, 0, "a0", (0, 2)), *step(3, 2, 1, "b1", (0, B)), *step(4, 2, 2, "b2", (0, B))]
    survivor.append(final(5, "b2"))
    # It had the whole all-reduce of step 1 (a peer crashed after it got it), applied it, died.
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 1, 1, "x1", (2, 2))]
    report = check_promises({"s": survivor, "lone": lone}, JOB, finishers=1)
    assert report.ok, report.problems


def test_a_step_applied_again_while_its_first_committer_lives_on_is_a_broken_promise() -> None:
    survivor = [*step(1, 1, 0, "a0", (0, 2)), *step(3, 2, 1, "b1", (0, B)), *step(4, 2, 2, "b2", (0, B))]
    survivor.append(final(5, "b2"))
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 1, 1, "x1", (2, 2))]
    lone.append({"t": 6, "kind": "epoch", "epoch": 3, "step": 2})  # it lived on, holding its own step 2
    report = check_promises({"s": survivor, "lone": lone}, JOB, finishers=1)
    assert any("step 2 committed in epoch 1 and again in epoch 2" in p for p in report.problems), report.problems


def test_a_step_applied_only_by_a_member_then_frozen_and_expelled_is_the_step_in_flight() -> None:
    # The chaos soak's case: a peer's link was cut in the all-reduce of step 1 after "lone"
    # had all of it; "lone" applied it and was frozen (SIGSTOP) before any later epoch; its
    # lease ran out, the survivor committed step 1 again alone, and "lone" came back as a
    # new member and took the group's state.
    survivor = [*step(1, 1, 0, "a0", (0, 2)), *step(3, 2, 1, "b1", (0, B)), *step(4, 2, 2, "b2", (0, B))]
    survivor.append(final(5, "b2"))
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 1, 1, "x1", (2, 2))]
    lone += [
        {"t": 4.5, "kind": "expelled", "reason": "no heartbeat", "step": 2},
        {"t": 4.6, "kind": "epoch", "epoch": 3, "step": 2},
        {"t": 4.7, "kind": "sync", "epoch": 3, "step": 3, "digest": "b2"},
        final(5, "b2"),
    ]
    report = check_promises({"s": survivor, "lone": lone}, JOB, finishers=2)
    assert report.ok, report.problems
    # The same, but it took part in epoch 2 before it was expelled: its step could have spread.
    lone.insert(2, {"t": 2.5, "kind": "epoch", "epoch": 2, "step": 2})
    report = check_promises({"s": survivor, "lone": lone}, JOB, finishers=2)
    assert any("step 2 committed in epoch 1 and again in epoch 2" in p for p in report.problems), report.problems
