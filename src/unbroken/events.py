"""The job's events: one list of kinds, one record, one log that everything reads.

The coordinator records an `Event` for each decision of its membership (joins, failures,
epochs, roles, offences), for what a node reports (`REPORTED`: a checkpoint written, state
received, a DiLoCo round rolled back), for each anomaly its detector finds and for its own
leadership. `EventLog.emit` numbers it, keeps the recent ones, counts every kind and
appends it to the event log file; the API behind the dashboard and `unbroken events`,
`/metrics` and the tests read those records (`Recorded`), never free strings.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.errors import ConfigError
from unbroken.observe.quiet import Hush

log = logging.getLogger(__name__)

UNWRITTEN_MAX = 4 << 20
"""Bytes of event lines kept for the event log file while its writes fail (about 15,000
events): the newest are written once it takes writes again, older ones are given up."""


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
    {Kind.CHECKPOINT, Kind.CHECKPOINT_OK, Kind.CHECKPOINT_FAILED, Kind.CHECKPOINT_SKIPPED, Kind.SYNC, Kind.ROLLBACK}
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


class EventLog:
    """The coordinator's events: the last ``keep`` in memory, every kind counted, every
    event appended to ``path`` (one JSON line each) when there is one.

    The file is opened once, here: a process out of file descriptors (a connection flood)
    still writes its events. A write that fails (a full disk, an I/O error) never fails
    `emit`, which decisions go through: the lines wait, up to `UNWRITTEN_MAX` bytes, for
    the next event's write, and the failure is counted (`health`) and logged (`Hush`).
    """

    def __init__(self, path: Path | None = None, keep: int = 10_000) -> None:
        """Raises:
        ConfigError: ``path`` cannot be opened for appending."""
        self.path = path
        self.keep = keep
        self.seq = 0
        self.counts: collections.Counter[Kind] = collections.Counter()
        """Every event by kind, including those only counted (`count`)."""
        self._recent: collections.deque[Recorded] = collections.deque(maxlen=keep)
        self._fd: int | None = None
        self._unwritten = bytearray()
        self.write_failures = 0
        self.dropped_bytes = 0
        """Event lines given up on: more than `UNWRITTEN_MAX` waited while writes failed."""
        self.last_error: str | None = None
        self._hush = Hush()
        if path is not None:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ConfigError(
                    f"cannot write the event log {path}: {exc.strerror or exc}; "
                    "give --event-log a writable file (or none)"
                ) from None

    def emit(self, ev: Event, node: str | None) -> Recorded:
        """Record ``ev`` (its time on the monotonic clock) of the member called ``node``."""
        wall = time.time() - (time.monotonic() - ev.time)
        self.seq += 1
        rec = Recorded(self.seq, wall, ev.kind, node, ev.member, ev.epoch, ev.step, ev.reason)
        self._recent.append(rec)
        self.counts[ev.kind] += 1
        if self._fd is not None:
            self._unwritten += (json.dumps(rec.to_json()) + "\n").encode()
            self._write()
        return rec

    def _write(self) -> None:
        assert self._fd is not None
        try:
            while self._unwritten:
                del self._unwritten[: os.write(self._fd, self._unwritten)]
            return
        except OSError as exc:
            self.write_failures += 1
            self.last_error = f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
        if len(self._unwritten) > UNWRITTEN_MAX:
            # Whole lines from the oldest: the file keeps the newest, each line readable.
            cut = self._unwritten.find(b"\n", len(self._unwritten) - UNWRITTEN_MAX) + 1
            self.dropped_bytes += cut
            del self._unwritten[:cut]
        counted = self._hush.allow("write", time.monotonic())
        if counted is not None:
            log.error(
                "cannot write the event log %s: %s; the job goes on, %d bytes of events wait for the next write%s",
                self.path,
                self.last_error,
                len(self._unwritten),
                f" ({counted} more failed writes not logged)" if counted else "",
            )

    def health(self) -> dict[str, Any]:
        """The event log file's state, for ``/api/state`` and ``/metrics``."""
        return {
            "path": str(self.path) if self.path is not None else None,
            "write_failures": self.write_failures,
            "unwritten_bytes": len(self._unwritten),
            "dropped_bytes": self.dropped_bytes,
            "last_error": self.last_error,
        }

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if self._unwritten:
                    self._write()
                os.close(self._fd)
            self._fd = None

    def count(self, kind: Kind) -> None:
        """An event too many of its source to list (a flood): counted, not kept."""
        self.counts[kind] += 1

    def __iter__(self) -> Iterator[Recorded]:
        return iter(self._recent)

    def __len__(self) -> int:
        return len(self._recent)

    def since(self, seq: int, kinds: Iterable[Kind] = (), node: str | None = None) -> list[Recorded]:
        """The kept events after ``seq``, of ``kinds`` (all when empty) and ``node`` (any when None)."""
        wanted = set(kinds)
        return [
            r
            for r in self._recent
            if r.seq > seq and (not wanted or r.kind in wanted) and (node is None or r.node == node)
        ]

    def last(self, n: int) -> list[Recorded]:
        return list(self._recent)[-n:] if n > 0 else []
