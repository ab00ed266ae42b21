"""The inter-zone codec's residual is node-local snapshot state: a node restarted from its
own checkpoint resumes it, even though the codec is made only when an epoch order names it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from unbroken.comm.codecs import make_codec
from unbroken.train.runtime import _CodecResidual


def node(name: str) -> Any:
    return SimpleNamespace(name=name, _codec=None, _codec_spec="", _pending_codec_state=None)


def test_the_residual_survives_a_restart_through_the_snapshot() -> None:
    before = node("a1")
    before._codec, before._codec_spec = make_codec("int8"), "int8"
    before._codec.encode(torch.linspace(-1, 1, 1000))
    saved = _CodecResidual(before).state_dict()
    assert saved["spec"] == "int8" and saved["codec"]["residual"].abs().sum() > 0

    after = node("a1")  # restarted: no codec until the first epoch order
    _CodecResidual(after).load_state_dict(saved)
    assert after._pending_codec_state is not None
    after._codec, after._codec_spec = make_codec("int8"), "int8"  # what _build_reducer does next
    after._codec.load_state_dict(after._pending_codec_state["codec"])
    assert torch.equal(after._codec.residual, saved["codec"]["residual"])


def test_a_live_codec_takes_the_residual_at_once_and_a_codec_without_one_saves_nothing() -> None:
    n = node("a1")
    n._codec, n._codec_spec = make_codec("topk:0.1"), "topk:0.1"
    _CodecResidual(n).load_state_dict({"spec": "topk:0.1", "codec": {"residual": torch.ones(5)}})
    assert torch.equal(n._codec.residual, torch.ones(5))
    assert _CodecResidual(node("b1")).state_dict() == {}
