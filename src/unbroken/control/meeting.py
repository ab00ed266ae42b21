"""The data plane's rendezvous, kept by the leader and spoken on the control sessions.

gloo meets through a key-value store: each rank writes its address under its rank and
reads everyone else's. A store listening on its own port is readable and writable by
anyone who reaches it (addresses leak; deleted or forged keys stop every group build).
Here each node keeps a private in-memory store per epoch (`unbroken.comm.group`); what
its data plane writes goes to the leader as `Meet`, and the leader hands every entry
to the epoch's members as `Met`. Only admitted members speak on those sessions, and the
leader checks each entry before anyone sees it:

* it belongs to the newest or the previous epoch, and its writer is a member of it;
* it is named ``GROUP/STREAM/RANK`` for one of the epoch's groups (`Zones.groups`) and
  one of that group's streams (the order's ``streams`` for the groups that cross zones),
  and RANK is the writer's own rank in that group: no member writes another's address;
* an entry, once written, never changes.

It also knows who has not written: a member whose entry for a group is still missing
``deadline_s`` after that group's build got under way never joined the data plane, and is
named as the epoch's culprit (`Rendezvous.absent`). The world's clock waits for a member of
the epoch before, not the first entry: after a join or a rebalance the newcomer builds at
once while the others finish their step (a DiLoCo round: many steps) first.
"""

from __future__ import annotations

import base64
import binascii
import socket
import struct
from dataclasses import dataclass, field

from unbroken.control import messages as m
from unbroken.errors import ProtocolError
from unbroken.sched.zones import WORLD, Zones

EPOCHS_KEPT = 2
"""Entries of the newest epoch and the one before (a slow member may still build it)."""

PROBES_PER_ACCUSER = 8
"""Addresses one member may have the others try per epoch: each costs a message to every
member; an honest node names at most half of its peers (past that, itself)."""
_SOCKADDR_BYTES = 128
"""``sockaddr_storage``, followed in gloo's address by an 8-byte sequence number."""
_FAMILIES = {socket.AF_INET: 4, socket.AF_INET6: 16}
"""Address families gloo listens on, with the length of their addresses."""


def data_address(raw: bytes) -> tuple[str, int]:
    """The host and port a rank's rendezvous entry asks its peers to connect to.

    The entry is gloo's own (its TCP transport's ``Rank``: a hostname and a socket address
    with native 64-bit lengths; no sequence number per peer, as members name peers by rank,
    `unbroken.comm.group.RANK_AS_SEQUENCE`). gloo reads it without
    bounds checks: a length that lies makes every peer read past the entry and crash, so
    the leader parses each entry here before anyone sees it (`ValueError` names the fault).
    """
    view = memoryview(raw)
    try:
        (name_len,) = struct.unpack_from("<Q", view, 0)
        if name_len > 255:
            raise ValueError(f"a host name of {name_len} bytes")
        at = 8 + name_len
        (addr_len,) = struct.unpack_from("<Q", view, at)
        at += 8
        if addr_len != _SOCKADDR_BYTES + 8 or at + addr_len > len(raw):
            raise ValueError(f"an address of {addr_len} bytes")
        (family, port) = struct.unpack_from("<H", view, at) + struct.unpack_from(">H", view, at + 2)
    except struct.error:
        raise ValueError(f"{len(raw)} bytes, too few for an entry") from None
    if family not in _FAMILIES or port == 0:
        raise ValueError(f"an address of family {family}, port {port}")
    rest = len(raw) - at - addr_len
    if rest:  # every member names peers by rank (`unbroken.comm.group.RANK_AS_SEQUENCE`)
        raise ValueError(f"{rest} bytes of peer sequence numbers (a node not naming peers by rank)")
    start = at + 4 if family == socket.AF_INET else at + 8  # sin6_flowinfo comes first
    length = _FAMILIES[family]
    host = socket.inet_ntop(family, bytes(view[start : start + length]))
    if family == socket.AF_INET6 and (scope := struct.unpack_from("<I", view, start + length)[0]):
        host = f"{host}%{scope}"  # a link-local address means nothing without its interface
    return host, port


def _number(text: str) -> bool:
    """A rank or stream as gloo writes it: decimal digits, no sign, no padding (one spelling
    per entry, or a member could write its entry under many keys)."""
    return text.isascii() and text.isdigit() and text == str(int(text))


def with_port(raw: bytes, port: int) -> bytes:
    """A rank's entry with another port (fault injection: an address nobody can reach)."""
    (name_len,) = struct.unpack_from("<Q", raw, 0)
    at = 8 + name_len + 8 + 2
    return raw[:at] + struct.pack(">H", port) + raw[at + 2 :]


@dataclass
class _Epoch:
    members: list[str]
    groups: dict[str, dict[str, int]]
    """Group name → member → its rank in the group."""
    streams: dict[str, int] = field(default_factory=dict)
    """Group name → its streams (an entry each per rank: `Zones.streams`)."""
    entries: dict[str, str] = field(default_factory=dict)
    missing: dict[str, set[str]] = field(default_factory=dict)
    """Member → the groups it has not written its entry for yet."""
    pending: dict[str, str] = field(default_factory=dict)
    """Entries written since the last `take`."""
    veterans: set[str] = field(default_factory=set)
    """Members of the epoch before too: they build once their step (or round) is over (all
    members, for an epoch with none)."""
    started: dict[str, float] = field(default_factory=dict)
    """Group → when most of its members had written (its build is under way)."""
    named: set[str] = field(default_factory=set)
    """Groups whose absentees were named already."""
    addresses: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)
    """(member, group) → the data-plane address (host, port) its entry gave."""
    probed: set[tuple[str, str]] = field(default_factory=set)
    """(member, group) addresses the others were asked to try (`probe`)."""
    asked: dict[str, int] = field(default_factory=dict)
    """Accuser → how many addresses it had the others try."""


class Rendezvous:
    """The rendezvous entries of the last epochs, checked as they arrive."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._epochs: dict[int, _Epoch] = {}

    def order(self, order: m.EpochOrder) -> None:
        """An epoch was ordered: its entries may come (older epochs' go)."""
        zones = Zones(tuple(order.zones) if order.zones else tuple("" for _ in order.members), tuple(order.ring))
        groups = {name: {order.members[r]: i for i, r in enumerate(ranks)} for name, ranks in zones.groups().items()}
        missing: dict[str, set[str]] = {mid: set() for mid in order.members}
        for name, ranks in groups.items():
            for mid in ranks:
                missing[mid].add(name)
        before = self._epochs[max(self._epochs)].members if self._epochs else []
        veterans = set(order.members) & set(before) or set(order.members)
        streams = {name: zones.streams(name, order.policy.streams) for name in groups}
        self._epochs[order.epoch] = _Epoch(
            list(order.members), groups, streams=streams, missing=missing, veterans=veterans
        )
        for old in sorted(self._epochs)[:-EPOCHS_KEPT]:
            del self._epochs[old]

    def put(self, member_id: str, meet: m.Meet, now: float) -> None:
        """Take one member's entry; raise `ProtocolError` (the session is dropped) for an
        entry no honest node writes. Entries of an epoch that is over are ignored."""
        ep = self._epochs.get(meet.epoch)
        if ep is None or member_id not in ep.missing:
            return  # late, or for an epoch this member was not ordered into
        parts = meet.key.split("/")  # GROUP/STREAM/RANK, as gloo names a rank's entry
        group, stream, rank = parts if len(parts) == 3 else ("", "", "")
        ranks = ep.groups.get(group)
        if ranks is None or not _number(rank):
            raise ProtocolError(f"rendezvous entry {meet.key!r} names no group of epoch {meet.epoch}")
        streams = ep.streams.get(group, 1)
        if not (_number(stream) and int(stream) < streams):
            raise ProtocolError(f"rendezvous entry {meet.key!r} names no stream of group {group} (it has {streams})")
        if ranks.get(member_id) != int(rank):
            raise ProtocolError(
                f"rendezvous entry {meet.key!r}: rank {rank} of group {group} is not this member's "
                f"({ranks.get(member_id)})"
            )
        try:
            raw = base64.b64decode(meet.value, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"rendezvous entry {meet.key!r} is not base64") from None
        try:
            address = data_address(raw)
        except ValueError as exc:
            raise ProtocolError(f"rendezvous entry {meet.key!r} is not gloo's: {exc}") from None
        known = ep.entries.get(meet.key)
        if known is not None:
            if known != meet.value:
                raise ProtocolError(f"rendezvous entry {meet.key!r} written twice with different values")
            return
        ep.entries[meet.key] = ep.pending[meet.key] = meet.value
        if stream != "0":
            return  # gloo writes a stream's entry once the stream before connected: the first says who came
        ep.missing[member_id].discard(group)
        ep.addresses[member_id, group] = address
        # The world's build starts as members finish their step (they finish it together:
        # it ends in their common all-reduce), newcomers at once: its clock starts with the
        # first member of the epoch before. Zone and leaders' groups are built right after
        # the world's, which completes for all at once: their first entry starts theirs.
        if group not in ep.started and (group != WORLD or member_id in ep.veterans):
            ep.started[group] = now

    def take(self) -> dict[int, tuple[list[str], dict[str, str]]]:
        """Entries written since the last call, by epoch, with the members to send them to."""
        out = {}
        for epoch, ep in self._epochs.items():
            if ep.pending:
                out[epoch] = (ep.members, ep.pending)
                ep.pending = {}
        return out

    def entries(self, epoch: int) -> dict[str, str]:
        """Every entry of ``epoch`` so far (for a member whose session came back)."""
        ep = self._epochs.get(epoch)
        return dict(ep.entries) if ep is not None else {}

    def probe(self, epoch: int, member_id: str, group: str, accuser: str) -> tuple[list[str], str, int] | None:
        """The first time a member of ``epoch`` (``accuser``) says it cannot reach
        ``member_id`` in ``group``: the others to ask, and the address they should try
        (None: asked already, unknown, or the accuser has asked enough)."""
        ep = self._epochs.get(epoch)
        key = (member_id, group)
        if ep is None or accuser not in ep.missing or key in ep.probed or key not in ep.addresses:
            return None
        if ep.asked.get(accuser, 0) >= PROBES_PER_ACCUSER:
            return None
        ep.probed.add(key)
        ep.asked[accuser] = ep.asked.get(accuser, 0) + 1
        host, port = ep.addresses[key]
        return [mid for mid in ep.members if mid != member_id], host, port

    def absent(self, epoch: int, now: float) -> dict[str, list[str]]:
        """Members of ``epoch`` whose entry for a group is still missing ``deadline_s`` after
        most of that group wrote theirs, each with those groups; named once a group."""
        ep = self._epochs.get(epoch)
        if ep is None:
            return {}
        due = {g for g, t in ep.started.items() if g not in ep.named and now - t >= self.deadline_s}
        if not due:
            return {}  # every tick: not a walk over every member still missing an entry
        ep.named |= due
        out: dict[str, list[str]] = {}
        for mid, groups in ep.missing.items():
            if late := sorted(groups & due):
                out[mid] = late
        return out
