"""The sync phase's decisions (who holds the group's state, who fetches it, audits), as the
training loop takes them: defined in `unbroken.state`, beside the peer transfer that acts on
them (`comm.transfer`): comm imports nothing of train."""

from unbroken.state.sync import (
    Standing,
    SyncPlan,
    audit,
    diverged,
    floored,
    plan_sync,
)

__all__ = [
    "Standing",
    "SyncPlan",
    "audit",
    "diverged",
    "floored",
    "plan_sync",
]
