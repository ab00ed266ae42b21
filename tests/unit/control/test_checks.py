"""The leader's part in checking the work (`unbroken.control.checks`): which findings name a
trainer (never one member's word), who confirms, and what is not compared; and Membership
turning a confirmed finding into a bench through the offence path."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from unbroken.config import MembershipConfig
from unbroken.control.checks import (
    ORDER_WAIT_S,
    SAID_EVERY_S,
    UNFOUNDED_LIMIT,
    WAIT_S,
    Candidate,
    Checks,
    Finding,
    Outcome,
    Verdict,
    confirmer,
)
from unbroken.control.membership import BENCH_S, JOIN_SETTLE_S, Membership
from unbroken.control.messages import Capabilities, Checked, Commitment, Hello, TensorSpec
from unbroken.events import Kind
from unbroken.specs import Role

CPU = "cpu x86_64 AVX2, 1 threads, torch 2.13.0+cpu (abcd0123)"
GOOD, BAD = "00000000000000aa", "00000000000000bb"


def commitment(step: int, digest: str = GOOD, epoch: int = 1, microbatch: int = 10) -> Commitment:
    return Commitment(epoch=epoch, step=step, digest=digest, microbatch=microbatch)


def finding(checker: str, step: int, digest: str = GOOD, at: float = 0.0, **fields: object) -> Finding:
    values: dict[str, object] = {"epoch": 1, "step": step, "trainer": "t", "digest": digest, "microbatch": 10}
    values |= {"arithmetic": CPU} | fields
    return Finding(checker, Checked(**values), at)  # type: ignore[arg-type]


class Leader:
    """`Checks` with a fixed confirmer, recording who was asked."""

    def __init__(self, confirmers: Collection[str] = ("c",)) -> None:
        self.confirmers = list(confirmers)
        self.checks = Checks(self.pick)

    def pick(self, trainer: str, accusers: Collection[str]) -> str | None:
        return next((c for c in self.confirmers if c != trainer and c not in accusers), None)

    def commit(self, *steps: int, digest: str = GOOD) -> list[Outcome]:
        """The trainer's commitments, the group at the newest of these steps."""
        return self.checks.committed("t", [commitment(s, digest) for s in steps], max(steps))

    def check(self, f: Finding) -> list[Outcome]:
        return self.checks.checked(f, CPU)


def verdicts(outcomes: list[Outcome]) -> list[Verdict]:
    return [o.verdict for o in outcomes]


def test_a_recomputation_equal_to_the_commitment_is_a_match() -> None:
    lead = Leader()
    lead.commit(3)
    assert verdicts(lead.check(finding("v", 3))) == [Verdict.MATCH]
    assert lead.checks.compared == 1 and lead.checks.mismatches == 0


def test_one_members_finding_names_nobody_and_asks_another_member_to_check_again() -> None:
    lead = Leader()
    lead.commit(3, 4, 5)
    (first,) = lead.check(finding("v", 3, BAD))
    assert first.verdict is Verdict.MISMATCH and first.confirmer == "c"
    assert "v's recomputation of its slice of step 3 differs" in first.reason
    # The same member again: still one member's word, and the order is not sent twice.
    (again,) = lead.check(finding("v", 4, BAD, at=1.0))
    assert again.verdict is Verdict.MISMATCH and again.confirmer is None and "c was asked" in again.reason
    # The member asked finds it too (on another step): two members, the trainer is named.
    (named,) = lead.check(finding("c", 5, BAD, at=2.0, ordered=True))
    assert named.verdict is Verdict.CONFIRMED and named.accusers == ("c", "v")
    assert "c at step 5" in named.reason and "v at step 3" in named.reason
    # What was found of the epoch it was named in is what it was named (and benched) for.
    lead.commit(6)
    assert lead.check(finding("v", 6, BAD, at=3.0)) == []
    lead.checks.committed("t", [commitment(7, epoch=2)], 7)
    (anew,) = lead.check(finding("v", 7, BAD, at=4.0, epoch=2))
    assert anew.verdict is Verdict.MISMATCH and anew.confirmer == "c", "a later epoch's: found anew"


def test_any_second_validator_confirms_not_only_the_one_asked() -> None:
    lead = Leader()
    lead.commit(3, 4)
    lead.check(finding("v", 3, BAD))
    (named,) = lead.check(finding("w", 4, BAD))  # another validator's own routine check
    assert named.verdict is Verdict.CONFIRMED and set(named.accusers) == {"v", "w"}


def test_the_member_asked_finding_the_work_right_leaves_the_finding_unconfirmed() -> None:
    lead = Leader(confirmers=["c", "d"])
    lead.commit(3, 4, 5)
    lead.check(finding("v", 3, BAD))
    (cleared,) = lead.check(finding("c", 4, GOOD, ordered=True))
    assert cleared.verdict is Verdict.UNCONFIRMED and "v's finding is alone" in cleared.reason
    # v's finding was withdrawn: a later finding of another member starts over.
    (fresh,) = lead.check(finding("w", 5, BAD))
    assert fresh.verdict is Verdict.MISMATCH and fresh.confirmer == "c"


def test_a_member_whose_findings_go_unconfirmed_is_not_followed_up() -> None:
    lead = Leader()
    steps = list(range(10, 10 + 2 * (UNFOUNDED_LIMIT + 1)))
    lead.commit(*steps)
    for k in range(UNFOUNDED_LIMIT):
        first, then = steps[2 * k], steps[2 * k + 1]
        assert lead.check(finding("liar", first, BAD, at=k))[0].confirmer == "c"
        assert lead.check(finding("c", then, GOOD, at=k, ordered=True))[0].verdict is Verdict.UNCONFIRMED
    (ignored,) = lead.check(finding("liar", steps[-2], BAD, at=10.0))
    assert ignored.verdict is Verdict.MISMATCH and ignored.confirmer is None and "not followed up" in ignored.reason
    # Nor does it stand against the trainer: another member's finding alone names nobody.
    (other,) = lead.check(finding("w", steps[-1], BAD, at=11.0))
    assert other.verdict is Verdict.MISMATCH and other.confirmer == "c"


def test_members_that_disagree_on_the_same_slice_name_nobody() -> None:
    lead = Leader()
    lead.commit(3)
    lead.check(finding("v", 3, BAD))
    (disputed,) = lead.check(finding("w", 3, GOOD))
    assert disputed.verdict is Verdict.DISPUTED and "v differing" in disputed.reason
    (alone,) = lead.check(finding("x", 3, BAD))  # the dispute withdrew v's finding
    assert alone.verdict is Verdict.DISPUTED


def test_a_finding_waits_for_its_commitment_then_is_compared() -> None:
    lead = Leader()
    assert lead.check(finding("v", 7, GOOD, at=1.0)) == []
    assert verdicts(lead.commit(7)) == [Verdict.MATCH]
    assert lead.check(finding("v", 8, GOOD, at=2.0)) == []
    (late,) = lead.checks.expire(2.0 + WAIT_S + 0.1)
    assert late.verdict is Verdict.NOT_COMPARED and "no commitment" in late.reason


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"arithmetic": "cpu x86_64 AVX512, 1 threads, torch 2.13.0+cpu (abcd0123)"}, "not bit for bit"),
        ({"microbatch": 5}, "micro-batches of 10, v in 5"),
        ({"digest": "", "skipped": "its scaled gradient overflowed"}, "v did not check it"),
    ],
)
def test_what_cannot_be_compared_bit_for_bit_names_nobody_and_is_said_once_a_while(
    fields: dict[str, object], said: str
) -> None:
    lead = Leader()
    lead.commit(3, 4, 5)
    (first,) = lead.check(finding("v", 3, **{"digest": BAD} | fields))  # type: ignore[arg-type]
    assert first.verdict is Verdict.NOT_COMPARED and said in first.reason
    assert lead.check(finding("v", 4, at=1.0, **{"digest": BAD} | fields)) == []  # type: ignore[arg-type]
    later = lead.check(finding("v", 5, at=SAID_EVERY_S + 1, **{"digest": BAD} | fields))  # type: ignore[arg-type]
    assert verdicts(later) == [Verdict.NOT_COMPARED]
    assert lead.checks.mismatches == 0


def test_an_order_unanswered_or_not_carried_out_leaves_the_finding_unconfirmed() -> None:
    lead = Leader()
    lead.commit(3)
    lead.check(finding("v", 3, BAD, at=0.0))
    (lapsed,) = lead.checks.expire(ORDER_WAIT_S + 1)
    assert lapsed.verdict is Verdict.UNCONFIRMED and "did not answer" in lapsed.reason
    lead = Leader()
    lead.commit(3)
    lead.check(finding("v", 3, BAD))
    out = lead.check(finding("c", 9, "", ordered=True, skipped="not checked: it trained in none of this node's steps"))
    assert Verdict.UNCONFIRMED in verdicts(out)


def test_the_confirmer_is_a_validator_computing_alike_else_the_fastest_trainer() -> None:
    other = "cuda NVIDIA H100, torch 2.13.0"
    members = [
        Candidate("t", Role.TRAINER, 10, CPU),
        Candidate("a", Role.TRAINER, 5, CPU),
        Candidate("b", Role.TRAINER, 15, CPU),
        Candidate("g", Role.VALIDATOR, 0, other),
        Candidate("v", Role.VALIDATOR, 0, CPU),
        Candidate("w", Role.VALIDATOR, 0, CPU),
        Candidate("s", Role.STANDBY, 0, CPU),
    ]
    assert confirmer(members, "t", {"v"}, CPU) == "w"
    assert confirmer(members, "t", {"v", "w"}, CPU) == "b", "the largest share: its step waits least"
    assert confirmer(members, "t", {"v", "w", "b"}, CPU) == "a"
    assert confirmer(members, "t", {"v", "w", "b", "a"}, CPU) is None, "never the trainer itself, nor a standby"
    assert confirmer(members, "t", set(), other) == "g"


# ---------------------------------------------------------------- Membership


def hello(member_id: str, role: str = "auto") -> Hello:
    return Hello(
        job="job",
        job_identity="ident",
        fingerprint=[TensorSpec(name="w", shape=[4], dtype="float32")],
        member_id=member_id,
        name=f"node-{member_id}",
        batch_size=30,
        capabilities=Capabilities(per_sample_s=0.001, measurements=3, arithmetic=CPU),
        role=role,  # type: ignore[arg-type]
    )


def test_membership_benches_a_trainer_two_members_found_wrong_and_asks_before() -> None:
    ms = Membership(MembershipConfig(lease_s=100.0), now=0.0)
    for mid, role in [("a", "auto"), ("b", "auto"), ("t", "auto"), ("v", "validator")]:
        assert ms.admit(hello(mid, role), 0.0).refuse is None
    order = next(iter(ms.tick(JOIN_SETTLE_S).orders.values()))
    assert order.roles == ["trainer", "trainer", "trainer", "validator"]
    epoch = order.epoch
    for mid in ("a", "b", "t", "v"):
        ms.heartbeat(mid, 4, 1.0)
    ms.committed("t", [commitment(s, epoch=epoch) for s in (3, 4)], 1.0)
    d = ms.checked("v", Checked(epoch=epoch, step=3, trainer="t", digest=BAD, microbatch=10, arithmetic=CPU), 1.0)
    (asked,) = d.verify.items()
    assert asked[0] in ("a", "b") and asked[1].trainer == "t", "no other validator: a trainer confirms"
    (ev,) = [e for e in d.events if e.kind is Kind.CHECK]
    assert ev.member == "t" and "node-v's recomputation" in ev.reason
    assert not [e for e in d.events if e.kind is Kind.BAD_WORK] and ms.members["t"].benched_until == 0
    # A member's finding about itself counts for nothing.
    mine = Checked(epoch=epoch, step=4, trainer="t", digest=BAD, microbatch=10, arithmetic=CPU)
    assert ms.checked("t", mine, 1.5).events == []
    d = ms.checked(asked[0], mine.model_copy(update={"ordered": True}), 2.0)
    (bench,) = [e for e in d.events if e.kind is Kind.BAD_WORK]
    assert bench.member == "t" and "node-v at step 3" in bench.reason and f"node-{asked[0]}" in bench.reason
    assert ms.members["t"].benched_until == pytest.approx(2.0 + BENCH_S)
    following = next(iter(ms.tick(2.1).orders.values()))
    assert following.shares[following.members.index("t")] == 0, "benched: no share"


def test_one_trainers_claim_of_a_far_step_prunes_nothing_and_the_record_stays_bounded() -> None:
    """A commitment past the group's step (a liar's 2**53) is dropped, not taken as the newest
    step: the others' are kept; and the record keeps only `KEPT_STEPS` behind the group's."""
    from unbroken.control.checks import KEPT_STEPS

    lead = Leader()
    lead.commit(3)
    lead.checks.committed("liar", [commitment(2**53)], 3)
    assert verdicts(lead.check(finding("v", 3))) == [Verdict.MATCH], "t's commitment of step 3 is still there"
    for step in range(4, 4 + 3 * KEPT_STEPS):
        lead.checks.committed("t", [commitment(step), commitment(step, epoch=2)], step)
    kept = sum(len(v) for v in lead.checks._commitments.values())
    assert kept <= 2 * (KEPT_STEPS + 2), kept
