"""The inter-zone codec's residual is node-local snapshot state: a node restarted from its
own checkpoint resumes it, even though the codec is made only when an epoch order names it."""

from __future__ import annotations

import torch

from unbroken.specs import CodecSpec
from unbroken.train.epochs import CodecSlot


def test_the_residual_survives_a_restart_through_the_snapshot() -> None:
    before = CodecSlot("a1")
    before.for_spec(CodecSpec.parse("int8")).encode(torch.linspace(-1, 1, 1000))
    saved = before.state_dict()
    assert saved["spec"] == "int8" and saved["codec"]["residual"].abs().sum() > 0

    after = CodecSlot("a1")  # restarted: no codec until the first epoch order
    after.load_state_dict(saved)
    assert after.pending is not None and after.codec is None
    codec = after.for_spec(CodecSpec.parse("int8"))  # the first epoch order names it
    assert torch.equal(codec.residual, saved["codec"]["residual"])  # type: ignore[attr-defined]
    assert after.pending is None


def test_a_residual_for_another_codec_is_dropped_when_the_order_names_a_different_one() -> None:
    after = CodecSlot("a1")
    after.load_state_dict({"spec": "int8", "codec": {"residual": torch.ones(5)}})
    codec = after.for_spec(CodecSpec.parse("topk:0.1"))
    assert codec.residual is None or not torch.equal(codec.residual, torch.ones(5))  # type: ignore[attr-defined]


def test_a_live_codec_takes_the_residual_at_once_and_a_codec_without_one_saves_nothing() -> None:
    n = CodecSlot("a1")
    n.for_spec(CodecSpec.parse("topk:0.1"))
    n.load_state_dict({"spec": "topk:0.1", "codec": {"residual": torch.ones(5)}})
    assert torch.equal(n.codec.residual, torch.ones(5))  # type: ignore[union-attr]
    assert CodecSlot("b1").state_dict() == {}
