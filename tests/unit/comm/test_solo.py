"""The group of a member alone in its zone, and a sharded zone of one member on it."""

from __future__ import annotations

import pytest
import torch

from unbroken.comm.group import EpochScope
from unbroken.comm.sharded import ShardedModel
from unbroken.comm.solo import Solo
from unbroken.state.shards import layout_for
from unit.comm.test_sharded import STEPS, Tiny, adamw, assert_matches, even, groups_of, reference, scope, train


def test_alone_a_sum_is_the_tensor_a_gather_its_copy_and_there_is_no_peer() -> None:
    g = Solo()
    x = torch.tensor([1.0, -2.0])
    assert g.allreduce([x]).wait() and torch.equal(x, torch.tensor([1.0, -2.0]))
    out = [[torch.zeros(2)]]
    assert g.allgather(out, [x]).is_completed() and torch.equal(out[0][0], x)
    assert g.broadcast(x, 0).get_future().done()
    with pytest.raises(ValueError, match="no rank 1"):
        g.send([x], 1)


def test_a_sharded_zone_of_one_member_trains_as_one_process() -> None:
    model = Tiny()
    numel = sum(p.numel() for p in model.parameters())
    zone = ShardedModel(
        model, layout_for(numel, {"a": 1}), "a", {"a": 0}, Solo(), scope(), adamw,
        blocks=[model.embed, model.body, model.head], groups=groups_of(model),
    )  # fmt: skip
    assert isinstance(zone.scope, EpochScope)
    for step in range(STEPS):
        train(zone, model, step, even(["a"]), "a")
    assert_matches({"a": zone}, reference(STEPS))
