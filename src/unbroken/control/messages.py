"""Typed control messages, validated at the boundary.

Every message is one JSON object with a ``type`` and the protocol version ``v``. Anything
that does not parse into one of these models is refused before it touches state.

Every message is reached from here (``from unbroken.control import messages as m``); they
are defined by direction: what a node says (`upward`), what the coordinator says
(`downward`), on the parts both share (`wire`). A relay's own messages, and the parsers
that check a message against all those that may come its way, are here.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
)

from unbroken.control.downward import (
    Ack,
    Challenge,
    Check,
    Command,
    EpochOrder,
    Expel,
    Finished,
    Met,
    PolicyMsg,
    Probe,
    Refused,
    Verify,
    Welcome,
)
from unbroken.control.upward import (
    FAULTS,
    KNOCK_BYTES,
    Checked,
    Commitment,
    Digest,
    Done,
    Fault,
    Heartbeat,
    Hello,
    Identity,
    Knock,
    Leave,
    Links,
    Meet,
    Progress,
    Report,
    StepPoint,
    Validation,
    Vanished,
)
from unbroken.control.wire import (
    CHECKED_MAX,
    COMMITMENTS_MAX,
    MAX_MEMBERS,
    MEET_KEY_CHARS,
    MEET_VALUE_CHARS,
    OUTAGE_TRUST_LEASES,
    PROTOCOL_VERSION,
    REFUSALS_KEPT,
    Capabilities,
    Count,
    EpochNo,
    Name,
    NodeName,
    PublicKey,
    Refusal,
    Resume,
    RoleName,
    Seconds,
    Signature,
    TensorSpec,
    Term,
    _Msg,
)
from unbroken.errors import ProtocolError

__all__ = [
    "CHECKED_MAX",
    "COMMITMENTS_MAX",
    "FAULTS",
    "KNOCK_BYTES",
    "MAX_MEMBERS",
    "MEET_KEY_CHARS",
    "MEET_VALUE_CHARS",
    "OUTAGE_TRUST_LEASES",
    "PROTOCOL_VERSION",
    "REFUSALS_KEPT",
    "Ack",
    "Capabilities",
    "Challenge",
    "Check",
    "Checked",
    "Command",
    "Commitment",
    "CoordinatorMessage",
    "Count",
    "Digest",
    "Done",
    "Down",
    "EpochNo",
    "EpochOrder",
    "Expel",
    "Fault",
    "Finished",
    "Gone",
    "Heartbeat",
    "Hello",
    "Identity",
    "Knock",
    "LeaderMessage",
    "Leave",
    "Links",
    "Meet",
    "Met",
    "Name",
    "NodeMessage",
    "NodeName",
    "PolicyMsg",
    "Probe",
    "Progress",
    "PublicKey",
    "Refusal",
    "Refused",
    "RelayHello",
    "RelayMessage",
    "RelayWelcome",
    "Report",
    "Resume",
    "RoleName",
    "Said",
    "Seconds",
    "Signature",
    "StepPoint",
    "TensorSpec",
    "Term",
    "Up",
    "Validation",
    "Vanished",
    "Verify",
    "Welcome",
    "down_text",
    "encode",
    "parse_coordinator_message",
    "parse_knock",
    "parse_leader_message",
    "parse_node_message",
    "parse_relay_message",
]


NodeMessage = Annotated[
    Hello | Heartbeat | Progress | Fault | Leave | Done | Validation | Report | Meet | Links | Vanished | Checked,
    Field(discriminator="type"),
]


CoordinatorMessage = Annotated[
    Challenge | Welcome | Refused | Ack | EpochOrder | Expel | Finished | Command | Met | Probe | Check | Verify,
    Field(discriminator="type"),
]


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
    forwarding: Annotated[str, Field(max_length=300)] = ""
    """Where it forwards for members behind NAT (HOST:PORT; empty: it does not)."""


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
    """Members heard from since the last batch whose step changed since the relay last said it."""
    steps: Annotated[list[Count], Field(max_length=MAX_MEMBERS)] = []
    """Their steps, in the order of ``alive``."""
    heard_within: Seconds = 0.0
    """The summary of its members' liveness: every member whose session the relay holds was
    heard within this many seconds before the batch was sent, except those in ``unheard``."""
    unheard: Annotated[list[Name], Field(max_length=MAX_MEMBERS)] = []
    unheard_s: Annotated[list[Seconds], Field(max_length=MAX_MEMBERS)] = []
    """How long before the batch each of ``unheard`` was last heard, in its order."""
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
        # pydantic-core reads the JSON and validates it in one pass: a relay's batch of a
        # hundred reports in a third of the time json.loads then validate_python took. The
        # models only hold what JSON carries (no tuples, enums or bytes a strict Python
        # validation would refuse from it), so both accept the same messages alike.
        return adapter.validate_json(data, strict=True)
    except ValidationError:
        pass  # the steps below say what is wrong, as they always did
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
