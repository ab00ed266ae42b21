from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from unbroken.testing import LocalCluster

JOB = str(Path(__file__).parent / "jobs" / "mlp.py") + ":job"

# One intra-op thread, as each node has (the warm parents set OMP_NUM_THREADS=1): a test's
# own torch work (single-process references) gains nothing from a second thread on small
# tensors, which only spins (a reference run: 6.2 s of CPU with 2, 3.7 s with 1, same wall).
# The processes a test starts itself inherit it (a plain script's reference, `unbroken
# demo`, `verify`, `chaos`): beside other work the spinning costs far more than it did alone
# (40 steps of examples/plain_loop.py side by side at a load of 9: 49.1 s with 2, 22.0 s with 1).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


@pytest.fixture
def arenas_laid(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads on which whole-file checkpoint buffers are laid out (`state.checkpoint._Arena`), in order."""
    from unbroken.state import checkpoint

    laid: list[str] = []
    real = checkpoint._Arena.__init__

    def arena(self: Any, header: Any) -> None:
        laid.append(threading.current_thread().name)
        real(self, header)

    monkeypatch.setattr(checkpoint._Arena, "__init__", arena)
    return laid
