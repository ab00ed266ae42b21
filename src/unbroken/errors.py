"""The exception tree of unbroken.

::

    UnbrokenError                      every error raised on purpose by this package
     ├── ConfigError                   a job or node setting is invalid (names the field)
     ├── JobLoadError                  `file.py:attr` / `module:attr` could not be loaded
     ├── JobFailed                     the job's own code (model, loss, data) raised: its traceback
     ├── CoordinatorUnreachable        no coordinator answered within the connect deadline
     ├── EtcdUnavailable               no member of the etcd cluster answered (or no majority)
     ├── JoinRefused                   the coordinator refused this node (names the reason)
     ├── JobHalted                     the group stopped the job on a failure it cannot train past
     │    └── RangesAbsent             ranges lost in every zone, none in a readable checkpoint
     ├── NotFinal                      the job finished without this node: its state is not the model
     ├── ProtocolError                 a control message was malformed or too large
     ├── EpochAborted                  the current epoch ended under us; form the next one
     │    └── Expelled                 the coordinator expelled this node (lease lost)
     ├── CollectiveFailed              a data-plane collective failed or ran past its deadline
     │    ├── BadContribution          a member's gradient was non-finite or far out of range
     │    │    └── AuditMismatch       a member's state differs from the majority's (corruption)
     │    ├── Suspicion                a step's sum did not add up, and cannot say whose part lied
     │    ├── Unreachable              a group build failed: a peer's data-plane address is unreachable
     │    └── NcclRefused              this member's own NCCL refused a group, whatever its peers did
     └── TransferError                 a state transfer was corrupt or incomplete
          └── BadRequest               a receiver asked for state that does not exist
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Where:
    """Where on a node an error happened: the epoch, the step being taken (the committed
    step + 1) and the node's rank in the epoch's group; None where it was not in one."""

    epoch: int | None = None
    step: int | None = None
    rank: int | None = None

    def __str__(self) -> str:
        parts = [f"{name} {value}" for name, value in vars(self).items() if value is not None]
        return ", ".join(parts)


class UnbrokenError(Exception):
    """Base class of every error unbroken raises on purpose; one raised on a node's data
    plane (a collective, a transfer) says where it happened (`Where`), in its message too."""

    where: Where | None = None

    def at(self, where: Where) -> UnbrokenError:
        """Say where (kept if it was said already, nearer the cause); returns the error."""
        if self.where is None or not str(self.where):
            self.where = where
        return self

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} [{self.where}]" if self.where is not None and str(self.where) else text


class ConfigError(UnbrokenError, ValueError):
    """A configuration value is invalid; the message names the field and the allowed range."""


class JobLoadError(UnbrokenError):
    """A job reference could not be imported or is not a `Job`."""


class JobFailed(UnbrokenError):
    """The job's own code (its model, loss, dataset or collate) raised; the message carries
    the original error and its traceback, so it is fixed where it is, not guessed at."""


class CoordinatorUnreachable(UnbrokenError):
    """No coordinator address answered within the connect deadline."""


class EtcdUnavailable(UnbrokenError):
    """No member of the etcd cluster answered, or the cluster has no majority; the message
    names every endpoint tried and what each said."""


class JoinRefused(UnbrokenError):
    """The coordinator refused to admit this node; the message says why and what to change."""


class JobHalted(UnbrokenError):
    """The group stopped the job: a failure training cannot go past (every member that
    computed a step refused for it, a divergence back after a repair, a rollback past its
    bound, no member left to train). The message names it; nothing is committed after it."""


class NotFinal(UnbrokenError):
    """The job finished while this node was not part of it (joining, benched, cut off): the
    state it holds is not the group's last committed one, so it must not pass for the model
    (the nodes that finished hold it: their ``--final-state``)."""

    def __init__(self, step: int) -> None:
        """``step``: the step of the state this node holds."""
        super().__init__(
            f"the job finished without this node: it holds the state of step {step}, not the group's final "
            "model (that is on the nodes that finished: their --final-state, or a checkpoint)"
        )
        self.step = step


class ProtocolError(UnbrokenError):
    """A control message was malformed, of an unknown version, or over the size limit."""


class EpochAborted(UnbrokenError):
    """The epoch this node was working in is over (failure, join or leave elsewhere)."""

    def __init__(self, reason: str, *, where: Where | None = None) -> None:
        """``where``: where this node was when it had to leave the epoch."""
        super().__init__(reason)
        self.reason = reason
        self.where = where

    def during(self, what: str) -> EpochAborted:
        """The same error, raised from inside ``what`` (a collective, a transfer)."""
        return type(self)(f"{what} abandoned: {self.reason}", where=self.where)


class Expelled(EpochAborted):
    """The coordinator expelled this node, usually because its heartbeat lease ran out."""


class CollectiveFailed(UnbrokenError):
    """A collective on the data plane failed (peer gone) or ran past its deadline."""


class BadContribution(CollectiveFailed):
    """A member contributed a non-finite or outlying gradient: the step is not applied."""

    def __init__(self, rank: int, reason: str, zone_only: bool = False) -> None:
        """``zone_only``: only the culprit's zone saw the evidence (a DiLoCo inner step)."""
        super().__init__(reason)
        self.rank = rank
        self.zone_only = zone_only


class Suspicion(CollectiveFailed):
    """The step's sum does not add up (not finite, larger than its parts' declared norms
    allow, or a norm slot that names someone no summed data can attribute): some member's
    contribution is not what it declared, and the sum cannot say whose. The step is not
    applied; the coordinator has the next steps gathered and checked row by row."""


class Unreachable(CollectiveFailed):
    """A group build failed, and this node could not connect to some peer's data-plane
    address: it said whom (the leader has the others try before benching anyone)."""


class NcclRefused(CollectiveFailed):
    """This member's own NCCL refused to form its zone's group, for a reason no peer has a
    part in (its device could not be set, the group's constructor, drawing rank 0's id):
    its reports say so, and its zone takes gloo while its members stay
    (`unbroken.train.shard_devices`). A peer's death, a connect or a deadline is a plain
    `CollectiveFailed`."""


class AuditMismatch(BadContribution):
    """A member's state digest differs from the majority's at the same committed step
    (silent corruption: a flipped bit); it is repaired from a peer in the next sync phase."""

    def __init__(self, rank: int, reason: str, rollback_to: int = -1) -> None:
        super().__init__(rank, reason)
        self.rollback_to = rollback_to
        """The step of the last audit that passed: where every member goes back to."""


class TransferError(UnbrokenError):
    """A peer-to-peer state transfer failed a checksum or ended early."""


class RangesAbsent(JobHalted):
    """No member of any zone holds some of a sharded job's current ranges, and no checkpoint
    every member can read holds them all. (The members first wait ``--absent-wait`` for a
    holder to rejoin, then go back to such a checkpoint where there is one:
    `unbroken.train.shard_fallback`.)"""


class BadRequest(TransferError):
    """A receiver asked a donor for more chunks than the state has, or for chunks it does not
    have: no honest node does, so the donor names it (``rank``) rather than retry forever."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(reason)
        self.rank = rank
