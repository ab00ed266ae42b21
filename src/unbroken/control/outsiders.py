"""What an outsider may hold of a coordinator or a relay before it proves the job token.

Anyone who reaches the service's port can open connections. Until a connection proves the
job token (`Guard.prove`, called by the session handshake once the knock or the relay's
hello checked out), it is an outsider's and is held on a short leash, below aiohttp, by a
protocol that wraps aiohttp's own (`GuardedSite`):

* at most `Limits.per_address` such connections per source address and `Limits.total` in
  all (never more than half the file descriptors the process may open): more are reset as
  they are accepted, before a byte is read, so a flood cannot take the descriptors the
  members' sessions and the event log need;
* a request (its line and headers) must be complete within `Limits.request_s` of the
  connection opening or of its last response, and a body within `Limits.body_s`: a
  slowloris trickling its headers held its descriptor forever;
* it may send `Limits.unproven_bytes` per request (headers, a body, a session's first
  message): a relay's hello was read up to 8 MB before its proof.

A proven connection (a member's or a relay's session) is neither counted nor limited: the
leash never cuts a member. The session handshakes keep their own deadlines
(`sessions.FIRST_MESSAGE_S`) and their own queue per address (`sessions.Doorman`).

::

    Connection ──accept──▶ counted ──request starts──▶ served ──response──▶ counted ...
        │ over a cap          │ too slow, too large       │ proven
        ▼                     ▼                           ▼
      reset                 reset                   not counted, not limited
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from unbroken.control.sessions import PREAUTH_PER_ADDRESS, PREAUTH_TOTAL, QUEUED
from unbroken.observe.quiet import Hush

log = logging.getLogger(__name__)

REQUEST_S = 5.0
"""An unproven connection's request must be complete within this long of the connection
opening or of its last response. An honest client sends its request in milliseconds, and
one idle this long on a keep-alive connection opens another at no cost; a busy 2-core
machine's longest loop stalls seen (about a second) fit several times."""
BODY_S = 5.0
"""A request's body must arrive within this long (none of the service's routes takes one
above a message's size, and none a slow one)."""
UNPROVEN_BYTES = 64 << 10
"""What an unproven connection may send per request: a request's line and headers (honest
clients send well under a kilobyte) and a session's first message (`messages.KNOCK_BYTES`)."""
PER_ADDRESS = 2 * QUEUED * PREAUTH_PER_ADDRESS
"""Twice the sessions one address may have waiting for the `Doorman` at once: a burst of
honest reconnects behind one NAT, and a dashboard's requests beside them."""
OPEN_FILES_MAX = 1 << 20
"""The soft limit of open files is raised to the hard one, but not past this (an unlimited
hard limit is not a number ``setrlimit`` takes)."""


@dataclass(frozen=True)
class Limits:
    per_address: int = PER_ADDRESS
    """Unproven connections one source address may hold."""
    total: int = PREAUTH_TOTAL
    """Unproven connections all addresses together may hold (at most half the open files)."""
    request_s: float = REQUEST_S
    body_s: float = BODY_S
    unproven_bytes: int = UNPROVEN_BYTES

    def __post_init__(self) -> None:
        for name in ("per_address", "total", "request_s", "body_s", "unproven_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit, and log the figure:
    the default soft limit (often 1,024) is what a flood exhausts first. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_MAX if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_MAX)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("open files: soft limit stays %d (could not raise it to %d: %s)", soft, wanted, exc)
            return soft
        log.info("open files: soft limit raised from %d to %d", soft, wanted)
        return wanted
    log.info("open files: soft limit %d", soft)
    return soft if soft != resource.RLIM_INFINITY else OPEN_FILES_MAX


class Door:
    """The count of unproven connections per address and in all (pure: no sockets)."""

    def __init__(self, per_address: int, total: int) -> None:
        self.per_address = per_address
        self.total = total
        self.held: collections.Counter[str] = collections.Counter()
        self.holding = 0

    def admit(self, peer: str) -> str | None:
        """Count a new connection of ``peer``; or why it is refused (and not counted)."""
        if self.held[peer] >= self.per_address:
            return "address"
        if self.holding >= self.total:
            return "total"
        self.held[peer] += 1
        self.holding += 1
        return None

    def leave(self, peer: str) -> None:
        """One of ``peer``'s counted connections ended or proved itself."""
        self.held[peer] -= 1
        self.holding -= 1
        if self.held[peer] <= 0:
            del self.held[peer]


class Guard:
    """The leash of a service's unproven connections (see the module's docstring); its
    `middleware` goes on the service's application, its site is a `GuardedSite`."""

    def __init__(self, limits: Limits | None = None, name: str = "service") -> None:
        self.limits = limits or Limits()
        self.name = name
        self.door = Door(self.limits.per_address, self.limits.total)
        self.cut: collections.Counter[str] = collections.Counter()
        """Connections reset, by why: ``address``, ``total`` (over a cap), ``slow``, ``large``."""
        self._open: dict[asyncio.BaseTransport, _Guarded] = {}
        self._hush = Hush()

    def fit(self, open_files: int) -> None:
        """Hold at most half of ``open_files`` unproven: the rest stay for the members."""
        self.door.total = max(1, min(self.limits.total, open_files // 2))

    def protocol(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server``: ``inner``'s connections, leashed."""
        return lambda: _Guarded(self, inner)

    def prove(self, request: web.BaseRequest) -> None:
        """``request``'s connection proved the job token: no longer counted nor limited."""
        conn = self._open.get(request.transport) if request.transport is not None else None
        if conn is not None:
            conn.proven()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        conn = self._open.get(request.transport) if request.transport is not None else None
        if conn is not None:
            conn.started()
        try:
            if request.body_exists:
                try:
                    await asyncio.wait_for(request.read(), self.limits.body_s)
                except (TimeoutError, asyncio.TimeoutError):
                    self._refused("slow", request.remote or "?")
                    raise web.HTTPRequestTimeout(
                        text=f"the request's body did not arrive within {self.limits.body_s:g} s"
                    ) from None
            return await handler(request)
        finally:
            if conn is not None:
                conn.ended()

    def state(self) -> dict[str, Any]:
        """For ``/api/state``: what unproven connections hold now, and how many were cut."""
        return {
            "unproven": self.door.holding,
            "addresses": len(self.door.held),
            "total_cap": self.door.total,
            "per_address_cap": self.door.per_address,
            "cut": dict(self.cut),
        }

    def _refused(self, why: str, peer: str) -> None:
        self.cut[why] += 1
        counted = self._hush.allow(why, time.monotonic())
        if counted is not None:
            more = f" ({counted} more since the last said)" if counted else ""
            log.warning("%s: reset a connection from %s (%s)%s", self.name, peer, _WHY[why], more)


_WHY = {
    "address": "too many unproven connections from its address",
    "total": "too many unproven connections in all",
    "slow": "its request was not complete in time",
    "large": "too many bytes before proving the job token",
}


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol behind the leash. Once proven, it only forwards."""

    def __init__(self, guard: Guard, inner: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self.make_inner = inner
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.counted = False
        self.busy = 0
        """Requests being handled (their own deadlines apply: a session's handshake, a body)."""
        self.received = 0
        """Bytes received since the last request started or ended."""
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        why = self.guard.door.admit(self.peer)
        if why is not None:
            self.guard._refused(why, self.peer)
            transport.abort()  # a reset: no lingering state, no TIME_WAIT on this side
            return
        self.counted = True
        self.transport = transport
        self.guard._open[transport] = self
        self._arm()
        self.inner = self.make_inner()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.counted:
            self.received += len(data)
            if self.received > self.guard.limits.unproven_bytes:
                self._cut("large")
                return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is None:
            return
        self._disarm()
        if self.transport is not None:
            self.guard._open.pop(self.transport, None)
        self._uncount()
        inner, self.inner = self.inner, None
        inner.connection_lost(exc)

    def proven(self) -> None:
        self._disarm()
        self._uncount()

    def started(self) -> None:
        self.busy += 1
        self.received = 0
        self._disarm()

    def ended(self) -> None:
        self.busy -= 1
        if self.busy == 0 and self.counted:
            self.received = 0
            self._arm()

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.guard.door.leave(self.peer)

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self.deadline = loop.call_later(self.guard.limits.request_s, self._expire)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self) -> None:
        self.deadline = None
        if not self.counted or self.busy or self.transport is None:
            return
        if self.received == 0:  # an idle keep-alive connection: an orderly close
            self.transport.close()
        else:
            self._cut("slow")

    def _cut(self, why: str) -> None:
        self.guard._refused(why, self.peer)
        if self.transport is not None:
            self.transport.abort()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through ``guard`` (`web.TCPSite` otherwise)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: Guard,
        host: str,
        port: int,
        ssl_context: Any = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.guard = guard
        self.host, self.port = host, port

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.protocol(server),
            self.host,
            self.port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
        )

    def bound_port(self) -> int:
        """The port listened on (``port`` 0 picks one)."""
        sockets = self._server.sockets if isinstance(self._server, asyncio.Server) else ()
        return int(sockets[0].getsockname()[1]) if sockets else self.port


async def listen(
    app: web.Application, guard: Guard, host: str, port: int, ssl_context: Any = None
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` through ``guard``; returns its runner and the port."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, guard, host, port, ssl_context)
    try:
        await site.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        raise
    return runner, site.bound_port()
