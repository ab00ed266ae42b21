"""The lone member holding the group's newest state dies, and a stale member goes on: the
group must go on from the newest checkpoint it can read, not from the stale member's older
state, and say which committed steps were lost.

n1 stops itself (SIGSTOP) at step 8 and is expelled; n2 trains on alone, writing a
checkpoint every 10 steps to the shared --checkpoint-dir, and is SIGKILLed at step 26 (or
freezes there: SIGSTOP); n1 is woken right then and rejoins holding step 8. Without the
comparison with the checkpoints, n1 trained steps 9..26 again from its state of step 8 and
the job ended with exit 0, its verdict clean. The frozen holder is still a member when n1
rejoins: their epoch never syncs, and the next keeps n1 alone (so does a killed process
that outlives its signal on a busy machine)."""

from __future__ import annotations

import signal

import pytest

from integration.helpers import assert_promises, events_of, fired, job_for
from unbroken.events import BACK_TO_CHECKPOINT
from unbroken.testing import check_promises


@pytest.mark.parametrize("death", ["kill", "stop"])
def test_a_stale_member_left_alone_goes_on_from_the_newer_checkpoint(make_cluster, tmp_path, death):
    env = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "20"}
    ckpt = tmp_path / "ckpt"
    args = ["--digest-every", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"]
    c = make_cluster(env=env, min_nodes=2, node_args=args)
    c.start_coordinator()
    stale = c.start_node("n1", fault="stop@compute:8")
    last = c.start_node("n2", fault=f"{death}@compute:26")
    c.wait_for(lambda: fired(stale, "stop"), 90, "n1 stopped at step 8")
    c.wait_for(lambda: fired(last, death), 90, f"n2, alone, {death} at step 26")
    stale.signal(signal.SIGCONT)
    codes = c.wait_exit(["n1"], timeout=150)
    last.kill()
    assert codes == {"n1": 0}, c.diagnostics()
    restores = [e for e in stale.entries() if e["kind"] == "restore"]
    # The checkpoint of step 20 is written in the background: on a busy machine the newest
    # complete one may be that of step 10; either is newer than n1's own state.
    assert restores and restores[0]["step"] in (10, 20), f"n1 must restore a checkpoint: {restores}\n{c.diagnostics()}"
    back = restores[0]["step"]
    redone = sorted(e["step"] for e in stale.entries() if e["kind"] == "commit" and e["t"] > restores[0]["t"])
    assert redone[0] == back + 1, f"n1 trains on from the checkpoint's step {back}: {redone[:5]}"
    said = [e["reason"] for e in events_of(c, "fallback") if BACK_TO_CHECKPOINT in e["reason"]]
    assert said and f"{BACK_TO_CHECKPOINT} {back}" in said[0], "\n".join(e["reason"] for e in c.events())
    assert f"steps {back + 1}.." in said[0], said  # the steps lost are named
    assert_promises(c, env, finishers=1)  # the restored state is n2's of that step (digests)
    # The verdict does not pretend: the steps after the checkpoint were committed twice.
    report = check_promises({name: n.entries() for name, n in c.nodes.items()}, job_for(env))
    assert any(f"(step {back})" in rb for rb in report.rollbacks), report.rollbacks
