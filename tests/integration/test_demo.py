"""The quick start's main command, shortened: it must finish with agreeing replicas."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def test_demo_survives_its_kill_and_ends_with_identical_replicas(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--steps", "150", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "SIGKILL node-2" in out
    assert "150 / 150" in out
    assert "faults survived" in out and "node-2: control connection dropped" in out
    assert "replicas bit-identical" in out and "│ yes" in out
    assert "heldout bits per char" in out


def test_ha_demo_survives_the_leaders_kill_and_a_nodes(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--ha", "--steps", "400", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "SIGKILL the leading coordinator" in out and "SIGKILL node-2" in out
    assert "400 / 400" in out
    assert "leader SIGKILL -> a standby leads" in out and "the killed one led term" in out
    assert "kill -> survivors' next commit" in out
    assert "replicas bit-identical" in out and "│ yes" in out
