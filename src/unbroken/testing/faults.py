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
import threading
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.errors import ConfigError

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
HANG = "hang"
"""Not a signal: the step loop blocks forever while the rest of the process (its control
session, its heartbeats) stays alive — a stuck data read or a hung kernel."""
PHASES = ("compute", "allreduce", "exchange")


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
        if (sig not in SIGNALS and sig != HANG) or phase not in PHASES or not (step.isascii() and step.isdigit()):
            raise ConfigError(
                f"fault {part!r} is not SIGNAL@PHASE:STEP with SIGNAL in {sorted([*SIGNALS, HANG])} "
                f"and PHASE in {list(PHASES)} (e.g. kill@allreduce:12)"
            )
        out.append(Fault(sig, phase, int(step)))
    return out


class FaultPlan:
    def __init__(self, faults: list[Fault], record: Callable[[dict[str, object]], None]) -> None:
        self._pending = list(faults)
        self._record = record

    def maybe_fire(self, phase: str, step: int) -> None:
        for f in self._pending:
            if f.phase == phase and f.step == step:
                self._pending.remove(f)
                self._record({"kind": "fault", "signal": f.signal, "phase": phase, "step": step, "pid": os.getpid()})
                if f.signal == HANG:
                    threading.Event().wait()
                os.kill(os.getpid(), SIGNALS[f.signal])
                return
