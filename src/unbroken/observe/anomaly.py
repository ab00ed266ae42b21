"""Anomalies, each with the figures that explain it.

Pure and fed by the coordinator (reports in, anomalies out; the clock is passed in):

- ``loss-nan``: the group's loss is not finite;
- ``loss-spike``: the loss jumps far above its recent level (``SPIKE_RATIO`` x the median
  of the last ``WINDOW`` steps, and ``SPIKE_MADS`` scaled deviations above it);
- ``throughput-collapse``: the group's rate over the last ``RECENT`` steps falls below
  ``COLLAPSE_RATIO`` of its rate over the ``BASELINE`` steps before (re-armed once it is
  back above ``RECOVERED_RATIO``);
- ``flapping``: a node (by name) fails ``FLAP_COUNT`` times within ``FLAP_WINDOW_S``.

Stragglers are found by the plan's review (`unbroken.sched.stragglers`) and reported as
``straggler`` events already. Each kind is reported once, then not again for a window, so a
sick job does not drown its event log.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from unbroken.events import Kind

WINDOW = 20
SPIKE_RATIO = 3.0
SPIKE_MADS = 6.0
RECENT = 5
BASELINE = 30
COLLAPSE_RATIO = 0.3
RECOVERED_RATIO = 0.6
FLAP_COUNT = 3
FLAP_WINDOW_S = 120.0


@dataclass(frozen=True)
class Anomaly:
    kind: Kind
    member: str | None
    """The node's name, for node anomalies."""
    reason: str
    step: int | None = None
    """The committed step it was seen at (None: the group's, when it is recorded)."""


class Detector:
    def __init__(self) -> None:
        self._losses: deque[float] = deque(maxlen=WINDOW)
        self._quiet_until: dict[Kind, int] = {}
        self._rates: deque[tuple[int, float, int]] = deque(maxlen=RECENT + BASELINE)
        self._collapsed = False
        self._failures: dict[str, deque[float]] = {}
        self._flapping: dict[str, float] = {}

    def loss(self, step: int, loss: float) -> list[Anomaly]:
        """A committed step's loss."""
        out: list[Anomaly] = []
        if not math.isfinite(loss):
            if self._quiet(Kind.LOSS_NAN, step):
                out.append(Anomaly(Kind.LOSS_NAN, None, f"the loss at step {step} is {loss}", step))
            return out
        if len(self._losses) >= WINDOW // 2:
            typical = statistics.median(self._losses)
            mad = statistics.median(abs(x - typical) for x in self._losses) * 1.4826
            if (
                loss > SPIKE_RATIO * typical
                and loss > typical + SPIKE_MADS * mad
                and self._quiet(Kind.LOSS_SPIKE, step)
            ):
                out.append(
                    Anomaly(
                        Kind.LOSS_SPIKE,
                        None,
                        f"the loss jumped to {loss:.4g} at step {step}: {loss / typical:.1f}x the median "
                        f"{typical:.4g} of the last {len(self._losses)} steps",
                        step,
                    )
                )
        self._losses.append(loss)
        return out

    def throughput(self, step: int, samples_per_s: float, members: int) -> list[Anomaly]:
        """The group's rate as reported with a committed step."""
        self._rates.append((step, samples_per_s, members))
        if len(self._rates) < RECENT + BASELINE:
            return []
        rates = list(self._rates)
        before = statistics.median(r for _, r, _ in rates[:BASELINE])
        now = statistics.median(r for _, r, _ in rates[BASELINE:])
        if before <= 0:
            return []
        if self._collapsed:
            self._collapsed = now < RECOVERED_RATIO * before
            return []
        if now >= COLLAPSE_RATIO * before:
            return []
        self._collapsed = True
        was, are = rates[BASELINE - 1][2], rates[-1][2]
        who = f"; members {was} -> {are}" if was != are else f"; still {are} members"
        return [
            Anomaly(
                Kind.THROUGHPUT_COLLAPSE,
                None,
                f"throughput fell to {now:.4g} samples/s over the last {RECENT} steps from {before:.4g} "
                f"({now / before:.0%}) by step {step}{who}",
                step,
            )
        ]

    def failure(self, name: str, now: float, cause: str) -> list[Anomaly]:
        """A node failed (crash, hang, cut link: anything but a graceful leave)."""
        times = self._failures.setdefault(name, deque(maxlen=FLAP_COUNT))
        times.append(now)
        if len(times) < FLAP_COUNT or now - times[0] > FLAP_WINDOW_S:
            return []
        if now - self._flapping.get(name, -math.inf) < FLAP_WINDOW_S:
            return []
        self._flapping[name] = now
        return [
            Anomaly(
                Kind.FLAPPING,
                name,
                f"{name} failed {FLAP_COUNT} times in {now - times[0]:.0f} s, rejoining in between "
                f"(last: {cause}); check its machine, or keep it out until fixed",
            )
        ]

    def _quiet(self, kind: Kind, step: int) -> bool:
        """True (and silence the kind for a window) unless it was reported just now."""
        if step < self._quiet_until.get(kind, -1):
            return False
        self._quiet_until[kind] = step + WINDOW
        return True
