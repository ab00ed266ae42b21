"""Where a node looks for the job's leader, and when it leaves one (`client.ControlClient`).

With etcd, the leader it names is tried first (behind any relay this node was given), then
the addresses given; a leader that stops acknowledging heartbeats is left as soon as etcd
shows it lost its lease. Without etcd, the given addresses are all there is.
"""

from __future__ import annotations

from collections.abc import Sequence

from unbroken.config import parse_address
from unbroken.control import records
from unbroken.control.election import find_leader, leader_key
from unbroken.control.etcd import Etcd
from unbroken.errors import EtcdUnavailable

Address = tuple[str, int]


async def candidates(
    etcd: Etcd | None, prefix: str, token: str | None, addresses: Sequence[Address], relays: Sequence[Address]
) -> tuple[list[Address], str]:
    """Where to look for the leader: through a relay first, then the leader etcd names,
    then the given addresses; and why etcd named none ("" when it did, or without etcd)."""
    given = [*relays, *addresses]
    if etcd is None:
        return given, ""
    try:
        found = await find_leader(etcd, prefix, token)
    except EtcdUnavailable as exc:
        return given, str(exc)
    if found is None:
        return given, f"etcd has no leader under {prefix!r} that may be followed"
    leader = parse_address(str(found[0]["address"]))  # checked by `records.leader_problem`
    return [*relays, leader, *(a for a in addresses if a != leader)], ""


async def leader_moved(etcd: Etcd | None, prefix: str, token: str | None, term: int) -> bool:
    """True when etcd shows no leader, or one of another term than ``term``."""
    if etcd is None:
        return False
    try:
        kv = await etcd.get(leader_key(prefix))
    except EtcdUnavailable:
        return False  # cut off from etcd too: nothing is known; the lease decides
    if kv is not None and records.leader(kv, token) is None:
        return False  # a record nobody may follow says nothing of the leader: the lease decides
    return kv is None or kv.create_revision != term


def unreachable_message(
    addresses: Sequence[Address], etcd: Sequence[str], prefix: str, timeout_s: float, why: str
) -> str:
    """What a node that found no coordinator says, and what to check."""
    where = ", ".join(f"{h}:{p}" for h, p in addresses)
    if etcd:
        return (
            f"found no coordinator leading under {prefix!r} in etcd at {', '.join(etcd)}"
            f"{' or at ' + where if where else ''} within {timeout_s:g} s "
            f"({why}); check that `unbroken coordinator --etcd ...` runs with "
            "the same --etcd-prefix, and that a majority of etcd is up"
        )
    return (
        f"could not reach a coordinator at {where} within {timeout_s:g} s "
        f"({why}); check the address and that `unbroken coordinator` is running there"
    )
