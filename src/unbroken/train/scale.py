"""Dynamic loss scaling for float16, as the training loop takes them: defined with the job that
describes it (`unbroken.job`), which the training loop builds on: the job imports nothing of
train."""

from unbroken.job.scale import (
    KEY,
    MAX_SKIPS,
    MIN_SCALE,
    LossScale,
    ScaleState,
)

__all__ = [
    "KEY",
    "MAX_SKIPS",
    "MIN_SCALE",
    "LossScale",
    "ScaleState",
]
