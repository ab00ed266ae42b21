"""The coordinator's sessions: a node's own, and the members a relay speaks for.

A node connected straight to the coordinator has a `Session` (one websocket, one writer
task keeping its messages in order). A relay (`unbroken.control.relay`, a zone's
sub-coordinator) has one `RelayLink` for all of its members; each member is a
`RelayedMember` that sends through it. The coordinator treats both alike: whatever it
tells a member goes through ``send`` or ``send_text``.

A relay's link ending is not its members' failure: they are *detached* (their leases run
on) and come back through another relay or straight to the coordinator, which takes them
back as they were. A member whose own session with its relay ended is reported ``gone``
and fails at once, as a dropped direct session does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

from aiohttp import WSMsgType, web
from pydantic import BaseModel

from unbroken.control import auth
from unbroken.control import messages as m
from unbroken.control.office import Gate
from unbroken.errors import ProtocolError

if TYPE_CHECKING:
    from unbroken.control.coordinator import Coordinator

log = logging.getLogger(__name__)
T = TypeVar("T")

HELLO_TIMEOUT_S = 10.0
FIRST_MESSAGE_S = 5.0
"""A session's first message (a knock, a relay's hello) must come within this long of its
challenge: an honest peer answers at once, and until it does it is an outsider's
(`outsiders`); a busy 2-core machine's longest loop stalls (about a second) fit several times."""
PREAUTH_PER_ADDRESS = 16
"""Sessions of one address read at a time before they proved the job token (`Doorman`)."""
QUEUED = 4
"""An address may have this many times its slots waiting: one address cannot fill the total."""
PREAUTH_TOTAL = 4096
"""Sessions held before proving the token, from all addresses together; more are closed unread."""
INLINE_PARSE_BYTES = 64 << 10
"""Larger messages are parsed on a worker thread: the event loop keeps acknowledging leases."""
RELAY_MESSAGE_FACTOR = 8
"""A relay's batch may be this many times a node's message limit: it carries up to
`batches.BATCH_BYTES` and then one more of its members' messages (each within the limit)."""

GateWait = Callable[[], Awaitable[Gate]]
"""Waits until a message may go out, and says whether it may (`office.Office.settled`)."""


class Sender(Protocol):
    member_id: str

    def send(self, msg: BaseModel) -> None: ...

    def send_text(self, text: str) -> None: ...

    def close(self) -> None: ...


class Session:
    """One websocket; a writer task keeps its messages in order and holds them while the
    coordinator is unsure of its lease (`Gate.WAIT`)."""

    def __init__(
        self, ws: web.WebSocketResponse, member_id: str, gate: GateWait, seal: auth.Seal | None = None
    ) -> None:
        """``gate`` says when a message may go out (`office.Office.settled`); ``seal``
        authenticates each (`auth.Seal`, with a job token)."""
        self.ws = ws
        self.seal = seal
        self.member_id = member_id
        self.gate = gate
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.writer = asyncio.create_task(self._write(), name=f"session-writer-{member_id}")

    async def _write(self) -> None:
        while (text := await self.queue.get()) is not None:
            if await self.gate() is Gate.STOP:
                break  # deposed while this waited: say nothing more, not even late orders
            try:
                await self.ws.send_str(auth.sealed(self.seal, text))
            except (ConnectionError, RuntimeError):
                return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), timeout=1.0)

    def send(self, msg: BaseModel) -> None:
        self.queue.put_nowait(m.encode(msg))

    def send_text(self, text: str) -> None:
        self.queue.put_nowait(text)

    def close(self) -> None:
        self.queue.put_nowait(None)


RELAY_CHALLENGES_KEPT = 1 << 16
"""Challenges of a relay link remembered as used; below the older half's top, all are."""


class RelayLink:
    """A relay's session: the members it speaks for, and when it was last heard."""

    vouched_at = -math.inf
    """Its members not in ``unheard`` were heard at or after this (its newest `m.Up` summary)."""
    unheard: frozenset[str] = frozenset()

    def __init__(
        self,
        ws: web.WebSocketResponse,
        relay_id: str,
        zone: str,
        gate: Callable[[], Awaitable[Gate]],
        seal: auth.Seal | None = None,
    ) -> None:
        self.relay_id = relay_id
        self.zone = zone
        self.session = Session(ws, f"relay:{relay_id}", gate, seal)
        self.nonce = auth.new_nonce()
        """This link's part of every challenge the relay sends its nodes (`fresh`)."""
        self._used: set[int] = set()
        self._floor = -1
        self.members: set[str] = set()
        self.heard_at = time.monotonic()
        self.forwarding = ""
        """Where the relay forwards for members behind NAT (`m.RelayHello.forwarding`)."""

    def fresh(self, challenge: str) -> str | None:
        """Why a node's knock that the relay forwards was not answered to a challenge of this
        link's, sent once (None: it was)."""
        link, _, counter = challenge.partition(".")
        if link != self.nonce or not counter.isdigit() or len(counter) > 18:
            return f"its knock answered no challenge of relay {self.relay_id}'s link (replayed from elsewhere)"
        n = int(counter)
        if n <= self._floor or n in self._used:
            return f"its knock answered a challenge of relay {self.relay_id} already used (replayed)"
        self._used.add(n)
        if len(self._used) > RELAY_CHALLENGES_KEPT:
            self._floor = sorted(self._used)[len(self._used) // 2]
            self._used = {x for x in self._used if x > self._floor}
        return None

    def member(self, member_id: str) -> RelayedMember:
        self.members.add(member_id)
        return RelayedMember(self, member_id)


class RelayedMember:
    """A member reached through its relay."""

    def __init__(self, link: RelayLink, member_id: str) -> None:
        self.link = link
        self.member_id = member_id

    def send(self, msg: BaseModel) -> None:
        self.send_text(m.encode(msg))

    def send_text(self, text: str) -> None:
        self.link.session.send_text(m.down_text([self.member_id], text))

    def close(self) -> None:
        self.link.members.discard(self.member_id)  # an expelled member's relay ends its session


class Doorman:
    """Sessions that have not proven the job token yet: at most ``per_address`` of one
    address are read at a time (the rest wait, unread, for a slot: a burst of honest
    reconnects behind one NAT only queues), and at most ``total`` are held in all (more
    are closed unread): a flood of them cannot take the event loop from the members."""

    def __init__(self, per_address: int = PREAUTH_PER_ADDRESS, total: int = PREAUTH_TOTAL) -> None:
        self.per_address = per_address
        self.total = total
        self._held: collections.Counter[str] = collections.Counter()
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.turned_away = 0

    async def enter(self, peer: str) -> Ticket | None:
        """Wait for a slot for a new session from ``peer``; its `Ticket` gives the slot back
        once the session proved itself or ended. None when too many are held already, from
        ``peer`` (`QUEUED` times its slots) or in all, or when no slot came within
        `HELLO_TIMEOUT_S`."""
        if self._held[peer] >= QUEUED * self.per_address or sum(self._held.values()) >= self.total:
            self.turned_away += 1
            return None
        self._held[peer] += 1
        slot = self._slots.setdefault(peer, asyncio.Semaphore(self.per_address))
        try:
            await asyncio.wait_for(slot.acquire(), timeout=HELLO_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            self._release(peer, acquired=False)
            self.turned_away += 1
            return None
        except BaseException:
            self._release(peer, acquired=False)
            raise
        return Ticket(self, peer)

    def leave(self, peer: str) -> None:
        """A session of ``peer`` proved itself or ended: its slot is free (`Ticket.done`)."""
        self._release(peer, acquired=True)

    def _release(self, peer: str, acquired: bool) -> None:
        if acquired:
            self._slots[peer].release()
        self._held[peer] -= 1
        if self._held[peer] <= 0:
            del self._held[peer], self._slots[peer]


class Ticket:
    """One unproven session's slot (`Doorman.enter`); `done` gives it back, once."""

    def __init__(self, doorman: Doorman, peer: str) -> None:
        self._doorman: Doorman | None = doorman
        self._peer = peer

    def done(self) -> None:
        if self._doorman is not None:
            self._doorman.leave(self._peer)
            self._doorman = None


async def turn_away(ws: web.WebSocketResponse) -> None:
    """Close a session over `Doorman`'s limits without reading anything from it."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code=1013, message=b"too many unauthenticated sessions"), timeout=1.0)


async def receive_text(ws: web.WebSocketResponse, what: str, timeout: float = HELLO_TIMEOUT_S) -> str:
    """The session's next message, as text (within ``timeout``)."""
    msg = await asyncio.wait_for(ws.receive(), timeout=timeout)
    if msg.type == WSMsgType.ERROR:
        raise ProtocolError(f"session error before its {what}: {ws.exception()}")
    if msg.type != WSMsgType.TEXT:
        raise ProtocolError(f"expected its {what}, got {msg.type.name}")
    return str(msg.data)


async def greet(ws: web.WebSocketResponse, asks_token: bool, challenge: str = "") -> tuple[str, str]:
    """Send a session's challenge (``challenge``, or a fresh one); returns it and the peer's
    first message (its knock or a relay's hello, as text), which is refused unread above
    `messages.KNOCK_BYTES`."""
    challenge = challenge or auth.new_nonce()
    await ws.send_str(m.encode(m.Challenge(nonce=challenge, auth=asks_token)))
    first = await receive_text(ws, "first message", FIRST_MESSAGE_S)
    if len(first) > m.KNOCK_BYTES:
        raise ProtocolError(
            f"first message of {len(first)} bytes before authentication (at most {m.KNOCK_BYTES}): "
            "not an unbroken node of this version"
        )
    return challenge, first


async def parse_off_loop(parse: Callable[[str, int], T], text: str, limit: int) -> T:
    """``parse(text, limit)``, on a worker thread when the text is large."""
    if len(text) <= INLINE_PARSE_BYTES:
        return parse(text, limit)
    return await asyncio.get_running_loop().run_in_executor(None, parse, text, limit)


async def read_hello(
    ws: web.WebSocketResponse, knock: m.Knock, limit: int, seal: auth.Seal | None
) -> tuple[m.Hello, int]:
    """The hello that follows a proven knock (sealed, with a token), from the same member,
    and its size."""
    text = auth.opened(seal, await receive_text(ws, "hello"))
    hello = await parse_off_loop(m.parse_node_message, text, limit)
    if not isinstance(hello, m.Hello):
        raise ProtocolError(f"a knock must be followed by a hello, got {hello.type!r}")
    if hello.member_id != knock.member_id:
        raise ProtocolError(f"knocked as {knock.member_id!r}, said hello as {hello.member_id!r}")
    return hello, len(text)


def send_all(sessions: Mapping[str, Sender], messages: Mapping[str, BaseModel]) -> None:
    """Send each member its message, encoding each message once and sending it once per
    relay (a large epoch order goes to thousands of members alike)."""
    encoded: dict[int, str] = {}
    relayed: dict[tuple[RelayLink, int], list[str]] = {}
    for mid, msg in messages.items():
        s = sessions.get(mid)
        if s is None:
            continue
        text = encoded.get(id(msg))
        if text is None:
            text = encoded[id(msg)] = m.encode(msg)
        if isinstance(s, RelayedMember):
            relayed.setdefault((s.link, id(msg)), []).append(mid)
        else:
            s.send_text(text)
    for (link, key), mids in relayed.items():
        link.session.send_text(m.down_text(mids, encoded[key]))


async def serve_relay(coord: Coordinator, request: web.Request) -> web.StreamResponse:
    """One relay's session: its handshake, then its batches until it ends."""
    limit = RELAY_MESSAGE_FACTOR * coord.config.service.max_message_bytes
    ws = web.WebSocketResponse(max_msg_size=limit, heartbeat=None)
    await ws.prepare(request)
    peer = request.remote or "?"
    ticket = await coord.doorman.enter(peer)
    if ticket is None:
        await turn_away(ws)
        return ws
    link: RelayLink | None = None
    try:
        challenge, first = await greet(ws, coord.token is not None)
        hello = m.parse_relay_message(first, limit)
        if not isinstance(hello, m.RelayHello):
            raise ProtocolError(f"the first message of a relay must be its hello, got {hello.type!r}")
        why = auth.unproven(
            coord.token, challenge, hello.nonce, hello.relay_id, hello.proof, who="relay", checker="coordinator"
        ) or coord.check_key(hello.key, hello.signature, challenge, hello.nonce, hello.relay_id, role="relay")
        if why is not None:
            await ws.send_str(m.encode(m.Refused(reason=why)))  # unsealed: the relay holds another key
            return ws
        seal = auth.seal(coord.token, challenge, hello.nonce, hello.relay_id, sending="down")
        if not coord.in_office():
            await ws.send_str(auth.sealed(seal, m.encode(coord.office.standby_refusal())))
            return ws
        ticket.done()
        coord.guard.prove(request)
        term = coord.term
        link = RelayLink(ws, hello.relay_id, hello.zone, coord.office.settled, seal)
        link.forwarding = hello.forwarding
        coord.relay_joined(link)
        link.session.send(
            m.RelayWelcome(
                coordinator_id=coord.coordinator_id,
                term=term,
                lease_s=coord.config.membership.lease_s,
                proof=auth.coordinator_proof(coord.token, challenge, hello.nonce, hello.relay_id)
                if coord.token
                else "",
                link=link.nonce,
            )
        )
        offer = f", forwarding at {hello.forwarding}" if hello.forwarding else ""
        log.info("relay %s (zone %r) joined from %s%s", hello.relay_id, hello.zone, peer, offer)
        async for raw in ws:
            if raw.type != WSMsgType.TEXT:
                raise ProtocolError(f"unexpected {raw.type.name} frame from relay {hello.relay_id}")
            if not coord.in_office() or coord.term != term:
                break
            read_at = time.monotonic()  # before parsing, which may wait for a thread
            up = await parse_off_loop(m.parse_relay_message, auth.opened(seal, raw.data), limit)
            if not isinstance(up, m.Up):
                raise ProtocolError("a relay sent its hello twice")
            link.heard_at = read_at
            link.session.send(coord.relay_up(link, up, request))
    except ProtocolError as exc:
        log.warning("dropping relay session from %s: %s", peer, exc)
    except (TimeoutError, asyncio.TimeoutError):
        log.warning("relay session from %s sent no hello within %s s", peer, FIRST_MESSAGE_S)
    finally:
        ticket.done()
        if link is not None:
            coord.relay_lost(link)
            link.session.close()
        if not ws.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), timeout=1.0)
    return ws
