"""A node whose gradient is poisoned (NaN, or a spike far out of range) is refused before the
step is applied; the step is retried without it and the model equals the reference."""

from __future__ import annotations

import math

import pytest
import torch

from integration.helpers import assert_promises, events_of, fired

ENV = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "10"}


def two_and_one(make_cluster, name: str, fault: str, timeout: float, coordinator_args=()):
    """Nodes a and b, and ``name`` with ``fault``, run to the end; a and b exit cleanly, and
    so does ``name`` unless it was quarantined: then it stops with an error naming why."""
    c = make_cluster(env=ENV, min_nodes=3, node_args=["--digest-every", "1"], coordinator_args=list(coordinator_args))
    c.start_coordinator()
    c.start_node("a")
    c.start_node("b")
    odd = c.start_node(name, fault=fault)
    codes = c.wait_exit(timeout=timeout)
    quarantined = any(e["reason"].startswith(name) for e in events_of(c, "quarantine"))
    assert codes == {"a": 0, "b": 0, name: 2 if quarantined else 0}, c.diagnostics()
    if quarantined:
        assert "quarantined by the group" in odd.stderr(), odd.stderr()[-2000:]
    return c, odd


def final_is_finite(c) -> bool:
    final = torch.load(c.nodes["a"].final_state, weights_only=True)["model"]
    return all(bool(torch.isfinite(v).all()) for v in final.values())


@pytest.mark.parametrize(("poison", "buckets"), [("nan", "25"), ("spike", "25"), ("spike", "0.0002")])
def test_a_poisoned_gradient_is_refused_and_the_model_stays_exact(make_cluster, poison, buckets):
    """A gradient poisoned once (a faulty device, a bad batch): the step is not applied; it
    is retried with every contribution gathered and checked, and since the retry is clean
    nobody is benched (no evidence), and the model equals the reference; also with the
    gradient sent in tiny buckets while backward runs."""
    c, bad = two_and_one(
        make_cluster, "bad", f"{poison}@grad:12", timeout=120, coordinator_args=["--bucket-mb", buckets]
    )
    assert fired(bad, poison)
    refused = [e for e in c.nodes["a"].entries() if e["kind"] == "refused"]
    assert refused and refused[0]["step"] == 12 and refused[0]["culprit"] is None, refused
    assert events_of(c, "suspect"), "most members saw the sum not add up"
    assert not events_of(c, "bad-gradient"), "a clean retry is no evidence against anyone"
    assert final_is_finite(c)
    losses = [e["loss"] for e in c.nodes["a"].entries() if e["kind"] == "commit"]
    assert all(math.isfinite(x) for x in losses)
    assert_promises(c, ENV, finishers=3)  # step 12 retried with the same samples: equal to the reference


@pytest.mark.parametrize(("lie", "aggregate"), [("hide-nan", "mean"), ("forge-slot", "mean"), ("hide-spike", "clip:2")])
def test_a_member_that_lies_about_its_gradient_is_named_from_the_data_itself(make_cluster, lie, aggregate):
    """A NaN or -10^6x gradient sent with the norm of the true one, or +inf written into the
    next member's norm slot: never applied, only the liar is named (from the gathered rows
    every member checks), and the honest group's model is the reference's."""
    c, liar = two_and_one(
        make_cluster, "liar", f"{lie}@grad:12", timeout=150, coordinator_args=["--aggregate", aggregate]
    )
    assert fired(liar, lie)
    named = [e for n in ("a", "b") for e in c.nodes[n].entries() if e["kind"] == "refused" and e["culprit"]]
    assert named and all(e["culprit"].startswith("liar") for e in named), named
    flagged = events_of(c, "bad-gradient")
    assert flagged and all("liar" in e["reason"] for e in flagged), flagged
    assert final_is_finite(c)
    # Named again whenever it lies again (every step is checked while it is in the epoch):
    # quarantined after three offences, out of training; the honest two finish the job.
    assert_promises(c, ENV, finishers=2, reference=aggregate == "mean")
