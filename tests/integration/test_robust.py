"""Robust aggregation: a node that sends a sign-flipped, ten-times-too-large gradient every
step (inside the guard's range, so nothing refuses it) drags the mean away from the
optimum; ``--aggregate clip`` / ``trimmed`` keep training on course, with every promise
but the exact-mean one (replicas agree bit for bit, every sample counted exactly once)."""

from __future__ import annotations

import pytest
import torch

from integration.helpers import fired, job_for
from jobs import mlp
from unbroken.testing import check_promises, reference_state

ENV = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "5", "UB_TEST_BATCH": "32"}


def heldout(state: dict[str, torch.Tensor]) -> float:
    model, _ = job_for(ENV).build()
    model.load_state_dict(state)
    return mlp.evaluate(model)["heldout_loss"]


def run(make_cluster, rule: str) -> float:
    c = make_cluster(
        env=ENV,
        min_nodes=4,
        coordinator_args=["--aggregate", rule, "--balance", "weights"],
        node_args=["--digest-every", "1"],
    )
    c.start_coordinator()
    for name in ("a", "b", "c"):
        c.start_node(name)
    bad = c.start_node("bad", fault="flip@grad:2")
    codes = c.wait_exit(timeout=120)
    assert codes == {"a": 0, "b": 0, "c": 0, "bad": 0}, c.diagnostics()
    assert fired(bad, "flip")
    report = check_promises({n: node.entries() for n, node in c.nodes.items()}, job_for(ENV), finishers=4)
    assert report.ok, "\n".join(report.problems) + "\n" + c.diagnostics()
    assert not [e for e in c.events() if e["kind"] == "bad-gradient"], "the flip stays inside the guard's range"
    return heldout(torch.load(c.nodes["a"].final_state, weights_only=True)["model"])


# Clipping bounds the bad node's pull to C x the median norm but keeps it: with three honest
# nodes and C = 2 the net step is about a third of the clean one. The trimmed mean drops it.
@pytest.mark.parametrize(("rule", "progress"), [("clip:2", 0.3), ("trimmed:0.25", 0.6)])
def test_a_robust_rule_keeps_training_on_course_despite_a_flipping_node(make_cluster, rule, progress):
    clean = heldout(reference_state(job_for(ENV)))
    start = heldout(reference_state(job_for(ENV), steps=0))
    got = run(make_cluster, rule)
    assert got < start - progress * (start - clean), (rule, got, clean, start)


def test_the_mean_follows_the_flipping_node(make_cluster):
    start = heldout(reference_state(job_for(ENV), steps=0))
    assert run(make_cluster, "mean") > start  # the attack is real: the robust rules are what stop it
