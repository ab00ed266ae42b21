"""What the dashboard plots: the job's curves, kept at the coordinator from the nodes' reports.

Every trainer reports the group's loss and rate after its commits (a few times a second);
one point per committed step is kept (the first report of it), plus each node's own rate.
Bounded: a long run keeps its last ``MAX_POINTS`` steps at full resolution and every
``k``-th step before them, so a day-long curve still fits in a page.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

MAX_POINTS = 4000
"""Steps kept at full resolution."""
COARSE_EVERY = 10
"""Older steps: one kept in this many."""


@dataclass(frozen=True)
class Point:
    step: int
    time: float
    """Wall-clock time of the report (seconds since the epoch)."""
    loss: float | None
    """The group's training loss at this step (None: not finite)."""
    samples_per_s: float
    """The group's throughput (global batch / step time) as its reporter measured it."""
    members: int
    epoch: int


class History:
    """The job's step series and each node's throughput series."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self._recent: deque[Point] = deque()
        self._old: list[Point] = []
        self._last_step = -1
        self.nodes: dict[str, deque[tuple[float, float]]] = {}
        """Per node name: (wall time, its own samples/s) pairs, the last ``max_points``."""

    def add(self, step: int, wall_time: float, loss: float, samples_per_s: float, members: int, epoch: int) -> bool:
        """Record a committed step; False when it is not new (another node reported it)."""
        if step <= self._last_step:
            return False
        self._last_step = step
        self._recent.append(
            Point(step, wall_time, loss if math.isfinite(loss) else None, samples_per_s, members, epoch)
        )
        while len(self._recent) > self.max_points:
            old = self._recent.popleft()
            if old.step % COARSE_EVERY == 0:
                self._old.append(old)
        return True

    def add_node(self, name: str, wall_time: float, samples_per_s: float) -> None:
        series = self.nodes.setdefault(name, deque(maxlen=self.max_points))
        series.append((wall_time, samples_per_s))

    def points(self, since_step: int = -1) -> list[Point]:
        return [p for p in (*self._old, *self._recent) if p.step > since_step]

    def step_rate(self, window_s: float = 10.0) -> float:
        """Committed steps per second over the last ``window_s`` seconds of reports."""
        if len(self._recent) < 2:
            return 0.0
        last = self._recent[-1]
        first = next((p for p in self._recent if p.time >= last.time - window_s), self._recent[0])
        dt = last.time - first.time
        return (last.step - first.step) / dt if dt > 0 else 0.0

    def to_json(self, since_step: int = -1) -> dict[str, Any]:
        return {
            "points": [asdict(p) for p in self.points(since_step)],
            "step_rate": self.step_rate(),
            "nodes": {name: list(series)[-200:] for name, series in self.nodes.items()},
        }
