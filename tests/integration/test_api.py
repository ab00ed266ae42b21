"""The coordinator started from Python, serving its state as JSON to real nodes."""

from __future__ import annotations

import json
import urllib.request

import pytest

from integration.helpers import assert_promises
from unbroken import Coordinator, CoordinatorConfig, MembershipConfig, ServiceConfig

pytestmark = pytest.mark.timeout(120)


def test_embedded_coordinator_serves_state(make_cluster):
    env = {"UB_TEST_STEPS": "60", "UB_TEST_DELAY_MS": "20"}
    coord = Coordinator(CoordinatorConfig(ServiceConfig(port=0), MembershipConfig(min_nodes=2))).start()
    try:
        c = make_cluster(env=env)
        c.address = coord.address
        c.start_node("a")
        c.start_node("b")
        c.wait_step(10)
        host, port = coord.address
        with urllib.request.urlopen(f"http://{host}:{port}/api/state", timeout=5) as r:
            state = json.load(r)
        assert state["job"] == "test-mlp"
        assert state["epoch"] >= 1  # a rebalance is an epoch too
        assert sorted(m["name"] for m in state["members"]) == ["a", "b"]
        assert sorted(m["rank"] for m in state["members"]) == [0, 1]
        # Two equal nodes; their measured speeds decide the exact split.
        assert sum(state["plan"]["shares"]) == 30 and state["plan"]["batch_size"] == 30
        assert all(m["capabilities"]["device"] == "cpu" for m in state["members"])
        assert 1 <= state["step"] <= c.max_committed()  # progress reports lag commits slightly
        codes = c.wait_exit(timeout=90)
        assert codes == {"a": 0, "b": 0}, c.diagnostics()
        assert_promises(c, env, finishers=2)
        assert coord.snapshot()["finished"]
    finally:
        coord.stop()
