"""Where the plan puts members that accept no connection (behind NAT, `--no-inbound`).

Such a member's peers reach it only through a forwarder (`unbroken.comm.forward`): every
byte sent to it crosses one more hop, and the forwarder's death cuts it off. So it sits
where its traffic is smallest. With zones, each zone's leader (its first member in rank
order, `unbroken.sched.zones.Zones.leaders`) sums its members' contributions and exchanges
them with the other zones' leaders; a member is a leaf otherwise, sending one contribution
and receiving one result. A NAT'd member leads its zone only where every member of the
zone is NAT'd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def reachable_first(order: Sequence[str], no_inbound: Callable[[str], bool]) -> list[str]:
    """``order`` with the members that accept no connection moved behind the others, each
    part kept in its order (a stable sort): no zone with a reachable member is led by one
    that is not."""
    return sorted(order, key=no_inbound)
