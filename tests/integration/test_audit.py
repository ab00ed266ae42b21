"""Consistency audit: a bit flipped in one replica (silent data corruption) is found by the
next audit, the right node is named and repaired from a peer, the steps its corrupted
replica took part in are redone, and the job ends equal to the reference."""

from __future__ import annotations

from typing import Any

import pytest

from integration.helpers import assert_promises, events_of, fired

ENV = {"UB_TEST_STEPS": "60", "UB_TEST_DELAY_MS": "10"}


def flipped(make_cluster: Any, env: dict[str, str], step: int) -> tuple[Any, Any]:
    """Three nodes audited every 10 steps, ``c`` with a bit flipped after committing
    ``step``, run to the end; the cluster and ``c``."""
    c = make_cluster(env=env, min_nodes=3, coordinator_args=["--audit-every", "10"], node_args=["--digest-every", "1"])
    c.start_coordinator()
    c.start_node("a")
    c.start_node("b")
    bad = c.start_node("c", fault=f"bitflip@commit:{step}")
    codes = c.wait_exit(timeout=120)
    assert codes == {"a": 0, "b": 0, "c": 0}, c.diagnostics()
    assert fired(bad, "bitflip")
    return c, bad


def test_a_flipped_bit_is_found_named_and_repaired(make_cluster):
    c, bad = flipped(make_cluster, ENV, 23)
    audits = events_of(c, "audit")
    assert len(audits) == 1 and audits[0]["node"] == "c", audits
    assert "step 30" in audits[0]["reason"] and "differs from the majority" in audits[0]["reason"]
    # ...and names where: the tensor the bit was flipped in, and on whom.
    assert "it differs in model " in audits[0]["reason"] and "(on c#" in audits[0]["reason"], audits[0]
    # Repaired: c received the majority's state, then trained on with it.
    kinds = [e["kind"] for e in bad.entries()]
    assert "sync" in kinds[kinds.index("refused") :], kinds
    checks = [e for e in c.nodes["a"].entries() if e["kind"] == "audit"]
    assert [(e["step"], e["ok"]) for e in checks] == [(10, True), (20, True), (30, False), (30, True), (40, True),
                                                      (50, True), (60, True)], checks  # fmt: skip
    restores = [e for e in c.nodes["a"].entries() if e["kind"] == "restore"]
    assert [e["step"] for e in restores] == [20], "back to the last audited state; steps 21..30 redone"
    sync = next(e for e in bad.entries() if e["kind"] == "sync")
    assert sync["step"] == 20, sync
    # Every promise: exactly-once samples, equal replicas after every step (the corrupted
    # ones, taken back, excepted), and the final model equal to single-process training.
    assert_promises(c, ENV, finishers=3)


@pytest.mark.parametrize(("steps", "flip", "back"), [(40, 35, 30), (45, 42, 40)], ids=["on-period", "off-period"])
def test_a_failed_audit_at_the_last_step_rolls_back_instead_of_finishing(make_cluster, steps, flip, back):
    """The audit of the job's last step finds a flipped bit: nobody finishes with that
    state; every member goes back to the last audited one, redoes the steps, and the job
    ends equal to the reference. The last step is audited even off the audit period."""
    env = {"UB_TEST_STEPS": str(steps), "UB_TEST_DELAY_MS": "10"}
    c, _ = flipped(make_cluster, env, flip)
    audits = events_of(c, "audit")
    assert len(audits) == 1 and f"step {steps}" in audits[0]["reason"], audits
    for name in ("a", "b"):
        entries = c.nodes[name].entries()
        assert [e["step"] for e in entries if e["kind"] == "restore"] == [back], name
        checks = [(e["step"], e["ok"]) for e in entries if e["kind"] == "audit"]
        assert checks[-3:] == [(back, True), (steps, False), (steps, True)], checks
    assert_promises(c, env, finishers=3)


def test_a_flipped_bit_met_first_by_an_epoch_change_still_takes_the_group_back(make_cluster):
    """The bit flips after step 23 and a member dies at step 26, before the audit of step 30:
    the sync phase of the next epoch compares the members' digests at one step, as an audit
    does. The flipped replica is named and every member goes back to the last audited state
    (step 20): its contributions since are not kept, and the job ends equal to the reference."""
    c = make_cluster(env=ENV, min_nodes=3, coordinator_args=["--audit-every", "10"], node_args=["--digest-every", "1"])
    c.start_coordinator()
    c.start_node("a")
    c.start_node("b")
    bad = c.start_node("c", fault="bitflip@commit:23")
    c.start_node("d", fault="kill@compute:26")
    codes = c.wait_exit(timeout=120)
    assert codes["a"] == codes["b"] == codes["c"] == 0 and codes["d"] != 0, c.diagnostics()
    assert fired(bad, "bitflip")
    audits = events_of(c, "audit")
    assert len(audits) == 1 and audits[0]["node"] == "c", audits
    for name in ("a", "b"):
        restores = [e["step"] for e in c.nodes[name].entries() if e["kind"] == "restore"]
        assert restores == [20], (name, restores)
    assert_promises(c, ENV, finishers=3)
