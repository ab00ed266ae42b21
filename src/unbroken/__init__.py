"""unbroken: training that does not stop.

Train one PyTorch model on many unreliable, unequal machines; keep going while they crash,
hang, leave and join, with no lost, repeated or diverging step. See docs/design.md for the
promises and README.md for the quick start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from unbroken.config import CoordinatorConfig, MembershipConfig, NodeConfig, ServiceConfig
from unbroken.errors import (
    AuditMismatch,
    BadContribution,
    BadRequest,
    CollectiveFailed,
    ConfigError,
    CoordinatorUnreachable,
    EpochAborted,
    EtcdUnavailable,
    Expelled,
    JobFailed,
    JobHalted,
    JobLoadError,
    JoinRefused,
    NcclRefused,
    NotFinal,
    ProtocolError,
    RangesAbsent,
    Suspicion,
    TransferError,
    UnbrokenError,
    Unreachable,
)
from unbroken.specs import CodecSpec, DiLoCoPolicy, Policy

if TYPE_CHECKING:
    from unbroken.control.coordinator import Coordinator
    from unbroken.job import Job, Sharding, load_job
    from unbroken.swarm import Swarm, join
    from unbroken.train.data import LoaderOrder
    from unbroken.train.runtime import Node, NodeResult, run_node
    from unbroken.train.step import Slice, StepProtocol

_LAZY = {
    "Coordinator": "unbroken.control.coordinator",
    "Job": "unbroken.job",
    "load_job": "unbroken.job",
    "Sharding": "unbroken.job",
    "join": "unbroken.swarm",
    "Swarm": "unbroken.swarm",
    "LoaderOrder": "unbroken.train.data",
    "Slice": "unbroken.train.step",
    "StepProtocol": "unbroken.train.step",
    "Node": "unbroken.train.runtime",
    "NodeResult": "unbroken.train.runtime",
    "run_node": "unbroken.train.runtime",
}


def __getattr__(name: str) -> Any:
    """What needs torch is imported when first used: a relay or `unbroken status` starts
    in a fraction of a second and a fraction of the memory."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")


__all__ = [
    "AuditMismatch",
    "BadContribution",
    "BadRequest",
    "CodecSpec",
    "CollectiveFailed",
    "ConfigError",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorUnreachable",
    "DiLoCoPolicy",
    "EpochAborted",
    "EtcdUnavailable",
    "Expelled",
    "Job",
    "JobFailed",
    "JobHalted",
    "JobLoadError",
    "JoinRefused",
    "LoaderOrder",
    "MembershipConfig",
    "NcclRefused",
    "Node",
    "NodeConfig",
    "NodeResult",
    "NotFinal",
    "Policy",
    "ProtocolError",
    "RangesAbsent",
    "ServiceConfig",
    "Sharding",
    "Slice",
    "StepProtocol",
    "Suspicion",
    "Swarm",
    "TransferError",
    "UnbrokenError",
    "Unreachable",
    "join",
    "load_job",
    "run_node",
]

__version__ = "0.1.0"
