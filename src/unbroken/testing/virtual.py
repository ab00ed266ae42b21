"""A virtual clock, a modelled network and single-threaded servers, in one process.

What the control-plane simulator (`unbroken.testing.simulate`) runs on. Nothing waits:
the clock jumps from one scheduled callback to the next, in time order (ties in the order
they were scheduled)::

    clock = VirtualClock()
    net = Network(clock, random.Random(0))
    link = net.link(LinkSpec(latency_s=0.025, bandwidth_Bps=125e6, loss=0.01))
    net.send(link, 1200, lambda: print("arrived at", clock.now))
    clock.run_until(1.0)

A `Link` is one direction of a TCP stream: a message leaves once the ones before it are
on the wire (``size / bandwidth`` each), arrives ``latency_s`` later, and arrives after
every message sent before it on the link. A lost message is sent again after a
retransmission timeout that doubles at each loss, as TCP does (Linux's least RTO is
200 ms), and what follows it on the stream waits for it (head-of-line blocking).

A `Process` is a single-threaded server: it handles one message or timer at a time, and
the CPU time its handler really took (measured with ``time.thread_time``) keeps it busy
that long in virtual time: what arrives meanwhile queues, and what it sends leaves when
the handler is done. Its CPU is the real code's, on this machine, less the garbage
collections that ran inside it (`Collections`): in one process those walk every simulated
node's objects and every message in flight, not the server's own (at 3,000 nodes they were
38 % of what the coordinator was charged), so a server's own collections are not counted
either.
"""

from __future__ import annotations

import cProfile
import gc
import heapq
import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

RTO_MIN_S = 0.2
"""The least retransmission timeout (Linux's ``TCP_RTO_MIN``)."""


class Collections:
    """The CPU the garbage collector took so far, through ``gc.callbacks`` (`Process`
    leaves it out of its handlers' time)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.total_s += time.thread_time() - self._started


COLLECTIONS = Collections()


class Timer:
    """A scheduled callback; `cancel` keeps it from running."""

    __slots__ = ("cancelled", "fn", "when")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when = when
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """Time that moves only from one scheduled callback to the next. Calling it reads it
    (it is a ``clock`` for `unbroken.control.coordinator.Coordinator`)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self.callbacks = 0
        """Callbacks run so far (the simulator's own events)."""

    def __call__(self) -> float:
        return self.now

    def at(self, when: float, fn: Callable[[], None]) -> Timer:
        """Run ``fn`` at ``when`` (now, if that has passed)."""
        timer = Timer(max(when, self.now), fn)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        return self.at(self.now + delay, fn)

    def run_until(self, until: float) -> None:
        """Run every callback due up to ``until``; the clock then reads ``until``."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, timer = heapq.heappop(heap)
            if timer.cancelled:
                continue
            self.now = when
            self.callbacks += 1
            timer.fn()
        self.now = max(self.now, until)

    def pending(self) -> int:
        return sum(not t.cancelled for _, _, t in self._heap)


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a path between two endpoints."""

    latency_s: float
    """One way (half the round trip)."""
    bandwidth_Bps: float = 125e6
    """Bytes per second (125e6: a gigabit)."""
    loss: float = 0.0
    """The chance that a message is lost (and sent again after a retransmission timeout)."""

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"LinkSpec.latency_s is {self.latency_s}: a latency is 0 or more seconds")
        if self.bandwidth_Bps <= 0:
            raise ValueError(f"LinkSpec.bandwidth_Bps is {self.bandwidth_Bps}: give a positive rate in bytes/s")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"LinkSpec.loss is {self.loss}: give a probability in [0, 1)")

    @property
    def rto_s(self) -> float:
        """The first retransmission timeout: TCP's, for a steady round trip."""
        return max(RTO_MIN_S, 2 * 2 * self.latency_s)


class Link:
    """One direction of a TCP stream (`LinkSpec`), with its queue on the wire."""

    __slots__ = ("bytes", "free_at", "last_arrival", "lost", "messages", "spec")

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.free_at = 0.0
        """When the sender's side is done putting the messages before on the wire."""
        self.last_arrival = 0.0
        self.messages = 0
        self.bytes = 0
        self.lost = 0


class Network:
    """Sends messages over `Link`s on a `VirtualClock`; ``rng`` decides the losses."""

    def __init__(self, clock: VirtualClock, rng: random.Random) -> None:
        self.clock = clock
        self.rng = rng

    def link(self, spec: LinkSpec) -> Link:
        return Link(spec)

    def arrival(self, link: Link, size: int, at: float | None = None) -> float:
        """When a message of ``size`` bytes put on ``link`` at ``at`` (default: now) arrives."""
        spec = link.spec
        start = max(self.clock.now if at is None else at, link.free_at)
        link.free_at = start + size / spec.bandwidth_Bps
        arrives = link.free_at + spec.latency_s
        rto = spec.rto_s
        while spec.loss and self.rng.random() < spec.loss:
            link.lost += 1
            arrives += rto
            rto *= 2
        arrives = max(arrives, link.last_arrival)  # a stream delivers in order
        link.last_arrival = arrives
        link.messages += 1
        link.bytes += size
        return arrives

    def send(self, link: Link, size: int, deliver: Callable[[], None], at: float | None = None) -> Timer:
        """Put a message on ``link``; ``deliver`` runs when it arrives."""
        return self.clock.at(self.arrival(link, size, at), deliver)


class Process:
    """A single-threaded server on a `VirtualClock` (module docstring)."""

    def __init__(self, clock: VirtualClock, name: str) -> None:
        self.clock = clock
        self.name = name
        self.cpu_s = 0.0
        """CPU its handlers took, measured."""
        self.gc_s = 0.0
        """Garbage collections inside its handlers: left out of ``cpu_s`` (module docstring)."""
        self.handled = 0
        self.busy_until = 0.0
        self.longest_wait_s = 0.0
        """The longest anything waited in its queue."""
        self._queue: deque[tuple[float, Callable[[], None]]] = deque()
        self._scheduled = False
        self._outbox: list[tuple[Network, Link, int, Callable[[], None]]] | None = None
        """While a handler runs: what it sends, to leave once it is done."""
        self._later: list[tuple[float, Callable[[], None]]] = []
        """While a handler runs: what it scheduled, counted from when it is done."""
        self.profile: cProfile.Profile | None = None
        """Set: its handlers run under this profiler (which slows them: for finding where its
        CPU goes, not for timings)."""

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a timer, not a handler) ``delay`` after the running handler is done, as
        a loop's ``await asyncio.sleep(delay)`` after its work does (or from now, outside one)."""
        if self._outbox is not None:
            self._later.append((delay, fn))
        else:
            self.clock.after(delay, fn)

    def send(self, net: Network, link: Link, size: int, deliver: Callable[[], None]) -> None:
        """Send from this process: from a handler, once the handler is done."""
        if self._outbox is not None:
            self._outbox.append((net, link, size, deliver))
        else:
            net.send(link, size, deliver)

    def submit(self, fn: Callable[[], None]) -> None:
        """Handle ``fn`` once what came before it is handled."""
        self._queue.append((self.clock.now, fn))
        if not self._scheduled:
            self._scheduled = True
            self.clock.at(self.busy_until, self._drain)

    def _drain(self) -> None:
        queued, fn = self._queue.popleft()
        now = self.clock.now
        self.longest_wait_s = max(self.longest_wait_s, now - queued)
        outbox: list[tuple[Network, Link, int, Callable[[], None]]] = []
        self._outbox = outbox
        if COLLECTIONS not in gc.callbacks:
            gc.callbacks.append(COLLECTIONS)
        t0, gc0 = time.thread_time(), COLLECTIONS.total_s
        if self.profile is not None:
            self.profile.enable()
        try:
            fn()
        finally:
            if self.profile is not None:
                self.profile.disable()
            collected = COLLECTIONS.total_s - gc0
            spent = max(time.thread_time() - t0 - collected, 0.0)
            self._outbox = None
        self.cpu_s += spent
        self.gc_s += collected
        self.handled += 1
        self.busy_until = now + spent
        for net, link, size, deliver in outbox:
            net.send(link, size, deliver, at=self.busy_until)
        later, self._later = self._later, []
        for delay, timer in later:
            self.clock.at(self.busy_until + delay, timer)
        if self._queue:
            self.clock.at(self.busy_until, self._drain)
        else:
            self._scheduled = False

    def call_soon(self, fn: Callable[..., object], *args: object) -> Timer:
        """For code written for an event loop (``loop.call_soon``): run on this process."""
        return self.call_later(0.0, fn, *args)

    def call_later(self, delay: float, fn: Callable[..., object], *args: object) -> Timer:
        def run() -> None:
            fn(*args)

        return self.clock.after(delay, lambda: self.submit(run))
