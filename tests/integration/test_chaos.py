"""A short chaos soak in CI: random kills, freezes, leaves, joins, leader kills and freezes
and etcd member kills (a real 3-member etcd cluster, two coordinators) and, where network
namespaces work (root), cut and slowed links, for about 40 s (at least 10 faults); then
every promise is checked by `unbroken chaos` itself. The single coordinator's restart is
covered by tests/integration/test_faults.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from unbroken.testing import netns

pytestmark = pytest.mark.timeout(420)


# In the parallel phase: its checks are promises and counts, not timings (beside two
# CPU-bound processes at load 9-10 it injected 17 faults, 7 of them to the leader or etcd).
def test_chaos_soak_keeps_every_promise(tmp_path):
    cmd = [sys.executable, "-m", "unbroken", "chaos", "--ha", "--duration", "40", "--rate", "0.55", "--seed", "24"]
    with subprocess.Popen([*cmd, "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        try:
            out, err = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            p.terminate()  # not SIGKILL: the soak reaps its nodes and deletes its namespaces on SIGTERM
            out, err = p.communicate(timeout=60)
            pytest.fail(f"the chaos soak ran past 400 s:\n{err.decode(errors='replace')[-3000:]}")
    lines = out.decode().strip().splitlines()
    assert lines, f"the chaos soak printed no summary (exit {p.returncode}):\n{err.decode(errors='replace')[-5000:]}"
    summary = json.loads(lines[-1])
    assert p.returncode == 0, summary["problems"][:10]
    assert summary["faults_total"] >= 10, summary["faults"]
    ha = sum(summary["faults"].get(k, 0) for k in ("leader-kill", "leader-stop", "etcd-kill"))
    assert ha >= 2, summary["faults"]
    assert summary["steps_lost"] == 0
    assert summary["replicas_equal_and_exactly_once"]
    assert summary["final_vs_reference_max_abs_diff"] <= 1e-5
    assert (tmp_path / "chaos-report.json").exists()
    if netns.available():
        assert summary["link_faults"].startswith("injected"), summary["link_faults"]
        assert summary["faults"].get("cut", 0) + summary["faults"].get("slow", 0) >= 1, summary["faults"]
    else:
        assert summary["link_faults"].startswith("skipped"), summary["link_faults"]
