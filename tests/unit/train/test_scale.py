"""The group's loss scale moves as torch.amp.GradScaler's does."""

from __future__ import annotations

import pytest
import torch

from unbroken.errors import ConfigError
from unbroken.train.scale import MAX_SKIPS, LossScale, ScaleState


def test_the_scale_follows_gradscaler_step_for_step() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = ScaleState(LossScale.like(theirs))
    for overflow in [True, False, False, False, False, True, False, False, False, False, False, False]:
        theirs.scale(torch.ones(()))
        param.grad = torch.full((3,), float("inf") if overflow else 1.0)
        theirs.unscale_(opt)
        theirs.step(opt)
        theirs.update()
        ours.update(overflow)
        assert ours.scale == theirs.get_scale()


def test_the_scale_is_replicated_state_and_bad_policies_are_refused() -> None:
    a = ScaleState(LossScale(init=8.0, growth_interval=2))
    a.update(False)
    b = ScaleState(LossScale(init=8.0, growth_interval=2))
    b.load_state_dict(a.state_dict())
    a.update(False)
    b.update(False)
    assert a.state_dict() == b.state_dict() == {"scale": 16.0, "clean_steps": 0, "skipped": 0}
    with pytest.raises(ConfigError, match="float32's range"):
        LossScale(init=2.0**130)
    with pytest.raises(ConfigError, match="growth_interval"):
        LossScale(growth_interval=0)


def test_the_overflow_slot_counts_only_where_a_loss_is_scaled_and_not_forever() -> None:
    from types import SimpleNamespace
    from typing import Any

    from unbroken.errors import Suspicion
    from unbroken.train.step import StepProtocol, Tally

    def protocol(scale: ScaleState | None) -> Any:
        p = StepProtocol.__new__(StepProtocol)
        p.node = SimpleNamespace(scale=scale)  # type: ignore[assignment]
        return p

    overflowed, clean = Tally(3, 12, 0, 1.0, 1), Tally(3, 12, 0, 1.0, 0)
    assert protocol(None).check_overflow(clean, 4) is False
    assert protocol(ScaleState(LossScale(init=8.0))).check_overflow(overflowed, 4) is True
    with pytest.raises(Suspicion, match="scales no loss"):
        protocol(None).check_overflow(overflowed, 4)
    broken = ScaleState(LossScale(init=8.0))
    for _ in range(MAX_SKIPS):
        assert broken.may_skip
        broken.update(True)
    with pytest.raises(Suspicion, match="32 steps in a row"):
        protocol(broken).check_overflow(overflowed, 4)
    broken.update(False)
    assert broken.may_skip and broken.scale == 2.0**-24  # the floor
