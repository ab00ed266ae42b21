"""unbroken: training that does not stop.

Train one PyTorch model on many unreliable, unequal machines; keep going while they crash,
hang, leave and join, with no lost, repeated or diverging step. See DESIGN.md for the
promises and README.md for the quick start.
"""

from unbroken.config import CoordinatorConfig, NodeConfig
from unbroken.control.coordinator import Coordinator
from unbroken.errors import (
    AuditMismatch,
    BadContribution,
    CollectiveFailed,
    ConfigError,
    CoordinatorUnreachable,
    EpochAborted,
    EtcdUnavailable,
    Expelled,
    JobLoadError,
    JoinRefused,
    ProtocolError,
    TransferError,
    UnbrokenError,
)
from unbroken.job import Job, load_job
from unbroken.train.runtime import Node, NodeResult, run_node

__all__ = [
    "AuditMismatch",
    "BadContribution",
    "CollectiveFailed",
    "ConfigError",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorUnreachable",
    "EpochAborted",
    "EtcdUnavailable",
    "Expelled",
    "Job",
    "JobLoadError",
    "JoinRefused",
    "Node",
    "NodeConfig",
    "NodeResult",
    "ProtocolError",
    "TransferError",
    "UnbrokenError",
    "load_job",
    "run_node",
]

__version__ = "0.1.0"
