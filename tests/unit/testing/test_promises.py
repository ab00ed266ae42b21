"""The promise checker: a step applied by a member that died before anyone else applied it
was the step in flight; a step applied twice by live members, a gap, a sample used twice or
left out, and replicas that differ are broken promises."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from unbroken.job import Job
from unbroken.observe.judge import judge
from unbroken.observe.verdict import Expect, Promise
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


def whole_run(digests: tuple[str, ...] = ("d0", "d1", "d2")) -> list[dict[str, Any]]:
    out = [e for s in range(T) for e in step(1 + s, 1, s, digests[s])]
    return [*out, final(5, digests[-1])]


def test_a_clean_run_of_two_members_keeps_every_promise() -> None:
    a = [e for s in range(T) for e in step(1 + s, 1, s, f"d{s}", (0, 2))] + [final(5, "d2")]
    b = [e for s in range(T) for e in step(1 + s, 1, s, f"d{s}", (2, 2))] + [final(5, "d2")]
    report = check_promises({"a": a, "b": b}, JOB, finishers=2)
    assert report.ok, report.problems


def test_a_gap_in_the_commits_is_a_broken_promise() -> None:
    run = [e for e in whole_run() if not (e["kind"] == "commit" and e["step"] == 2)]
    report = check_promises({"a": run}, JOB, finishers=1)
    assert "steps never committed: [2]" in report.problems, report.problems


def test_a_sample_used_twice_is_a_broken_promise() -> None:
    run = whole_run()
    contrib = next(e for e in run if e["kind"] == "contrib" and e["step"] == 1)
    contrib["indices"] = [*contrib["indices"][:-1], PLAN.indices(0, 0, B)[0]]  # one of step 0's again
    report = check_promises({"a": run}, JOB, finishers=1)
    assert report.problems == ["step 2 (epoch 1) consumed 4 samples from 1 slices; expected exactly the 4 planned ones"]


def test_a_sample_left_out_is_a_broken_promise() -> None:
    run = whole_run()
    contrib = next(e for e in run if e["kind"] == "contrib" and e["step"] == 2)
    contrib["indices"] = contrib["indices"][:-1]
    report = check_promises({"a": run}, JOB, finishers=1)
    assert report.problems == ["step 3 (epoch 1) consumed 3 samples from 1 slices; expected exactly the 4 planned ones"]


def test_replicas_that_differ_after_a_step_break_the_promise() -> None:
    a = [e for s in range(T) for e in step(1 + s, 1, s, f"d{s}", (0, 2))] + [final(5, "d2")]
    b = [e for s in range(T) for e in step(1 + s, 1, s, "x1" if s == 1 else f"d{s}", (2, 2))] + [final(5, "d2")]
    report = check_promises({"a": a, "b": b}, JOB, finishers=2)
    assert report.problems == ["replicas differ after step 2: {'a': 'd1', 'b': 'x1'}"]


def test_committed_steps_lost_with_their_only_holder_are_named_not_passed_over() -> None:
    # "lone" trained steps 2 and 3 alone and died with them; "stale", expelled after step 1,
    # came back and trained them again from its state of step 1, with no restore: allowed
    # (every holder of the newest state is gone), but two committed steps were lost.
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 2, 1, "x1"), *step(3, 2, 2, "x2")]
    stale = [*step(1, 1, 0, "a0", (0, 2)), {"t": 3.5, "kind": "expelled", "reason": "lease", "step": 1}]
    stale += [*step(4, 3, 1, "b1"), *step(5, 3, 2, "b2"), final(6, "b2")]
    report = check_promises({"lone": lone, "stale": stale}, JOB, finishers=1)
    assert report.ok, report.problems
    assert report.rollbacks == [
        "lone died holding steps 2-3, which no other member held, and no checkpoint was restored: "
        "2 committed steps lost and trained again"
    ], report.rollbacks
    # Gone back to a checkpoint of step 2 instead: only step 3 was redone, and the restore says so.
    stale = [*step(1, 1, 0, "a0", (0, 2)), {"t": 3.5, "kind": "expelled", "reason": "lease", "step": 1}]
    stale += [{"t": 3.9, "kind": "restore", "step": 2, "path": "ckpt-2.pt", "digest": "x1"}]
    stale += [*step(5, 3, 2, "b2"), final(6, "b2")]
    report = check_promises({"lone": lone, "stale": stale}, JOB, finishers=1)
    assert report.ok, report.problems
    assert report.rollbacks == [
        "stale restarted from a checkpoint, ckpt-2.pt (step 2) after the group had reached step 3: 1 steps redone"
    ], report.rollbacks


def test_single_steps_lost_by_different_members_in_different_epochs_are_no_run() -> None:
    # x alone committed step 2 in epoch 2 and died with it (the step in flight); y, later
    # alone, committed step 3 in epoch 4 and died with it (another step in flight). No run
    # of committed steps was lost with one member: nothing to name.
    s = [*step(1, 1, 0, "a0", (0, 2)), *step(3, 3, 1, "s1", (0, 2)), *step(5, 5, 2, "s2"), final(6, "s2")]
    x = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 2, 1, "x1")]
    y = [*step(1.5, 1, 0, "a0", (2, 0)), *step(3, 3, 1, "s1", (2, 2)), *step(4, 4, 2, "y2")]
    report = check_promises({"s": s, "x": x, "y": y}, JOB, finishers=1)
    assert report.ok, report.problems
    assert report.rollbacks == [], report.rollbacks


def test_a_lost_run_is_dated_by_its_holders_commit_not_by_the_commit_again() -> None:
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 2, 1, "x1"), *step(3, 2, 2, "x2")]
    stale = [*step(1, 1, 0, "a0", (0, 2)), {"t": 3.5, "kind": "expelled", "reason": "lease", "step": 1}]
    stale += [*step(4, 3, 1, "b1"), *step(5, 3, 2, "b2"), final(6, "b2")]
    expect = Expect(num_steps=T, batch_size=B, plan=PLAN, finishers=1)
    verdict = judge({"lone": lambda: lone, "stale": lambda: stale}, expect)
    (lost,) = [e for c in verdict.checks if c.promise is Promise.ROLLBACKS for e in c.evidence]
    assert (lost.node, lost.step, lost.epoch, lost.t) == ("lone", 2, 2, 2.01), lost


def test_steps_lost_with_two_holders_dying_one_after_the_other_are_not_passed_over() -> None:
    # a and b committed step 2 together, b died; a alone committed step 3 and died: s, stale
    # since step 1, trained both again with no restore. Each step had its own holders, but
    # two committed steps were lost: never excused as two steps in flight.
    s = [*step(1, 1, 0, "a0", (0, 2)), {"t": 1.5, "kind": "expelled", "reason": "lease", "step": 1}]
    s += [*step(5, 4, 1, "s1"), *step(6, 4, 2, "s2"), final(7, "s2")]
    a = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 2, 1, "x1", (0, 2)), *step(3, 3, 2, "x2")]
    b = [*step(2, 2, 1, "x1", (2, 2))]
    report = check_promises({"s": s, "a": a, "b": b}, JOB, finishers=1)
    assert not report.ok and "step 2 committed in epoch 2 and again in epoch 4" in report.problems, report.problems
