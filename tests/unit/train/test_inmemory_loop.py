"""The step loop without sockets or processes: the library's own nodes as threads on the
in-memory planes (`unbroken.testing.inmemory`), synchronous steps and DiLoCo rounds, with a
member killed in the middle of a collective."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from jobs import mlp
from unbroken.control import messages as m
from unbroken.events import Entry, Kind
from unbroken.job import Job
from unbroken.specs import CodecSpec, DiLoCoPolicy, Policy
from unbroken.state import checkpoint as ck
from unbroken.testing.inmemory import Crash, Crashed, MemoryJob
from unbroken.testing.promises import check_promises, reference_state
from unbroken.train.hooks import NoFaults
from unbroken.train.runtime import NodeResult

ATOL = 1e-5
ZONES = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}
DILOCO = Policy(codec=CodecSpec.parse("int8"), diloco=DiLoCoPolicy(inner_steps=4))

pytestmark = pytest.mark.timeout(120)


def job(steps: int) -> Job:
    return mlp.make(steps, delay_ms=0)


def finished(results: dict[str, NodeResult | BaseException]) -> dict[str, NodeResult]:
    out = {n: r for n, r in results.items() if isinstance(r, NodeResult)}
    assert all(r.outcome == "finished" for r in out.values()), results
    return out


def assert_promised(mj: MemoryJob, j: Job, finishers: int) -> None:
    report = check_promises(mj.logs(), j, finishers=finishers)
    assert report.ok, "\n".join(report.problems)


def outer_commits(mj: MemoryJob, name: str) -> list[int]:
    return [e["step"] for e in mj.logs()[name] if e["kind"] == Entry.COMMIT and e.get("outer")]


def test_synchronous_steps_match_one_process_training_the_whole_batch(tmp_path: Path) -> None:
    j = job(12)
    with MemoryJob(j, ["a", "b", "c"], tmp_path) as mj:
        mj.order(["a", "b", "c"])
        results = finished(mj.join(60))
    assert len(results) == 3 and len({r.digest for r in results.values()}) == 1
    assert_promised(mj, j, finishers=3)
    got = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    for k, v in reference_state(j).items():
        assert (got[k] - v).abs().max().item() <= ATOL, k


def test_a_member_killed_mid_all_reduce_costs_the_step_in_flight_only(tmp_path: Path) -> None:
    j = job(12)
    with MemoryJob(j, ["a", "b", "c"], tmp_path, faults={"c": Crash("allreduce", 5)}) as mj:
        mj.order(["a", "b", "c"])
        faults = mj.wait_fault(timeout=30)
        assert {who for who, _ in faults} <= {"a", "b"}
        mj.order(["a", "b"], urgent=True, reason="c died")
        results = mj.join(60)
    assert isinstance(results["c"], Crashed)
    assert set(finished(results)) == {"a", "b"}
    assert_promised(mj, j, finishers=2)
    # Step 6 was in flight: each survivor committed it once, in epoch 1 if c's part had
    # completed the sum before it died, else in epoch 2.
    for name in ("a", "b"):
        steps = [e["step"] for e in mj.logs()[name] if e["kind"] == Entry.COMMIT]
        assert steps == list(range(1, 13)), steps
    got = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    for k, v in reference_state(j).items():
        assert (got[k] - v).abs().max().item() <= ATOL, k


def test_a_diloco_round_across_two_zones_commits_at_round_ends_with_every_sample_once(tmp_path: Path) -> None:
    j = job(16)
    with MemoryJob(j, list(ZONES), tmp_path, policy=DILOCO, zones=ZONES) as mj:
        mj.order(list(ZONES))
        results = finished(mj.join(60))
    assert len({r.digest for r in results.values()}) == 1
    assert_promised(mj, j, finishers=4)
    for name in ZONES:
        assert outer_commits(mj, name) == [4, 8, 12, 16]
    losses = [e["loss"] for e in mj.logs()["a1"] if e["kind"] == Entry.COMMIT and e.get("outer")]
    assert losses[-1] < losses[0], losses
    inter = [e["wire"]["inter"] for e in mj.logs()["a1"] if e["kind"] == Entry.COMMIT and "wire" in e]
    assert inter and all(b > 0 for b in inter), "the zone leaders exchanged pseudo-gradients"


def test_an_outer_optimizer_without_momentum_is_plain_sgd(tmp_path: Path) -> None:
    # --outer-momentum 0 is a valid policy: Nesterov needs momentum, so the outer step is
    # plain SGD (it used to raise in every node's DiLoCo set-up).
    j = job(8)
    plain = Policy(codec=CodecSpec.parse("int8"), diloco=DiLoCoPolicy(inner_steps=4, outer_momentum=0.0))
    with MemoryJob(j, list(ZONES), tmp_path, policy=plain, zones=ZONES) as mj:
        mj.order(list(ZONES))
        results = finished(mj.join(60))
    assert len({r.digest for r in results.values()}) == 1
    assert outer_commits(mj, "a1") == [4, 8]


def rollbacks(mj: MemoryJob) -> set[str]:
    return {who for who, msg in mj.received if isinstance(msg, m.Report) and msg.kind == Kind.ROLLBACK}


def run_diloco_with_a_crash(tmp_path: Path, crash: Crash) -> MemoryJob:
    """Two zones of two; b1 (zone B's leader) dies; the test orders the survivors' epoch."""
    j = job(16)
    with MemoryJob(j, list(ZONES), tmp_path, policy=DILOCO, zones=ZONES, faults={"b1": crash}) as mj:
        mj.order(list(ZONES))
        mj.wait_fault(timeout=30)
        mj.order(["a1", "a2", "b2"], urgent=True, reason="b1 died")
        results = mj.join(60)
    assert isinstance(results["b1"], Crashed)
    assert set(finished(results)) == {"a1", "a2", "b2"}
    assert_promised(mj, j, finishers=3)
    return mj


def test_a_member_killed_mid_round_rolls_the_round_back_and_the_survivors_retry_it(tmp_path: Path) -> None:
    mj = run_diloco_with_a_crash(tmp_path, Crash("allreduce", 6))  # inner step 6 of round 2 (steps 4..7)
    for name in ("a1", "a2", "b2"):
        # Zone A finished the round's inner steps, but its exchange lost zone B: nothing of
        # round 2 committed in epoch 1, and the round was retried whole.
        assert outer_commits(mj, name) == [4, 8, 12, 16], name
    assert outer_commits(mj, "b1") == [4]
    assert rollbacks(mj) == {"a1", "a2", "b2"}, "every survivor went back to the round's start"


def test_a_zone_leader_killed_after_the_exchange_left_its_zone_behind_which_catches_up(tmp_path: Path) -> None:
    # b1 dies right after its pseudo-gradient went out, before it broadcast the outer step
    # to b2: zone A applied round 2, b2 never did, and takes the committed state from a peer.
    mj = run_diloco_with_a_crash(tmp_path, Crash("exchange", 7, delivered=True))
    for name in ("a1", "a2"):
        assert outer_commits(mj, name) == [4, 8, 12, 16], name
    assert outer_commits(mj, "b2") == [4, 12, 16]
    synced = [e["step"] for e in mj.logs()["b2"] if e["kind"] == Entry.SYNC]
    assert synced == [8], "b2 took step 8 from a peer that committed it"
    # b2 abandoned round 2's inner steps; zone A abandons round 3 if it began before the order.
    assert "b2" in rollbacks(mj)


def test_rank_0_lays_out_its_checkpoint_buffers_a_few_steps_ahead_and_the_others_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arenas_laid: list[str]
) -> None:
    laid: list[tuple[str, int]] = []
    real = ck.Checkpointer.prepare

    def prepare(self: ck.Checkpointer, tree: dict[str, Any], fragments: int | None = None) -> None:
        laid.append((self.directory.name, int(tree["step"])))
        real(self, tree, fragments)

    monkeypatch.setattr(ck.Checkpointer, "prepare", prepare)
    j = job(12)
    with MemoryJob(j, ["a", "b"], tmp_path, checkpoint_every=6) as mj:
        mj.order(["a", "b"])
        finished(mj.join(60))
    assert laid == [("a-ckpt", 3)], "rank 0 alone, once, LAY_OUT_AHEAD commits before step 6"
    assert arenas_laid == ["checkpoint-buffers"], "every checkpoint filled the buffers laid out ahead"
    # Step 12's may be skipped: step 6's write can still be running then.
    assert (tmp_path / "a-ckpt" / "ckpt-000000006.pt").exists()
    assert not (tmp_path / "b-ckpt").exists() or not list((tmp_path / "b-ckpt").glob("ckpt-*"))


def test_a_checkpoint_skipped_behind_one_still_being_written_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = ck.Checkpointer._write

    def held(self: ck.Checkpointer, snap: dict[str, Any]) -> None:
        if int(snap["step"]) == 4:
            assert release.wait(60), "the test never let step 4's write go"
        real(self, snap)

    monkeypatch.setattr(ck.Checkpointer, "_write", held)

    def skips(mj: MemoryJob) -> list[tuple[str, int, str]]:
        got = list(mj.received)
        return [
            (who, msg.step, msg.reason)
            for who, msg in got
            if isinstance(msg, m.Report) and msg.kind is Kind.CHECKPOINT_SKIPPED
        ]

    with MemoryJob(job(12), ["a", "b"], tmp_path, checkpoint_every=4) as mj:
        mj.order(["a", "b"])
        deadline = time.monotonic() + 60
        while len(skips(mj)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        release.set()  # the job's end waits for the write
        finished(mj.join(60))
    reported = skips(mj)
    assert [(who, step) for who, step, _ in reported] == [("a", 8), ("a", 12)], reported
    assert all("the one of step 4 is still being written" in why for _, _, why in reported), reported
    assert "2 skipped so far" in reported[-1][2]
    assert sorted(p.name for p in (tmp_path / "a-ckpt").iterdir()) == ["ckpt-000000004.pt"], "nothing half-written left"


def test_the_step_flat_is_kept_across_graceful_epoch_changes_and_let_go_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh flat tensor at each epoch change cost every member 1.4 s for a 50M model on a
    # busy machine. After a failure a collective of the abandoned epoch may still write into
    # the old one: that one is not used again. It is not cleared: each contribution writes
    # all of it (here it is handed over full of NaN, which the guard would refuse).
    from unbroken.train import runtime
    from unbroken.train.step import StepProtocol

    seen: list[tuple[str, int, int]] = []
    real, real_buffer = StepProtocol.__init__, runtime.Node._step_buffer

    def init(self: StepProtocol, node: Any, group: Any, reducer: Any, *, flat: Any = None, **kw: Any) -> None:
        real(self, node, group, reducer, flat=flat, **kw)
        seen.append((node.name, group.epoch, self.flat.untyped_storage().data_ptr()))

    built: dict[str, int] = {}

    def step_buffer(self: runtime.Node, members: int) -> torch.Tensor:
        flat = real_buffer(self, members).fill_(float("nan"))
        built.setdefault(self.name, flat.untyped_storage().data_ptr())  # in `Node.__init__`
        return flat

    monkeypatch.setattr(StepProtocol, "__init__", init)
    monkeypatch.setattr(runtime.Node, "_step_buffer", step_buffer)
    monkeypatch.setattr(runtime, "FLAT_MEMBERS", 1)  # built with norm slots for 2: grown for 3
    j = job(24)
    with MemoryJob(j, ["a", "b", "c"], tmp_path, faults={"c": Crash("allreduce", 16)}) as mj:
        mj.order(["a", "b", "c"])
        deadline = time.monotonic() + 30
        while not any(e["kind"] == Entry.COMMIT and e["step"] >= 4 for e in mj.logs()["a"]):
            assert time.monotonic() < deadline, "no commit in epoch 1"
            time.sleep(0.01)
        mj.order(["a", "b", "c"], reason="a graceful change: every member switches after a commit")
        mj.wait_fault(timeout=30)
        mj.order(["a", "b"], urgent=True, reason="c died")
        results = mj.join(60)
    assert set(finished(results)) == {"a", "b"}
    assert_promised(mj, j, finishers=2)
    for name in ("a", "b"):
        epochs = {epoch: ptr for who, epoch, ptr in seen if who == name}
        assert sorted(epochs) == [1, 2, 3], seen
        assert epochs[1] != built[name], "grown: the one built had norm slots for 2 members"
        assert epochs[1] == epochs[2], "kept across the graceful change"
        assert epochs[3] != epochs[2], "a new one after the failure"


class Held(NoFaults):
    """A node whose step loop stalls right after committing ``step`` until released (a node
    whose lease runs out while it writes a checkpoint, on a busy machine)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.reached, self.release = threading.Event(), threading.Event()

    def bitflip(self, step: int) -> bool:
        if step == self.step:
            self.reached.set()
            self.release.wait(60)
        return False


@pytest.mark.parametrize("same", [True, False], ids=["same-state", "other-state"])
def test_a_node_cut_short_in_the_last_steps_audit_finished_if_it_holds_the_state_the_job_finished_with(
    tmp_path: Path, same: bool
) -> None:
    j = job(12)
    held = Held(12)
    with MemoryJob(j, ["a", "b", "c"], tmp_path, faults={"c": held}) as mj:
        mj.order(["a", "b", "c"])
        assert held.reached.wait(30), "c never committed the last step"
        mj.order(["a", "b"], urgent=True, reason="c's lease expired")
        deadline = time.monotonic() + 30
        while len(done := [msg for _, msg in list(mj.received) if isinstance(msg, m.Done)]) < 2:
            assert time.monotonic() < deadline, "a and b did not finish without c"
            time.sleep(0.01)
        assert isinstance(done[0], m.Done)
        for name in ("a", "b"):  # they exited: c's audit of epoch 1 cannot complete
            mj.groups.kill(name)
        mj.finish(12, done[0].digest if same else "0" * 64)
        held.release.set()
        results = mj.join(60)
    c = results["c"]
    assert isinstance(c, NodeResult) and c.step == 12
    finals = [e for e in mj.logs()["c"] if e["kind"] == Entry.FINAL]
    if same:
        assert c.outcome == "finished" and c.digest == done[0].digest and len(finals) == 1
        assert_promised(mj, j, finishers=3)
    else:
        assert c.outcome == "job-finished" and not finals, "its state is not the one the job finished with"
        assert_promised(mj, j, finishers=2)


class PausedDonor(NoFaults):
    """The first state transfer any of the nodes sharing it makes as a donor stalls after its
    first chunk until released."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def maybe_fire(self, phase: str, step: int) -> None:
        if phase != "resync":
            return
        with self.lock:
            first = not self.reached.is_set()
            self.reached.set()
        if first:
            self.release.wait(60)


def test_members_in_a_step_leave_it_once_a_member_left_the_sync_phase_for_a_newer_epoch(tmp_path: Path) -> None:
    """A non-urgent order ends a sync phase's transfer at once but a step only at its vote:
    the members a joiner did not ask for chunks are in the step by then. They must leave it
    once the donor builds the new epoch (the step cannot complete without it), not wait out
    the collective timeout (and be named absent from the new epoch meanwhile)."""
    j = mlp.make(40, delay_ms=20)
    paused = PausedDonor()
    try:
        with MemoryJob(
            j,
            ["a", "b", "c", "d"],
            tmp_path,
            faults=dict.fromkeys("abc", paused),
            collective_timeout_s=90,
            max_donors=1,
        ) as mj:
            mj.order(["a", "b", "c"])
            deadline = time.monotonic() + 30
            while mj.nodes["a"].state.step < 5:
                assert time.monotonic() < deadline, "epoch 1 did not train"
                time.sleep(0.01)
            mj.order(["a", "b", "c", "d"], reason="d joined")
            assert paused.reached.wait(30), "nobody sent d the state"
            mj.order(["a", "b", "c", "d"], reason="a rebalance")
            results = mj.join(60)
    finally:
        paused.release.set()
    assert set(finished(results)) == {"a", "b", "c", "d"}
    assert not mj.faults(), "nobody waited out a collective's timeout"
    assert_promised(mj, j, finishers=4)
    logs = mj.logs()
    receivers = [n for n in "abc" if any(e["kind"] == Entry.SYNC for e in logs[n])]
    assert not receivers, f"{receivers} left a step the others committed"
