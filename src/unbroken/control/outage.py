"""Evidence that a coordinator outage is real (`connection.State.SUSPENDED`).

An outage is trusted a lease at a time (`messages.OUTAGE_TRUST_LEASES`): each needs
evidence, asked for at once and then every quarter lease, counted from when it was asked,
that no coordinator can have formed an epoch without this node. A coordinator that starts
(or takes over) does not leave out a member of the epoch it finds until as long after it
started (`Membership`) unless most of that epoch's other members find nothing listening at
the member's data-plane address (its process is gone: it commits nothing), so the evidence
is that none started: with etcd, no leader of a newer term and no newer epoch published
(the old leader's key may outlive it while its address refuses connections), or no etcd
majority at all (every member refuses or answers that it has no raft leader, and one that
answers lists no more members than this node was given: nobody can be elected); without
etcd, every coordinator address refuses connections.

Trust that lapses (this node cut off: no answer at all) counts as a lapse and is not
renewed by later evidence: the step in flight is not committed, and the node waits for a
coordinator's order. A refused connection is taken to mean that nothing listens there: a
firewall that rejects (rather than drops) this node's packets to a live coordinator would
mislead it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from unbroken.config import parse_address
from unbroken.control import records
from unbroken.control.election import epoch_key, leader_key
from unbroken.control.etcd import Etcd, View
from unbroken.errors import ConfigError, EtcdUnavailable


async def nobody_else_leads(
    etcd: Etcd | None,
    addresses: Sequence[tuple[str, int]],
    prefix: str,
    token: str | None,
    *,
    term: int,
    epoch: int,
    trust_s: float,
) -> bool:
    """Evidence, as of when this was called, that no coordinator has started since the
    node's last session (of leader ``term``, its newest epoch ``epoch``): none can have
    formed an epoch without it (module docstring). Each check takes a part of ``trust_s``."""
    if etcd is None:
        wait = trust_s / 4
        refusals = await asyncio.gather(*(refuses(h, p, wait) for h, p in addresses))
        return bool(refusals) and all(refusals)
    etcd.timeout_s = trust_s / 6  # a silent member must not use up the check
    views = await etcd.views()
    if View.LED not in views:
        # Every member down or outside a majority: nobody can be elected. (A silent one
        # might be leading a majority that this node cannot see; so might members this
        # node was not told of.)
        if not all(v in (View.DOWN, View.LEADERLESS) for v in views):
            return False
        try:
            return await etcd.cluster_size() <= len(set(etcd.endpoints))
        except EtcdUnavailable:
            return False
    try:
        held = await etcd.get(leader_key(prefix))
        published = await etcd.get(epoch_key(prefix))
    except EtcdUnavailable:
        return False
    # A record that may not be believed hides what was there: no evidence either way.
    epoch_record = records.epoch(published, token) if published is not None else {"epoch": 0}
    if epoch_record is None or epoch_record["epoch"] > epoch:
        return False  # an epoch this node has not had (or a record it cannot believe)
    if held is None:
        return True
    record = records.leader(held, token)
    if record is None or held.create_revision != term:
        return False
    try:  # the leader of this node's term: still there unless its address refuses connections
        host, port = parse_address(str(record.get("address", "")))
    except ConfigError:
        return False
    return await refuses(host, port, trust_s / 4)


async def refuses(host: str, port: int, timeout_s: float) -> bool:
    """True when ``host:port`` refuses a connection (nothing listens there); False when it
    accepts or does not answer in time."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False
