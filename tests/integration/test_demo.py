"""The quick start's main command, shortened: it must finish with agreeing replicas."""

from __future__ import annotations

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
