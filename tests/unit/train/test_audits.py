"""The state a failed audit comes back to, as a receiver keeps it after the sync phase."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from unbroken.errors import AuditMismatch
from unbroken.state import layout
from unbroken.state.snapshot import TrainState
from unbroken.train.audits import Audits
from unbroken.train.sync import Standing, floored


class Residual:
    """A node's own state (a codec's error feedback), not the replicas'."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.value = torch.full((3,), 7.0)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value.copy_(state["value"])


def make_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return TrainState(model, opt, step=5, cursor=20)


def ptrs(tree: Any) -> set[int]:
    return {t.data_ptr() for t in layout.split(tree)[1] if t.numel()}


def test_a_receiver_keeps_what_it_fetched_with_its_own_state_and_reuses_it_at_the_next_audit() -> None:
    donor, receiver = make_state(1), make_state(2)
    receiver.node_local = Residual("n2")
    fetched = layout.copy(donor.tree())  # what the transfer left in buffers of its own
    receiver.restore(fetched)  # the state took copies
    audits = Audits(SimpleNamespace(state=receiver))  # type: ignore[arg-type]
    audits.every = 5
    audits.synced(1, received=True, fetched=fetched)
    kept = audits.audited
    assert kept is not None and kept["model"] is fetched["model"], "no second copy of the state"
    assert not ptrs(kept) & ptrs(receiver.tree(local=True)), "nothing shared with the live state"
    assert torch.equal(kept["local"]["state"]["value"], receiver.node_local.value)
    digest = receiver.digest()
    receiver.model(torch.randn(2, 4)).sum().backward()
    receiver.optimizer.step()
    receiver.node_local.value.zero_()
    receiver.step = 6
    assert receiver.digest() != digest
    receiver.restore(kept)  # a failed audit comes back
    assert receiver.digest() == digest and torch.equal(receiver.node_local.value, torch.full((3,), 7.0))
    before = ptrs(kept)
    audits.synced(2, received=True)  # a later sync without a fetch of its own: captured into the same buffers
    assert audits.audited is not None and ptrs(audits.audited) == before


def ordered_back_to(step: int, held: int | None, at: int) -> tuple[Audits, TrainState, list[Any]]:
    """A node at step ``at`` holding an audited copy of step ``held``, told to go back to ``step``."""
    state = make_state(3)
    logged: list[Any] = []
    records = SimpleNamespace(settle=lambda: None, log=lambda kind, fields: logged.append((kind, fields)))
    order = SimpleNamespace(rollback_to=step)
    client = SimpleNamespace(latest_order=lambda: order, step=at)
    job = SimpleNamespace(num_steps=105)
    node = SimpleNamespace(state=state, records=records, client=client, name="n", applied_step=at, job=job)

    def restored() -> None:  # as `Node.restored`
        node.applied_step, client.step = -1, state.step

    node.restored = restored
    audits = Audits(node)  # type: ignore[arg-type]
    audits.every = 10
    if held is not None:
        state.step = held
        audits.audited = state.capture()
    state.step = at
    audits.committed_epoch = 3
    return audits, state, logged


def test_a_node_holding_the_state_ordered_back_to_restores_it() -> None:
    audits, state, logged = ordered_back_to(20, held=20, at=30)
    audits.rollback_if_ordered()
    assert state.step == 20 and not audits.behind and audits.committed_epoch == -1
    assert [fields["step"] for _, fields in logged] == [20]


def test_a_node_without_a_copy_of_that_state_is_put_behind_instead_of_offering_its_own() -> None:
    for held in (25, None):  # a joiner's copy is of its join step; a node may hold none
        audits, state, logged = ordered_back_to(20, held=held, at=30)
        audits.rollback_if_ordered()
        assert audits.behind and state.step == 30 and not logged, held
        audits.synced(4, received=True)  # the sync phase replaced its state
        assert not audits.behind and audits.committed_epoch == -1, "a peer's state: not committed here"


def test_a_node_not_ahead_of_the_state_ordered_back_to_stays_as_it_is() -> None:
    audits, state, _ = ordered_back_to(20, held=25, at=20)
    audits.rollback_if_ordered()
    assert not audits.behind and state.step == 20


def test_a_verdict_takes_a_compared_member_back_and_leaves_it_a_floor_and_one_below_the_step_behind() -> None:
    g = SimpleNamespace(rank=0, epoch=6, members=["n", "x"])
    audits, state, _ = ordered_back_to(-1, held=20, at=30)
    with pytest.raises(AuditMismatch) as exc:
        audits.failed(g, 1, "x's state differs")  # type: ignore[arg-type]
    assert exc.value.rollback_to == 20 and state.step == 20 and not audits.behind
    assert (audits.floor, audits.floor_epoch) == (20, 6), "reported at the next sync, for members that missed it"
    audits, state, _ = ordered_back_to(-1, held=10, at=15)  # an old copy: it must not pull the group back to 10
    with pytest.raises(AuditMismatch) as exc:
        audits.failed(g, 1, "x's state differs", below_top=True)  # type: ignore[arg-type]
    assert exc.value.rollback_to == -1 and state.step == 15 and audits.behind and audits.floor == -1
    audits, state, _ = ordered_back_to(-1, held=20, at=30)
    with pytest.raises(AuditMismatch):
        audits.failed(g, 0, "n's state differs")  # type: ignore[arg-type]
    assert state.step == 20 and audits.behind, "the culprit goes back, then fetches a peer's copy"
    audits.synced(7, received=True)
    assert not audits.behind and audits.floor == -1 and audits.synced_epoch == 7


def test_an_audit_where_no_state_has_a_majority_takes_every_member_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.train import audits as module

    g = SimpleNamespace(rank=0, epoch=6, size=2, members=["n", "x"], pg=object())

    def parts(pg: Any, size: int, values: list[int], *_: Any) -> list[tuple[int, ...]]:
        """x's state differs from n's in its third part (the first model tensor)."""
        theirs = list(values)
        if len(values) > 2:
            theirs[2] += 1
        return [tuple(values), tuple(theirs)]

    monkeypatch.setattr(module, "gather_values", parts)
    for reports, goes_back in (([(30, 1), (30, 2)], True), ([(30, 1), (30, 1)], False)):
        monkeypatch.setattr(module, "gather_digests", lambda *_, reports=reports: reports)
        audits, state, _ = ordered_back_to(-1, held=20, at=30)
        audits.node.scope = lambda during_step: None  # type: ignore[attr-defined]
        if goes_back:
            with pytest.raises(AuditMismatch) as exc:
                audits.check(g)  # type: ignore[arg-type]
            assert exc.value.rank == -1 and "no state has a majority" in str(exc.value)
            assert "; it differs in model " in str(exc.value) and "(on x)" in str(exc.value), str(exc.value)
            assert state.step == 20 and not audits.behind, "both go back: nobody can be named"
        else:
            audits.check(g)  # type: ignore[arg-type]
            assert state.step == 30 and audits.audited is not None and int(audits.audited["step"]) == 30


def test_the_last_step_is_audited_and_a_verdict_not_seen_keeps_the_node_from_finishing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from unbroken.errors import EpochAborted
    from unbroken.train import audits as module

    audits, _, _ = ordered_back_to(-1, held=100, at=105)
    assert [s for s in range(1, 106) if audits.due(s)] == [10 * k for k in range(1, 11)] + [105]

    def cut_short(*_: Any) -> Any:
        raise EpochAborted("epoch 7 ordered")

    monkeypatch.setattr(module, "gather_digests", cut_short)
    audits.node.scope = lambda during_step: None  # type: ignore[attr-defined]
    g = SimpleNamespace(rank=0, epoch=6, size=2, members=["n", "x"], pg=object())
    with pytest.raises(EpochAborted):
        audits.check(g)  # type: ignore[arg-type]
    assert audits.unsettled, "not finished on a state whose audit it never saw the end of"
    audits.synced(7, received=False)
    assert not audits.unsettled


def test_a_difference_without_a_majority_that_comes_back_every_time_is_settled_instead_of_looping() -> None:
    from unbroken.train.audits import MAX_TIES

    g = SimpleNamespace(rank=0, epoch=6, members=["n", "x"])
    audits, state, _ = ordered_back_to(-1, held=20, at=30)
    audits.committed_epoch = 6
    for _ in range(MAX_TIES):
        with pytest.raises(AuditMismatch) as exc:
            audits.failed(g, -1, "audit at step 30: no state has a majority")  # type: ignore[arg-type]
        assert exc.value.rollback_to == 20 and state.step == 20
        state.step, audits.committed_epoch = 30, 6  # the steps redone: the same difference again
    with pytest.raises(AuditMismatch) as exc:
        audits.failed(g, -1, "audit at step 30: no state has a majority")  # type: ignore[arg-type]
    assert exc.value.rollback_to == -1 and state.step == 30, "no rollback the 4th time"
    assert "arithmetic differs" in str(exc.value) and audits.arithmetic_differs == {"n", "x"}
    assert audits.committed_epoch == -1, "the next sync phase only repairs it (no verdict on it)"
    assert audits.unsettled, "not final before that sync phase (it may be the job's last step)"
    state.step, audits.committed_epoch = 130, 7
    with pytest.raises(AuditMismatch) as exc:
        audits.failed(g, -1, "audit at step 130: no state has a majority")  # type: ignore[arg-type]
    assert exc.value.rollback_to == -1 and state.step == 130, "settled at once while the same members train"
    g.members = ["n", "y"]  # x left: a difference with y is rolled back again
    with pytest.raises(AuditMismatch) as exc:
        audits.failed(g, -1, "audit at step 130: no state has a majority")  # type: ignore[arg-type]
    assert exc.value.rollback_to == 20 and state.step == 20


def test_a_state_committed_before_a_recorded_verdict_above_its_step_is_refused() -> None:
    from unbroken.control.messages import Refusal

    for committed, step, refused in ((5, 200, True), (4, 101, True), (6, 200, False), (-1, 200, False), (5, 90, False)):
        audits, state, _ = ordered_back_to(-1, held=None, at=step)
        audits.node.client.latest_order().refused = [Refusal(epoch=2, step=10), Refusal(epoch=5, step=100)]
        audits.committed_epoch = committed
        audits.refuse_if_recorded()
        assert audits.behind is refused and state.step == step, (committed, step)
    audits, state, _ = ordered_back_to(-1, held=80, at=200)  # it holds an audited state before the verdict's step
    audits.node.client.latest_order().refused = [Refusal(epoch=5, step=100)]
    audits.committed_epoch = 5
    audits.refuse_if_recorded()
    assert state.step == 80 and not audits.behind, "offered again: the sync phase decides from there"


def test_a_process_restarted_from_a_checkpoint_has_settled_the_epochs_before_it() -> None:
    # The whole group restarted from checkpoints of epoch 7: a live member's floor from a
    # verdict of epoch 5 must not put them behind (no sync phase completed since the restart).
    audits, _, _ = ordered_back_to(20, held=None, at=30)
    audits.node.records.restored_epoch = None
    assert audits.standing() is not None and audits.standing().synced_epoch == -1  # type: ignore[union-attr]
    audits.node.records.restored_epoch = 7
    restarted = audits.standing()
    assert restarted is not None and restarted.synced_epoch == 7
    live = Standing(False, 5, 20, 5, 4)  # went back to step 20 at a verdict of epoch 5, holds it
    assert floored([30, 30, 20], [restarted, restarted, live]) == [30, 30, 20]
    assert floored([30, 30, 20], [live, live, live]) == [-1, -1, 20]  # without the restart: behind


def test_a_checkpoint_written_before_a_verdict_and_above_its_step_is_refused() -> None:
    # A node restarted from a checkpoint of step 30 written in epoch 3; the group went back to
    # step 20 at a verdict of epoch 4: that checkpoint holds the corrupted contributions.
    for checkpoint_epoch, refused in ((3, True), (4, True), (5, False)):
        audits, state, _ = ordered_back_to(-1, held=None, at=30)
        audits.committed_epoch, audits.checkpoint_epoch = -1, checkpoint_epoch
        audits.node.client.latest_order = lambda: SimpleNamespace(refused=[SimpleNamespace(epoch=4, step=20)])
        audits.refuse_if_recorded()
        assert audits.behind is refused and state.step == 30, checkpoint_epoch
    audits, _, _ = ordered_back_to(-1, held=None, at=30)
    audits.committed_epoch, audits.checkpoint_epoch = -1, 3
    audits.synced(6, received=True)  # the state was then fetched from a peer: not the checkpoint's
    assert audits.checkpoint_epoch == -1
    audits.node.client.latest_order = lambda: SimpleNamespace(refused=[SimpleNamespace(epoch=4, step=20)])
    audits.refuse_if_recorded()
    assert not audits.behind
