"""Heterogeneous nodes: shares follow measured speed and memory, roles for nodes too slow to train.

Nodes are made unequal with ``--throttle`` (an emulated slower device) on a job whose compute
cost is a sleep per sample, so the CPU of a two-core machine is not what decides the speeds.
"""

from __future__ import annotations

import itertools
import signal
import statistics
import time

import pytest
import torch

from integration.helpers import Pace, assert_promises, events_of, fired, job_for, slowdown
from unbroken.testing import reference_state
from unbroken.train.device import STATE_BYTES_PER_PARAM_BYTE, SavedBytes

BASE = {"UB_TEST_DELAY_MS": "0", "UB_TEST_SAMPLE_MS": "2", "UB_TEST_BATCH": "60"}
BUSY = 1.25
"""A busy loop's slowdown (`helpers.slowdown`, ``load=False``) from which the machine's other
processes take a fifth of a core from it: processes meant to be identical are not, there
(two CPU-bound neighbours on 2 cores: 1.5)."""


def start(make_cluster, env, n, **kw):
    c = make_cluster(env=env, min_nodes=n, node_args=["--digest-every", "1"], **kw)
    c.start_coordinator()
    return c


def shares_by_step(node) -> dict[int, int]:
    """Samples this node computed for each committed step (its last contribution to it)."""
    out: dict[int, int] = {}
    for e in node.entries():
        if e["kind"] == "contrib":
            out[e["step"]] = len(e["indices"])
    return out


@pytest.mark.serial  # shares by measured speed: another test's load would skew them
def test_unequal_nodes_get_shares_by_speed_and_match_the_reference(make_cluster):
    env = {**BASE, "UB_TEST_STEPS": "40"}
    c = start(make_cluster, env, n=3)
    c.start_node("full")
    c.start_node("half", extra=["--throttle", "0.5"])
    c.start_node("quarter", extra=["--throttle", "0.25"])
    codes = c.wait_exit(timeout=120)
    assert codes == {"full": 0, "half": 0, "quarter": 0}, c.diagnostics()
    mid = {name: statistics.median(shares_by_step(n).values()) for name, n in c.nodes.items()}
    # Speeds 1 : 1/2 : 1/4 of B = 60 → about 34 : 17 : 9.
    assert mid["full"] > mid["half"] > mid["quarter"] > 0, mid
    assert 1.4 <= mid["full"] / mid["half"] <= 2.8, mid
    assert 1.4 <= mid["half"] / mid["quarter"] <= 2.8, mid
    assert_promises(c, env, finishers=3)


@pytest.mark.serial  # shares by measured speed: another test's load would skew them
def test_a_node_slowed_mid_run_loses_share_and_gets_it_back(make_cluster):
    env = {**BASE, "UB_TEST_STEPS": "120"}
    c = start(make_cluster, env, n=2)
    c.start_node("steady")
    c.start_node("varying", extra=["--throttle", "1,30:0.25,75:1"])
    codes = c.wait_exit(timeout=180)
    assert codes == {"steady": 0, "varying": 0}, c.diagnostics()
    share = shares_by_step(c.nodes["varying"])
    before = statistics.median(share[s] for s in range(10, 30))
    assert 20 <= before <= 40, share  # equal speeds: about half of 60
    shrunk = next(s for s in range(30, 75) if share.get(s, before) <= before * 0.6)
    assert shrunk - 30 <= 10, f"share shrank only at step {shrunk}: {share}"
    assert statistics.median(share[s] for s in range(shrunk, 75)) <= before * 0.5, share
    grown = next(s for s in range(75, 120) if share.get(s, 0) >= before * 0.8)
    assert grown - 75 <= 15, f"share grew back only at step {grown}: {share}"
    stragglers = events_of(c, "straggler")
    assert any("varying" in e["reason"] for e in stragglers), stragglers
    assert len(events_of(c, "epoch")) <= 6, "the plan flapped: " + str(events_of(c, "epoch"))
    assert_promises(c, env, finishers=2)


@pytest.mark.serial  # judges speeds: another test's load would make one node slow at random
def test_a_node_too_slow_to_train_validates_committed_state(make_cluster):
    env = {**BASE, "UB_TEST_STEPS": "60", "UB_TEST_EVAL": "1"}
    c = start(make_cluster, env, n=3)
    c.start_node("a")
    c.start_node("b")
    slow = c.start_node("slow", extra=["--throttle", "0.02"])  # one sample takes it 100 ms; the step 60 ms
    codes = c.wait_exit(timeout=120)
    assert codes == {"a": 0, "b": 0, "slow": 0}, c.diagnostics()
    # Its start-up estimate alone does not demote it: it trains a sample per step until its
    # speed is measured on real steps, then validates.
    contribs = [e for e in slow.entries() if e["kind"] == "contrib"]
    first = next(i for i, e in enumerate(contribs) if e["role"] == "validator")
    # The plan waits for measured steps and a dwell time (seconds, not steps): on an idle
    # machine it is demoted near step 10; a busy one runs more steps in that time.
    assert contribs[first]["step"] <= 30, contribs[first]
    assert all(len(e["indices"]) <= 1 for e in contribs[:first]), contribs[:first]
    assert all(e["role"] == "validator" and not e["indices"] for e in contribs[first:]), contribs[first:][:3]
    roles = [e for e in events_of(c, "role") if "slow" in e["reason"]]
    assert roles and "validator" in roles[0]["reason"] and "ms" in roles[0]["reason"], roles
    validations = [e for e in slow.entries() if e["kind"] == "validation"]
    assert len(validations) >= 2, validations
    job = job_for(env)
    for v in validations[:3]:
        model = job.model()
        model.load_state_dict(reference_state(job, steps=v["step"]))
        with torch.no_grad():
            direct = job.evaluate(model)["heldout_loss"]
        assert abs(v["metrics"]["heldout_loss"] - direct) < 1e-5, (v, direct)
    reported = events_of(c, "validation")
    assert len(reported) >= len(validations) - 1, reported
    assert_promises(c, env, finishers=3)


def test_a_standby_replaces_a_killed_trainer_faster_than_a_cold_join(make_cluster, tmp_path):
    # 700 steps, paced until the late node trains (its cold start took 5 s on a busy machine,
    # and 260 steps had ended before it), then the rest at full speed: nothing after is timed.
    pace = Pace(tmp_path)
    env = {**BASE, "UB_TEST_STEPS": "700", "UB_TEST_BATCH": "30", "UB_TEST_SAMPLE_MS": "0", "UB_TEST_DELAY_MS": "30"}
    env |= pace.env
    c = start(make_cluster, env, n=3, warm=False)  # the late node's join is timed from a cold start
    c.start_node("a")
    victim = c.start_node("b", fault="kill@allreduce:20")
    spare = c.start_node("spare", extra=["--role", "standby"])
    # Three cold starts first: beside two burners at load 16, one node had not joined after 60 s.
    c.wait_for(lambda: victim.proc.poll() is not None, 150, "the victim's death")
    killed_at = time.time()
    c.wait_step(40, timeout=60)
    late = c.start_node("late")
    c.wait_for(lambda: any(e["kind"] == "commit" for e in late.entries()), 150, "the late node committing")
    pace.release()
    codes = c.wait_exit(timeout=180)
    assert fired(victim, "kill")
    assert codes == {"a": 0, "b": -signal.SIGKILL, "spare": 0, "late": 0}, c.diagnostics()
    spare_share = shares_by_step(spare)
    assert all(spare_share[s] == 0 for s in range(0, 20)), spare_share
    worked = [e for e in spare.entries() if e["kind"] == "contrib" and e["indices"]]
    assert worked and worked[0]["step"] <= 21, worked[:1]
    commits = [e for e in spare.entries() if e["kind"] == "commit" and e["step"] == worked[0]["step"] + 1]
    promoted_pause = commits[0]["t"] - killed_at if commits else float("inf")
    assert not [e for e in spare.entries() if e["kind"] == "sync"], "a warm standby needs no state transfer"
    late_work = [e for e in late.entries() if e["kind"] == "contrib" and e["indices"]]
    late_commit = next(e for e in late.entries() if e["kind"] == "commit" and e["step"] > late_work[0]["step"])
    cold_join = late_commit["t"] - late.started_at
    print(f"standby promoted: kill -> its first commit {promoted_pause:.2f} s; cold join {cold_join:.2f} s")
    assert promoted_pause < cold_join, (promoted_pause, cold_join)
    assert any("promoted" in e["reason"] for e in events_of(c, "role")), events_of(c, "role")
    assert_promises(c, env, finishers=3)


def activation_bytes(job, n: int) -> int:
    model = job.model()
    inputs, targets = job.collate([job.dataset[i] for i in range(n)])
    with SavedBytes() as counter:
        job.loss(model(inputs), targets)
    return counter.total


def test_memory_limit_sets_micro_batches_and_too_little_memory_means_no_share(make_cluster):
    env = {**BASE, "UB_TEST_STEPS": "30"}
    job = job_for(env)
    per_sample = activation_bytes(job, 9) - activation_bytes(job, 8)
    model_bytes = sum(t.numel() * t.element_size() for t in job.model().state_dict().values())
    fixed = activation_bytes(job, 1) - per_sample
    limit = model_bytes * STATE_BYTES_PER_PARAM_BYTE + fixed + int(per_sample * 4.5)  # room for 4 samples
    c = start(make_cluster, env, n=3)
    c.start_node("big")
    small = c.start_node("small", extra=["--memory-limit", str(limit)])
    tiny = c.start_node("tiny", extra=["--memory-limit", "1KB"])
    codes = c.wait_exit(timeout=120)
    assert codes == {"big": 0, "small": 0, "tiny": 0}, c.diagnostics()
    small_contribs = [e for e in small.entries() if e["kind"] == "contrib" and e["indices"]]
    assert small_contribs and all(e["microbatch"] == 4 for e in small_contribs), small_contribs[:2]
    assert all(len(e["indices"]) > 4 for e in small_contribs), "the share is not capped by memory, only split"
    assert all(not e["indices"] for e in tiny.entries() if e["kind"] == "contrib")
    assert any("tiny" in e["reason"] and "memory" in e["reason"] for e in events_of(c, "role")), events_of(c, "role")
    assert_promises(c, env, finishers=3)


@pytest.mark.serial  # identical only on a machine no other test loads
def test_identical_nodes_keep_equal_shares_and_the_trainer_role_for_half_a_minute(make_cluster):
    # The demo's job on 3 identical nodes: steps of a few milliseconds on two shared cores,
    # where whichever process is descheduled for a moment looks slow. None of that is a
    # reason to move shares or roles, or to call a node a straggler.
    # Started cold, as users start them: forked nodes failed this once in three runs here (2
    # rebalances 5 s apart), cold ones never in nine; why is not known yet.
    # The machine's other processes, measured before ours load it (ours alone take its 2 cores).
    neighbours = slowdown(1.0, load=False)
    c = make_cluster(job="unbroken.demo.charlm:job", env={"UNBROKEN_DEMO_STEPS": "10000000"}, min_nodes=3, warm=False)
    c.start_coordinator()
    nodes = [c.start_node(f"n{i}") for i in range(3)]
    c.wait_step(5, timeout=120)
    start = c.max_committed()
    time.sleep(30)  # a window for what must not happen (a minute before: half the suite's serial time)
    trained, slow = c.max_committed() - start, slowdown()
    assert trained > 250 / slow, f"the nodes hardly trained: {trained} steps in 30 s (slowdown {slow:.1f})"
    epochs = events_of(c, "epoch")
    rebalances = [e for e in epochs if "rebalance" in e["reason"]]
    assert len(epochs) - len(rebalances) == 1, epochs  # the first epoch, and nothing else happened
    reasons = [f"{e['time']:.1f}: {e['reason']}" for e in rebalances]
    if neighbours < BUSY:
        assert len(rebalances) <= 1, reasons
    else:
        # Beside CPU-bound neighbours (scripts/check --stress: load 11 on 2 cores) the three
        # nodes do not get equal CPU: one measured 0.49 ms a sample against 0.30 for seconds,
        # each in turn, and the planner moves shares as it must for a node truly slowed that
        # long (test_a_node_slowed_mid_run_loses_share_and_gets_it_back: a predicted gain of
        # 40% either way; from the measurements the two cases cannot be told apart). What must
        # not happen there either is a plan that follows each moment's descheduling: a
        # rebalance at the planner's own pace (every 1.5 s: its dwell and persistence) rather
        # than the neighbours' (3 in 30 s seen).
        times = [e["time"] for e in rebalances]
        assert len(rebalances) <= 3 and all(b - a >= 5.0 for a, b in itertools.pairwise(times)), reasons
    assert events_of(c, "straggler") == []
    assert events_of(c, "role") == []
    last = {n.name: [e for e in n.entries() if e["kind"] == "contrib"][-1] for n in nodes}
    assert all(e["role"] == "trainer" for e in last.values()), last
    if not rebalances:
        assert sorted(len(e["indices"]) for e in last.values()) == [64, 64, 64], last
