"""`unbroken verify`'s judge on synthetic logs: each broken promise is found and named
(node, step, epoch), what cannot be checked is said, and a run that kept every promise is OK."""

from __future__ import annotations

import functools
from typing import Any

from unbroken.events import Kind, Recorded
from unbroken.observe.judge import judge
from unbroken.observe.verdict import Expect, Promise, Status, Verdict
from unbroken.train.data import DataPlan

B, T = 4, 3
PLAN = DataPlan(40, B, 7)
WITH_PLAN = Expect(num_steps=T, batch_size=B, plan=PLAN)

Log = list[dict[str, Any]]


def step(t: float, epoch: int, s: int, digest: str | None, share: tuple[int, int] = (0, B)) -> Log:
    """A contribution to step s (0-based) and its commit, as a node logs them."""
    offset, count = share
    commit: dict[str, Any] = {"t": t + 0.01, "kind": "commit", "epoch": epoch, "step": s + 1}
    if digest is not None:
        commit["digest"] = digest
    return [{"t": t, "kind": "contrib", "epoch": epoch, "step": s, "indices": PLAN.indices(s, offset, count)}, commit]


def final(t: float, digest: str, at: int = T) -> dict[str, Any]:
    return {"t": t, "kind": "final", "step": at, "digest": digest}


def run(share: tuple[int, int] = (0, B), digests: bool = True, last: str = "d2") -> Log:
    """A whole run of one node: T steps in epoch 1, then its final entry."""
    out = [e for s in range(T) for e in step(1 + s, 1, s, f"d{s}" if digests else None, share)]
    return [*out, final(5, last)]


def pair() -> dict[str, Log]:
    return {"a": run((0, 2)), "b": run((2, 2))}


def event(kind: Kind, node: str | None, step: int, reason: str, t: float = 4.0) -> Recorded:
    return Recorded(1, t, kind, node, f"{node}#1" if node else None, 1, step, reason)


def verdict(logs: dict[str, Log], expect: Expect = WITH_PLAN, events: list[Recorded] | None = None) -> Verdict:
    return judge({node: functools.partial(list, log) for node, log in logs.items()}, expect, events)


def statuses(v: Verdict) -> dict[str, str]:
    return {c.promise.value: c.status.value for c in v.checks}


def test_a_run_that_kept_every_promise_is_ok_on_every_count() -> None:
    v = verdict(pair(), events=[])
    assert v.ok and all(c.status is Status.OK for c in v.checks), statuses(v)
    assert "each of 3 committed steps read exactly its 4 planned samples" in v.check(Promise.SAMPLES).summary
    assert "2 nodes finished at step 3" in v.check(Promise.FINAL).summary


def test_a_step_never_committed_is_a_gap_named_by_its_step() -> None:
    logs = {"a": [e for e in run() if not (e["kind"] == "commit" and e["step"] == 2)]}
    c = verdict(logs).check(Promise.STEPS)
    assert c.status is Status.VIOLATED
    assert [(e.step, e.text) for e in c.evidence if "never" in e.text] == [(2, "step 2 never committed")]


def test_a_node_that_skips_a_step_is_named_with_its_step_and_epoch() -> None:
    a = run()
    a[3]["step"] = 3  # its commit of step 2 says 3: it went from step 1 to step 3
    c = verdict({"a": a, "b": run()}).check(Promise.STEPS)
    assert c.status is Status.VIOLATED
    assert any(e.node == "a" and e.step == 3 and e.epoch == 1 and "right after step 1" in e.text for e in c.evidence)


def test_a_step_committed_again_while_its_first_committer_lived_on_is_applied_twice_with_its_results() -> None:
    survivor = [*step(1, 1, 0, "a0", (0, 2)), *step(3, 2, 1, "b1"), *step(4, 2, 2, "b2"), final(5, "b2")]
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 1, 1, "x1", (2, 2))]
    lone.append({"t": 6, "kind": "epoch", "epoch": 3, "step": 2})  # it lived on, holding its own step 2
    c = verdict({"s": survivor, "lone": lone}).check(Promise.ONCE)
    assert c.status is Status.VIOLATED
    (e,) = c.evidence
    assert (e.node, e.step, e.epoch) == ("s", 2, 2)
    assert "committed in epoch 1 and again in epoch 2: digest x1, then b1 (lone applied it first" in e.text


def test_a_step_in_flight_that_died_with_its_only_committer_is_not_applied_twice() -> None:
    survivor = [*step(1, 1, 0, "a0", (0, 2)), *step(3, 2, 1, "b1"), *step(4, 2, 2, "b2"), final(5, "b2")]
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 1, 1, "x1", (2, 2))]  # then SIGKILLed
    v = verdict({"s": survivor, "lone": lone})
    assert v.ok, [c.evidence for c in v.violated]


def test_steps_a_node_left_with_and_the_group_trained_again_are_named() -> None:
    # Not the step in flight dying with its committer: a graceful leave hands its state on.
    survivor = [*step(1, 1, 0, "a0", (0, 2)), *step(3, 2, 1, "b1"), *step(4, 2, 2, "b2"), final(5, "b2")]
    lone = [*step(1, 1, 0, "a0", (2, 2)), *step(2, 1, 1, "x1", (2, 2)), {"t": 2.5, "kind": "left", "step": 2}]
    c = verdict({"s": survivor, "lone": lone}).check(Promise.ONCE)
    assert c.status is Status.VIOLATED
    assert "step 2 committed in epoch 1 and again in epoch 2" in c.evidence[0].text


def test_a_node_that_applies_a_step_twice_is_named() -> None:
    a = run()
    a.insert(4, {**a[3], "t": 2.02})  # step 2 committed twice in a row
    c = verdict({"a": a}).check(Promise.ONCE)
    assert c.status is Status.VIOLATED
    assert c.evidence[0].node == "a" and "committed step 2 right after step 2" in c.evidence[0].text


def test_a_sample_read_twice_is_named_with_the_nodes_that_read_it() -> None:
    logs = pair()
    contrib = logs["b"][2]  # b's slice of step 1 (0-based): one of step 0's samples instead of its last
    contrib["indices"] = [*contrib["indices"][:-1], PLAN.indices(0, 0, B)[0]]
    c = verdict(logs).check(Promise.SAMPLES)
    assert c.status is Status.VIOLATED
    (e,) = c.evidence
    assert (e.step, e.epoch, e.node) == (2, 1, "a, b")
    assert f"sample {PLAN.indices(1, 0, B)[-1]} never read" in e.text
    assert f"sample {PLAN.indices(0, 0, B)[0]} is not in its plan (read by b)" in e.text


def test_a_sample_left_out_is_named() -> None:
    logs = {"a": run()}
    logs["a"][4]["indices"] = logs["a"][4]["indices"][:-1]
    (e,) = verdict(logs).check(Promise.SAMPLES).evidence
    assert e.step == 3 and f"sample {PLAN.indices(2, 0, B)[-1]} never read" in e.text
    assert "consumed 3 samples from 1 slices" in e.text


def test_a_step_across_the_end_of_a_pass_may_read_a_sample_twice_as_its_plan_says() -> None:
    plan = DataPlan(6, B, 0)  # step 1 reads the last 2 samples of pass 0 and the first 2 of pass 1
    logs = {"a": []}
    for s in range(T):
        logs["a"] += [
            {"t": 1.0 + s, "kind": "contrib", "epoch": 1, "step": s, "indices": plan.indices(s, 0, B)},
            {"t": 1.5 + s, "kind": "commit", "epoch": 1, "step": s + 1},
        ]
    logs["a"].append(final(5, "d2"))
    crossing = plan.indices(1, 0, B)
    assert len(set(crossing)) < B, crossing  # the case: one sample twice in a step, as planned
    assert verdict(logs, Expect(num_steps=T, batch_size=B, plan=plan)).ok
    c = verdict(logs, Expect()).check(Promise.SAMPLES)
    assert c.status is Status.OK and "read 4 samples" in c.summary
    assert "which samples each step read" in c.unchecked and "--job" in c.unchecked
    # A sample of its plan read twice (another left out) is named, with how often the plan has it.
    once = next(i for i in crossing if crossing.count(i) == 1)
    logs["a"][2]["indices"] = [once if i != once and crossing.count(i) == 1 else i for i in crossing]
    (e,) = verdict(logs, Expect(num_steps=T, batch_size=B, plan=plan)).check(Promise.SAMPLES).evidence
    assert f"sample {once} read 2 times (a, a)" in e.text and "never read" in e.text
    doubled = next(i for i in crossing if crossing.count(i) == 2)
    assert f"sample {doubled} read" not in e.text  # read twice, as planned


def test_without_the_plan_a_step_that_read_fewer_samples_than_the_others_is_found() -> None:
    logs = {"a": run()}
    logs["a"][2]["indices"] = logs["a"][2]["indices"][:-1]
    (e,) = verdict(logs, Expect()).check(Promise.SAMPLES).evidence
    assert e.step == 2 and "read 3 samples, not B = 4" in e.text


def test_replicas_that_differ_at_a_step_name_the_odd_one() -> None:
    logs = {"a": run((0, 2)), "b": run((2, 2)), "c": run((0, 0))}
    logs["c"][3]["digest"] = "x1"
    c = verdict(logs).check(Promise.REPLICAS)
    assert c.status is Status.VIOLATED
    (e,) = c.evidence
    assert (e.node, e.step, e.epoch) == ("c", 2, 1) and "a, b d1; c x1" in e.text


def test_replicas_without_any_digest_are_not_checked_and_say_how_to_log_one() -> None:
    logs = {"a": run((0, 2), digests=False), "b": run((2, 2), digests=False)}
    c = verdict(logs).check(Promise.REPLICAS)
    assert c.status is Status.NOT_CHECKED and "--digest-every" in c.unchecked
    assert verdict(logs).ok


def test_a_failed_audit_differs_by_definition_and_a_passed_one_is_compared() -> None:
    logs = {"a": run((0, 2), digests=False), "b": run((2, 2), digests=False)}
    logs["a"].insert(6, {"t": 3.5, "kind": "audit", "step": 3, "digest": "d2", "ok": True})
    logs["b"].insert(6, {"t": 3.5, "kind": "audit", "step": 3, "digest": "zz", "ok": True})
    assert verdict(logs).check(Promise.REPLICAS).status is Status.VIOLATED
    logs["b"][6]["ok"] = False
    assert verdict(logs).check(Promise.REPLICAS).status is Status.OK


def test_a_node_whose_final_digest_is_not_the_groups_is_named() -> None:
    logs = {"a": run((0, 2)), "b": run((2, 2), last="x2")}
    c = verdict(logs).check(Promise.FINAL)
    assert c.status is Status.VIOLATED
    (e,) = c.evidence
    assert e.node == "b" and "finished with digest x2, the group's final is d2 (its commit of step 3" in e.text


def test_a_node_that_finished_before_the_last_step_is_named() -> None:
    logs = pair()
    logs["b"][-1] = final(5, "d1", at=2)
    c = verdict(logs).check(Promise.FINAL)
    assert any(e.node == "b" and e.step == 2 and "finished at step 2, not 3" in e.text for e in c.evidence)


def test_a_run_no_node_finished_is_violated() -> None:
    logs = {"a": run()[:-1]}
    c = verdict(logs).check(Promise.FINAL)
    assert c.status is Status.VIOLATED and c.evidence[0].text == "no node finished the job (no final entry)"


def audit_rollback(t: float, to: int) -> dict[str, Any]:
    return {"t": t, "kind": "restore", "step": to, "digest": f"d{to - 1}", "why": "failed audit"}


def test_a_failed_audits_rollback_is_noted_with_the_steps_it_made_the_group_redo() -> None:
    # Both go back from step 3 to step 1 and commit steps 2 and 3 again in epoch 2.
    logs: dict[str, Log] = {}
    for node, share in (("a", (0, 2)), ("b", (2, 2))):
        again = [e for s in (1, 2) for e in step(6 + s, 2, s, f"d{s}", share)]
        logs[node] = [*run(share)[:-1], audit_rollback(5.5, 1), *again, final(9, "d2")]
    verdict_ = verdict(logs, events=[event(Kind.AUDIT, "b", 3, "b's state differs", t=5.4)])
    c = verdict_.check(Promise.ROLLBACKS)
    assert verdict_.ok and c.status is Status.NOTED, statuses(verdict_)
    assert "a failed audit took a, b back from step 3 to step 1: 2 steps redone" in c.evidence[1].text
    assert c.evidence[0].text == "audit verdict: b's state differs"


def test_the_group_going_back_to_one_step_again_after_its_repair_is_violated() -> None:
    again = [e for s in (1, 2) for e in step(6 + s, 2, s, f"d{s}")]
    twice = [e for s in (1, 2) for e in step(10 + s, 3, s, f"d{s}")]
    logs = {"a": [*run()[:-1], audit_rollback(5.5, 1), *again, audit_rollback(9.5, 1), *twice, final(13, "d2")]}
    c = verdict(logs).check(Promise.ROLLBACKS)
    assert c.status is Status.VIOLATED
    assert "back to step 1 2 times" in c.evidence[0].text and c.evidence[0].step == 1
    # The same restore logged twice (no step committed in between) is one rollback.
    logs = {"a": [*run()[:-1], audit_rollback(5.5, 1), audit_rollback(5.6, 1), *again, final(9, "d2")]}
    assert verdict(logs).check(Promise.ROLLBACKS).status is Status.NOTED


def test_a_restart_from_a_checkpoint_that_redid_committed_steps_is_noted() -> None:
    restart = {"t": 6.0, "kind": "restore", "step": 1, "digest": "d0", "path": "/ck/ckpt-1.pt"}
    again = [e for s in (1, 2) for e in step(6 + s, 2, s, f"d{s}")]
    logs = {"a": [*run()[:-1], restart, *again, final(9, "d2")]}
    v = verdict(logs)
    c = v.check(Promise.ROLLBACKS)
    assert v.ok and c.status is Status.NOTED
    assert (
        "restarted from a checkpoint, /ck/ckpt-1.pt (step 1) after the group had reached step 3" in c.evidence[0].text
    )


def test_a_halt_is_violated_and_a_quarantine_noted_and_without_an_event_log_neither_is_checked() -> None:
    v = verdict(pair(), events=[event(Kind.QUARANTINE, "b", 2, "b quarantined after 3 offences")])
    assert v.ok and v.check(Promise.QUARANTINES).status is Status.NOTED
    assert v.check(Promise.QUARANTINES).evidence[0].node == "b"
    halted = event(Kind.HALTED, None, 2, "job stopped at step 2: the data gives NaN")
    v = verdict(pair(), events=[halted])
    c = v.check(Promise.HALTS)
    assert not v.ok and c.status is Status.VIOLATED and c.evidence[0].step == 2 and "NaN" in c.evidence[0].text
    v = verdict(pair())
    assert v.check(Promise.HALTS).status is Status.NOT_CHECKED and "--event-log" in v.check(Promise.HALTS).unchecked


def test_without_the_job_the_last_step_is_where_the_nodes_finished() -> None:
    v = verdict(pair(), Expect())
    assert v.num_steps == T and v.ok
    logs = {"a": run()[:-1]}  # nobody finished: the last step committed, said
    v = verdict(logs, Expect())
    assert v.num_steps == T and any("no node finished" in n for n in v.notes)


def test_the_verdict_as_json_lists_every_promise() -> None:
    d = verdict(pair(), events=[]).to_json()
    assert d["ok"] is True and d["violated"] == []
    assert [c["promise"] for c in d["checks"]] == [p.value for p in Promise]
    assert all(set(c) >= {"status", "summary", "evidence", "evidence_total"} for c in d["checks"])
