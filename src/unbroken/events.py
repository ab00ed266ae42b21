"""The job's events: one list of kinds, one record, one log that everything reads.

The coordinator records an `Event` for each decision of its membership (joins, failures,
epochs, roles, offences), for what a node reports (`REPORTED`: a checkpoint written, state
received, a DiLoCo round rolled back), for each anomaly its detector finds and for its own
leadership. `unbroken.observe.eventlog.EventLog.emit` numbers it, keeps the recent ones,
counts every kind and appends it to the event log file; the API behind the dashboard and `unbroken events`,
`/metrics` and the tests read those records (`Recorded`), never free strings.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class StrEnum(str, enum.Enum):
    """A str whose members print as their value (`enum.StrEnum` is Python 3.11+)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


@enum.unique
class Kind(StrEnum):
    # Membership: who is in, and the epochs they form.
    JOIN = "join"
    LEAVE = "leave"
    FAILURE = "failure"
    EPOCH = "epoch"
    ADOPT = "adopt"
    """A restarted coordinator rebuilt the epoch its members carried."""
    ROLE = "role"
    FINISHED = "finished"
    VALIDATION = "validation"
    LINKS = "links"
    """A zone leader's measured inter-zone rates."""
    FORWARDED = "forwarded"
    """Most of the others could not connect to a member: it is moved behind a forwarder
    (`unbroken.sched.nat.unreachable`)."""
    # Faults, offences and refusals (promise 8).
    FAULT = "fault"
    SUSPECT = "suspect"
    """A step's sum did not add up and nobody can say whose part lied."""
    BAD_GRADIENT = "bad-gradient"
    CHECK = "check"
    """A recomputed slice differed from its trainer's commitment (awaiting another member's
    confirmation), was not confirmed, or could not be compared bit for bit."""
    BAD_WORK = "bad-work"
    """Two members recomputed a trainer's slices and found them differing from its
    commitments: it is benched (`unbroken.control.checks`)."""
    AUDIT = "audit"
    ABSENT = "absent"
    UNREACHABLE = "unreachable"
    UNFOUNDED = "unfounded"
    BAD_REQUEST = "bad-request"
    """Most of the epoch's other members refused what a receiver asked of them in a state
    transfer (chunks the state does not have): it is kept out of the epochs."""
    CHURN = "churn"
    """A join waits before an epoch takes it: its key or address left epochs lately before
    they trained (`unbroken.control.admissions`)."""
    QUARANTINE = "quarantine"
    HALTED = "halted"
    """The job stopped on a failure it cannot train past (`Membership.halt`)."""
    REFUSED = "refused"
    PROTOCOL = "protocol"
    # Anomalies (`unbroken.observe.anomaly`; stragglers from the plan's review).
    STRAGGLER = "straggler"
    LOSS_NAN = "loss-nan"
    LOSS_SPIKE = "loss-spike"
    THROUGHPUT_COLLAPSE = "throughput-collapse"
    FLAPPING = "flapping"
    # What nodes report.
    CHECKPOINT = "checkpoint"
    CHECKPOINT_OK = "checkpoint-ok"
    CHECKPOINT_FAILED = "checkpoint-failed"
    CHECKPOINT_SKIPPED = "checkpoint-skipped"
    """The last checkpoint was still being written when the next was due."""
    SYNC = "sync"
    ROLLBACK = "rollback"
    FALLBACK = "fallback"
    """A sharded zone took lost ranges from their buddies, another zone, or a checkpoint
    (the whole job rolled back to it): which, and the ranges. Of a checkpoint, every member
    reports it (the reason says `BACK_TO_CHECKPOINT`), and the job's log has one event."""
    # The control plane itself.
    LEADER = "leader"
    DEPOSED = "deposed"
    OPERATOR = "operator"


@enum.unique
class Entry(StrEnum):
    """What a node writes to its own commit log (``--commit-log``: one JSON line each, with
    the wall time ``t`` and the node's name), which `unbroken.testing.check_promises` reads."""

    EPOCH = "epoch"
    CONTRIB = "contrib"
    """The samples this node computed in a step (their indices) and its role."""
    COMMIT = "commit"
    SYNC = "sync"
    """State received from peers (a join, or a node that fell behind)."""
    INNER_SYNC = "inner-sync"
    RESHARD = "reshard"
    """A sharded zone's ranges given anew (`unbroken.train.sharding`): why, and what moved."""
    RESTORE = "restore"
    """State restored: from a checkpoint, or back to the last audit after a failed one."""
    FINAL = "final"
    EXPELLED = "expelled"
    LEFT = "left"
    FAULT = "fault"
    """A fault injected by a test fired (or an operator's kill)."""
    REFUSED = "refused"
    """A contribution this node refused (a bad gradient, a failed audit, a doubtful sum)."""
    AUDIT = "audit"
    VALIDATION = "validation"
    CHECK = "check"
    """A trainer's slice this node recomputed (`unbroken.train.checks`): its digest, or why not."""
    LINKS = "links"
    CANDIDATE = "candidate"
    CHECKPOINT_FAILED = "checkpoint-failed"


REPORTED = frozenset(
    {
        Kind.CHECKPOINT,
        Kind.CHECKPOINT_OK,
        Kind.CHECKPOINT_FAILED,
        Kind.CHECKPOINT_SKIPPED,
        Kind.SYNC,
        Kind.ROLLBACK,
        Kind.FALLBACK,
    }
)
"""The kinds a node may report (`unbroken.control.messages.Report`): a node that could
report a failure or an epoch would write the coordinator's decisions for it."""
ANOMALIES = frozenset({Kind.STRAGGLER, Kind.LOSS_NAN, Kind.LOSS_SPIKE, Kind.THROUGHPUT_COLLAPSE, Kind.FLAPPING})
"""The kinds the dashboard marks as anomalies."""
ALARMS = ANOMALIES | {
    Kind.FAILURE,
    Kind.BAD_GRADIENT,
    Kind.BAD_WORK,
    Kind.ABSENT,
    Kind.UNREACHABLE,
    Kind.BAD_REQUEST,
    Kind.CHURN,
    Kind.SUSPECT,
    Kind.QUARANTINE,
    Kind.REFUSED,
}
"""The kinds `unbroken events` shows in red."""


@dataclass(frozen=True)
class Event:
    """Something that happened, as the part that saw it says: on the recorder's clock
    (monotonic), by member id."""

    time: float
    kind: Kind
    member: str | None
    epoch: int
    step: int
    reason: str


@dataclass(frozen=True)
class Recorded:
    """An event as the log keeps it: numbered, on the wall clock, with the member's name."""

    seq: int
    time: float
    kind: Kind
    node: str | None
    """The member's name (its id without the incarnation when it is gone)."""
    member: str | None
    epoch: int
    step: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "time": self.time,
            "kind": self.kind.value,
            "node": self.node,
            "member": self.member,
            "epoch": self.epoch,
            "step": self.step,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Recorded:
        """One line of an event log or an entry of ``/api/events``; a kind this version does
        not know is an error that names it (logs of a newer version)."""
        return cls(
            seq=int(d["seq"]),
            time=float(d["time"]),
            kind=Kind(d["kind"]),
            node=d.get("node"),
            member=d.get("member"),
            epoch=int(d["epoch"]),
            step=int(d["step"]),
            reason=str(d["reason"]),
        )


def read_log(path: Path) -> list[Recorded]:
    """The records of an event log file; a last line cut short by a crash is left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(Recorded.from_json(json.loads(line)))
        except json.JSONDecodeError:
            continue
    return out


BACK_TO_CHECKPOINT = "rolled back to checkpoint step"
"""What a ``fallback`` report of a sharded job gone back to a checkpoint in process says,
with the step: the leader moves the group's step back to it once every member of the epoch
said it (`unbroken.control.roster.Roster.went_back`)."""
GOES_ON_FROM = "the group goes on from step"
"""What a ``rollback`` report says, with the step, where an epoch started behind the group
and no checkpoint was newer than its best state (`unbroken.train.catchup`): the committed
steps above it are lost, and the leader's step goes back to it as for `BACK_TO_CHECKPOINT`."""


def goes_back(kind: Kind, reason: str) -> bool:
    """Whether a node's report says that it went back to an older step with the rest of its
    epoch (the leader follows once every member said the same step)."""
    fallback = kind is Kind.FALLBACK and BACK_TO_CHECKPOINT in reason
    return fallback or (kind is Kind.ROLLBACK and GOES_ON_FROM in reason)
