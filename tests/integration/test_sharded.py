"""A sharded zone of real node processes under kill, freeze, join and leave (`Job.shard`).

Each test checks the promises on the commit logs, that every range's two holders finished
with the same bytes, and that the model put together from the finished members' primary
ranges is the single-process run's (up to float summation order).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

from integration.helpers import ATOL, events_of, fired, job_for
from unbroken.testing import LocalCluster, check_promises, reference_state
from unbroken.testing.cluster import NodeProcess
from unbroken.train.sharding import assemble_files

pytestmark = pytest.mark.timeout(180)

ENV = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "20", "UB_TEST_SHARD": "1"}


def start(make_cluster: Any, env: dict[str, str], n: int, node_args: tuple[str, ...] = (), **kw: Any) -> LocalCluster:
    c: LocalCluster = make_cluster(env=env, min_nodes=n, node_args=["--digest-every", "1", *node_args], **kw)
    c.start_coordinator()
    return c


def reshards(c: LocalCluster) -> list[dict[str, Any]]:
    return [e for node in c.nodes.values() for e in node.entries() if e["kind"] == "reshard"]


def three_with(make_cluster: Any, fault: str) -> tuple[LocalCluster, NodeProcess]:
    """Three nodes to the end of the job, n2 with ``fault`` (which must fire); the cluster and n2."""
    c = start(make_cluster, ENV, 3)
    c.start_node("n1")
    faulty = c.start_node("n2", fault=fault)
    c.start_node("n3")
    codes = c.wait_exit(timeout=120)
    assert fired(faulty, fault.partition("@")[0]), c.diagnostics()
    assert codes == {"n1": 0, "n2": 0, "n3": 0}, c.diagnostics()
    return c, faulty


def assert_sharded(c: LocalCluster, env: dict[str, str], finishers: int, cli: bool = False) -> None:
    """The promises, every range's holders equal, and the finished model one process's
    (put together by ``unbroken assemble`` where ``cli``)."""
    job = job_for(env)
    report = check_promises({name: n.entries() for name, n in c.nodes.items()}, job, finishers=finishers)
    assert report.ok, "\n".join(report.problems) + "\n" + c.diagnostics()
    finals = [e for n in c.nodes.values() for e in n.entries() if e["kind"] == "final"]
    held: dict[str, set[str]] = {}
    for e in finals:
        for span, digest in e["ranges"].items():
            held.setdefault(span, set()).add(digest)
    assert held and all(len(d) == 1 for d in held.values()), f"a range's holders differ: {held}"
    paths = [n.final_state for n in c.nodes.values() if n.final_state.exists()]
    if cli:
        out = c.workdir / "model.pt"
        done = subprocess.run(
            [sys.executable, "-m", "unbroken", "assemble", str(out), *map(str, paths)], capture_output=True, text=True
        )
        assert done.returncode == 0 and out.exists(), done.stderr
        got = torch.load(out, weights_only=True)
    else:
        got = assemble_files(paths)
    for name, want in reference_state(job).items():
        diff = (got[name] - want).abs().max().item()
        assert diff <= ATOL, f"{name} differs from the single-process reference by {diff:.2e} (> {ATOL})"


def test_a_sharded_zone_trains_as_one_process_and_survives_a_sigkill(make_cluster: Any) -> None:
    c = start(make_cluster, ENV, 4)
    victim = None
    for i in range(1, 5):
        node = c.start_node(f"n{i}", fault="kill@allreduce:15" if i == 2 else "")
        victim = node if i == 2 else victim
    codes = c.wait_exit(timeout=120)
    assert victim is not None and fired(victim, "kill"), c.diagnostics()
    assert codes == {"n1": 0, "n2": -signal.SIGKILL, "n3": 0, "n4": 0}, c.diagnostics()
    assert_sharded(c, ENV, finishers=3, cli=True)
    one = subprocess.run(
        [sys.executable, "-m", "unbroken", "assemble", str(c.workdir / "x.pt"), str(c.nodes["n1"].final_state)],
        capture_output=True,
        text=True,
    )
    assert one.returncode != 0 and "cover" in one.stderr and "nodes that finished" in one.stderr, one.stderr
    lost = [e for e in reshards(c) if "lost" in e["reason"]]
    assert {e["node"] for e in lost} == {"n1", "n3", "n4"}, reshards(c)
    said = [e["reason"] for e in events_of(c, "fallback")]
    assert any("from their buddy copies" in r for r in said), said  # the event says what served
    fault_t = next(e["t"] for e in victim.entries() if e["kind"] == "fault")
    first = min(
        e["t"] for n in c.nodes.values() for e in n.entries() if e["kind"] == "commit" and e["t"] > fault_t
    )  # fmt: skip
    assert first - fault_t < 5.0, first - fault_t  # measured ~0.5 s; the bench reports it


def test_a_frozen_member_is_left_behind_then_rejoins_for_a_new_range(make_cluster: Any) -> None:
    env = ENV | {"UB_TEST_STEPS": "150"}
    c = start(make_cluster, env, 3)
    c.start_node("n1")
    frozen = c.start_node("n2", fault="stop@allreduce:12")
    c.start_node("n3")
    c.wait_for(lambda: any("n2" in e["reason"] for e in events_of(c, "failure")), 60, "n2 expelled")
    frozen.signal(signal.SIGCONT)
    codes = c.wait_exit(timeout=150)
    assert fired(frozen, "stop")
    assert codes == {"n1": 0, "n2": 0, "n3": 0}, c.diagnostics()
    kinds = [e["kind"] for e in frozen.entries()]
    assert "expelled" in kinds, c.diagnostics()
    after = [e for e in frozen.entries()[kinds.index("expelled") :] if e["kind"] == "reshard"]
    assert after and "joining" in after[0]["reason"], after  # a new member: its old copies are stale
    assert_sharded(c, env, finishers=3)


def test_a_joiner_gets_its_ranges_and_a_leaver_goes_without_loss(make_cluster: Any) -> None:
    env = ENV | {"UB_TEST_STEPS": "300"}  # a node starting on a busy machine took 6 s: 100 steps' time
    c = start(make_cluster, env, 3)
    for i in (1, 2, 3):
        c.start_node(f"n{i}")
    c.wait_step(10, timeout=90)
    c.start_node("n4")
    c.wait_for(lambda: any("joining" in e["reason"] for e in reshards(c)), 60, "n4 sharded in")
    c.nodes["n1"].signal(signal.SIGTERM)
    codes = c.wait_exit(timeout=150)
    assert codes == {"n1": 0, "n2": 0, "n3": 0, "n4": 0}, c.diagnostics()
    assert any(e["kind"] == "left" for e in c.nodes["n1"].entries()), c.diagnostics()
    joined = [e for e in reshards(c) if e["node"] == "n4"]
    assert joined and "joining" in joined[0]["reason"], joined
    assert_sharded(c, env, finishers=3)


def test_a_restart_of_every_member_reads_the_ranges_from_the_checkpoint(make_cluster: Any, tmp_path: Any) -> None:
    steps = 200  # paced: 4 s at least for the first group, which writes a checkpoint every 10
    env = ENV | {"UB_TEST_STEPS": str(steps)}
    ck = tmp_path / "ck"
    args = ("--checkpoint-dir", str(ck), "--checkpoint-every", "10")
    c = start(make_cluster, env, 3, node_args=args)
    for i in (1, 2, 3):
        c.start_node(f"n{i}")
    # The nodes are killed only once a checkpoint is complete (on a busy machine, some steps
    # after the one it holds), and before they finish the job.
    c.wait_for(lambda: any(ck.glob("ckpt-*.pt")), 120, "a checkpoint written")
    for node in c.nodes.values():
        node.kill()
    assert set(c.wait_exit(timeout=30).values()) == {-signal.SIGKILL}, c.diagnostics()
    assert sorted(ck.glob("shard-*.pt")), "every member writes its range at a checkpoint"
    # The steps were paced only to leave the first group time for a checkpoint: the second
    # runs the rest at full speed (the same job: its pacing changes no result).
    c2 = start(make_cluster, env | {"UB_TEST_DELAY_MS": "0"}, 3, node_args=args)
    for i in (1, 2, 3):
        c2.start_node(f"m{i}")
    codes = c2.wait_exit(timeout=120)
    assert codes == {"m1": 0, "m2": 0, "m3": 0}, c2.diagnostics()
    restored = [e for e in reshards(c2) if "checkpoint" in e["reason"]]
    assert restored, reshards(c2)
    job = job_for(env)
    paths = [n.final_state for n in c2.nodes.values()]
    got = assemble_files(paths)
    for name, want in reference_state(job).items():
        assert (got[name] - want).abs().max().item() <= ATOL, name
    # The model of the last checkpoint, from its shard files alone (every node gone).
    out = tmp_path / "from-checkpoint.pt"
    files = [str(f) for f in ck.glob(f"shard-{steps:09d}-*.pt")]
    done = subprocess.run(
        [sys.executable, "-m", "unbroken", "assemble", str(out), *files], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    from_files = torch.load(out, weights_only=True)
    assert all(torch.equal(from_files[k], got[k]) for k in got), f"the shard files of step {steps} are the model"


def test_with_erasure_coded_checkpoints_a_lost_disk_loses_no_range(make_cluster: Any, tmp_path: Any) -> None:
    """Each node checkpoints to a disk of its own, --fragments 2,1: every range lies on two
    disks (its primary's and its buddy's). Every node killed and one disk lost: `unbroken
    restore` from the other two puts the step together, and three new nodes finish the job
    from it as one process would."""
    env = ENV | {"UB_TEST_STEPS": "150"}
    own = {f"n{i}": tmp_path / f"disk{i}" for i in (1, 2, 3)}
    c = start(make_cluster, env, 3, coordinator_args=["--fragments", "2,1"])
    for name, disk in own.items():
        c.start_node(name, extra=["--checkpoint-dir", str(disk), "--checkpoint-every", "10"])

    def on_every_disk() -> bool:
        """A checkpoint of all three (on a busy machine one may be out for a while): each
        disk holds its primary range, the one it is buddy for, and its fragment."""
        steps = [{f.name[6:15] for f in d.glob("shard-*.pt")} for d in own.values()]
        return any(
            all(len(list(d.glob(f"shard-{s}-*.pt"))) >= 2 and (d / f"frag-{s}.json").exists() for d in own.values())
            for s in set.intersection(*steps)
        )

    c.wait_for(on_every_disk, 120, "a checkpoint on every disk")
    for node in c.nodes.values():
        node.kill()
    c.wait_exit(timeout=30)
    shared = tmp_path / "shared"
    rest = [a for d in (own["n1"], own["n3"]) for a in ("--from", str(d))]  # disk2 is gone
    done = subprocess.run(
        [sys.executable, "-m", "unbroken", "restore", *rest, "--to", str(shared)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    c2 = start(make_cluster, env, 3, coordinator_args=["--fragments", "2,1"])
    for i in (1, 2, 3):
        c2.start_node(f"m{i}", extra=["--checkpoint-dir", str(shared), "--checkpoint-every", "10"])
    codes = c2.wait_exit(timeout=120)
    assert codes == {"m1": 0, "m2": 0, "m3": 0}, c2.diagnostics()
    assert [e for e in reshards(c2) if "checkpoint" in e["reason"]], reshards(c2)
    got = assemble_files([n.final_state for n in c2.nodes.values()])
    for name, want in reference_state(job_for(env)).items():
        assert (got[name] - want).abs().max().item() <= ATOL, name


def test_the_shard_flag_must_agree_and_its_refusal_names_it(make_cluster: Any) -> None:
    env = {k: v for k, v in ENV.items() if k != "UB_TEST_SHARD"} | {"UB_TEST_STEPS": "200"}
    c = start(make_cluster, env, 1)
    c.start_node("n1", extra=["--shard"])
    c.wait_step(3, timeout=60)
    plain = c.start_node("n2")
    assert plain.wait(timeout=60) != 0
    assert "shard" in plain.stderr(), plain.stderr()[-2000:]
    c.nodes["n1"].signal(signal.SIGTERM)
    c.wait_exit(["n1"], timeout=60)


def test_ranges_follow_memory_and_a_node_too_small_for_one_trains_holding_none(make_cluster: Any) -> None:
    c = start(make_cluster, ENV, 3)
    for name, memory in (("big", "4GB"), ("mid", "2GB"), ("tiny", "1MB")):
        c.start_node(name, extra=["--memory-limit", memory])
    codes = c.wait_exit(timeout=120)
    assert codes == {"big": 0, "mid": 0, "tiny": 0}, c.diagnostics()
    first = {e["node"]: e for e in reversed(reshards(c))}
    assert first["tiny"]["held"] == 0, first  # neither a range nor a copy of one
    assert abs(first["big"]["primary"] - 2 * first["mid"]["primary"]) <= 1, first  # 4 GB against 2 GB
    contributed = {e["node"] for n in c.nodes.values() for e in n.entries() if e["kind"] == "contrib" and e["indices"]}
    assert "tiny" in contributed, "it computes its share of the batch with the gathered blocks"
    assert_sharded(c, ENV, finishers=3)


def test_a_member_spoiling_its_gradient_while_declaring_its_true_norm_is_refused(make_cluster: Any) -> None:
    # Nobody holds the whole summed gradient: its norm, summed over the zone's ranges, is held
    # against the declared norms before the vote, as an unsharded job holds the sum's.
    c, _ = three_with(make_cluster, "spike@grad:10")
    refused = [e for n in c.nodes.values() for e in n.entries() if e["kind"] == "refused" and e["step"] == 10]
    assert refused and all("exceeds the declared" in e["reason"] for e in refused), refused
    assert_sharded(c, ENV, finishers=3)  # the step retried with the same samples: one process's model


def test_two_zones_each_hold_a_replica_and_a_zone_that_lost_both_holders_takes_them_from_the_other(
    make_cluster: Any,
) -> None:
    # Zone A (a1, a2, a3) and zone B (b1, b2) each shard a whole replica; the gradient is summed
    # in each zone, then over the zones. a2 and a3 die in the same step: some of A's ranges lost
    # both their holders in A, and come from B's holders of the same elements.
    env = ENV | {"UB_TEST_STEPS": "60"}
    c = start(make_cluster, env, 5)
    for name in ("a1", "a2", "a3", "b1", "b2"):
        fault = "kill@allreduce:20" if name in ("a2", "a3") else ""
        c.start_node(name, extra=["--zone", name[0].upper()], fault=fault)
    codes = c.wait_exit(timeout=150)
    assert codes == {"a1": 0, "a2": -signal.SIGKILL, "a3": -signal.SIGKILL, "b1": 0, "b2": 0}, c.diagnostics()
    first = {e["node"]: e for e in reversed(reshards(c))}
    assert first["a1"]["held"] < first["b1"]["held"], first  # 2/3 of the state each in A, all of it in B
    after = [e for e in reshards(c) if e["node"] == "a1" and e["step"] >= 20]
    assert after and "lost" in after[0]["reason"], reshards(c)
    assert after[-1]["held"] == after[-1]["primary"] > 0, "alone in its zone: the whole replica, no buddy"
    said = [e["reason"] for e in events_of(c, "fallback")]
    assert any("zone A: " in r and "from another zone" in r for r in said), said
    assert_sharded(c, env, finishers=3)


def test_a_member_whose_commit_failed_after_the_vote_applies_the_step_late_from_its_sums(make_cluster: Any) -> None:
    # n2's commit fence fails at step 12 after the vote went through everywhere: n1 and n3
    # commit it, n2 does not. Its ranges' other copies moved on; it holds step 12's complete
    # sums and applies them in the next sync (a step is applied by all or by none).
    c, lapsed = three_with(make_cluster, "lapse@commit:12")
    late = [e for e in lapsed.entries() if e["kind"] == "reshard" and "late" in e["reason"]]
    assert late and late[0]["step"] == 13, [e for e in lapsed.entries() if e["kind"] == "reshard"]
    assert_sharded(c, ENV, finishers=3)


def test_both_holders_of_a_range_killed_the_survivor_rolls_back_to_the_checkpoint_and_finishes(
    make_cluster: Any, tmp_path: Any
) -> None:
    # A range's two holders, neither of them n4 (read from n4's layout), killed at once: no
    # member of any zone holds it. The member left with a --checkpoint-dir goes back, in
    # process, to the newest checkpoint whose files it can read whole, trains the steps since
    # again with their samples, and ends with one process's model. n4 joins after the
    # checkpoints, without --checkpoint-dir: it takes the replicated state from the reader, and
    # its ranges at a later re-shard.
    env = ENV | {"UB_TEST_STEPS": "120"}
    ck = tmp_path / "ck"
    wait = ["--absent-wait", "1"]
    c = start(make_cluster, env, 3)
    for i in (1, 2, 3):  # together: which range each holds is read from n4's layout below
        c.start_node(f"n{i}", extra=["--checkpoint-dir", str(ck), "--checkpoint-every", "5", *wait])
    # Two: the older one's shard files are all written (the killed may not have written the newer's).
    c.wait_for(lambda: len(list(ck.glob("ckpt-*.pt"))) >= 2, 120, "two checkpoints written")
    c.start_node("n4", extra=wait)
    c.wait_for(lambda: any(e["kind"] == "reshard" and e["held"] for e in c.nodes["n4"].entries()), 60, "n4's ranges")
    pairs = [e for e in c.nodes["n4"].entries() if e["kind"] == "reshard"][-1]["pairs"]
    named = [tuple(str(m).partition("#")[0] for m in pair) for pair in pairs]
    killed = next(pair for pair in named if "n4" not in pair and "None" not in pair)
    reader = next(n for n in ("n1", "n2", "n3") if n not in killed)
    for name in killed:
        c.nodes[name].kill()
    codes = c.wait_exit(timeout=150)
    assert codes == {n: -signal.SIGKILL if n in killed else 0 for n in c.nodes}, c.diagnostics()
    back = [e for e in c.nodes[reader].entries() if e["kind"] == "restore"]
    assert back and "rolled back to checkpoint step" in back[0]["why"], c.diagnostics()
    took = [e for e in c.nodes["n4"].entries() if e["kind"] == "restore"]
    assert took and took[0]["step"] == back[0]["step"] and f"received from {reader}" in took[0]["path"], c.diagnostics()
    # Steps after the checkpoint were committed before the kill and again after the restore.
    before = max(e["step"] for n in killed for e in c.nodes[n].entries() if e["kind"] == "commit")
    assert back[0]["step"] <= before, (back[0], before)
    said = [e["reason"] for e in events_of(c, "fallback")]
    gone_back = [r for r in said if f"rolled back to checkpoint step {back[0]['step']}" in r]
    assert len(gone_back) == 1, f"one event for the job, though both members report it: {said}"
    assert_sharded(c, env, finishers=2)
