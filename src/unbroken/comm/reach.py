"""Whether this node can connect to its peers' data-plane addresses.

A member whose gloo port the others cannot reach (a firewall that drops inbound TCP, a
NAT, an address of a private interface) writes its rendezvous entry like any other, and
then every build with it waits: the peers that must connect to it never get through. Once
every entry of a group is in and the build still has not finished half ``--build-deadline``
later (or failed), the node tries each peer's address itself and tells the leader whom it
cannot reach (`unbroken.control.messages.Fault` ``unreachable``). The leader has the
epoch's other members try the same address (`unbroken.control.messages.Probe`) and benches
the member only once most of them could not connect either: one member's word benches
nobody, except its own about itself (it reaches almost none of its peers).
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from unbroken.control import messages as m
from unbroken.control.meeting import data_address
from unbroken.events import Kind
from unbroken.sched.zones import WORLD

REACH_TIMEOUT_S = 1.0
"""How long one connection attempt to a peer's data-plane address may take."""
REACH_THREADS = 64

T = TypeVar("T")


def reach(targets: dict[str, tuple[str, int]], timeout_s: float = REACH_TIMEOUT_S) -> dict[str, str]:
    """Try a TCP connection to each member's (host, port); the ones that failed, with why."""

    def attempt(address: tuple[str, int]) -> str | None:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except TimeoutError:
            return f"no answer in {timeout_s:g} s"
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        return None

    errors = _each(targets, attempt)
    return {mid: error for mid, error in errors.items() if error is not None}


def refusing(targets: dict[str, tuple[str, int]], timeout_s: float = REACH_TIMEOUT_S) -> list[str]:
    """The members whose (host, port) refuses a TCP connection: nothing listens there, so
    the process that did is gone. A dead process's ports refuse at once; a cut-off host's
    time out, and a frozen process's kernel still accepts: both count as alive. (A firewall
    that rejects rather than drops would pass for a dead process.)"""

    def attempt(address: tuple[str, int]) -> bool:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False

    return [mid for mid, gone in _each(targets, attempt).items() if gone]


def _each(targets: dict[str, tuple[str, int]], attempt: Callable[[tuple[str, int]], T]) -> dict[str, T]:
    """``attempt`` on every member's address at once (each connection waits on its own)."""
    if not targets:
        return {}
    with ThreadPoolExecutor(min(REACH_THREADS, len(targets)), thread_name_prefix="reach") as pool:
        return dict(zip(targets, pool.map(attempt, targets.values()), strict=True))


def unreachable_fault(epoch: int, group: str, member: str, host: str, port: int, error: str) -> m.Fault:
    return m.Fault(
        epoch=epoch,
        kind=Kind.UNREACHABLE,
        culprit=member,
        group=group,
        reason=(
            f"its data-plane address {host}:{port} refuses or drops connections ({error}): a firewall "
            "or NAT in the way? Its gloo port must accept TCP from the other members (--gloo-host: an "
            "address they reach)"
        ),
    )


def accuse(
    epoch: int,
    group: str,
    entries: dict[int, bytes],
    ids: list[str],
    rank: int,
    send: Callable[[m.Fault], None],
) -> bool:
    """Try the addresses of a group's other ranks (``entries``: rank → its rendezvous entry,
    ``ids``: the group's members by rank) and report the ones this node cannot reach. A node
    that reaches fewer than half of the world's other members is the one cut off: it names
    itself (not for a zone's group: a few members writing bad addresses there could make it).
    True when anything was reported."""
    targets = {}
    for r, raw in entries.items():
        if r != rank and r < len(ids):
            try:
                targets[ids[r]] = data_address(raw)
            except ValueError:
                continue  # the leader checked it; a build that garbled it can't be judged here
    failed = reach(targets)
    if not failed:
        return False
    me = ids[rank]
    if group == WORLD and len(targets) >= 2 and len(failed) * 2 > len(targets):
        host, port = data_address(entries[rank]) if rank in entries else ("?", 0)
        send(
            m.Fault(
                epoch=epoch,
                kind=Kind.UNREACHABLE,
                culprit=me,
                group=group,
                reason=(
                    f"reaches {len(targets) - len(failed)} of its {len(targets)} peers' data-plane addresses "
                    f"({next(iter(failed.values()))}): its own outbound connections are blocked or its "
                    f"network is cut (its own address: {host}:{port})"
                ),
            )
        )
        return True
    for mid, error in failed.items():
        send(unreachable_fault(epoch, group, mid, *targets[mid], error))
    return True


class Stall:
    """Polled while a group build waits: once every rank's entry is in (``complete``) and
    the build is still unfinished ``deadline_s`` later, runs ``then`` once, on a thread of
    its own (it takes up to `REACH_TIMEOUT_S`; the build's wait goes on meanwhile)."""

    def __init__(self, complete: Callable[[], bool], deadline_s: float, then: Callable[[], object]) -> None:
        self._complete = complete
        self._deadline_s = deadline_s
        self._then = then
        self._since: float | None = None

    def __call__(self) -> None:
        now = time.monotonic()
        if self._since is None:
            if self._complete():
                self._since = now
        elif now - self._since > self._deadline_s:
            self._since = math.inf
            threading.Thread(target=self._then, name="reach", daemon=True).start()
