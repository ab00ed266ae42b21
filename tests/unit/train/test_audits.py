"""The state a failed audit comes back to, as a receiver keeps it after the sync phase."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from unbroken.state import layout
from unbroken.state.snapshot import TrainState
from unbroken.train.audits import Audits


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
    audits.synced(received=True, fetched=fetched)
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
    audits.synced(received=True)  # a later sync without a fetch of its own: captured into the same buffers
    assert audits.audited is not None and ptrs(audits.audited) == before
