"""A node's session at the coordinator, from its knock to its last message.

The node proves the job's token and its key before it may say anything (`auth`,
`identity`); a coordinator standing by answers with the leader's address; a proven hello
is admitted by `Coordinator.join`, and every message after it goes, opened and parsed off
the event loop, to `Coordinator.dispatch`. A session belongs to the term it began in: a
new term (an election, a deposition) ends it, and the node reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web

from unbroken.control import auth
from unbroken.control import messages as m
from unbroken.control.sessions import Sender, Session, greet, parse_off_loop, read_hello, turn_away
from unbroken.errors import ProtocolError
from unbroken.events import Kind

if TYPE_CHECKING:
    from unbroken.control.coordinator import Coordinator

log = logging.getLogger(__name__)


def _unproven(token: str | None, knock: m.Knock, challenge: str) -> str | None:
    """Why this knock may not go on to its hello (wrong, missing or replayed proof), or None."""
    return auth.unproven(token, challenge, knock.nonce, knock.member_id, knock.proof, who="node", checker="coordinator")


async def serve_node(coord: Coordinator, request: web.Request) -> web.StreamResponse:
    """One node's session: its knock, its hello, then its messages until it ends (or the
    coordinator's term does: the node reconnects to whoever leads)."""
    limit = coord.config.service.max_message_bytes
    ws = web.WebSocketResponse(max_msg_size=limit, heartbeat=None)
    await ws.prepare(request)
    peer = request.remote or "?"
    ticket = await coord.doorman.enter(peer)
    if ticket is None:
        await turn_away(ws)
        return ws
    session: Sender | None = None
    try:
        challenge, first = await greet(ws, coord.token is not None)
        knock = m.parse_knock(first)
        why = _unproven(coord.token, knock, challenge) or coord.check_key(
            knock.key, knock.signature, challenge, knock.nonce, knock.member_id
        )
        if why is not None:
            coord.chronicle.refusal(peer, f"{knock.member_id} from {peer}: {why}")
            await ws.send_str(m.encode(m.Refused(reason=why)))  # unsealed: the node holds another key
            await ws.close()
            return ws
        seal = auth.seal(coord.token, challenge, knock.nonce, knock.member_id, sending="down")
        if not coord.in_office():
            await ws.send_str(auth.sealed(seal, m.encode(coord.office.standby_refusal())))
            await ws.close()
            return ws
        ticket.done()
        coord.guard.prove(request)
        hello, _ = await read_hello(ws, knock, limit, seal)
        term = coord.term  # the session belongs to this term (an election may come while it waited)
        proof = auth.coordinator_proof(coord.token, challenge, knock.nonce, knock.member_id) if coord.token else ""
        session_of = lambda: Session(ws, hello.member_id, coord.office.settled, seal)  # noqa: E731
        joined = coord.join(hello, peer, session_of, proof, knock.key)
        if isinstance(joined, m.Refused):
            await ws.send_str(auth.sealed(seal, m.encode(joined)))
            await ws.close()
            return ws
        session = joined
        async for raw in ws:
            if raw.type != WSMsgType.TEXT:
                if raw.type == WSMsgType.ERROR:
                    raise ProtocolError(f"session error: {ws.exception()}")
                raise ProtocolError(f"unexpected {raw.type.name} frame")
            if not coord.in_office() or coord.term != term:
                break  # deposed (or re-elected: a new term's view): the node reconnects
            text = auth.opened(seal, raw.data)
            coord.dispatch(session, await parse_off_loop(m.parse_node_message, text, limit))
    except ProtocolError as exc:
        log.warning("dropping session from %s: %s", peer, exc)
        reason = f"session from {peer} dropped: {exc}"
        if session is None:
            coord.chronicle.refusal(peer, reason, Kind.PROTOCOL)
        else:
            coord.chronicle.now(Kind.PROTOCOL, session.member_id, reason)
    except (TimeoutError, asyncio.TimeoutError):
        log.warning("session from %s sent no knock or hello in time", peer)
    finally:
        ticket.done()
        if session is not None:
            coord.session_ended(session)
            session.close()
        if not ws.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), timeout=1.0)
    return ws
