"""Which state a failed audit comes back to, who holds a copy of it, and where its buffers come from."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from unbroken.state import layout
from unbroken.state.snapshot import TrainState
from unbroken.train.audits import LAY_OUT_AHEAD, Audits


class Residual:
    """A node's own state (a codec's error feedback), not the replicas'."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.value = torch.full((3,), 7.0)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value.copy_(state["value"])


def make_state(seed: int, step: int = 5) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return TrainState(model, opt, step=step, cursor=4 * step)


def train(st: TrainState) -> None:
    st.model(torch.randn(2, 4)).sum().backward()
    st.optimizer.step()
    st.step += 1


def make_node(st: TrainState, rollback_to: int = -1) -> SimpleNamespace:
    logged: list[tuple[Any, dict[str, Any]]] = []
    order = SimpleNamespace(rollback_to=rollback_to)
    return SimpleNamespace(
        state=st, applied_step=st.step - 1, logged=logged,
        client=SimpleNamespace(step=st.step, latest_order=lambda: order),
        records=SimpleNamespace(settle=lambda: None, log=lambda kind, fields: logged.append((kind, fields))),
    )  # fmt: skip


def ptrs(tree: Any) -> set[int]:
    return {t.data_ptr() for t in layout.split(tree)[1] if t.numel()}


def test_a_first_epoch_state_is_kept_a_joiners_is_not_and_a_repaired_culprit_refills_its_copy() -> None:
    cold = Audits(make_node(make_state(1)))  # type: ignore[arg-type]
    cold.every = 10
    cold.synced(received=False)
    assert cold.audited is not None and int(cold.audited["step"]) == 5, "the job's starting state"
    joiner = Audits(make_node(make_state(2)))  # type: ignore[arg-type]
    joiner.every = 10
    joiner.synced(received=True)
    assert joiner.audited is None, "no 400 MB copy on a joiner's first step"
    joiner.synced(received=False)
    assert joiner.audited is None, "nor when it later gives its state to the next joiner"
    before = ptrs(cold.audited)
    cold.node.state.step = 9
    cold.synced(received=True)  # a culprit, repaired: the received state into the same buffers
    assert int(cold.audited["step"]) == 9 and ptrs(cold.audited) == before
    off = Audits(make_node(make_state(3)))  # type: ignore[arg-type]
    off.synced(received=False)
    assert off.audited is None, "audits off: no copy"


def test_the_first_audit_captures_into_buffers_laid_out_ahead_on_a_thread() -> None:
    st = make_state(1, step=0)
    st.node_local = Residual("n1")
    audits = Audits(make_node(st))  # type: ignore[arg-type]
    audits.every = 10
    audits.synced(received=True)
    for step in range(1, 10):
        audits.ahead(step)
        assert (audits._laying is not None) == (step >= 10 - LAY_OUT_AHEAD), step
    assert audits._laying is not None
    audits._laying.join()
    blank = audits._blank
    assert blank is not None and all(not t.any() for t in layout.split(blank)[1])
    st.step = 10
    audits.audited = st.capture(reuse=audits._buffers())
    assert ptrs(audits.audited) == ptrs(blank), "the capture filled what was laid out"
    assert st.digest_of(audits.audited) == st.digest() and not ptrs(audits.audited) & ptrs(st.tree(local=True))
    assert torch.equal(audits.audited["local"]["state"]["value"], torch.full((3,), 7.0))
    audits.ahead(17)
    assert audits._laying is None, "a copy is held: its buffers are reused"


def test_a_rollback_restores_the_copy_of_its_step_where_held() -> None:
    st = make_state(1, step=100)
    audits = Audits(make_node(st, rollback_to=100))  # type: ignore[arg-type]
    audits.every = 100
    audits.synced(received=False)
    digest = st.digest()
    for _ in range(7):
        train(st)
    audits.rollback_if_ordered()
    assert st.step == 100 and st.digest() == digest


def test_a_member_without_a_copy_of_the_rollback_step_goes_behind_it_instead_of_leading_the_sync() -> None:
    # The sync's source is the highest step: a joiner still at the suspect step 130 would
    # hand the group the state the audit refused.
    for held in (None, 120):
        st = make_state(2, step=130)
        node = make_node(st, rollback_to=100)
        audits = Audits(node)  # type: ignore[arg-type]
        audits.every = 100
        if held is not None:
            audits.audited = st.capture()
            audits.audited["step"] = held
        audits.rollback_if_ordered()
        assert st.step == 99 and node.client.step == 99 and node.applied_step == -1, held
        assert node.logged and "no copy of step 100" in node.logged[-1][1]["why"]
    behind = make_state(3, step=90)
    audits = Audits(make_node(behind, rollback_to=100))  # type: ignore[arg-type]
    audits.rollback_if_ordered()
    assert behind.step == 90, "behind the rollback already: the sync brings it up"
