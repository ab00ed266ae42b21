"""A short chaos soak in CI: random kills, freezes, leaves, joins and coordinator restarts for
about 50 s (at least 10 faults), then every promise is checked by `unbroken chaos` itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(420)


def test_chaos_soak_keeps_every_promise(tmp_path):
    cmd = [sys.executable, "-m", "unbroken", "chaos", "--duration", "50", "--rate", "0.45", "--seed", "2"]
    r = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=400)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, summary["problems"][:10]
    assert summary["faults_total"] >= 10, summary["faults"]
    assert summary["steps_lost"] == 0
    assert summary["replicas_equal_and_exactly_once"]
    assert summary["final_vs_reference_max_abs_diff"] <= 1e-5
    assert (tmp_path / "chaos-report.json").exists()
