"""A reconnecting member's resume as a digest (`unbroken.control.resumes`): checked against
what the coordinator holds of the epoch, the lists asked for only where nothing matches."""

from __future__ import annotations

from unbroken.control import messages as m
from unbroken.control.resumes import Resumes, digested
from unbroken.specs import Role

from .test_membership import hello


def order(epoch: int, members: list[str]) -> m.EpochOrder:
    n = len(members)
    roles = [Role.TRAINER] * (n - 1) + [Role.STANDBY]
    return m.EpochOrder(epoch=epoch, members=members, shares=[2] * n, urgent=False, reason="", roles=roles)


def resume_of(o: m.EpochOrder, **fields: object) -> m.Resume:
    """What a member of ``o``'s epoch says of it (`train.session.hello`)."""
    values: dict[str, object] = {
        "epoch": o.epoch, "members": list(o.members), "step": 7, "shares": list(o.shares), "roles": list(o.roles),
    }  # fmt: skip
    values.update(fields)
    return m.Resume(**values)  # type: ignore[arg-type]


def test_a_digest_of_the_order_in_force_is_taken_from_that_order() -> None:
    o = order(4, ["a", "b", "c"])
    sent = digested(resume_of(o, abandoned=True))
    assert sent.members == [] and sent.shares == [] and sent.roles == [] and sent.digest
    assert Resumes().expand(sent, o) == resume_of(o, abandoned=True)


def test_a_coordinator_that_holds_nothing_of_the_epoch_asks_once_per_epoch() -> None:
    o = order(9, ["a", "b", "c"])
    kept = Resumes()
    assert kept.expand(digested(resume_of(o)), None) is None, "just started: nothing to check the digest against"
    assert kept.expand(resume_of(o, step=8), None) == resume_of(o, step=8), "the lists, sent in full"
    assert kept.expand(digested(resume_of(o, step=6)), None) == resume_of(o, step=6), "the next member's digest"


def test_a_digest_of_other_lists_is_not_taken_for_the_coordinators() -> None:
    o = order(5, ["a", "b", "c"])
    kept = Resumes()
    assert kept.expand(digested(resume_of(o, members=["a", "c", "b"])), o) is None
    assert kept.expand(digested(resume_of(o, roles=[Role.TRAINER] * 3)), o) is None
    assert kept.expand(digested(resume_of(o, epoch=4)), o) is None, "an older epoch than the order in force"


def test_a_hello_at_ten_thousand_members_is_small_with_the_digest() -> None:
    members = [f"node-{i:05d}-0123456789abcdef0123456789" for i in range(10_000)]
    full = hello("node-00001-0123456789abcdef0123456789", resume=resume_of(order(3, members)))
    small = full.model_copy(update={"resume": digested(full.resume)})  # type: ignore[arg-type]
    assert len(m.encode(full)) > 300_000
    assert len(m.encode(small)) < 2_000
    assert m.parse_node_message(m.encode(small)) == small
