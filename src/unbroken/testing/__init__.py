"""Testing aids shipped with unbroken: fault injection, a local cluster, promise checks."""

from unbroken.testing.cluster import LocalCluster, NodeProcess
from unbroken.testing.etcd import EtcdCluster
from unbroken.testing.faults import Fault, parse_faults
from unbroken.testing.promises import PromiseReport, check_promises, reference_state
from unbroken.testing.throttle import Throttle, parse_throttle

__all__ = [
    "EtcdCluster",
    "Fault",
    "LocalCluster",
    "NodeProcess",
    "PromiseReport",
    "Throttle",
    "check_promises",
    "parse_faults",
    "parse_throttle",
    "reference_state",
]
