"""`integration.helpers.slowdown`: the factor by which tests stretch an idle machine's time bounds."""

from __future__ import annotations

import os
import subprocess
import sys

from integration.helpers import slowdown


def test_cpu_bound_neighbours_stretch_the_bounds():
    cores = len(os.sched_getaffinity(0))
    assert slowdown() >= 1.0
    # Two busy processes per core: this process gets a third of one at best.
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores)]
    try:
        measured = slowdown(sample_s=0.3)
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait(10)
    assert measured >= 2.0, measured
