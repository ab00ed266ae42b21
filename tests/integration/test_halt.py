"""A failure training cannot go past stops the job with its cause named, on every node and
with a non-zero exit; it is never a loop that looks like training (promise 9)."""

from __future__ import annotations

import signal

import pytest

from integration.helpers import events_of

pytestmark = pytest.mark.timeout(180)

NAN_AT = 5
ENV = {"UB_TEST_STEPS": "30", "UB_TEST_DELAY_MS": "10", "UB_TEST_NAN_AT": str(NAN_AT)}


def commits(c) -> list[int]:
    return [e["step"] for n in c.nodes.values() for e in n.entries() if e["kind"] == "commit"]


def test_a_step_whose_samples_give_nan_on_every_member_stops_the_job_naming_the_step(make_cluster):
    """NaN in the samples of one step: each member that computes them is refused in turn.
    The second member refused for the same step is the data's evidence, not a node's: the
    job stops, every node exits non-zero saying which step and why, and a node that comes
    later is refused with the same reason (before: both nodes quarantined, the job hung)."""
    c = make_cluster(env=ENV, min_nodes=2)
    c.start_coordinator()
    c.start_node("a")
    c.start_node("b")
    codes = c.wait_exit(timeout=90)
    assert codes == {"a": 2, "b": 2}, c.diagnostics()
    for node in c.nodes.values():
        err = node.stderr()
        assert f"step {NAN_AT} was refused for every member that computed it" in err, err[-3000:]
        assert "not a faulty node" in err
    (halted,) = events_of(c, "halted")
    assert f"step {NAN_AT}" in halted["reason"], halted
    assert max(commits(c)) == NAN_AT, "nothing is committed at or after the step that cannot be computed"
    assert not events_of(c, "quarantine"), "the data, not the members, was named"
    late = c.start_node("late")
    assert late.wait(timeout=60) == 2
    assert "was stopped at step" in late.stderr() and f"step {NAN_AT}" in late.stderr(), late.stderr()[-3000:]


def test_a_quarantined_node_is_told_and_exits_naming_its_offences(make_cluster):
    """One node: its gradient of step 5 is refused again and again until it is quarantined;
    it is told so and exits non-zero with the offences (before: it waited, alive, forever).
    One member alone cannot tell its data from itself, so nothing halts: the group waits
    for nodes, as after any loss of the last one."""
    c = make_cluster(env=ENV, min_nodes=1)
    c.start_coordinator()
    c.start_node("a")
    assert c.wait_exit(timeout=90) == {"a": 2}, c.diagnostics()
    err = c.nodes["a"].stderr()
    assert "quarantined by the group" in err and "not finite" in err, err[-3000:]
    assert events_of(c, "quarantine") and not events_of(c, "halted")
    assert max(commits(c)) == NAN_AT


def test_a_node_the_job_finished_without_exits_non_zero_saying_its_model_is_not_the_final_one(make_cluster):
    """A node frozen while the others train to the end holds an older state when it wakes:
    it must not exit 0 as if it held the model (promise 9; it used to exit 0, outcome
    job-finished). A node that comes after the end is refused (exit 2), as before."""
    c = make_cluster(env={"UB_TEST_STEPS": "60", "UB_TEST_DELAY_MS": "20"}, min_nodes=2)
    c.start_coordinator()
    c.start_node("a")
    b = c.start_node("b")
    c.wait_step(10, timeout=90)
    b.signal(signal.SIGSTOP)
    try:
        assert c.wait_exit(["a"], timeout=120) == {"a": 0}, c.diagnostics()
    finally:
        b.signal(signal.SIGCONT)
    assert b.wait(timeout=60) == 3, b.stderr()[-3000:]
    assert "not the group's final model" in b.stderr(), b.stderr()[-3000:]
    late = c.start_node("late")
    assert late.wait(timeout=60) == 2 and "already finished" in late.stderr(), late.stderr()[-3000:]
