"""Process groups rebuilt for every membership epoch, and waits that can be abandoned.

A gloo collective whose peer froze blocks until its timeout, and destroying its process
group waits for that too. So the step loop never blocks on either: collectives are waited
on against an abort signal, and abandoned groups are kept alive in a `Graveyard` until
their own timeout has passed, then dropped on a background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from torch._C._distributed_c10d import ProcessGroupGloo
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from unbroken.errors import CollectiveFailed, EpochAborted, UnbrokenError

T = TypeVar("T")

log = logging.getLogger(__name__)

AbortCheck = Callable[[], str | None]
"""Returns a reason to give up, or None to keep waiting."""


@dataclass
class EpochGroup:
    """The data-plane group of one epoch."""

    epoch: int
    rank: int
    members: list[str]
    shares: list[int]
    pg: Any
    built_in_s: float = 0.0
    roles: list[str] = field(default_factory=list)
    microbatches: list[int] = field(default_factory=list)
    extra_pgs: list[Any] = field(default_factory=list)
    """Zone and leader groups of this epoch (buried with the epoch's group)."""

    @property
    def role(self) -> str:
        return self.roles[self.rank] if self.roles else "trainer"

    @property
    def microbatch(self) -> int:
        return self.microbatches[self.rank] if self.microbatches else 0

    @property
    def size(self) -> int:
        return len(self.members)


def wait_until(
    done: Callable[[], bool],
    wake: threading.Event,
    should_abort: AbortCheck,
    deadline_s: float,
    what: str,
    poll_s: float = 0.05,
) -> None:
    """Block until ``done()``; raise `EpochAborted` on abort, `CollectiveFailed` past the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        wake.clear()
        if done():
            return
        reason = should_abort()
        if reason is not None:
            raise EpochAborted(f"{what} abandoned: {reason}")
        left = end - time.monotonic()
        if left <= 0:
            raise CollectiveFailed(f"{what} ran past its {deadline_s:g} s deadline")
        wake.wait(min(left, poll_s))


def wait_work(work: Any, wake: threading.Event, should_abort: AbortCheck, deadline_s: float, what: str) -> None:
    """Wait for a c10d work item against an abort signal; surface its error as `CollectiveFailed`."""
    fut = work.get_future()
    fut.add_done_callback(lambda _f: wake.set())
    wait_until(fut.done, wake, should_abort, deadline_s, what)
    try:
        work.wait()
    except RuntimeError as exc:
        raise CollectiveFailed(f"{what} failed: {str(exc).splitlines()[0][:300]}") from exc


def run_abortable(
    fn: Callable[[], T], wake: threading.Event, should_abort: AbortCheck, deadline_s: float, what: str
) -> T:
    """Run blocking data-plane work (gloo send/recv have no future) on a helper thread.

    If the epoch is abandoned, the helper is left to end at the group's own timeout.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc
        finally:
            wake.set()

    threading.Thread(target=target, name=f"dataplane-{what}", daemon=True).start()
    wait_until(lambda: bool(box), wake, should_abort, deadline_s, what)
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, RuntimeError) and not isinstance(exc, UnbrokenError):
            raise CollectiveFailed(f"{what} failed: {str(exc).splitlines()[0][:300]}") from exc
        raise exc
    value: T = box["value"]
    return value


class StoreClient:
    """The store connections of one coordinator incarnation (a restarted one gets new ones).

    A store client runs one request at a time, and a group build blocks its connection until
    every rank has arrived: an abandoned build still waiting for a peer that never came
    would hold every later build on that connection until its timeout. So each epoch's
    builds get a connection of their own (`EpochStore`), and a connection whose builds
    finished goes back to a pool for the next epoch: a healthy node keeps one connection,
    not one per epoch (each new one costs a reverse lookup of the peer's address on both
    sides, which takes seconds where DNS is slow or rate-limited)."""

    def __init__(self) -> None:
        self._key: tuple[str, str, int] | None = None
        self._base: TCPStore | None = None
        self._idle: list[TCPStore] = []
        self._lock = threading.Lock()

    def get(self, coordinator_id: str, host: str, port: int, timeout_s: float) -> TCPStore:
        """A connection of its own for this coordinator incarnation's store.

        Connecting happens outside the lock: an abandoned group build still trying a dead
        coordinator's store (it retries until its timeout) must not hold up the build of
        the next epoch on the new coordinator's."""
        key = (coordinator_id, host, port)
        with self._lock:
            if self._key == key:
                if self._idle:
                    return self._idle.pop()
                base = self._base
            else:
                base = None
        if base is None:
            base = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
            with self._lock:
                if self._key != key:  # older incarnations' connections go
                    self._key, self._base, self._idle = key, base, []
                base = self._base
            assert base is not None
            return base.clone()  # type: ignore[attr-defined,no-any-return]
        return base.clone()  # type: ignore[attr-defined,no-any-return]

    def give_back(self, coordinator_id: str, host: str, port: int, connection: TCPStore) -> None:
        """A connection whose builds all finished, for the next epoch."""
        with self._lock:
            if self._key == (coordinator_id, host, port):
                self._idle.append(connection)

    def reset(self) -> None:
        """Forget the connections after an error; the next `get` reconnects."""
        with self._lock:
            self._key, self._base, self._idle = None, None, []


class EpochStore:
    """The store connection of one epoch's group builds (the epoch's group, then its zone
    and leaders' groups, one after the other), taken when first needed; `release` hands it
    back once they all finished (`StoreClient`)."""

    def __init__(self, take: Callable[[], TCPStore], give_back: Callable[[TCPStore], None] | None = None) -> None:
        self._take = take
        self._give_back = give_back
        self._connection: TCPStore | None = None
        self._lock = threading.Lock()

    def __call__(self) -> TCPStore:
        with self._lock:
            if self._connection is None:
                self._connection = self._take()
            return self._connection

    def release(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None and self._give_back is not None:
            self._give_back(connection)


def build_group(
    store: Callable[[], TCPStore],
    prefix: str,
    rank: int,
    size: int,
    gloo_host: str | None,
    timeout_s: float,
    wake: threading.Event,
    should_abort: AbortCheck,
) -> tuple[Any, float]:
    """Build a `ProcessGroupGloo` for one epoch without letting a missing peer block us.

    ``store`` gives the store connection to meet on (`EpochStore`: one per epoch). The store
    client and the constructor block (the latter until every rank has connected), so both
    run on a helper thread;
    if the epoch is superseded meanwhile we walk away and the helper ends at its timeout.
    """
    result: dict[str, Any] = {}

    def build() -> None:
        try:
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timedelta(seconds=timeout_s)
            if gloo_host:
                opts._devices = [ProcessGroupGloo.create_device(hostname=gloo_host)]
            else:
                opts._devices = [ProcessGroupGloo.create_default_device()]
            result["pg"] = ProcessGroupGloo(PrefixStore(prefix, store()), rank, size, opts)
        except Exception as exc:  # reported to the waiting thread
            result["error"] = exc
        finally:
            wake.set()

    start = time.monotonic()
    threading.Thread(target=build, name=f"pg-build-{prefix}", daemon=True).start()
    wait_until(lambda: bool(result), wake, should_abort, timeout_s, f"building group {prefix}")
    if "error" in result:
        raise CollectiveFailed(f"building group {prefix} failed: {result['error']}")
    return result["pg"], time.monotonic() - start


class Graveyard:
    """Keeps abandoned process groups referenced until their collectives have timed out."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._graves: list[tuple[float, Any]] = []
        self._lock = threading.Lock()

    def bury(self, pg: Any) -> None:
        if pg is None:
            return
        with self._lock:
            self._graves.append((time.monotonic() + self.hold_s, pg))

    def sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [pg for t, pg in self._graves if t <= now]
            self._graves = [(t, pg) for t, pg in self._graves if t > now]
        if due:
            threading.Thread(target=due.clear, name="pg-reaper", daemon=True).start()
