"""The sync phase's transfer (`comm.transfer.sync_state`) over the epoch's world group as it
is across zones: lazily connected (`unit.comm.lazy`), ranks as threads, no sockets."""

from __future__ import annotations

import threading

import pytest

from unbroken.comm.group import EpochScope
from unbroken.comm.transfer import SyncResult, sync_state
from unbroken.testing.fake import FakeWorld
from unit.comm.lazy import Connections, LazyGroup
from unit.comm.test_fake_reduce import run, trained_state


@pytest.mark.parametrize("streams", [1, 5, 8])
@pytest.mark.parametrize("roles", ["dddrr", "rrddd", "drdrd"])
def test_several_donors_and_receivers_complete_on_a_lazily_connected_group(roles: str, streams: int) -> None:
    """A pair connects on its first use, which blocks until the peer's (`Connections`, at its
    strictest). The transfer cannot wait in a cycle: every donor serves the receivers in rank
    order, and both ends of a pair post its operations in one order (the source's description,
    the counts and asks, then the chunks asked, ascending). Donors serving the receivers in
    orders of their own (rotated, say, to spread the load) hang here in 6 of these 9 cases: a
    chunk's first use of a stream falls beyond a receiver's first window of posts, and two
    donors each wait for a receiver that waits for the other's chunks."""
    n = len(roles)
    world, connections = FakeWorld(n), Connections(streams, timeout_s=5.0)
    # Donors at step 12 alike; each receiver behind with a state of its own (every chunk differs).
    states = [trained_state(1, 12) if role == "d" else trained_state(7 + r, 3) for r, role in enumerate(roles)]

    def member(r: int) -> SyncResult:
        scope = EpochScope(threading.Event(), lambda: None, 10.0)
        return sync_state(LazyGroup(world, r, connections), r, n, states[r], scope, chunk_bytes=1024)

    out = run(n, member, timeout=30)  # every rank's outcome is checked
    failed = {r: v for r, v in out.items() if isinstance(v, BaseException)}
    assert not failed, failed
    donors = [r for r, role in enumerate(roles) if role == "d"]
    for r, role in enumerate(roles):
        result = out[r]
        assert isinstance(result, SyncResult)
        if role == "r":
            assert result.role == "receiver" and set(result.peers) == set(donors), result
            assert states[r].step == 12 and states[r].digest() == states[donors[0]].digest()
        else:
            assert result.role in ("source", "donor") and result.megabytes > 0, result
