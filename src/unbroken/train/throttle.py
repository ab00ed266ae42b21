"""Emulated slow devices (`unbroken node --throttle`): heterogeneous groups on one machine.

``--throttle 0.25`` makes a node compute at a quarter of its speed: after each forward and
backward pass that took ``t`` seconds it idles ``t * (1/0.25 - 1)`` more, so its measured
throughput, its step time and the plan built on them are those of a 4x slower device
(without the CPU contention a busy loop would add to the other nodes on the machine).
A schedule changes the speed at given steps, deterministically::

    --throttle 0.25                # a quarter of its speed, throughout
    --throttle 1,40:0.25,80:1      # full speed; a quarter from step 40; full again from step 80
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.errors import ConfigError


@dataclass(frozen=True)
class Throttle:
    """Speed factors by step: ``schedule`` is ``((from_step, factor), ...)`` in step order."""

    schedule: tuple[tuple[int, float], ...] = ((0, 1.0),)

    def __post_init__(self) -> None:
        steps = [s for s, _ in self.schedule]
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            raise ConfigError(f"throttle schedule {self.schedule} must list each step once, in order")
        for _, f in self.schedule:
            if not 0 < f <= 1:
                raise ConfigError(f"throttle factor {f!r} must be greater than 0 and at most 1 (1 = full speed)")

    def factor(self, step: int) -> float:
        current = 1.0
        for start, f in self.schedule:
            if step >= start:
                current = f
        return current

    @property
    def active(self) -> bool:
        return any(f < 1 for _, f in self.schedule)

    def stretch(self, elapsed_s: float, step: int, touch: Callable[[], None] = lambda: None) -> float:
        """Idle so that ``elapsed_s`` of work takes as long as on the emulated device; returns the idle time."""
        extra = elapsed_s * (1 / self.factor(step) - 1)
        end = time.monotonic() + extra
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
            touch()
        return max(extra, 0.0)


def parse_throttle(text: str) -> Throttle:
    """Parse ``F`` or ``F,STEP:F,...`` (see the module docstring)."""
    text = text.strip()
    if not text:
        return Throttle()
    schedule: list[tuple[int, float]] = []
    for i, part in enumerate(text.split(",")):
        step_s, sep, factor_s = part.strip().rpartition(":")
        try:
            step = int(step_s) if sep else 0
            factor = float(factor_s)
        except ValueError:
            raise ConfigError(
                f"--throttle {text!r}: {part!r} is not FACTOR or STEP:FACTOR (e.g. 0.25 or 1,40:0.25,80:1)"
            ) from None
        if i == 0 and sep and step != 0:
            schedule.append((0, 1.0))
        if step < 0:
            raise ConfigError(f"--throttle {text!r}: step {step} must be non-negative")
        schedule.append((step, factor))
    return Throttle(tuple(schedule))
