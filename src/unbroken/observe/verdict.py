"""What `unbroken verify` says of a finished job: per promise, held or not, and the evidence.

`unbroken.observe.judge` reaches the verdict from the nodes' commit logs and the job's
events; `unbroken.observe.rundir` finds them in a run's directory; ``unbroken verify``
prints it (``--json``: `Verdict.to_json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from unbroken.events import StrEnum


class Promise(StrEnum):
    STEPS = "steps"
    ONCE = "applied-once"
    SAMPLES = "samples"
    REPLICAS = "replicas"
    FINAL = "final"
    ROLLBACKS = "rollbacks"
    HALTS = "halts"
    QUARANTINES = "quarantines"


class Status(StrEnum):
    OK = "ok"
    VIOLATED = "violated"
    NOTED = "noted"
    """Something a reader should know that broke no promise (a repair, a benched node)."""
    NOT_CHECKED = "not checked"


class Plan(Protocol):
    """The data plan (`unbroken.train.data.DataPlan`, `StreamPlan`)."""

    def indices(self, step: int, offset: int, count: int) -> list[int]: ...


@dataclass(frozen=True)
class Expect:
    """What the job says its run must be (``unbroken verify --job``); None: inferred."""

    num_steps: int | None = None
    """T (None: the step the nodes finished at, else the last step committed)."""
    batch_size: int | None = None
    """B (None: the number of samples most committed steps read)."""
    plan: Plan | None = None
    """Which samples each step reads (None: not checked)."""
    finishers: int = 1
    """How many nodes must finish."""


@dataclass(frozen=True)
class Evidence:
    text: str
    node: str | None = None
    step: int | None = None
    epoch: int | None = None
    t: float | None = None
    """Wall time, as the node or the coordinator logged it."""

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "step": self.step, "epoch": self.epoch, "t": self.t, "text": self.text}


@dataclass
class Check:
    promise: Promise
    status: Status
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    """The first `KEPT` pieces, in the order found."""
    total: int = 0
    """Every piece found."""
    unchecked: str = ""
    """What could not be checked, and why."""

    def to_json(self) -> dict[str, Any]:
        return {
            "promise": self.promise.value,
            "status": self.status.value,
            "summary": self.summary,
            "evidence": [e.to_json() for e in self.evidence],
            "evidence_total": self.total,
            "not_checked": self.unchecked or None,
        }


@dataclass
class Verdict:
    checks: list[Check]
    num_steps: int
    nodes: list[str]
    committed_in: dict[int, int]
    """Step index s (0-based) → the epoch that committed it (the last, if several did)."""
    final_digests: dict[str, str]
    problems: list[str]
    """The broken promises as `unbroken.testing.check_promises` words them (``legacy``)."""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violated

    @property
    def violated(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.VIOLATED]

    def check(self, promise: Promise) -> Check:
        return next(c for c in self.checks if c.promise is promise)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "violated": [c.promise.value for c in self.violated],
            "num_steps": self.num_steps,
            "nodes": self.nodes,
            "checks": [c.to_json() for c in self.checks],
            "notes": self.notes,
        }
