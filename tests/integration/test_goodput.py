"""A short run of bench/goodput.py: unbroken (one of its processes a hot spare) and plain
DDP under one seeded schedule of kills, stops, leaves and joins. The figures come from the
benchmark itself; this checks that every fault kind reaches a real job, that the spare takes
a lost trainer's place, that the promises hold over its log, that the JSON it hands on (its
last line, and the results file) says so, and that each fault's cost (read from the commit
timeline) is there and adds up to what the window lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
SEED = 28
"""Its schedule at one fault every 4 s: kill, stop, join, kill, join, term, term, term in 16 s;
the first kill hits the second of the three processes, a trainer (the third is the spare)."""


def test_a_short_goodput_run_keeps_the_promises_under_every_fault_kind_where_plain_ddp_stops(tmp_path):
    out = tmp_path / "goodput.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "goodput.py"), "--systems", "unbroken,ddp", "--rates", "4",
         "--window", "16", "--free-window", "5", "--seed", str(SEED), "--spares", "1", "--json", str(out), "--plot", "",
         "--workdir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert last["promises_kept"] is True, run.stdout[-3000:]
    assert last["failures"] >= 3, last  # a fault passed over (the last trainer) is not counted
    ours, ddp = last["goodput"], last["baselines"]["ddp"]
    # Honest margins on a busy machine: plain DDP is dead within a second of the window's
    # 16; unbroken trains through all of it, however slowly its replacements start.
    assert 0 <= ddp < 0.35, last
    assert ours > ddp, last
    results = json.loads(out.read_text())
    assert results["rates"] == [4.0] and results["ours"] == [ours], results
    assert results["baselines"] == {"ddp": [ddp]}, results
    assert results["command"].startswith("python ") and results["date"], results
    # The spare took the killed trainer's place: the coordinator said so after a loss.
    assert results["spares"] == 1 and results["promotions_s"]["unbroken"]["4"], results
    assert set(last["samples_per_s"]) == {"unbroken", "ddp"}, last
    assert "Where the time goes" in run.stdout
    # Each fault applied has its cost, and the costs account for every second the window lost.
    costs = results["fault_costs"]["unbroken"]["4"]
    assert sorted(c["kind"] for c in costs["faults"]) == sorted(k for k, n in last["faults"].items() for _ in range(n))
    lost = sum(c["lost_s"] for c in costs["faults"]) + costs["lost_unowned_s"]
    assert lost == pytest.approx(16 * (1 - ours), abs=0.1), costs
    # A killed or leaving node is in effect until its replacement (started a second later) commits.
    gone = [c for c in costs["faults"] if c["kind"] in ("kill", "term")]
    assert gone and all(c["effect_s"] > 1.0 for c in gone), costs
    assert "What each kind of fault cost" in run.stdout
    assert results["load"]["start"] and results["machine"]["cores"], results
