"""Dynamic loss scaling for float16 mixed precision, for a whole group at once.

``torch.amp.GradScaler`` scales the loss so small float16 gradients do not flush to zero,
skips the optimizer step when a gradient overflowed, and halves the scale (doubling it again
after ``growth_interval`` clean steps). Across nodes the decision must be the group's, not
each node's: a node whose slice overflowed contributes a zero gradient and raises the
overflow slot of the step's all-reduce (`train.step`), so every replica skips that update
and moves its scale the same way. The step still commits: its samples are used (as a
skipped step's batch is in a plain loop), and the scheduler steps.

The scale is replicated state: digested, sent to joiners and checkpointed with the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unbroken.errors import ConfigError

KEY = "unbroken.loss_scale"
"""Its name among the replicated extra state (`TrainState.extra`)."""
MAX_SKIPS = 32
"""Overflowed steps in a row after which an overflow is no longer believed: the scale has
fallen 2**32-fold, and a member whose gradient is still not finite is broken (or lying)."""
MIN_SCALE = 2.0**-24


@dataclass(frozen=True)
class LossScale:
    """How the scale moves; the defaults are ``torch.amp.GradScaler``'s."""

    init: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not MIN_SCALE <= self.init < 2.0**127:
            raise ConfigError(f"LossScale.init = {self.init} must lie in [2**-24, 2**127) (float32's range)")
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError("LossScale: growth_factor must be above 1, backoff_factor between 0 and 1")
        if self.growth_interval < 1:
            raise ConfigError(f"LossScale.growth_interval = {self.growth_interval} must be at least 1")

    @classmethod
    def like(cls, scaler: Any) -> LossScale:
        """The policy of a ``torch.amp.GradScaler`` (its scale, growth, backoff and interval)."""
        return cls(
            init=float(scaler.get_scale()),
            growth_factor=float(scaler.get_growth_factor()),
            backoff_factor=float(scaler.get_backoff_factor()),
            growth_interval=int(scaler.get_growth_interval()),
        )


class ScaleState:
    """The group's current scale (replicated: ``state_dict``/``load_state_dict``)."""

    def __init__(self, policy: LossScale) -> None:
        self.policy = policy
        self.scale = policy.init
        self.clean_steps = 0
        self.skipped = 0
        """Steps skipped in a row."""

    @property
    def may_skip(self) -> bool:
        """Whether the next overflow is believed (`MAX_SKIPS`)."""
        return self.skipped < MAX_SKIPS

    def update(self, overflow: bool) -> None:
        """After a committed step, on every replica alike."""
        if overflow:
            self.scale = max(MIN_SCALE, self.scale * self.policy.backoff_factor)
            self.clean_steps = 0
            self.skipped += 1
            return
        self.skipped = 0
        self.clean_steps += 1
        if self.clean_steps == self.policy.growth_interval:
            self.scale = min(2.0**126, self.scale * self.policy.growth_factor)
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state.get("skipped", 0))
