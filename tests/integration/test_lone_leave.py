"""The last member of a group asked to leave while a stale member comes back: the state it
alone holds must reach the returning member, or no committed step is trained twice.

n1 stops itself (SIGSTOP) at step 8 and is expelled; n2 trains on alone and sends itself
SIGTERM at step 14; n1 is woken right then and rejoins holding step 8. A lone member that
went at once left the group to n1, which trained steps 9..14 again from its older state."""

from __future__ import annotations

import signal

from integration.helpers import assert_promises, events_of, fired


def test_a_lone_member_asked_to_leave_hands_its_state_to_a_stale_member_coming_back(make_cluster):
    env = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "20"}
    c = make_cluster(env=env, min_nodes=2, node_args=["--digest-every", "1"])
    c.start_coordinator()
    stale = c.start_node("n1", fault="stop@compute:8")
    last = c.start_node("n2", fault="term@compute:14")
    c.wait_for(lambda: fired(stale, "stop"), 90, "n1 stopped at step 8")
    c.wait_for(lambda: fired(last, "term"), 90, "n2, alone, asked to leave at step 14")
    stale.signal(signal.SIGCONT)
    codes = c.wait_exit(timeout=150)
    assert codes == {"n1": 0, "n2": 0}, c.diagnostics()
    assert any(e["kind"] == "left" for e in last.entries()), c.diagnostics()
    assert_promises(c, env, finishers=1)  # no step committed twice, replicas agree
    synced = [e for e in stale.entries() if e["kind"] == "sync"]
    assert synced and synced[-1]["step"] >= 14, f"n1 must receive n2's state: {synced}\n{c.diagnostics()}"
    assert not events_of(c, "rollback"), "\n".join(f"{e['kind']}: {e['reason']}" for e in c.events())
