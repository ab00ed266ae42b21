"""An in-memory process group for tests: ranks are threads, collectives meet in memory.

`FakeWorld(n)` holds ``n`` ranks; ``world.group(rank)`` is that rank's group, with the part
of `ProcessGroupGloo` the data plane uses (``size``, ``rank``, ``allreduce``, ``allgather``,
``broadcast``, each returning a work item with ``wait`` and ``get_future``). Each rank's
k-th collective meets every other rank's k-th, as gloo's do; the last rank to arrive
computes the result for all. Faults are deterministic: `FakeWorld.kill` makes every
collective that rank has not completed fail on the others ("connection reset"), as a
peer's death does in gloo, and a rank that never arrives leaves the others waiting, which
only the caller's deadline or abort ends (as with a frozen peer). No sockets, no timeouts.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def _reset(rank: int) -> RuntimeError:
    """What a peer's death looks like to the others, as gloo reports it."""
    return RuntimeError(f"Connection reset by peer (rank {rank} is gone)")


class FakeWork:
    """A collective in flight: `wait` returns once every rank has arrived, or raises."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        self._future = future

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> bool:
        try:
            self._future.wait()
        except Exception as exc:  # surfaced as gloo surfaces a failed collective
            raise RuntimeError(str(exc)) from None
        return True


@dataclass
class _Meeting:
    """The k-th collective of every rank."""

    op: str
    arrived: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    futures: dict[int, torch.futures.Future[Any]] = field(default_factory=dict)
    broken_by: int | None = None
    """The rank whose death broke it (every rank's part fails, those still to come too)."""


class FakeWorld:
    """``size`` ranks whose collectives meet in memory (see the module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._meetings: dict[int, _Meeting] = {}
        self._dead: set[int] = set()
        self._mail: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
        """(source, destination, tag) → messages sent and not yet received."""
        self._receiving: dict[tuple[int, int, int], deque[tuple[torch.Tensor, torch.futures.Future[Any]]]] = {}
        """(source, destination, tag) → receives posted before their message came."""
        self.calls: list[tuple[int, str]] = []
        """(rank, op) of every collective posted, in order: what a test may assert on."""

    def group(self, rank: int) -> FakeProcessGroup:
        return FakeProcessGroup(self, rank)

    def delivered(self, rank: int) -> bool:
        """Whether every collective ``rank`` has joined is complete (what it sent has arrived)."""
        with self._lock:
            return not any(rank in m.arrived and m.broken_by is None for m in self._meetings.values())

    def kill(self, rank: int) -> None:
        """``rank`` is gone: its pending and future collectives fail on every other rank."""
        with self._lock:
            self._dead.add(rank)
            # A ring with a dead peer breaks whether or not that peer had sent its part.
            pending = list(self._meetings.values())
            for meeting in pending:
                if meeting.broken_by is None:  # the first death broke it: name that one
                    meeting.broken_by = rank
            orphans = [f for key, q in self._receiving.items() if key[0] == rank for _, f in q]
            self._receiving = {k: q for k, q in self._receiving.items() if k[0] != rank}
        for meeting in pending:
            self._fail(meeting)
        for fut in orphans:
            fut.set_exception(_reset(rank))

    def _send(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> FakeWork:
        done: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            self.calls.append((src, "send"))
            waiting = self._receiving.get((src, dst, tag))
            receiver = waiting.popleft() if waiting else None
            if receiver is None:
                self._mail.setdefault((src, dst, tag), deque()).append(tensor.detach().clone())
        if receiver is not None:
            into, fut = receiver
            into.copy_(tensor)
            fut.set_result(None)
        done.set_result(None)
        return FakeWork(done)

    def _recv(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> FakeWork:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            self.calls.append((dst, "recv"))
            mail = self._mail.get((src, dst, tag))
            message = mail.popleft() if mail else None
            gone = message is None and src in self._dead
            if message is None and not gone:
                self._receiving.setdefault((src, dst, tag), deque()).append((tensor, fut))
        if message is not None:
            tensor.copy_(message)
            fut.set_result(None)
        elif gone:
            fut.set_exception(_reset(src))
        return FakeWork(fut)

    def _fail(self, meeting: _Meeting) -> None:
        """Every part of ``meeting`` fails, naming the rank whose death broke it."""
        assert meeting.broken_by is not None
        for fut in list(meeting.futures.values()):
            # A kill and a peer's arrival may fail the same meeting at once: the first wins.
            with contextlib.suppress(RuntimeError):
                if not fut.done():
                    fut.set_exception(_reset(meeting.broken_by))

    def _arrive(
        self, seq: int, rank: int, op: str, args: tuple[Any, ...], finish: Callable[[_Meeting], None]
    ) -> FakeWork:
        future: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            self.calls.append((rank, op))
            meeting = self._meetings.setdefault(seq, _Meeting(op))
            if meeting.op != op:
                raise RuntimeError(f"rank {rank}'s collective {seq} is {op}, the others' {meeting.op}")
            meeting.arrived[rank] = args
            meeting.futures[rank] = future
            dead = sorted(self._dead - set(meeting.arrived))
            if meeting.broken_by is None and dead:
                meeting.broken_by = dead[0]
            complete = len(meeting.arrived) == self.size
            if complete:
                del self._meetings[seq]
        if meeting.broken_by is not None:
            self._fail(meeting)
        elif complete:
            finish(meeting)
            for fut in meeting.futures.values():
                fut.set_result(None)
        return FakeWork(future)


class FakeProcessGroup:
    """One rank's view of a `FakeWorld`."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self._rank = rank
        self._seq = 0

    def size(self) -> int:
        return self.world.size

    def rank(self) -> int:
        return self._rank

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def allreduce(self, tensors: list[torch.Tensor]) -> FakeWork:
        """Sum in rank order (the same bits on every rank), written into each rank's tensor."""

        def finish(m: _Meeting) -> None:
            total = torch.zeros_like(m.arrived[0][0])
            for r in range(self.world.size):
                total += m.arrived[r][0]
            for r in range(self.world.size):
                m.arrived[r][0].copy_(total)

        return self.world._arrive(self._next(), self._rank, "allreduce", (tensors[0],), finish)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> FakeWork:
        def finish(m: _Meeting) -> None:
            for r in range(self.world.size):
                for src, out in enumerate(m.arrived[r][1]):
                    out.copy_(m.arrived[src][0])

        return self.world._arrive(self._next(), self._rank, "allgather", (inputs[0], outputs[0]), finish)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> FakeWork:
        return self.world._send(self._rank, dst, tag, tensors[0])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> FakeWork:
        return self.world._recv(src, self._rank, tag, tensors[0])

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> FakeWork:
        def finish(m: _Meeting) -> None:
            source = m.arrived[root][0].clone()
            for r in range(self.world.size):
                m.arrived[r][0].copy_(source)

        return self.world._arrive(self._next(), self._rank, "broadcast", (tensor,), finish)
