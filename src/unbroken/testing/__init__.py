"""Testing aids shipped with unbroken: fault injection, a local cluster, promise checks."""

from unbroken.testing.cluster import LocalCluster, NodeProcess
from unbroken.testing.faults import Fault, parse_faults
from unbroken.testing.promises import PromiseReport, check_promises, reference_state

__all__ = [
    "Fault",
    "LocalCluster",
    "NodeProcess",
    "PromiseReport",
    "check_promises",
    "parse_faults",
    "reference_state",
]
