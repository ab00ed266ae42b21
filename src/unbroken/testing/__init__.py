"""Testing aids shipped with unbroken: fault injection, a local cluster, promise checks.

The library never imports this package; the CLI (``--fault``) and tests do. Its names load
on first use, so ``unbroken node --fault`` does not start the cluster harness.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.testing.cluster import LocalCluster, NodeProcess
    from unbroken.testing.etcd import EtcdCluster
    from unbroken.testing.faults import Fault, FaultPlan, parse_faults
    from unbroken.testing.inmemory import Crash, MemoryJob
    from unbroken.testing.promises import PromiseReport, check_promises, reference_state
    from unbroken.train.throttle import Throttle, parse_throttle

_LAZY = {
    "Crash": "unbroken.testing.inmemory",
    "EtcdCluster": "unbroken.testing.etcd",
    "Fault": "unbroken.testing.faults",
    "FaultPlan": "unbroken.testing.faults",
    "LocalCluster": "unbroken.testing.cluster",
    "MemoryJob": "unbroken.testing.inmemory",
    "NodeProcess": "unbroken.testing.cluster",
    "PromiseReport": "unbroken.testing.promises",
    "Throttle": "unbroken.train.throttle",
    "check_promises": "unbroken.testing.promises",
    "parse_faults": "unbroken.testing.faults",
    "parse_throttle": "unbroken.train.throttle",
    "reference_state": "unbroken.testing.promises",
}

__all__ = [
    "Crash",
    "EtcdCluster",
    "Fault",
    "FaultPlan",
    "LocalCluster",
    "MemoryJob",
    "NodeProcess",
    "PromiseReport",
    "Throttle",
    "check_promises",
    "parse_faults",
    "parse_throttle",
    "reference_state",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unbroken.testing' has no attribute {name!r}")
