"""What a node says to the coordinator: its knock and hello, then heartbeats, progress,
reports, faults, findings and its end (`unbroken.control.messages` gathers every message).

A node's word is checked where it lands (promise 8): these models bound what it may say,
the membership decides what it is worth."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)

from unbroken.control.wire import (
    CHECKED_MAX,
    COMMITMENTS_MAX,
    MAX_MEMBERS,
    MEET_KEY_CHARS,
    MEET_VALUE_CHARS,
    Capabilities,
    Count,
    EpochNo,
    Name,
    NodeName,
    PublicKey,
    Resume,
    Seconds,
    Signature,
    TensorSpec,
    _Msg,
)
from unbroken.events import REPORTED, Kind
from unbroken.specs import Preference

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
    """The newest epoch this node has heard of; epochs after a restart are numbered above it."""
    restored_epoch: EpochNo | None = None
    """The epoch of the checkpoint the node cold-started from (None: it did not): the
    job's epochs go on above it, and a cold start still waits for ``--min-nodes``."""
    capabilities: Capabilities = Capabilities()
    role: Annotated[Preference, BeforeValidator(Preference)] = Preference.AUTO
    zone: Annotated[str, Field(max_length=128)] = ""
    """Where the node is (a site, a region); empty is the default zone."""
    evaluates: bool = False
    """The job has an evaluation function (the node can be a validator)."""
    no_inbound: bool = False
    """It accepts no connection (NAT): peers reach it through a forwarder; it leads no zone (`sched.nat`)."""
    forwarding: Annotated[str, Field(max_length=300)] = ""
    """HOST:PORT where it forwards for members behind NAT (``--offer-forwarding``; empty: it does not)."""


class Heartbeat(_Msg):
    """Sent only while a node has nothing else to say: its progress reports carry the same
    ``seq`` and keep its lease while it trains."""

    type: Literal["heartbeat"] = "heartbeat"
    seq: Count
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
    last: bool = False
    """The sender alone holds the group's newest state and nobody came to take it: it goes
    anyway (`unbroken.train.leaving`). Otherwise the last member of the epoch stays."""


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


class Meet(_Msg):
    """An entry of a process group's rendezvous, written by this member's data plane.

    The rendezvous travels on the authenticated control sessions: no one without the job's
    credentials can read the members' data-plane addresses or write into a group build."""

    type: Literal["meet"] = "meet"
    epoch: EpochNo
    key: Annotated[str, Field(min_length=1, max_length=MEET_KEY_CHARS)]
    value: Annotated[str, Field(max_length=MEET_VALUE_CHARS)]
    """Base64 of the bytes the data plane wrote."""


class Vanished(_Msg):
    """Members of ``epoch`` whose data-plane address refused this node's connection: nothing
    listens there, so their processes are gone (or left that epoch long ago)."""

    type: Literal["vanished"] = "vanished"
    epoch: EpochNo
    members: Annotated[list[Name], Field(max_length=CHECKED_MAX)]
