"""What a web browser may ask of the coordinator (and of a relay).

A browser that can reach the coordinator (on its machine, or on the job's network) sends
it whatever requests the pages it shows ask for, pages of other sites included:

- **cross-site request forgery**: a page of another site POSTs to ``/api/nodes/NAME/kill``
  or opens ``/ws``; the browser adds that page's ``Origin``;
- **DNS rebinding**: the attacker's own name is made to resolve to the coordinator's
  address; the page's requests are then same-origin to the browser (``Origin`` and
  ``Host`` agree), and ``Host`` carries the attacker's name.

So every request that changes something (any method but GET, HEAD and OPTIONS) and every
websocket upgrade that carries an ``Origin`` must pass two checks (`refusal`):

- ``Host`` names this coordinator: an IP address (a page whose origin is an address was
  served from that address: nobody can rebind it), ``localhost`` or ``*.localhost`` (which
  browsers resolve to loopback themselves), this machine's host name and FQDN, the names of
  ``--host`` and ``--advertise``, or a name the operator allowed (``--allow-host``, e.g. a
  DNS alias or a reverse proxy's name). The port is not compared: an ssh tunnel or a port
  forward changes it, and a rebinding needs a name of the attacker's.
- ``Origin``, when sent, is the request's own (``scheme://Host``: the dashboard, from the
  coordinator itself), or its host is a name the operator allowed (a page served under
  another name). ``Origin: null`` (a sandboxed frame, a ``file://`` page) is refused.

Nodes, relays and ``unbroken status``/``events`` are no browsers: they send no ``Origin``,
and a websocket upgrade without one is not checked, since they may dial the coordinator by
any address it can be reached at (a 0.0.0.0 binding, a NAT, a relay) and a rebinding needs
a browser. Their GETs are never checked either: the read-only views stay open as they were.
A POST without ``Origin`` (``curl``; every browser sends one with a POST) still has its
``Host`` checked: the one cost is that ``curl`` must name the coordinator by one of the
names above.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
FQDN_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Names:
    """The names (lower case, without a trailing dot) this service answers to."""

    own: frozenset[str]
    """This machine's and the ``--host``/``--advertise`` names (addresses need no listing)."""
    allowed: frozenset[str] = frozenset()
    """The operator's (``--allow-host``): also accepted as the host of an ``Origin``."""

    def __contains__(self, name: object) -> bool:
        return name in self.own or name in self.allowed


def _bare(name: str) -> str:
    return name.lower().rstrip(".")


async def names_of(host: str, advertise: str = "", allowed: Iterable[str] = ()) -> Names:
    """The names of a service bound to ``host``, advertised as ``advertise`` (HOST[:PORT]).
    The FQDN is looked up on a worker thread, for `FQDN_TIMEOUT_S` at most: a broken
    resolver must not hold the service's start (a name left out costs only ``--allow-host``
    to a browser that uses it)."""
    try:
        fqdn = await asyncio.wait_for(asyncio.to_thread(socket.getfqdn), FQDN_TIMEOUT_S)
    except asyncio.TimeoutError:
        fqdn = ""
    own = {socket.gethostname(), fqdn, host, urlsplit("//" + advertise).hostname or ""} - {""}
    return Names(frozenset(_bare(n) for n in own), frozenset(_bare(n) for n in allowed))


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _host_refusal(name: str, host: str, names: Names) -> str | None:
    if _is_address(name) or name == "localhost" or name.endswith(".localhost") or name in names:
        return None
    known = ", ".join(sorted(names.own | names.allowed | {"localhost"}))
    return (
        f"refused: Host {host!r} is not a name of this coordinator (a page whose name was pointed at its "
        f"address, a DNS rebinding?). Reach it by an address or by one of {known}; or, if {name!r} is "
        f"yours, start the coordinator with --allow-host {name}"
    )


def refusal(method: str, headers: Mapping[str, str], scheme: str, names: Names) -> str | None:
    """Why a browser may not make this request (None: it may, or it is no browser's).

    ``scheme`` is the one the request came on (``http``, or ``https`` under TLS)."""
    origin = headers.get("Origin")
    upgrade = headers.get("Upgrade", "").lower() == "websocket"
    if method.upper() in SAFE_METHODS and not (upgrade and origin is not None):
        return None
    host = headers.get("Host")
    if host is None:
        return None  # HTTP/1.0: no browser sends a request without one
    try:
        split = urlsplit("//" + host)
        name, port = _bare(split.hostname or ""), split.port or DEFAULT_PORTS[scheme]
    except ValueError:
        return f"refused: malformed Host {host!r}"
    if (why := _host_refusal(name, host, names)) is not None:
        return why
    if origin is None:
        return None
    try:
        o = urlsplit(origin)
        theirs = (o.scheme, _bare(o.hostname or ""), o.port or DEFAULT_PORTS.get(o.scheme, 0))
    except ValueError:
        theirs = ("", "", 0)
    o_name = theirs[1]
    if theirs == (scheme, name, port) or (o_name and o_name in names.allowed):
        return None
    fix = f"; if that page is yours, start the coordinator with --allow-host {o_name}" if o_name else ""
    return (
        f"refused: Origin {origin!r} is not this coordinator's own ({scheme}://{host}): a page of another "
        f"site may not act on it{fix}"
    )


def guard(names: Names) -> Middleware:
    """An aiohttp middleware that answers 403 with the `refusal`, before any handler runs."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        why = refusal(request.method, request.headers, request.scheme, names)
        if why is not None:
            raise web.HTTPForbidden(text=why)
        return await handler(request)

    return middleware
