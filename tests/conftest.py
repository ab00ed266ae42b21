from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from unbroken.testing import LocalCluster

JOB = str(Path(__file__).parent / "jobs" / "mlp.py") + ":job"


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[object]:
    """Build local clusters that are always reaped, even when the test fails."""
    clusters: list[LocalCluster] = []

    def make(**kwargs: object) -> LocalCluster:
        # Nodes fork from a parent that imported torch once; a test that times a cold start
        # passes warm=False.
        kwargs.setdefault("warm", True)
        c = LocalCluster(kwargs.pop("job", JOB), tmp_path / f"cluster{len(clusters)}", **kwargs)  # type: ignore[arg-type]
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.close()
