"""Straggler detection: robust statistics over the trainers' recent step times.

With a balanced plan every trainer's compute time per step is about the same; a trainer
whose recent median is well above the group's is a straggler (load from another process,
thermal throttling, a shared GPU). Medians, not means, so one slow step (a page fault, a
garbage collection) is not a straggler.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence

MIN_SAMPLES = 3
"""Step times a trainer must have reported before it is judged; its median over its last
this many is what is judged (one outlier is ignored, a lasting change shows in two steps)."""
RATIO = 1.5
"""A straggler's median compute time is at least this many times the group's median."""
MAD_Z = 3.0
"""...and this many scaled median absolute deviations above it, when the group has spread..."""
MATTERS = 0.25
"""...and its excess is at least this fraction of the whole step (the all-reduce included):
a few milliseconds late in a step that mostly waits on the network hold nobody up."""


def _median_without(ordered: Sequence[float], value: float) -> float:
    """The median of ``ordered`` (sorted) with one element equal to ``value`` taken out."""
    i = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def find_stragglers(
    times: Mapping[str, Sequence[float]],
    expected: Mapping[str, float],
    overhead_s: float = 0.0,
    shares: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Trainers whose recent compute times stand out, each with the reason.

    ``times`` holds each trainer's recent compute times per step (seconds); ``expected``
    the plan's prediction for each (its share at the speed it had when the plan was made);
    ``overhead_s`` the part of a step outside compute; ``shares`` each trainer's samples per
    step, when the plan gave them unequal ones. A trainer is a straggler when it is slow
    against both its prediction and its peers (the median of the others, and their median
    absolute deviation from it), by enough to matter for the step.

    With ``shares`` peers are compared per sample: a plan made on start-up estimates can give
    one node most of the batch, and its longer step is then the plan's doing, not the
    node's. Whether it matters is judged on the step, which lasts as long as the slowest
    peer's: a node done before them holds nobody up, however slow it is per sample.

    O(N log N) for N trainers: a median without one element is read off the sorted list,
    and the peers' median takes at most three values, each with its sorted deviations.
    """
    medians = {
        k: statistics.median(list(v)[-MIN_SAMPLES:])
        for k, v in times.items()
        if len(v) >= MIN_SAMPLES and (shares is None or shares.get(k, 0) > 0)
    }
    rates = {k: med / shares[k] for k, med in medians.items()} if shares is not None else medians
    ordered = sorted(medians.values())
    ordered_rates = sorted(rates.values())
    deviations: dict[float, list[float]] = {}
    out = {}
    for name, med in medians.items():
        predicted = expected.get(name, 0.0)
        if predicted > 0 and med < RATIO * predicted:
            continue  # as fast as the plan expects: any difference is the plan's
        if len(ordered) < 2:
            if predicted <= 0:
                continue
            baseline = step = predicted
            against = f"{baseline * 1e3:.1f} ms planned"
        else:
            rate = rates[name]
            base_rate = _median_without(ordered_rates, rate)
            around = deviations.get(base_rate)
            if around is None:
                around = deviations[base_rate] = sorted(abs(x - base_rate) for x in ordered_rates)
            spread = _median_without(around, abs(rate - base_rate)) * 1.4826
            if rate < RATIO * base_rate or (spread > 0 and rate - base_rate < MAD_Z * spread):
                continue
            if shares is None:
                baseline = step = _median_without(ordered, med)
                against = f"{baseline * 1e3:.1f} ms peers' median"
            else:
                # Its share at its peers' speed; the step lasts as long as its slowest peer's.
                baseline = base_rate * shares[name]
                step = ordered[-1] if ordered[-1] != med else ordered[-2]
                against = (
                    f"{baseline * 1e3:.1f} ms at its peers' speed ({rate * 1e3:.2f} ms/sample for "
                    f"{shares[name]} samples vs {base_rate * 1e3:.2f} ms peers' median)"
                )
        if med - baseline < MATTERS * (step + overhead_s):
            continue  # a few ms late in a step that mostly waits on others or the network
        out[name] = (
            f"compute {med * 1e3:.1f} ms/step over its last {MIN_SAMPLES} steps vs "
            f"{against} ({med / max(baseline, 1e-12):.1f}x)"
        )
    return out
