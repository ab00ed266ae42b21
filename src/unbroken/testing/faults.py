"""Deterministic fault injection: a node signals itself at a given (phase, step).

Spec syntax, comma separated: ``SIGNAL@PHASE:STEP`` with SIGNAL one of ``kill`` (SIGKILL),
``stop`` (SIGSTOP), ``term`` (SIGTERM) or ``hang`` (the step loop blocks forever while
heartbeats go on), and PHASE one of ``compute`` (before the step's
forward pass), ``allreduce`` (while the step's all-reduce is in flight) or ``exchange``
(a zone leader, while the exchange between zones is in flight). Each fault
fires once; a ``fault`` line is written to the commit log first so tests can assert it
fired. A testing aid: shipped so users can test their own jobs the same way.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import dataclass

from unbroken.errors import ConfigError
from unbroken.events import Entry
from unbroken.train.hooks import LIES, Record

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
HANG = "hang"
"""Not a signal: the step loop blocks forever while the rest of the process (its control
session, its heartbeats) stays alive — a stuck data read or a hung kernel."""
CORRUPT = {"nan": float("nan"), "spike": 1e6, "flip": -10.0, "shrink": 0.9}
"""Not signals: the node's gradient of that step is poisoned (``nan``: every element NaN;
``spike``: multiplied by a million) after its backward pass — a faulty device or a bad
batch. ``flip`` multiplies it by -10 at that step *and every later one*: a persistently
wrong node that stays inside the guard's range (robust aggregation's case); ``shrink`` by
0.9 from that step on: wrong by too little for any check of the sum or of the norms (only
recomputing its slice shows it: `unbroken.train.checks`). Use PHASE ``grad``, or ``outer``
(``nan``, ``spike``) for the pseudo-gradient a DiLoCo zone leader sends after inner step STEP."""
PERSISTENT = ("flip", "shrink")
# LIES (`unbroken.train.hooks`, where the node carries them out): a member that lies from
# step STEP on (``…@grad:STEP``), as a compromised node would; ``hide-nan@outer:STEP`` and
# ``hide-spike@outer:STEP``: a DiLoCo zone leader whose every pseudo-gradient after inner
# step STEP is spoiled, with its true norm claimed.
BITFLIP = "bitflip"
"""``bitflip@commit:STEP``: right after committing STEP, one bit of this node's copy of the
first parameter flips (silent data corruption) — what the consistency audit must catch."""
MUTE = "mute"
"""``mute@build:EPOCH``: from epoch EPOCH on, this node's data plane never reaches the
rendezvous while its control session goes on — a node that heartbeats but never joins the
data plane (a data plane that cannot start, or a hostile member)."""
FALSE_ALARM = "false-alarm"
"""``false-alarm@commit:STEP``: from step STEP on, once in every epoch, right after a
commit, this node reports that a collective failed when none did (it trains honestly
otherwise): a broken node, or a hostile one holding the token."""
LAPSE = "lapse"
"""``lapse@commit:STEP``: this node's commit fence fails at STEP after the step's vote went
through everywhere (its lease lapsed, as for a node paused past it): the others commit the
step, it does not, and it reports the epoch failed. What a sharded member then does with the
sums it holds is the test (`unbroken.train.sharding`: it applies the step late)."""
UNREACHABLE = "unreachable"
"""``unreachable@build:EPOCH``: from epoch EPOCH on, the data-plane address in this node's
rendezvous entries is one where connections hang (`dropping_sockets`), as a firewall that
drops inbound TCP or a NAT would make it: the entries arrive, the builds cannot connect."""
GREEDY = "greedy"
"""``greedy@build:EPOCH``: from epoch EPOCH on, whenever this node receives state it tells
every donor it wants `GREEDY_CHUNKS` chunks (a hostile joiner's request, past any state's size)."""
GREEDY_CHUNKS = 2**40
SHIFT = "shift"
"""``shift@data:STEP``: from step STEP on, this node's data loader reads the samples of its
slice of the *next* step (a loader off by one batch, a wrong shard), while it reports the
slice it was given: its gradient looks as good as anyone's, and only recomputing its slice
shows it is not (`unbroken.train.checks`)."""
PHASES = ("compute", "allreduce", "exchange", "grad", "outer", "commit", "resync", "build", "data")
"""``resync``'s number counts chunks, not steps: ``kill@resync:3`` kills a node right after
it sent its third chunk of state to a peer that is catching up (a donor dying mid-transfer)."""


@dataclass(frozen=True)
class Fault:
    signal: str
    phase: str
    step: int


def parse_faults(spec: str) -> list[Fault]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        sig, _, rest = part.partition("@")
        phase, _, step = rest.partition(":")
        known = (
            ((sig in SIGNALS or sig == HANG) and phase != "outer")
            or (sig in CORRUPT and (phase == "grad" or (phase == "outer" and sig not in PERSISTENT)))
            or (sig in LIES and (phase == "grad" or (phase == "outer" and sig != "forge-slot")))
            or (sig in (BITFLIP, FALSE_ALARM, LAPSE) and phase == "commit")
            or (sig in (MUTE, UNREACHABLE, GREEDY) and phase == "build")
            or (sig == SHIFT and phase == "data")
        )
        if not known or phase not in PHASES or not (step.isascii() and step.isdigit()):
            raise ConfigError(
                f"fault {part!r} is not SIGNAL@PHASE:STEP with SIGNAL in {sorted([*SIGNALS, HANG])} "
                f"(or nan@grad:STEP / spike@grad:STEP / flip@grad:STEP / shrink@grad:STEP / nan@outer:STEP / "
                f"spike@outer:STEP / shift@data:STEP / "
                f"bitflip@commit:STEP / "
                f"mute@build:EPOCH / greedy@build:EPOCH / "
                f"false-alarm@commit:STEP / unreachable@build:EPOCH / "
                f"hide-nan@grad:STEP / hide-spike@grad:STEP / forge-slot@grad:STEP / "
                f"hide-nan@outer:STEP / hide-spike@outer:STEP) "
                f"and PHASE in {list(PHASES)} (e.g. kill@allreduce:12)"
            )
        out.append(Fault(sig, phase, int(step)))
    return out


class FaultPlan:
    """The faults a node was given, as the node's `unbroken.train.hooks.Faults`."""

    def __init__(self, faults: list[Fault], record: Record | None = None) -> None:
        self._pending = list(faults)
        self._persistent: list[Fault] = []
        self._record: Record = record or (lambda _kind, _fields: None)
        self._dead: list[socket.socket] = []
        self._alarmed: set[int] = set()

    def attach(self, record: Record) -> None:
        self._record = record

    def corruption(self, step: int, phase: str = "grad") -> float | None:
        """The poison for this step's gradient (``outer``: the pseudo-gradient sent after it),
        if any (``flip`` from its step on, the others once)."""
        for f in self._persistent:
            if f.signal in CORRUPT and f.phase == phase and step >= f.step:
                return CORRUPT[f.signal]
        for f in self._pending:
            if f.signal in CORRUPT and f.phase == phase and f.step == step:
                self._pending.remove(f)
                self._record(Entry.FAULT, {"signal": f.signal, "phase": phase, "step": step, "pid": os.getpid()})
                if f.signal in PERSISTENT:
                    self._persistent.append(f)
                return CORRUPT[f.signal]
        return None

    def lie(self, step: int, phase: str = "grad") -> str | None:
        """The lie this node tells at ``step`` (`LIES`), from its first step on (``outer``:
        in every pseudo-gradient it sends as a DiLoCo zone leader after that step)."""
        for f in list(self._pending):
            if f.signal in LIES and f.phase == phase and step >= f.step:
                self._pending.remove(f)
                self._persistent.append(f)
                self._record(Entry.FAULT, {"signal": f.signal, "phase": phase, "step": step, "pid": os.getpid()})
        return next((f.signal for f in self._persistent if f.signal in LIES and f.phase == phase), None)

    def muted(self, epoch: int) -> bool:
        """True when this node's rendezvous entries for ``epoch`` must not go out."""
        return self._from(MUTE, epoch)

    def _from(self, signal: str, at: int, phase: str = "build") -> bool:
        """Whether a fault that holds from its number on (``signal@PHASE:N``) holds at
        ``at`` (an epoch, or a step); recorded the first time."""
        for f in list(self._pending):
            if f.signal == signal and at >= f.step:
                self._pending.remove(f)
                self._persistent.append(f)
                self._record(Entry.FAULT, {"signal": signal, "phase": phase, "step": at, "pid": os.getpid()})
        return any(f.signal == signal and at >= f.step for f in self._persistent)

    def unreachable(self, epoch: int) -> bool:
        """True when this node's rendezvous entries for ``epoch`` must give an unreachable address."""
        return self._from(UNREACHABLE, epoch)

    def greedy(self, epoch: int) -> int:
        """How many chunks this node tells each donor it wants in ``epoch`` (0: the truth)."""
        return GREEDY_CHUNKS if self._from(GREEDY, epoch) else 0

    def dropping_port(self, host: str) -> int:
        """A port on ``host`` where connections hang (kept for the life of the process)."""
        if not self._dead:
            self._dead = dropping_sockets(host)
        port: int = self._dead[0].getsockname()[1]
        return port

    def false_alarm(self, step: int, epoch: int) -> bool:
        """True once per epoch, from the step of a ``false-alarm`` fault on."""
        if not self._from(FALSE_ALARM, step, phase="commit") or epoch in self._alarmed:
            return False
        self._alarmed.add(epoch)
        return True

    def bitflip(self, step: int) -> bool:
        """True (once) when a bit of this node's state should flip after committing ``step``."""
        return self._once(BITFLIP, step)

    def lapse(self, step: int) -> bool:
        """True (once) when this node's commit fence of ``step`` must fail (`LAPSE`)."""
        return self._once(LAPSE, step)

    def _once(self, signal: str, step: int, phase: str = "commit") -> bool:
        for f in self._pending:
            if f.signal == signal and f.step == step:
                self._pending.remove(f)
                self._record(Entry.FAULT, {"signal": signal, "phase": phase, "step": step, "pid": os.getpid()})
                return True
        return False

    def wrong_samples(self, step: int) -> bool:
        """True from the step of a ``shift`` fault on (`SHIFT`)."""
        return self._from(SHIFT, step, phase="data")

    def maybe_fire(self, phase: str, step: int) -> None:
        for f in self._pending:
            if f.phase == phase and f.step == step:
                self._pending.remove(f)
                self._record(Entry.FAULT, {"signal": f.signal, "phase": phase, "step": step, "pid": os.getpid()})
                if f.signal == HANG:
                    threading.Event().wait()
                os.kill(os.getpid(), SIGNALS[f.signal])
                return


def refusing_socket(host: str) -> socket.socket:
    """A socket bound on ``host``, never listening: connections to its port are refused.

    gloo decides which side of a pair connects by comparing the two addresses (ports as
    stored, in network byte order): a port whose low byte is 0 compares below every port
    whose low byte is not, so every peer takes this one for the side it must connect to,
    and every peer's connection fails, as with a firewall that rejects all inbound TCP."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    for high in range(255, 3, -1):
        try:
            sock.bind((host, high << 8))
            return sock
        except OSError:
            continue
    sock.close()
    raise OSError(f"no port of the form N*256 is free on {host}")


def dropping_sockets(host: str) -> list[socket.socket]:
    """A port on ``host`` where connections hang, as a firewall that drops inbound TCP makes
    them (the first socket's; keep the list open): it listens with no room to queue, and one
    connection that is never accepted fills that room, so the kernel drops every later SYN."""
    listener = refusing_socket(host)
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname()[:2], timeout=5)
    return [listener, filler]
