"""What the coordinator says to a node: its challenge and welcome (or refusal), epoch orders
with the policy they carry, expulsions, the job's end, operators' commands, and the data
plane's rendezvous and probes (`unbroken.control.messages` gathers every message)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    model_validator,
)

from unbroken.control.wire import (
    CHECKED_MAX,
    MAX_MEMBERS,
    MEET_KEY_CHARS,
    MEET_VALUE_CHARS,
    REFUSALS_KEPT,
    Count,
    EpochNo,
    Name,
    Refusal,
    RoleName,
    Seconds,
    Term,
    _Msg,
)
from unbroken.specs import (
    AUDIT_EVERY,
    BUCKET_MB,
    INNER_STEPS,
    MAX_BUCKET_MB,
    MAX_STREAMS,
    OUTER_LR,
    OUTER_MOMENTUM,
    STREAMS,
    DiLoCoPolicy,
    Policy,
)


class Challenge(_Msg):
    """The coordinator's first message on every session."""

    type: Literal["challenge"] = "challenge"
    nonce: Annotated[str, Field(max_length=64)]
    auth: bool
    """The job has a token: the hello must prove it."""


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    lease_s: float
    heartbeat_s: float
    coordinator_id: str
    proof: Annotated[str, Field(max_length=64)] = ""
    """The coordinator's proof that it holds the job token ("" without one)."""
    term: Term = 0
    """The leader's term: a node refuses sessions and orders of an older term than it has seen."""
    report_s: Seconds = 0.05
    """How often a training node reports progress (larger groups report less often)."""
    group_step: Count = 0
    """The step the group has committed (0: no group trains yet, a cold start): a node whose
    restored checkpoint is ahead of it does not use it (another run's)."""
    build_deadline_s: Seconds = 5.0
    """The leader's `--build-deadline`: a group build still unfinished half this long after
    every member's entry arrived has a peer this node cannot connect to: it tries each
    peer's address and says which (the other half is for the others to confirm)."""


class Refused(_Msg):
    type: Literal["refused"] = "refused"
    reason: str
    finished: bool = False
    """True when the job is already over (nothing is wrong with the node)."""
    final_digest: Annotated[str, Field(max_length=128)] = ""
    """With ``finished``: the state the job finished with (`Finished.digest`)."""
    standby: bool = False
    """This coordinator does not lead: try ``leader`` (or again shortly, when it is empty)."""
    leader: Annotated[str, Field(max_length=300)] = ""
    """HOST:PORT of the current leader, as the standby last read it from etcd."""
    resume_in_full: bool = False
    """The hello's resume came as a digest this coordinator cannot check: say it again with
    its lists (nothing is wrong with the node)."""


class Ack(_Msg):
    type: Literal["ack"] = "ack"
    seq: Count
    report_s: Seconds = 0.0
    """To a relay: send the members' routine progress reports up this often (0: as it
    likes, `batches.REPORT_EVERY_S`). The leader sets it by the group's size, so that
    routine reports cost it the same at any size (`relaying.Relays.report_s`)."""


class PolicyMsg(BaseModel):
    """`unbroken.specs.Policy` on the wire: each field as its command-line flag spells it,
    parsed and checked on arrival (a coordinator's word is checked too)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    codec: Annotated[str, Field(max_length=64)] = "none"
    aggregate: Annotated[str, Field(max_length=64)] = "mean"
    fragments: Annotated[str, Field(max_length=16)] = ""
    """``K,M`` (empty: whole files)."""
    audit_every: Annotated[int, Field(ge=0, le=1_000_000)] = AUDIT_EVERY
    streams: Annotated[int, Field(ge=1, le=MAX_STREAMS)] = STREAMS
    bucket_mb: Annotated[float, Field(ge=0, le=MAX_BUCKET_MB)] = BUCKET_MB
    mode: Literal["sync", "diloco"] = "sync"
    inner_steps: Annotated[int, Field(ge=1, le=1_000_000)] = INNER_STEPS
    outer_lr: Annotated[float, Field(gt=0, le=100)] = OUTER_LR
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = OUTER_MOMENTUM
    outer_overlap: bool = False

    @classmethod
    def of(cls, p: Policy) -> PolicyMsg:
        d = p.diloco or DiLoCoPolicy()
        return cls(
            codec=str(p.codec),
            aggregate=str(p.aggregate),
            fragments=str(p.fragments) if p.fragments else "",
            audit_every=p.audit_every,
            streams=p.streams,
            bucket_mb=p.bucket_mb,
            mode=p.mode.value,
            inner_steps=d.inner_steps,
            outer_lr=d.outer_lr,
            outer_momentum=d.outer_momentum,
            outer_overlap=d.overlap,
        )

    _parsed: Policy | None = PrivateAttr(default=None)

    def parsed(self) -> Policy:
        """The typed policy, parsed once when the message is (`_parses`)."""
        if self._parsed is None:
            self._parsed = self._parse()
        return self._parsed

    def _parse(self) -> Policy:
        """Raises ConfigError naming what does not parse."""
        return Policy.parse(**self.model_dump())

    @model_validator(mode="after")
    def _parses(self) -> PolicyMsg:
        self._parsed = self._parse()
        return self


class EpochOrder(_Msg):
    """Form epoch ``epoch`` with ``members`` (rank = position) and these batch shares."""

    type: Literal["epoch"] = "epoch"
    epoch: EpochNo
    term: Term = 0
    """The term of the leader that ordered it (nodes refuse orders of older terms)."""
    members: list[Name]
    shares: list[Count]
    urgent: bool
    """True when a member failed: abandon the step in flight at once."""
    reason: str
    roles: list[RoleName] = []
    """Each member's role (empty: all train)."""
    microbatches: list[Count] = []
    """Each member's micro-batch size (empty or 0: its whole share at once)."""
    zones: list[Annotated[str, Field(max_length=128)]] = []
    """Each member's zone (empty: one zone)."""
    ring: Annotated[list[Annotated[str, Field(max_length=128)]], Field(max_length=MAX_MEMBERS)] = []
    """The zones in the order of the leaders' ring (`sched.links`; empty: as they first appear)."""
    probe_links: bool = False
    """The zone leaders measure the rate between each pair of zones and report it (`Links`)."""
    rollback_to: Annotated[int, Field(ge=-1)] = -1
    """After a failed audit: members holding the state audited at this step go back to it."""
    group_step: Count = 0
    """Non-zero where no member of the epoch holds the group's last committed step (as the
    leader heard it: this), every holder gone: the members compare their best state with
    the checkpoints they can read (`unbroken.train.catchup`)."""
    refused: Annotated[list[Refusal], Field(max_length=REFUSALS_KEPT)] = []
    """The latest verdicts (a member back from a long absence must not offer a refused state)."""
    policy: PolicyMsg = PolicyMsg()
    """How the group trains (the same in every order, but for ``aggregate`` while the
    coordinator has contributions checked)."""
    forwarders: Annotated[list[Annotated[str, Field(max_length=300)]], Field(max_length=64)] = []
    """HOST:PORT of the members that forward for members behind NAT (`sched.nat.forwarders`)."""
    behind: Annotated[list[Name], Field(max_length=MAX_MEMBERS)] = []
    """Members the others could not connect to, told to go behind one of ``forwarders``
    (`sched.nat.unreachable`); one that is there already goes on as it is."""
    # On the wire only (`unbroken.control.orders`): a node sees the full order.
    base: EpochNo = 0
    """Non-zero: ``members`` is empty and the order is a change to epoch ``base``'s."""
    removed: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    """Ranks of the base order that are not in this one."""
    added: Annotated[list[Name], Field(max_length=MAX_MEMBERS)] = []
    """Members appended after the base order's remaining ones."""
    shares_runs: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    """Non-empty: ``shares`` holds runs of equal values, each repeated this many times."""
    microbatches_runs: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    roles_runs: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    zones_runs: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []


class Expel(_Msg):
    type: Literal["expelled"] = "expelled"
    reason: str
    term: Term = 0
    final: bool = False
    """Not to come back: the member is quarantined (``reason`` names its offences)."""


class Finished(_Msg):
    type: Literal["finished"] = "finished"
    step: Count
    term: Term = 0
    digest: Annotated[str, Field(max_length=128)] = ""
    """The state most of the last epoch's trainers finished with: a member still waiting at
    the last step (an audit not settled) that holds the same state has finished too."""
    error: Annotated[str, Field(max_length=4000)] = ""
    """The job was halted, not finished (`Membership.halt`): every node stops with this."""


class Command(_Msg):
    """An operator's action on one node (from the dashboard or the API)."""

    type: Literal["command"] = "command"
    action: Literal["drain", "kill"]
    """``drain``: leave gracefully after the current step; ``kill``: SIGKILL itself (chaos)."""
    reason: Annotated[str, Field(max_length=2000)]
    term: Term = 0


class Met(_Msg):
    """Rendezvous entries of the epoch's members, for this member's group builds."""

    type: Literal["met"] = "met"
    epoch: EpochNo
    term: Term = 0
    entries: Annotated[
        dict[Annotated[str, Field(max_length=MEET_KEY_CHARS)], Annotated[str, Field(max_length=MEET_VALUE_CHARS)]],
        Field(max_length=MAX_MEMBERS),
    ]


class Probe(_Msg):
    """Try to connect to a member's data-plane address: another member says it cannot
    (`Fault` ``unreachable``), and the leader benches it only if most of the epoch agrees."""

    type: Literal["probe"] = "probe"
    epoch: EpochNo
    term: Term = 0
    member: Name
    group: Annotated[str, Field(max_length=64)]
    host: Annotated[str, Field(max_length=64)]
    port: Annotated[int, Field(ge=1, le=65535)]


class Verify(_Msg):
    """Recompute ``trainer``'s slice of a step of this member's, the first from ``step`` in
    which it trains, and report it (`Checked` with ``ordered``): another member's check found
    its work differing from its commitment, and one member's word alone names nobody."""

    type: Literal["verify"] = "verify"
    epoch: EpochNo
    term: Term = 0
    trainer: Name
    step: Count
    reason: Annotated[str, Field(max_length=2000)] = ""


class Check(_Msg):
    """A new leader asks a member back from ``epoch`` to try the data-plane addresses those
    ``members`` had in it: none of them came back yet, and one still in that epoch (its
    session cut off, its lease fresh) could commit a step there, so the leader waits a lease
    before leaving it out, unless most of the others find nothing listening (`Vanished`)."""

    type: Literal["check"] = "check"
    epoch: EpochNo
    term: Term = 0
    members: Annotated[list[Name], Field(max_length=CHECKED_MAX)]
