"""A node process reuses the large tensors it frees instead of faulting in fresh pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, torch
from unbroken.train.memory import keep_freed_memory
kept = keep_freed_memory()
for _ in range(2):  # the heap settles: its first two blocks of this size are new
    x = torch.ones(16 * 2**20)  # 64 MB: over glibc's largest threshold for a mapping of its own
    del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    x = torch.ones(16 * 2**20)
    del x
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    kept, count = out.stdout.split()
    return kept == "True", int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_large_tensor_freed_and_allocated_again_faults_no_fresh_pages_unless_malloc_is_left_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_MALLOC"}
    kept, count = faults(env)
    assert kept and count < 2_000, f"{count} page faults for 3 x 64 MB allocated again"
    kept, count = faults(env | {"UNBROKEN_MALLOC": "system"})
    assert not kept and count >= 3 * 16_000, f"only {count} page faults: each 64 MB is mapped afresh by default"
