"""A sharded zone's ranges as the re-shard reads and rebuilds them (`comm.reshard`), on one
member (no group is used): a range's digest hashed where its pieces lie, and the pieces it
keeps of its own taken where they are."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from unbroken.comm.group import EpochScope
from unbroken.comm.reshard import digest_of, held_pieces
from unbroken.comm.sharded import ShardedModel
from unbroken.comm.solo import Solo
from unbroken.errors import TransferError
from unbroken.state.shards import layout_for

OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
}


def zone(optimizer: str, weights: dict[str, int], steps: int) -> ShardedModel:
    """Member ``a`` of a zone of ``weights`` (its holdings, pieces of several parameters each),
    its optimizer stepped ``steps`` times on made-up gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    layout = layout_for(sum(p.numel() for p in model.parameters()), weights)
    scope = EpochScope(threading.Event(), lambda: None, 10.0)
    z = ShardedModel(model, layout, "a", {"a": 0}, Solo(), scope, OPTIMIZERS[optimizer])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for h in z.holdings:
            for piece in h.pieces:
                piece.tensor.grad = torch.randn(piece.tensor.shape, generator=g)
        z.step()
    return z


@pytest.mark.parametrize(("optimizer", "steps"), [("adamw", 2), ("sgd-momentum", 1), ("adamw", 0)])
def test_a_ranges_digest_hashed_in_place_is_the_digest_of_its_export(optimizer: str, steps: int) -> None:
    z = zone(optimizer, {"a": 1, "b": 1, "c": 1}, steps)
    spans = [(h.start, h.end) for h in z.holdings]
    most = max(z.holdings, key=lambda h: len(h.pieces))
    assert len(most.pieces) > 2, "the test needs a range of several pieces"
    spans.append((most.pieces[0].start + 1, most.end - 1))  # across three pieces, cut at both ends
    for start, end in spans:
        part = z.export(start, end)
        assert z.digest(start, end) == digest_of(part["values"], part["state"]), (start, end)
    with pytest.raises(TransferError, match="holds"):
        z.digest(0, z.layout.numel)  # b's primary is not a's


def test_ranges_rebuilt_from_the_pieces_held_train_on_as_before() -> None:
    """``a`` holds everything in both layouts (a primary and its buddy copy of b's): the new
    ranges come from its own pieces alone, values and Adam's moments alike, and the next step
    is the one the old ranges would have taken."""
    z, same = zone("adamw", {"a": 1, "b": 1}, 2), zone("adamw", {"a": 1, "b": 1}, 2)
    numel = z.layout.numel
    before = z.export(0, numel)
    elements, _ = z.state_layout()
    z.load(layout_for(numel, {"a": 2, "b": 1}), "a", held_pieces(z, elements), z.shared_state())
    assert [(h.start, h.end) for h in z.holdings] != [(h.start, h.end) for h in same.holdings]
    after = z.export(0, numel)
    assert torch.equal(after["values"], before["values"])
    assert all(torch.equal(after["state"][k], before["state"][k]) for k in before["state"])
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    for x in (z, same):
        for h in x.holdings:
            for piece in h.pieces:
                piece.tensor.grad = grad[piece.start : piece.end].clone()
        x.step()
    assert z.digest(0, numel) == same.digest(0, numel)
