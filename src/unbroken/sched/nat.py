"""Where the plan puts members that accept no connection (behind NAT, `--no-inbound`).

Such a member's peers reach it only through a forwarder (`unbroken.comm.forward`): every
byte sent to it crosses one more hop, and the forwarder's death cuts it off. So it sits
where its traffic is smallest. With zones, each zone's leader (its first member in rank
order, `unbroken.sched.zones.Zones.leaders`) sums its members' contributions and exchanges
them with the other zones' leaders; a member is a leaf otherwise, sending one contribution
and receiving one result. A NAT'd member leads its zone only where every member of the
zone is NAT'd.

Members that offer forwarding (``--offer-forwarding``) say where in their hello; each epoch
order names those of its members (`forwarders`), so a member behind NAT needs no list of
its own: it dials the first that answers, the next once that one is lost.

A member nobody declared behind NAT but that most of the others cannot connect to
(`unbroken.comm.reach`) is moved behind a forwarder where the epoch has one (`unreachable`):
the next epoch order names it among those its peers reach through one, and it goes there
as with ``--no-inbound``. It stays there until it restarts, reachable again or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


def reachable_first(order: Sequence[str], no_inbound: Callable[[str], bool]) -> list[str]:
    """``order`` with the members that accept no connection moved behind the others, each
    part kept in its order (a stable sort): no zone with a reachable member is led by one
    that is not."""
    return sorted(order, key=no_inbound)


MAX_FORWARDERS = 16
"""Forwarders an epoch order names at most (a NAT'd node needs one that answers)."""


def forwarders(members: Sequence[tuple[str, bool]], relays: Sequence[str] = ()) -> list[str]:
    """The forwarders an epoch order names: of its members (each ``(HOST:PORT offered or
    "", accepts no connection)``, in rank order), those that offer one and accept
    connections themselves (a NAT'd member's offer reaches nobody), then the ``relays'``
    offers (each HOST:PORT), at most `MAX_FORWARDERS`."""
    offers = [offer for offer, no_inbound in members if offer and not no_inbound]
    return list(dict.fromkeys([*offers, *relays]))[:MAX_FORWARDERS]


@dataclass(frozen=True)
class Unreachable:
    """What becomes of a member most of the others could not connect to."""

    forwarder: str | None
    """The forwarder its peers will reach it through (HOST:PORT); None: it is benched."""
    reason: str
    """Why, for the event and `unbroken status`: whom it is unreachable from, and the fix."""


def unreachable(name: str, accusers: Sequence[str], offers: Sequence[str], behind: bool) -> Unreachable:
    """The verdict on member ``name`` that ``accusers`` (most of the others, by name) could
    not connect to: moved behind the first of ``offers`` (the forwarders its epoch names,
    `forwarders`), unless it is ``behind`` one already (then the forwarder's port is what
    they could not reach, and only the bench is left), or none is offered (benched, told how
    to fix it, in few words: `unbroken status` shows the start of an event's reason)."""
    said = f"{name} unreachable from {', '.join(accusers)}"
    if behind:
        return Unreachable(None, f"{said}, through its forwarder too: benched")
    if offers:
        return Unreachable(offers[0], f"{said}: now behind forwarder {offers[0]}")
    fix = "to fix: --offer-forwarding PORT on a reachable member, or open its gloo port to the others"
    return Unreachable(None, f"{said}, no forwarder to move it behind ({fix}): benched")
