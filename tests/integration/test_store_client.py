"""A node's store client across coordinator restarts (real TCPStores on loopback)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from unbroken.comm.group import StoreClient


def test_a_build_stuck_on_a_dead_coordinators_store_does_not_hold_up_the_next_one() -> None:
    with socket.socket() as s:  # a port nobody listens on: the old coordinator's, gone
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    live = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = StoreClient()
    stuck = threading.Thread(target=lambda: _try(client, "old", dead), daemon=True)
    stuck.start()
    time.sleep(0.3)
    start = time.monotonic()
    store = client.get("new", "127.0.0.1", live.port, 10.0)
    store.set("k", "v")
    assert time.monotonic() - start < 2.0 and stuck.is_alive(), "the new store must not wait for the dead one"


def test_an_epochs_connection_is_reused_only_once_its_builds_finished() -> None:
    live = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = StoreClient()
    first = client.get("c", "127.0.0.1", live.port, 10.0)
    # Not given back (an abandoned build may still wait on it): the next epoch gets another,
    # which works while the first is blocked.
    blocked = threading.Thread(target=lambda: _wait_forever(first), daemon=True)
    blocked.start()
    second = client.get("c", "127.0.0.1", live.port, 10.0)
    assert second is not first
    second.set("k", "v")
    client.give_back("c", "127.0.0.1", live.port, second)
    assert client.get("c", "127.0.0.1", live.port, 10.0) is second  # a healthy node keeps one connection
    client.give_back("old", "127.0.0.1", live.port, first)  # another incarnation's: dropped
    assert client.get("c", "127.0.0.1", live.port, 10.0) not in (first, second)
    blocked.join(10)  # its wait times out: no thread is left inside the store when it goes


def _wait_forever(store: TCPStore) -> None:
    with contextlib.suppress(Exception):
        store.wait(["never"], timedelta(seconds=1))


def _try(client: StoreClient, cid: str, port: int) -> None:
    with contextlib.suppress(Exception):  # the dead store: refused after retrying for its timeout
        client.get(cid, "127.0.0.1", port, 5.0)
