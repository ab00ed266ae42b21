"""Process groups rebuilt for every membership epoch, and waits that can be abandoned.

A gloo collective whose peer froze blocks until its timeout, and destroying its process
group waits for that too. So the step loop never blocks on either: collectives are waited
on against an abort signal, and abandoned groups are kept alive in a `Graveyard` until
their own timeout has passed, then dropped on a background thread.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.distributed import HashStore, PrefixStore  # type: ignore[attr-defined]

from unbroken.errors import CollectiveFailed, EpochAborted, TransferError, UnbrokenError, Where
from unbroken.specs import Role

T = TypeVar("T")

log = logging.getLogger(__name__)

RANK_AS_SEQUENCE = "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"
"""With it, a rank's rendezvous entry is its address alone (a hundred-odd bytes) instead of
its address and a sequence number per peer (8 bytes × the group's size): the entries every
member receives grow with the group, not with its square. Peers then name themselves by
rank when they connect, so a device serves one group and stream (`Meeting.devices`). Set for the whole
process, once, before any data-plane thread runs: every member must name peers the same way."""
os.environ[RANK_AS_SEQUENCE] = "1"
PUBLISH_S = 0.002
"""How often a build passes on what its rank wrote to the rendezvous (`Meeting.publish`)."""

AbortCheck = Callable[[], "EpochAborted | None"]
"""Why the epoch must be left now, if it must: the error to raise (`Expelled` when this node
was expelled), with where the node was; None to keep waiting."""


@dataclass(frozen=True)
class EpochScope:
    """What every wait of one epoch shares: the event that wakes it early (a collective
    done, an order arrived), the check that ends it (`AbortCheck`), and how long any one
    wait may last. A node builds it once per epoch (`unbroken.train.runtime.Node.scope`);
    every collective, transfer and build of the epoch waits under it."""

    wake: threading.Event
    abort: AbortCheck
    timeout_s: float
    where: Callable[[], Where] = Where
    """Where this node is now (its errors carry it)."""


class Work(Protocol):
    """A collective in flight."""

    def wait(self) -> bool: ...

    def is_completed(self) -> bool: ...

    def get_future(self) -> torch.futures.Future[Any]: ...


class ProcessGroup(Protocol):
    """What the data plane uses of a process group: `ProcessGroupGloo`'s calls as they are
    made here, and all that `unbroken.testing.fake.FakeProcessGroup` has (unit tests run the
    reducer, transfers and the step loop on it)."""

    def size(self) -> int: ...

    def rank(self) -> int: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> Work:
        """Sum ``tensors[0]`` over the group, in place."""

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Work:
        """``outputs[0][r]`` is rank r's ``inputs[0]``."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work: ...


@dataclass
class EpochGroup:
    """The data-plane group of one epoch."""

    epoch: int
    rank: int
    members: list[str]
    shares: list[int]
    pg: ProcessGroup | None
    built_in_s: float = 0.0
    roles: list[Role] = field(default_factory=list)
    microbatches: list[int] = field(default_factory=list)
    extra_pgs: list[ProcessGroup] = field(default_factory=list)
    """Zone and leader groups of this epoch (buried with the epoch's group)."""
    lazy: bool = False
    """Its group over all members connects pairs on first use (`Meeting.devices`): a peer
    it cannot reach shows in a collective, not in the build."""
    addresses: dict[str, tuple[str, int]] = field(default_factory=dict)
    """The other members' data-plane addresses in its world group, once built (kept here: a
    new leader's welcome clears the rendezvous the build met on)."""

    @property
    def role(self) -> Role:
        return self.roles[self.rank] if self.roles else Role.TRAINER

    @property
    def microbatch(self) -> int:
        return self.microbatches[self.rank] if self.microbatches else 0

    @property
    def size(self) -> int:
        return len(self.members)


def wait_until(done: Callable[[], bool], scope: EpochScope, what: str, poll_s: float = 0.05) -> None:
    """Block until ``done()``; raise `EpochAborted` on abort, `CollectiveFailed` past the deadline."""
    end = time.monotonic() + scope.timeout_s
    while True:
        scope.wake.clear()
        if done():
            return
        reason = scope.abort()
        if reason is not None:
            raise reason.during(what)
        left = end - time.monotonic()
        if left <= 0:
            raise CollectiveFailed(f"{what} ran past its {scope.timeout_s:g} s deadline").at(scope.where())
        scope.wake.wait(min(left, poll_s))


def wait_work(work: Any, scope: EpochScope, what: str) -> None:
    """Wait for a c10d work item against an abort signal; surface its error as `CollectiveFailed`."""
    wait_all([work], scope, what)


def wait_all(works: list[Any], scope: EpochScope, what: str) -> None:
    """`wait_work` for several work items under one deadline (a failed one named by its place)."""
    futures = [work.get_future() for work in works]
    for fut in futures:
        fut.add_done_callback(lambda _f: scope.wake.set())
    wait_until(lambda: all(f.done() for f in futures), scope, what)
    _outcomes(works, scope, what)


def _outcomes(works: list[Any], scope: EpochScope, what: str) -> None:
    """Each finished work's outcome: the first that failed raised as `CollectiveFailed`,
    named by its place among ``works``."""
    for i, work in enumerate(works):
        try:
            work.wait()
        except RuntimeError as exc:
            part = f" (part {i + 1} of {len(works)})" if len(works) > 1 else ""
            raise _failed(f"{what}{part}", exc, scope) from exc


def _failed(what: str, exc: BaseException, scope: EpochScope) -> CollectiveFailed:
    """``exc`` (a backend's error, many lines long) as the failure of ``what``."""
    failed = CollectiveFailed(f"{what} failed: {str(exc).splitlines()[0][:300]}")
    failed.at(scope.where())
    return failed


POLL_DEVICE_S = 0.001
"""How often a wait on device work (`wait_polled`) looks again: it has no callback to wake it."""


def posted(post: Callable[[], T], scope: EpochScope, what: str) -> T:
    """``post()``'s work on a group, a backend's refusal to post failing it as a failed
    collective does: an NCCL communicator that torch's watchdog aborted after a peer's
    failure raises at the next post, before any wait could see the failure, and a lazily
    connected gloo group connects a pair inside its first post (a dead peer: "Connection
    closed by peer", a RuntimeError that ended the node).

    Raises:
        CollectiveFailed: the backend refused the post.
    """
    try:
        return post()
    except RuntimeError as exc:  # as `run_abortable` reads a backend's error
        if isinstance(exc, UnbrokenError):
            raise
        raise _failed(what, exc, scope) from exc


def wait_polled(works: list[Any], scope: EpochScope, what: str, group: Any) -> None:
    """`wait_all` for an NCCL group's work: its futures are done as soon as the work is
    queued on the group's stream, so completion is polled (``is_completed`` asks the GPU,
    without blocking). On the abort or past the deadline the group is aborted first
    (`abort_group`): its kernels would otherwise wait on a dead or frozen peer forever,
    holding the device. The step's next attempt runs on the next epoch's group.

    Raises:
        EpochAborted: the epoch was abandoned.
        CollectiveFailed: past the deadline, or the work failed.
    """
    try:
        wait_until(lambda: all(w.is_completed() for w in works), scope, what, poll_s=POLL_DEVICE_S)
    except (EpochAborted, CollectiveFailed):
        abort_group(group)
        raise
    _outcomes(works, scope, what)


def abort_group(group: Any) -> None:
    """Abort an NCCL group's communicator (its pending kernels end; the group is unusable
    after), on a thread of its own: the caller never waits on it. A group without
    ``abort`` (gloo's fails its collectives on a dead peer by itself) is left as it is."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        threading.Thread(target=abort, name="nccl-abort", daemon=True).start()


def run_abortable(fn: Callable[[], T], scope: EpochScope, what: str) -> T:
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
            scope.wake.set()

    threading.Thread(target=target, name=f"dataplane-{what}", daemon=True).start()
    wait_until(lambda: bool(box), scope, what)
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, RuntimeError) and not isinstance(exc, UnbrokenError):
            raise _failed(what, exc, scope) from exc
        if isinstance(exc, CollectiveFailed | TransferError):
            exc.at(scope.where())
        raise exc
    value: T = box["value"]
    return value


class EntryView(Protocol):
    """How a node that accepts no connection writes and reads the rendezvous
    (`unbroken.comm.tunnel.NatView`): what its entries advertise, and what its gloo reads
    of its peers'."""

    def advertise(self, epoch: int, raw: bytes) -> bytes:
        """The entry peers get for this node's ``raw`` one."""

    def translate(self, epoch: int, own: bytes, advertised: bytes, peer: bytes) -> bytes:
        """What this node's gloo reads for ``peer``'s entry of the stream where its own
        entry is ``own``, advertised as ``advertised``."""

    def forget(self, epoch: int) -> None:
        """``epoch`` is over (its entries are dropped)."""


class Meeting:
    """A node's side of the rendezvous (`unbroken.control.meeting`): a private in-memory
    store per epoch that its group builds meet on. Entries the data plane writes go to
    the leader through ``send``; entries the leader hands over are written in by
    `deliver`. Nothing listens on a port: no one outside the job reads or writes it.

    With a ``view`` (a node behind NAT), its entries are sent as the view advertises them,
    and a peer's entry reaches its gloo, translated, only once its own entry for the same
    stream is out: the translation depends on it."""

    def __init__(self, send: Callable[[int, str, bytes], None], keep: int = 3, view: EntryView | None = None) -> None:
        self._send = send
        self._keep = keep
        self.view = view
        self.view_from = 0
        """The first epoch whose entries go through ``view`` (`behind`)."""
        self._epochs: dict[int, _Entries] = {}
        self._lock = threading.Lock()

    def devices(self, epoch: int, group: str, host: str | None, lazy: bool = False, streams: int = 1) -> list[Any]:
        """The gloo devices (their listeners) for ``group`` of ``epoch``: one per build and
        stream, since peers identify themselves by rank (`RANK_AS_SEQUENCE`), and kept as
        long as the epoch's entries are, so their addresses stay reachable after a failed
        build (peers may be trying them, `unbroken.comm.reach`).

        ``lazy``: a group built on them connects a pair of ranks only when they first
        exchange data (reading the peer's entry then), not all N−1 pairs at its build: a
        ring all-gather opens 2 connections per rank, a transfer one per donor.
        ``streams``: the group gets that many gloo contexts, each with its own connections;
        its collectives take turns on them (and a send or receive takes the one its tag
        names), so work posted together travels over several connections at once."""
        ep = self._get(epoch)
        with self._lock:
            if group not in ep.devices:
                make = functools.partial(ProcessGroupGloo.create_device, hostname=host) if host else None
                ep.devices[group] = [
                    make(lazy_init=lazy) if make else ProcessGroupGloo.create_default_device(lazy_init=lazy)
                    for _ in range(streams)
                ]
            return ep.devices[group]

    def behind(self, view: EntryView, epoch: int) -> None:
        """From ``epoch`` on, entries go through ``view``: the node was moved behind a
        forwarder. Called before any entry of ``epoch`` arrives (on its order); the epochs
        before keep the entries they were built with."""
        with self._lock:  # the two together: `_view` must never pair one's old with the other's new
            self.view_from = epoch
            self.view = view

    def _view(self, epoch: int) -> EntryView | None:
        with self._lock:
            view, start = self.view, self.view_from
        return view if epoch >= start else None

    def complete(self, epoch: int, group: str, size: int) -> bool:
        """Every rank of ``group`` has its entry here (its build can connect now). Its first
        stream's: gloo connects the streams one after another, writing a stream's entry once
        the stream before connected."""
        with self._lock:
            ep = self._epochs.get(epoch)
            return ep is not None and sum(1 for k in ep.known if k.startswith(f"{group}/0/")) >= size

    def entries(self, epoch: int, group: str) -> dict[int, bytes]:
        """The entries of ``group``'s first stream by rank (gloo names them ``GROUP/STREAM/RANK``)."""
        with self._lock:
            ep = self._epochs.get(epoch)
            if ep is None:
                return {}
            ranks = {k: r for k in ep.known if (r := _first_stream_rank(k, group)) is not None}
            # As advertised: what the members were given (the view rewrites what gloo reads).
            return {r: ep.advertised.get(k) or ep.held.get(k) or ep.store.get(k) for k, r in ranks.items()}

    def writers(self, epoch: int, group: str, before: float) -> set[int]:
        """The ranks of ``group`` whose entry for ``epoch`` the leader handed over before
        ``before`` (a `time.monotonic` time)."""
        with self._lock:
            ep = self._epochs.get(epoch)
            keys = [k for k, t in ep.arrived.items() if t < before] if ep is not None else []
        return {r for k in keys if (r := _first_stream_rank(k, group)) is not None}

    def store(self, epoch: int) -> HashStore:
        return self._get(epoch).store

    def _get(self, epoch: int) -> _Entries:
        with self._lock:
            found = self._epochs.get(epoch)
            if found is None:
                found = self._epochs[epoch] = _Entries(HashStore())
                for old in sorted(self._epochs)[: -self._keep]:
                    del self._epochs[old]
                    if self.view is not None:
                        self.view.forget(old)
            return found

    def deliver(self, epoch: int, entries: dict[str, bytes]) -> None:
        """Entries of the epoch's members, from the leader."""
        ep = self._get(epoch)
        view = self._view(epoch)
        with self._lock:
            now = time.monotonic()
            for key, value in entries.items():
                if key not in ep.known:
                    ep.known.add(key)  # before it is visible: `publish` must not take it for ours
                    ep.arrived[key] = now
                    if view is None:
                        ep.store.set(key, value)  # type: ignore[arg-type]  # bytes, as gloo wrote them
                    else:
                        ep.held[key] = value
        if view is not None:
            self._translate(epoch, ep, view)

    def publish(self, epoch: int) -> None:
        """Send the leader whatever this node's data plane wrote since the last call."""
        ep = self._get(epoch)
        view = self._view(epoch)
        with self._lock:
            new = {k: ep.store.get(k) for k in ep.store.list_keys() if k not in ep.known}
            ep.known.update(new)
        if view is not None:
            # A round trip to the forwarder per new entry (a group's stream): outside the lock.
            new = {k: view.advertise(epoch, v) for k, v in new.items()}
        with self._lock:
            ep.mine.update(new)
            ep.advertised.update(new)
        for key, value in new.items():
            self._send(epoch, key, value)
        if view is not None:
            self._translate(epoch, ep, view)

    def _translate(self, epoch: int, ep: _Entries, view: EntryView) -> None:
        """Hand gloo the held peers' entries of the streams whose own entry is out."""
        with self._lock:
            ready = {k: v for k, v in ep.held.items() if k.rsplit("/", 1)[0] in ep.streams_out}
            for key in ready:
                del ep.held[key]
            own = {k: (ep.store.get(k), v) for k, v in ep.mine.items()}
        by_stream = {k.rsplit("/", 1)[0]: v for k, v in own.items()}
        for key, value in ready.items():
            mine, advertised = by_stream[key.rsplit("/", 1)[0]]
            translated = view.translate(epoch, mine, advertised, value)
            with self._lock:
                ep.advertised[key] = value
                ep.store.set(key, translated)  # type: ignore[arg-type]

    def republish(self) -> None:
        """Send this node's entries again (a new session: the leader may not have them)."""
        with self._lock:
            mine = [(epoch, dict(ep.mine)) for epoch, ep in self._epochs.items()]
        for epoch, entries in mine:
            for key, value in entries.items():
                self._send(epoch, key, value)

    def reset(self) -> None:
        """A new leader incarnation: its epochs are new, so are their entries."""
        with self._lock:
            self._epochs.clear()


def _first_stream_rank(key: str, group: str) -> int | None:
    """The rank of a rendezvous key of ``group``'s first stream (gloo's ``GROUP/0/RANK``)."""
    prefix = f"{group}/0/"
    rank = key[len(prefix) :] if key.startswith(prefix) else ""
    return int(rank) if rank.isascii() and rank.isdigit() else None


@dataclass
class _Entries:
    store: HashStore
    known: set[str] = field(default_factory=set)
    """Keys the leader knows (received from it, or sent)."""
    arrived: dict[str, float] = field(default_factory=dict)
    """Keys received from the leader: when."""
    mine: dict[str, bytes] = field(default_factory=dict)
    """What this node's data plane wrote (as sent: advertised)."""
    advertised: dict[str, bytes] = field(default_factory=dict)
    """With a view: entries as the members were given them, where gloo's store holds another."""
    held: dict[str, bytes] = field(default_factory=dict)
    """With a view: peers' entries waiting for this node's own entry of their stream."""
    devices: dict[str, list[Any]] = field(default_factory=dict)
    """Group → the gloo devices its build listens on (one per stream)."""

    @property
    def streams_out(self) -> set[str]:
        """``GROUP/STREAM`` of this node's own entries sent."""
        return {k.rsplit("/", 1)[0] for k in self.mine}


def build_group(
    store: Any,
    group: str,
    rank: int,
    size: int,
    devices: list[Any],
    scope: EpochScope,
    publish: Callable[[], None] | None = None,
) -> tuple[Any, float]:
    """Build a `ProcessGroupGloo` named ``group`` without letting a missing peer block us.

    The members meet on ``store`` under ``group/`` (`Meeting.store`); ``publish`` is called
    every few milliseconds meanwhile to pass on what this rank wrote. The constructor
    blocks until every rank has connected, so it runs on a helper thread; if the epoch is
    superseded meanwhile we walk away and the helper ends at its timeout (the scope's, also
    the group's collective timeout).
    """
    result: dict[str, Any] = {}

    def build() -> None:
        try:
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timedelta(seconds=scope.timeout_s)
            opts._devices = devices
            opts._threads = max(2, len(devices))  # a stream's work is not queued behind another's
            result["pg"] = ProcessGroupGloo(PrefixStore(group, store), rank, size, opts)
        except Exception as exc:  # reported to the waiting thread
            result["error"] = exc
        finally:
            scope.wake.set()

    def built() -> bool:
        # Read before publishing: a lazy build writes its last stream's entry just before it
        # returns, and a peer's first use of that stream waits for the entry.
        done = bool(result)
        if publish is not None:
            publish()
        return done

    start = time.monotonic()
    threading.Thread(target=build, name=f"pg-build-{group}", daemon=True).start()
    wait_until(built, scope, f"building group {group}", poll_s=PUBLISH_S)
    if "error" in result:
        raise CollectiveFailed(f"building group {group} failed: {result['error']}").at(scope.where())
    return result["pg"], time.monotonic() - start


class Graveyard:
    """Keeps abandoned process groups referenced until their collectives have timed out."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._graves: list[tuple[float, Any]] = []
        self._lock = threading.Lock()

    def bury(self, pg: ProcessGroup | None) -> None:
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
