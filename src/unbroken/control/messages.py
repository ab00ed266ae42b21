"""Typed control messages, validated at the boundary.

Every message is one JSON object with a ``type`` and the protocol version ``v``. Anything
that does not parse into one of these models is refused before it touches state.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from unbroken.errors import ProtocolError
from unbroken.events import REPORTED, Kind
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
    Preference,
    Role,
)

PROTOCOL_VERSION = 3

Name = Annotated[str, Field(min_length=1, max_length=256)]
PublicKey = Annotated[str, Field(max_length=64)]
"""A node's public key as `unbroken.control.identity.public_text` writes it."""
Signature = Annotated[str, Field(max_length=128)]


def _printable(text: str) -> str:
    if not text.isprintable():
        bad = next(c for c in text if not c.isprintable())
        raise ValueError(
            f"holds the unprintable character {bad!r}: a node's name is shown in terminals and logs, "
            "give one of printable characters"
        )
    return text


NodeName = Annotated[Name, AfterValidator(_printable)]
"""A name a node chooses for itself (and its id, which starts with it): printable text, so
that no escape sequence of its own reaches an operator's terminal (`observe.printable`
escapes any other peer text on the way out)."""
COMMITMENTS_MAX = 512
"""Commitments one progress report carries (a node keeps no more unsent)."""
Count = Annotated[int, Field(ge=0, le=2**53)]
EpochNo = Annotated[int, Field(ge=0, le=2**31)]
"""Epoch numbers stay far below any overflow, whatever a hostile hello claims."""
RoleName = Annotated[Role, BeforeValidator(Role)]  # the enum, from its value on the wire (strict parsing)
MAX_MEMBERS = 1 << 20
"""Members one message may list: far above any job, a bound on what a hostile peer sends
(the message size limit binds first)."""


class _Msg(BaseModel):
    # NaN and infinities are refused at the boundary: no peer puts them into the state or
    # the JSON the dashboard reads (nodes send non-finite figures as flagged sentinels).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    v: Literal[3] = 3


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    name: Annotated[str, Field(max_length=1024)]
    shape: Annotated[list[Count], Field(max_length=64)]
    dtype: Annotated[str, Field(max_length=64)]


class Resume(BaseModel):
    """What a reconnecting member knows, so a restarted coordinator can rebuild its view."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    epoch: EpochNo
    members: Annotated[list[Name], Field(max_length=MAX_MEMBERS)]
    step: Count
    shares: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    roles: Annotated[list[RoleName], Field(max_length=MAX_MEMBERS)] = []
    abandoned: bool = False
    """The member left this epoch (a collective failed while no coordinator could be told):
    the epoch is over, so a new coordinator forms the next one without waiting for the rest."""


Term = Annotated[int, Field(ge=0, le=2**62)]
"""A leader's term (its etcd election key's create revision; 0 without etcd)."""

Seconds = Annotated[float, Field(ge=0, le=1e6)]


class Capabilities(BaseModel):
    """What a node can do, measured at join and refreshed with every progress report."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    device: Annotated[str, Field(max_length=128)] = "cpu"
    """Device kind and index, e.g. ``cpu``, ``cuda:0``."""
    device_name: Annotated[str, Field(max_length=256)] = ""
    memory_total: Count = 0
    """Bytes of memory on the compute device (0: unknown)."""
    memory_used: Count = 0
    per_sample_s: Seconds = 0.0
    """Compute seconds per sample (forward + backward), smoothed."""
    overhead_s: Seconds = 0.0
    """Fixed compute seconds per micro-batch."""
    measurements: Count = 0
    """Steps and probes behind the speed figures (0: the start-up estimate only)."""
    noise: Annotated[float, Field(ge=0, le=10)] = 0.0
    """Relative standard error of the step time ``per_sample_s`` and ``overhead_s`` give, from
    the spread of the steps they follow the median of (0 before three steps, when
    ``measurements`` says the figure is a start-up estimate). The plan treats differences
    within it as noise."""
    max_microbatch: Annotated[int, Field(ge=-1, le=2**31)] = 0
    """Largest micro-batch that fits in memory (0: no limit; -1: not even one sample)."""
    comm_s: Seconds = 0.0
    """Seconds of the last step spent in the all-reduce (waiting for peers included)."""
    rtt_s: Seconds = 0.0
    """Round-trip time to the coordinator (heartbeat to acknowledgement), smoothed."""
    throttle: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Emulated speed factor (testing aid; 1 = full speed)."""
    arithmetic: Annotated[str, Field(max_length=256)] = ""
    """What its gradients' bits depend on besides the data (device kind, kernels, threads,
    torch build: `unbroken.train.checks.arithmetic`): a validator whose own differs cannot
    recompute its slices bit for bit, so its checks of this node are not compared."""


KNOCK_BYTES = 2048
"""The most a peer may send before it has proven it holds the job token."""


class Knock(_Msg):
    """A node's first message: who it is and its token proof, small enough to be checked
    before anything else it sends is read. Its hello follows."""

    type: Literal["knock"] = "knock"
    member_id: NodeName
    nonce: Annotated[str, Field(max_length=64)] = ""
    """The node's half of the challenge-response (see `unbroken.control.auth`)."""
    proof: Annotated[str, Field(max_length=64)] = ""
    """HMAC of the coordinator's challenge and ``nonce`` under the job token ("" without one)."""
    key: PublicKey = ""
    """The node's public key (`unbroken.control.identity`): its member id is bound to it."""
    signature: Signature = ""
    """The key's signature of the challenge, ``nonce``, the member id and ``key``."""


class Identity(BaseModel):
    """A node's signed knock, as the relay it knocked at checked it: the leader checks it again."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: PublicKey
    signature: Signature
    challenge: Annotated[str, Field(max_length=64)]
    nonce: Annotated[str, Field(max_length=64)]


class Hello(_Msg):
    """What a node brings (its model's fingerprint, its state, its speed), after its knock."""

    type: Literal["hello"] = "hello"
    job: Name
    job_identity: Annotated[str, Field(max_length=64)]
    job_spec: Annotated[str, Field(max_length=65_536)] = ""
    """What ``job_identity`` hashes, as JSON (`Job.identity_spec`): a refusal names what differs."""
    fingerprint: Annotated[list[TensorSpec], Field(max_length=100_000)]
    member_id: NodeName
    name: NodeName
    batch_size: Annotated[int, Field(ge=1, le=2**31)]
    steps: Count = 0
    """The job's last step (0: not said); no member reports a step beyond it."""
    weight: Annotated[float, Field(gt=0, le=1e9)] = 1.0
    step: Count = 0
    host: Annotated[str, Field(max_length=256)] = ""
    pid: Count = 0
    resume: Resume | None = None
    identity: Identity | None = None
    """Set by a relay alone: the knock it took (the leader has a direct node's own)."""
    last_epoch: EpochNo = 0
    restored_epoch: EpochNo | None = None
    """The epoch of the checkpoint the node cold-started from (None: it did not): the
    job's epochs go on above it, and a cold start still waits for ``--min-nodes``."""
    capabilities: Capabilities = Capabilities()
    role: Annotated[Preference, BeforeValidator(Preference)] = Preference.AUTO
    zone: Annotated[str, Field(max_length=128)] = ""
    """Where the node is (a site, a region); empty is the default zone."""
    evaluates: bool = False
    """The job has an evaluation function (the node can be a validator)."""
    """The newest epoch this node has heard of; epochs after a restart are numbered above it."""


class Heartbeat(_Msg):
    """Sent only while a node has nothing else to say: its progress reports carry the same
    ``seq`` and keep its lease while it trains."""

    type: Literal["heartbeat"] = "heartbeat"
    seq: Count
    step: Count


REFUSALS_KEPT = 8
OUTAGE_TRUST_LEASES = 1.0
"""A node in a coordinator outage trusts its epoch this many leases past its last evidence
that no coordinator had started (`unbroken.control.client`); a coordinator that starts or
takes over leaves out no member of the epoch it finds before as long (and a margin) has
passed (`unbroken.control.membership`). Half a lease was tried: a leader and a node dying
together cost the survivors 0.5 s less, but evidence can be missing for longer than that
while etcd loses its majority (a member believes in its raft leader for an election
timeout, 0.5 s here, while reads through it time out), and the group stalled there."""


class Refusal(BaseModel):
    """A verdict of the consistency audits: a state committed in ``epoch`` or before and
    above ``step`` holds a corrupted replica's contributions (the group went back to ``step``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    epoch: EpochNo
    step: Count


class StepPoint(BaseModel):
    """One committed step as its reporter saw it (the dashboard's curves, anomaly checks)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    step: Count
    loss: float
    """-1 when not finite (``finite`` says)."""
    finite: bool = True
    samples_per_s: Annotated[float, Field(ge=0)] = 0.0
    wall_time: float = 0.0


Digest = Annotated[str, Field(max_length=32)]


class Commitment(BaseModel):
    """A trainer's word on its slice of a committed step (`unbroken.train.checks`): the
    digest of the gradient it contributed and of the slice's positions, and the micro-batch
    size it computed it in. Made before it could know whether that step will be checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    epoch: EpochNo
    step: Count
    digest: Digest
    microbatch: Count


class Progress(_Msg):
    type: Literal["progress"] = "progress"
    epoch: EpochNo
    step: Count
    loss: float
    wall_time: float
    first_in_epoch: bool = False
    samples_per_s: Annotated[float, Field(ge=0)] = 0.0
    compute_s: Seconds = 0.0
    """Compute time of the last step (0 for a member without a share)."""
    bytes_intra: Count = 0
    """Bytes this node has sent inside its zone (all steps so far)."""
    bytes_inter: Count = 0
    """Bytes this node has sent to other zones (all steps so far)."""
    capabilities: Capabilities | None = None
    loss_finite: bool = True
    """False when the loss was NaN or infinite (``loss`` then carries -1)."""
    recent: Annotated[list[StepPoint], Field(max_length=512)] = []
    """The group's rank 0: every step it committed since its last report (others: empty)."""
    seq: Count = 0
    """Like a heartbeat's: acknowledged, and keeps the lease (0: not counted as one)."""
    commitments: Annotated[list[Commitment], Field(max_length=COMMITMENTS_MAX)] = []
    """A trainer's commitments to its slices of the steps committed since its last report."""


def _kind_of(allowed: frozenset[Kind]) -> BeforeValidator:
    """An event kind from the wire, one of ``allowed`` (what a member may say it saw)."""

    def check(value: object) -> Kind:
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{value!r} is not one of {sorted(k.value for k in allowed)}")
        return Kind(value)

    return BeforeValidator(check)


FAULTS = frozenset({Kind.BAD_GRADIENT, Kind.AUDIT, Kind.SUSPECT, Kind.UNREACHABLE, Kind.BAD_REQUEST})
"""What a `Fault` may name."""


class Report(_Msg):
    """Something a node did that belongs in the job's event log (a checkpoint written,
    state received from a peer, a DiLoCo round rolled back...)."""

    type: Literal["report"] = "report"
    kind: Annotated[Kind, _kind_of(REPORTED)]
    step: Count
    reason: Annotated[str, Field(max_length=2000)]


class Validation(_Msg):
    """A validator's evaluation of the committed state after ``step``."""

    type: Literal["validation"] = "validation"
    step: Count
    metrics: Annotated[dict[Annotated[str, Field(max_length=128)], float], Field(max_length=64)]
    seconds: Seconds


class Checked(_Msg):
    """A member's recomputation of a trainer's slice of a committed step (`unbroken.train.checks`):
    its digest, to compare with the trainer's `Commitment`, or why it was not computed."""

    type: Literal["checked"] = "checked"
    epoch: EpochNo
    step: Count
    """The step whose slice was recomputed (as `Commitment.step`)."""
    trainer: Name
    digest: Digest = ""
    """Empty when ``skipped``."""
    microbatch: Count = 0
    arithmetic: Annotated[str, Field(max_length=256)] = ""
    """The checker's (`Capabilities.arithmetic` of the CPU it recomputed on)."""
    ordered: bool = False
    """The leader asked for it (`Verify`): a confirmation."""
    skipped: Annotated[str, Field(max_length=500)] = ""
    """Why nothing was recomputed (the check cannot be bit-exact there, or its order lapsed)."""
    seconds: Seconds = 0.0


class Fault(_Msg):
    type: Literal["fault"] = "fault"
    epoch: EpochNo
    reason: Annotated[str, Field(max_length=2000)]
    culprit: Name | None = None
    """The member whose contribution was refused (a bad gradient), when the fault is one."""
    step: Annotated[int, Field(ge=-1)] = -1
    """The step that failed (the reporter's committed step; -1: not said)."""
    kind: Annotated[Kind, _kind_of(FAULTS)] = Kind.BAD_GRADIENT
    """Why the culprit was refused: its gradient, or its state failed the consistency audit;
    ``suspect`` (no culprit): the step's sum did not add up, and nobody can say whose part lied;
    ``unreachable``: this member could not connect to the culprit's data-plane address (the
    culprit is this member itself when it reaches almost none of its peers); ``bad-request``:
    the culprit asked this member, its donor, for chunks the state does not have."""
    zone_only: bool = False
    """Only the culprit's zone saw the evidence (a DiLoCo inner step): its majority decides."""
    group: Annotated[str, Field(max_length=64)] = ""
    """``unreachable``: the group whose build could not connect to the culprit."""
    rollback_to: Annotated[int, Field(ge=-1)] = -1
    """A failed audit: the step of the last audit that passed (every member goes back to it)."""


class Leave(_Msg):
    type: Literal["leave"] = "leave"
    reason: Annotated[str, Field(max_length=2000)] = "requested"


class Links(_Msg):
    """What a zone leader measured (an order's ``probe_links``): MB/s received from each
    other zone's leader."""

    type: Literal["links"] = "links"
    epoch: EpochNo
    rates: Annotated[
        dict[Annotated[str, Field(max_length=128)], Annotated[float, Field(ge=0, le=1e7)]],
        Field(max_length=MAX_MEMBERS),
    ]


class Done(_Msg):
    type: Literal["done"] = "done"
    step: Count
    digest: Annotated[str, Field(max_length=128)]
    metrics: Annotated[dict[Annotated[str, Field(max_length=128)], float], Field(max_length=64)] = {}


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


class Ack(_Msg):
    type: Literal["ack"] = "ack"
    seq: Count


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
    refused: Annotated[list[Refusal], Field(max_length=REFUSALS_KEPT)] = []
    """The latest verdicts (a member back from a long absence must not offer a refused state)."""
    policy: PolicyMsg = PolicyMsg()
    """How the group trains (the same in every order, but for ``aggregate`` while the
    coordinator has contributions checked)."""
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


MEET_KEY_CHARS = 512
MEET_VALUE_CHARS = 1 << 16
"""A data-plane address blob (base64): gloo writes about 170 bytes plus 8 per rank."""


class Meet(_Msg):
    """An entry of a process group's rendezvous, written by this member's data plane.

    The rendezvous travels on the authenticated control sessions: no one without the job's
    credentials can read the members' data-plane addresses or write into a group build."""

    type: Literal["meet"] = "meet"
    epoch: EpochNo
    key: Annotated[str, Field(min_length=1, max_length=MEET_KEY_CHARS)]
    value: Annotated[str, Field(max_length=MEET_VALUE_CHARS)]
    """Base64 of the bytes the data plane wrote."""


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


CHECKED_MAX = 64
"""Members one `Check` names (a new leader asks about those of the epoch it found that are
not back; past this many, the rest wait out the outage fence)."""


class Check(_Msg):
    """A new leader asks a member back from ``epoch`` to try the data-plane addresses those
    ``members`` had in it: none of them came back yet, and one still in that epoch (its
    session cut off, its lease fresh) could commit a step there, so the leader waits a lease
    before leaving it out, unless most of the others find nothing listening (`Vanished`)."""

    type: Literal["check"] = "check"
    epoch: EpochNo
    term: Term = 0
    members: Annotated[list[Name], Field(max_length=CHECKED_MAX)]


class Vanished(_Msg):
    """Members of ``epoch`` whose data-plane address refused this node's connection: nothing
    listens there, so their processes are gone (or left that epoch long ago)."""

    type: Literal["vanished"] = "vanished"
    epoch: EpochNo
    members: Annotated[list[Name], Field(max_length=CHECKED_MAX)]


NodeMessage = Annotated[
    Hello | Heartbeat | Progress | Fault | Leave | Done | Validation | Report | Meet | Links | Vanished | Checked,
    Field(discriminator="type"),
]
CoordinatorMessage = Annotated[
    Challenge | Welcome | Refused | Ack | EpochOrder | Expel | Finished | Command | Met | Probe | Check | Verify,
    Field(discriminator="type"),
]


# ---------------------------------------------------------------- relays
#
# A relay (a zone's sub-coordinator, `unbroken.control.relay`) holds its members' sessions
# and speaks for them to the leader on one session of its own: what they say goes up in
# batches, with one list of the members heard from (their liveness); what the leader
# tells them comes down once per relay, addressed to the members it is for.


class RelayHello(_Msg):
    """A relay's first message to the leader (after its challenge), proving the job token."""

    type: Literal["relay-hello"] = "relay-hello"
    relay_id: Name
    zone: Annotated[str, Field(max_length=128)] = ""
    nonce: Annotated[str, Field(max_length=64)] = ""
    proof: Annotated[str, Field(max_length=64)] = ""
    key: PublicKey = ""
    """The relay's public key: its id is made from it, as a member's (`Knock.key`)."""
    signature: Signature = ""


class RelayWelcome(_Msg):
    type: Literal["relay-welcome"] = "relay-welcome"
    coordinator_id: str
    term: Term = 0
    lease_s: float
    proof: Annotated[str, Field(max_length=64)] = ""
    link: Annotated[str, Field(max_length=64)] = ""
    """The leader's part of every challenge the relay sends its nodes (``LINK.N``, N counting
    up): a node's signed knock is good on this link, once (`sessions.RelayLink.fresh`)."""


class Said(BaseModel):
    """One member's message, as its relay received it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    member: Name
    msg: NodeMessage


class Gone(BaseModel):
    """A member's session with the relay ended."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    member: Name
    reason: Annotated[str, Field(max_length=2000)]


class Up(_Msg):
    """What a relay's members said since its last batch."""

    type: Literal["up"] = "up"
    seq: Count
    """Acknowledged by the leader; the relay then acknowledges its members' heartbeats."""
    alive: Annotated[list[Name], Field(max_length=MAX_MEMBERS)] = []
    """Members heard from since the last batch (a heartbeat or a report each)."""
    steps: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    """Their steps, in the order of ``alive``."""
    said: Annotated[list[Said], Field(max_length=MAX_MEMBERS)] = []
    gone: Annotated[list[Gone], Field(max_length=MAX_MEMBERS)] = []


class Down(_Msg):
    """A message of the leader for some of a relay's members."""

    type: Literal["down"] = "down"
    to: Annotated[list[Name], Field(max_length=MAX_MEMBERS)]
    msg: CoordinatorMessage


RelayMessage = Annotated[RelayHello | Up, Field(discriminator="type")]
LeaderMessage = Annotated[Challenge | RelayWelcome | Refused | Ack | Down, Field(discriminator="type")]

_knock_adapter: TypeAdapter[Knock] = TypeAdapter(Knock)
_node_adapter: TypeAdapter[NodeMessage] = TypeAdapter(NodeMessage)
_coord_adapter: TypeAdapter[CoordinatorMessage] = TypeAdapter(CoordinatorMessage)
_relay_adapter: TypeAdapter[RelayMessage] = TypeAdapter(RelayMessage)
_leader_adapter: TypeAdapter[LeaderMessage] = TypeAdapter(LeaderMessage)


def _parse(adapter: TypeAdapter[object], data: str | bytes, limit: int) -> object:
    if len(data) > limit:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"control message is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("control message is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal of thousands of digits
        raise ProtocolError(f"control message is not acceptable JSON: {exc}") from None
    version = raw.get("v", PROTOCOL_VERSION) if isinstance(raw, dict) else PROTOCOL_VERSION
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {raw.get('v')!r} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same unbroken version on every node"
        )
    try:
        return adapter.validate_python(raw, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise ProtocolError(f"invalid control message at {where}: {first['msg']}") from None


def parse_knock(data: str | bytes) -> Knock:
    return _parse(_knock_adapter, data, KNOCK_BYTES)  # type: ignore[arg-type,return-value]


def parse_node_message(data: str | bytes, limit: int = 1 << 20) -> NodeMessage:
    return _parse(_node_adapter, data, limit)  # type: ignore[arg-type,return-value]


def parse_coordinator_message(data: str | bytes, limit: int = 64 << 20) -> CoordinatorMessage:
    return _parse(_coord_adapter, data, limit)  # type: ignore[arg-type,return-value]


def parse_relay_message(data: str | bytes, limit: int = 64 << 20) -> RelayMessage:
    return _parse(_relay_adapter, data, limit)  # type: ignore[arg-type,return-value]


def parse_leader_message(data: str | bytes, limit: int = 64 << 20) -> LeaderMessage:
    return _parse(_leader_adapter, data, limit)  # type: ignore[arg-type,return-value]


def down_text(to: list[str], encoded: str) -> str:
    """A `Down` around a message encoded once (an order goes to every relay alike)."""
    return f'{{"v":{PROTOCOL_VERSION},"type":"down","to":{json.dumps(to)},"msg":{encoded}}}'


def encode(msg: BaseModel) -> str:
    return msg.model_dump_json()
