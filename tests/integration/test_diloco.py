"""DiLoCo mode: two zones of two nodes train alone for H inner steps, then exchange
compressed pseudo-gradients; the promises hold at outer-step granularity.

Nodes a1, a2 sit in zone A and b1, b2 in zone B; a1 and b1 join first and lead their zones.
"""

from __future__ import annotations

import signal

import pytest
import torch

from integration.helpers import events_of, fired, job_for
from jobs import mlp
from unbroken.comm.codecs import make_codec
from unbroken.testing import check_promises, reference_state

H = 10
ENV = {"UB_TEST_STEPS": "60", "UB_TEST_DELAY_MS": "5", "UB_TEST_EVAL": "1"}


def start(
    make_cluster, env=ENV, codec="int8", faults=None, names=("a1", "b1", "a2", "b2"), overlap=False, coordinator=()
):
    faults = faults or {}
    c = make_cluster(
        env=env,
        min_nodes=len(names),
        coordinator_args=["--mode", "diloco", "--inner-steps", str(H), "--codec", codec, "--balance", "weights"]
        + (["--outer-overlap"] if overlap else [])
        + list(coordinator),
        node_args=["--digest-every", "1"],
    )
    c.start_coordinator()

    def joined(who):
        return lambda: {m["name"] for m in c.state()["members"]} >= set(who)

    for name in names:
        c.start_node(name, extra=["--zone", name[0].upper()], fault=faults.get(name, ""))
        if name.endswith("1"):  # join order makes a1 and b1 the leaders
            c.wait_for(joined([name]), 60, f"{name} to join")
    return c


def heldout(c, name: str) -> tuple[float, float]:
    job = job_for(ENV)
    got, ref = job.model(), job.model()
    got.load_state_dict(torch.load(c.nodes[name].final_state, weights_only=True)["model"])
    ref.load_state_dict(reference_state(job))
    with torch.no_grad():
        return job.evaluate(got)["heldout_loss"], job.evaluate(ref)["heldout_loss"]


def promises(c, finishers: int) -> None:
    report = check_promises({n: p.entries() for n, p in c.nodes.items()}, job_for(ENV), finishers=finishers)
    assert report.ok, "\n".join(report.problems) + "\n" + c.diagnostics()


def inter_zone_bytes(c) -> dict[str, list[int]]:
    return {
        n: [e["wire"]["inter"] for e in p.entries() if e["kind"] == "commit" and e.get("wire", {}).get("inter")]
        for n, p in c.nodes.items()
    }


@pytest.mark.parametrize("codec", ["int8", "int2", "int1"])
def test_two_zones_train_to_the_expected_loss_and_talk_once_a_round(make_cluster, codec):
    c = start(make_cluster, codec=codec)
    codes = c.wait_exit(timeout=120)
    assert codes == {"a1": 0, "b1": 0, "a2": 0, "b2": 0}, c.diagnostics()
    promises(c, finishers=4)  # each batch once, a commit per step, equal digests after every outer step
    ours, sync = heldout(c, "a1")
    start_loss = heldout_at_start()
    assert ours < start_loss - 0.8 * (start_loss - sync), (ours, sync, start_loss)
    sent = inter_zone_bytes(c)
    assert len(sent["a1"]) == 60 // H and len(sent["b1"]) == 60 // H and not sent["a2"] and not sent["b2"], sent
    numel = sum(p.numel() for p in job_for(ENV).model().parameters())
    payload = make_codec(codec).payload_bytes(numel)  # what one leader sends, its votes aside
    assert all(payload <= b <= payload + 1024 for b in sent["a1"] + sent["b1"]), (payload, sent)


def heldout_at_start() -> float:
    job = job_for(ENV)
    model = job.model()
    model.load_state_dict(reference_state(job, steps=0))
    with torch.no_grad():
        return job.evaluate(model)["heldout_loss"]


def test_a_zone_leader_killed_mid_exchange_costs_one_round_and_a_dead_zone_drops_out(make_cluster):
    # b1 dies in the exchange of the second outer step (after inner step 19): every node
    # rolls back to step 10, b2 leads zone B, the round is retried with the same samples.
    # Then b2 dies in the exchange after step 39: zone A trains on alone.
    c = start(make_cluster, faults={"b1": "kill@exchange:19", "b2": "kill@exchange:39"})
    codes = c.wait_exit(timeout=120)
    assert fired(c.nodes["b1"], "kill") and fired(c.nodes["b2"], "kill"), c.diagnostics()
    assert codes == {"a1": 0, "b1": -signal.SIGKILL, "a2": 0, "b2": -signal.SIGKILL}, c.diagnostics()
    promises(c, finishers=2)  # no outer step lost or applied twice, each batch once
    b2 = [e["step"] for e in c.nodes["b2"].entries() if e["kind"] == "commit" and e.get("wire", {}).get("inter")]
    # b1 dies after posting its part of the exchange: zone A may complete that outer step (b2
    # then catches up from A and leads B's next one), or not (then every node retries it from
    # step 10 and b2 leads it). Either way each outer step is committed once (promises above).
    assert b2 in ([20, 30], [30]), f"b2 must have led zone B after b1 died: {b2}"
    a1 = [e["step"] for e in c.nodes["a1"].entries() if e["kind"] == "commit" and e.get("outer")]
    assert a1 == [10, 20, 30, 40, 50, 60], a1
    ours, _ = heldout(c, "a1")
    assert ours < heldout_at_start()


def test_a_node_joining_mid_round_catches_up(make_cluster):
    env = {**ENV, "UB_TEST_STEPS": "200", "UB_TEST_DELAY_MS": "50"}
    # Tiny buckets: each inner step's zone sum goes out in pieces while backward runs.
    c = start(make_cluster, env=env, names=("a1", "b1", "a2"), coordinator=["--bucket-mb", "0.0002"])
    c.wait_step(H, timeout=60)
    c.start_node("b2", extra=["--zone", "B"])
    codes = c.wait_exit(timeout=120)
    assert codes == {"a1": 0, "b1": 0, "a2": 0, "b2": 0}, c.diagnostics()
    report = check_promises({n: p.entries() for n, p in c.nodes.items()}, job_for(env), finishers=4)
    assert report.ok, "\n".join(report.problems) + "\n" + c.diagnostics()
    took = [e for e in c.nodes["b2"].entries() if e["kind"] == "inner-sync"]
    assert took and took[0]["zone"] == "B", "b2 must take over zone B's inner optimizer state from b1"
    first = min(e["step"] for e in c.nodes["b2"].entries() if e["kind"] == "contrib")
    assert first % H == 0 and H <= first < 200, first  # it starts with a round, from the outer state
    done = [e["step"] for e in c.nodes["a1"].entries() if e["kind"] == "contrib"]
    assert len(done) == len(set(done)) == 200, "the join waited for the round's end: no inner step redone"
    buckets = [e["buckets"] for e in c.nodes["a1"].entries() if e["kind"] == "contrib"]
    assert all(b[0] == b[1] > 1 for b in buckets), buckets[:8]


def test_rounds_applied_late_keep_every_promise_through_a_kill_and_a_join(make_cluster):
    # --outer-overlap: each round's exchange runs while the next round trains, and is applied
    # at that round's end. b2 dies mid-run (the group rolls back to the last round applied and
    # retries what was in flight); b3 joins later (what is in flight is applied before the
    # epoch changes).
    env = {**ENV, "UB_TEST_STEPS": "200", "UB_TEST_DELAY_MS": "50"}
    c = start(make_cluster, env=env, overlap=True, faults={"b2": "kill@compute:45"})
    c.wait_for(lambda: c.nodes["b2"].proc.poll() is not None, 60, "b2's death")
    c.start_node("b3", extra=["--zone", "B"])
    codes = c.wait_exit(timeout=150)
    assert fired(c.nodes["b2"], "kill"), c.diagnostics()
    assert codes == {"a1": 0, "b1": 0, "a2": 0, "b2": -signal.SIGKILL, "b3": 0}, c.diagnostics()
    report = check_promises({n: p.entries() for n, p in c.nodes.items()}, job_for(env), finishers=4)
    assert report.ok, "\n".join(report.problems) + "\n" + c.diagnostics()
    assert [e for e in c.nodes["b3"].entries() if e["kind"] == "contrib"], "b3 must have trained"
    outer = [e["step"] for e in c.nodes["a1"].entries() if e["kind"] == "commit" and e.get("outer")]
    assert outer == sorted(set(outer)) and outer[-1] == 200 and all(s % H == 0 for s in outer), outer
    # A round is applied one round late: its commit comes after the next round's inner steps.
    entries = c.nodes["a1"].entries()
    commit_10 = next(i for i, e in enumerate(entries) if e["kind"] == "commit" and e["step"] == 10)
    assert any(e["kind"] == "contrib" and e["step"] >= 10 for e in entries[:commit_10]), "round 2 trained first"
    got = job_for(env).model()
    got.load_state_dict(torch.load(c.nodes["a1"].final_state, weights_only=True)["model"])
    with torch.no_grad():
        accuracy = (got.net(mlp.X_HELD_OUT).argmax(1) == mlp.Y_HELD_OUT).float().mean().item()
    # What is asserted of the model: it learns (the last five rounds' mean training loss is
    # a third of the first round's or less: 0.09 to 0.24 against 1.23), and the rounds the
    # kill rolled back and the join applied early did not throw it away: held-out accuracy
    # well above chance. Not held-out cross-entropy (this bound was 0.25 above the untrained
    # model's 1.41, and CI's schedule of the kill and join gave 1.69 once): on this job it
    # measures how sure the model is of its few mistakes. The outer step (lr 0.7, Nesterov
    # 0.9) moves the anchor up to seven times a round's progress, further with progress a
    # round stale, and the final anchor overshoots the zones' models. bench/diloco_late.py
    # replays the mode's math on this job without faults or processes (two zones, 20 rounds,
    # 6 seeds): held-out cross-entropy 1.21 to 1.91 applied late (0.53 to 1.32 at once, 0.14
    # sync), accuracy 0.83 to 0.87 (0.85 to 0.92 at once, 0.96 sync, 0.23 untrained). The
    # kill and the join lose no sample (a round they cut is retried with the same ones), so
    # a run lands in that spread, whatever their schedule: two runs here at a load of 18 to
    # 30 gave 0.875 and 0.915. The bound sits between chance (0.25: the untrained model, or
    # an outer step overshot past the data) and the replay's lowest, nearer the latter.
    round_losses = [e["loss"] for e in entries if e["kind"] == "commit" and e.get("outer")]
    assert sum(round_losses[-5:]) / 5 < round_losses[0] / 3, round_losses
    assert accuracy >= 0.7, accuracy


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_nan_pseudo_gradient_from_a_zone_leader_is_refused_before_anyone_applies_it(make_cluster, codec):
    # b1 leads zone B and sends a NaN pseudo-gradient (with its norm, NaN, in its slot) in the
    # exchange after inner step 19: every node refuses that outer step (int8: the payload's
    # scales do not decode; none: the sum and the leader's slot are not finite), rolls back to
    # step 10 and retries the round, which is clean; the model stays finite, promises hold.
    c = start(make_cluster, codec=codec, faults={"b1": "nan@outer:19"})
    codes = c.wait_exit(timeout=120)
    assert fired(c.nodes["b1"], "nan"), c.diagnostics()
    assert codes == {"a1": 0, "b1": 0, "a2": 0, "b2": 0}, c.diagnostics()
    refused = [e for n in c.nodes.values() for e in n.entries() if e["kind"] == "refused"]
    reasons = [e["reason"] for e in refused]
    assert reasons and all(r.startswith("outer step after inner step 19: ") for r in reasons), reasons
    assert all(("not finite" if codec == "none" else "rank 1 sent int8 payload") in r for r in reasons), reasons
    # b1's row is its own (its zone's sum leaves the head out), so every node names it, as
    # a refused gradient's sender is named, rather than only suspecting the sum.
    assert all((e["culprit"] or "").startswith("b1") for e in refused), refused
    promises(c, finishers=4)
    final = torch.load(c.nodes["a2"].final_state, weights_only=True)["model"]
    assert all(bool(torch.isfinite(v).all()) for v in final.values())
    ours, _ = heldout(c, "a2")
    assert ours < heldout_at_start()


def test_a_zone_leader_that_lies_every_round_is_named_and_the_job_trains_on_without_it(make_cluster):
    # From the exchange after inner step 19 on, b1 sends a NaN pseudo-gradient every round
    # and claims a finite norm. Its row is its own (its zone's sum leaves the head out), so
    # every node names b1 each time; the coordinator benches and then quarantines it, zone B
    # trains on under b2, and the job ends with every promise kept and a finite model.
    c = start(make_cluster, codec="none", faults={"b1": "hide-nan@outer:19"})
    codes = c.wait_exit(timeout=180)
    assert fired(c.nodes["b1"], "hide-nan"), c.diagnostics()
    assert codes.get("a1") == codes.get("a2") == codes.get("b2") == 0, c.diagnostics()
    refused = [e for n in c.nodes.values() for e in n.entries() if e["kind"] == "refused"]
    assert refused and all((e["culprit"] or "").startswith("b1") for e in refused), refused
    offences = [e for e in events_of(c, "bad-gradient") if e["node"] == "b1"]
    assert offences, c.diagnostics()
    final = torch.load(c.nodes["a2"].final_state, weights_only=True)["model"]
    assert all(bool(torch.isfinite(v).all()) for v in final.values())
    promises(c, finishers=3)
