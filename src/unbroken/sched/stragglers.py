"""Straggler detection: robust statistics over the trainers' recent step times.

With a balanced plan every trainer's compute time per step is about the same; a trainer
whose recent median is well above the group's is a straggler (load from another process,
thermal throttling, a shared GPU). Medians, not means, so one slow step (a page fault, a
garbage collection) is not a straggler.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

MIN_SAMPLES = 3
"""Step times a trainer must have reported before it is judged; its median over its last
this many is what is judged (one outlier is ignored, a lasting change shows in two steps)."""
RATIO = 1.5
"""A straggler's median compute time is at least this many times the group's median."""
MAD_Z = 3.0
"""...and this many scaled median absolute deviations above it, when the group has spread."""


def find_stragglers(times: Mapping[str, Sequence[float]], expected: Mapping[str, float]) -> dict[str, str]:
    """Trainers whose recent compute times stand out, each with the reason.

    ``times`` holds each trainer's recent compute times per step (seconds); ``expected``
    the plan's prediction for each (its share at the speed it had when the plan was made).
    A trainer is a straggler when it is slow against both its prediction and its peers.
    """
    medians = {k: statistics.median(list(v)[-MIN_SAMPLES:]) for k, v in times.items() if len(v) >= MIN_SAMPLES}
    out = {}
    for name, med in medians.items():
        others = [v for k, v in medians.items() if k != name]
        predicted = expected.get(name, 0.0)
        if predicted > 0 and med < RATIO * predicted:
            continue  # as fast as the plan expects: any difference is the plan's
        if not others:
            if predicted <= 0:
                continue
            baseline, against = predicted, "planned"
        else:
            baseline, against = statistics.median(others), "peers' median"
            spread = statistics.median(abs(x - baseline) for x in others) * 1.4826
            if med < RATIO * baseline or (spread > 0 and med - baseline < MAD_Z * spread):
                continue
        out[name] = (
            f"compute {med * 1e3:.1f} ms/step over its last {MIN_SAMPLES} steps vs "
            f"{baseline * 1e3:.1f} ms {against} ({med / max(baseline, 1e-12):.1f}x)"
        )
    return out
