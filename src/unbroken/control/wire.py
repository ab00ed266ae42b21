"""The parts every control message is made of: the base model, bounded field types, shared
sub-models and the protocol's limits (`unbroken.control.messages` gathers the messages).

Every bound here is one a hostile peer meets before anything is allocated for what it says:
names, lists and numbers are limited at the boundary, NaN and infinities refused."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)

from unbroken.specs import Role

PROTOCOL_VERSION = 4
"""4: `Ack.report_s` and `EpochOrder.group_step` (2026-12-08): a node or relay of 3 refuses
every message that carries a field it does not know, so versions do not mix."""


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
    v: Literal[4] = 4


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    name: Annotated[str, Field(max_length=1024)]
    shape: Annotated[list[Count], Field(max_length=64)]
    dtype: Annotated[str, Field(max_length=64)]


class Resume(BaseModel):
    """What a reconnecting member knows, so a restarted coordinator can rebuild its view.

    A node sends its epoch's lists as ``digest`` alone (at 10,000 members they are 370 KB);
    a coordinator that cannot check that digest against an order or a resume it holds
    refuses the hello asking for them (`Refused.resume_in_full`), and the node says them
    again in full (`unbroken.control.resumes`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    epoch: EpochNo
    members: Annotated[list[Name], Field(max_length=MAX_MEMBERS)] = []
    """Empty where ``digest`` stands for the lists."""
    step: Count
    shares: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    roles: Annotated[list[RoleName], Field(max_length=MAX_MEMBERS)] = []
    abandoned: bool = False
    """The member left this epoch (a collective failed while no coordinator could be told):
    the epoch is over, so a new coordinator forms the next one without waiting for the rest."""
    digest: Annotated[str, Field(max_length=64)] = ""
    """Set: ``members``, ``shares`` and ``roles`` are left out, and this is their digest
    (`unbroken.control.resumes.digest`)."""


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


MEET_KEY_CHARS = 512


MEET_VALUE_CHARS = 1 << 16
"""A data-plane address blob (base64): gloo writes about 170 bytes plus 8 per rank."""


CHECKED_MAX = 64
"""Members one `Check` names (a new leader asks about those of the epoch it found that are
not back; past this many, the rest wait out the outage fence)."""
