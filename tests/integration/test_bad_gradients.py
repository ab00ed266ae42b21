"""A node whose gradient is poisoned (NaN, or a spike far out of range) is refused before the
step is applied; the step is retried without it and the model equals the reference."""

from __future__ import annotations

import math

import pytest
import torch

from integration.helpers import assert_promises, events_of, fired

ENV = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "10"}


@pytest.mark.parametrize("poison", ["nan", "spike"])
def test_a_poisoned_gradient_is_refused_and_the_model_stays_exact(make_cluster, poison):
    c = make_cluster(env=ENV, min_nodes=3, node_args=["--digest-every", "1"])
    c.start_coordinator()
    c.start_node("a")
    c.start_node("b")
    bad = c.start_node("bad", fault=f"{poison}@grad:12")
    codes = c.wait_exit(timeout=120)
    assert codes == {"a": 0, "b": 0, "bad": 0}, c.diagnostics()
    assert fired(bad, poison)
    refused = [e for e in c.nodes["a"].entries() if e["kind"] == "refused"]
    assert refused and refused[0]["step"] == 12 and refused[0]["culprit"].startswith("bad"), refused
    flagged = events_of(c, "bad-gradient")
    assert len(flagged) == 1 and "bad" in flagged[0]["reason"], flagged
    # Benched: the node keeps its replica but computes nothing for a while.
    after = [e for e in bad.entries() if e["kind"] == "contrib" and e["step"] >= 12 and e["epoch"] > 1]
    assert after and all(not e["indices"] for e in after[:5]), after[:5]
    final = torch.load(c.nodes["a"].final_state, weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in final.values())
    losses = [e["loss"] for e in c.nodes["a"].entries() if e["kind"] == "commit"]
    assert all(math.isfinite(x) for x in losses)
    assert_promises(c, ENV, finishers=3)  # step 12 retried with the same samples: equal to the reference
