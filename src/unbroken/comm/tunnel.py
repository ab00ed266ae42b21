"""A NAT'd node's side of forwarding (`unbroken.comm.forward`): its session with a
forwarder, and what its rendezvous entries say.

Its gloo devices listen on `LOOPBACK`, where only this host reaches them. For each device
it asks the forwarder for a port and advertises the forwarder's address in its entry
(`NatView.advertise`). gloo decides who dials by comparing addresses (`gloo_initiator`);
the peers compare the advertised one, this node its loopback one, so before the peers'
entries reach its gloo `NatView.translate` rewrites each so that both sides agree:

- the peer's advertised address is greater: the peer dials the forwarder. Here the entry
  says `NOWHERE`, greater than the loopback address, so this node listens;
- it is smaller: this node dials it, straight (it compares lower than the loopback
  address: the usual private and public ranges below 127/8), or through a splice on
  127.0.0.1 to it (an address above 127/8).

Two NAT'd nodes pair the same way: the one whose forwarder address is greater dials the
other's forwarder. The direction is the one every node computes from the advertised
addresses, whoever rewrote what.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from dataclasses import dataclass, field

from unbroken.comm.forward import (
    CHUNK,
    HANDSHAKE_S,
    LoopThread,
    entry_with,
    gloo_initiator,
    no_delay,
    proof,
    read_line,
    splice,
    write_line,
)
from unbroken.control.meeting import data_address
from unbroken.errors import CollectiveFailed, ProtocolError

log = logging.getLogger(__name__)

LOOPBACK = "127.255.255.254"
"""Where a NAT'd node's gloo listens: on loopback (no firewall drops it), and as high in
127/8 as it goes, so that it dials every peer below 127/8 itself."""
NOWHERE = ("255.255.255.255", 65535)
"""A peer's address as this node's gloo sees it when the peer dials: greater than any, never dialled."""


class ForwardingError(ProtocolError):
    """No forwarder took this node's session or opened it a port; says which and why."""


@dataclass
class _Link:
    host: str
    port: int
    sid: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    replies: dict[int, asyncio.Future[dict[str, object]]] = field(default_factory=dict)


class Tunnel:
    """This node's session with the first of ``forwarders`` that takes it (the next one
    once it is lost), the ports it holds there, and local splices to peers above 127/8."""

    def __init__(self, forwarders: tuple[tuple[str, int], ...], token: str | None, member: str) -> None:
        if not token:
            raise ForwardingError("forwarding needs the job's token (--token-file or $UNBROKEN_TOKEN)")
        self.given = forwarders
        """The forwarders this node was given (``--forwarder``): tried first."""
        self.offered: tuple[tuple[str, int], ...] = ()
        """The forwarders the latest epoch order names (members offering forwarding)."""
        self._token = token
        self.member = member
        self._loop = LoopThread("tunnel")
        self._link: _Link | None = None
        self._ports: dict[int, tuple[int, tuple[str, int]]] = {}
        """Port at the forwarder → (epoch, the local gloo listener it leads to)."""
        self._splices: dict[tuple[str, int], tuple[int, asyncio.Server]] = {}
        self._reqs = 0
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Future[None]] = set()
        """Tasks on the loop (asyncio keeps only weak references to them)."""

    # ---------------------------------------------------------------- called by the node

    def open(self, epoch: int, local: tuple[str, int]) -> tuple[str, int]:
        """A port at the forwarder that leads to ``local`` (a gloo listener of ``epoch``)."""
        try:
            found: tuple[str, int] = self._loop.call(self._open(epoch, local), 2 * HANDSHAKE_S)
        except TimeoutError:
            why = f"no forwarder of {self._names()} opened a port within {2 * HANDSHAKE_S:g} s"
            raise ForwardingError(why) from None
        return found

    def probe(self, address: tuple[str, int]) -> str | None:
        """Why the forwarder cannot connect to ``address`` (this node's own), or None when it can."""
        try:
            reply: dict[str, object] = self._loop.call(
                self._ask({"probe": 0, "address": list(address)}), 2 * HANDSHAKE_S
            )
        except TimeoutError:
            raise ForwardingError(
                f"no forwarder of {self._names()} answered a probe within {2 * HANDSHAKE_S:g} s"
            ) from None
        error = reply.get("error")
        return None if error is None else str(error)

    def local_dial(self, epoch: int, target: tuple[str, int]) -> tuple[str, int]:
        """A port on 127.0.0.1 whose connections are spliced to ``target``."""
        found: tuple[str, int] = self._loop.call(self._splice_to(epoch, target), HANDSHAKE_S)
        return found

    @property
    def forwarders(self) -> tuple[tuple[str, int], ...]:
        return tuple(dict.fromkeys(self.given + self.offered))

    def learn(self, offers: list[str]) -> None:
        """The forwarders an epoch order names (``HOST:PORT``; one that does not parse is skipped)."""
        found = []
        for offer in offers:
            host, _, port = offer.rpartition(":")
            if host and port.isdigit() and 0 < int(port) < 65536:
                found.append((host.strip("[]"), int(port)))
        self.offered = tuple(found)

    def forget(self, epoch: int) -> None:
        """Close the ports and splices of ``epoch`` (over: the rendezvous dropped it)."""
        self._loop.loop.call_soon_threadsafe(self._forget, epoch)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.call(self._close(), HANDSHAKE_S)
        self._loop.stop()

    # ---------------------------------------------------------------- on the loop

    async def _ask(self, order: dict[str, object]) -> dict[str, object]:
        """Send ``order`` on the session (its first key numbered), return the forwarder's reply."""
        link = await self._connected()
        self._reqs += 1
        req = self._reqs
        future: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        link.replies[req] = future
        first = next(iter(order))
        write_line(link.writer, {**order, first: req})
        return await asyncio.wait_for(future, HANDSHAKE_S)

    async def _open(self, epoch: int, local: tuple[str, int]) -> tuple[str, int]:
        reply = await self._ask({"open": 0})
        link = self._link
        assert link is not None, "a reply came on the session"
        port = reply.get("port")
        if not isinstance(port, int):
            raise ForwardingError(f"forwarder {link.host}:{link.port} opened no port: {reply.get('error')}")
        self._ports[port] = (epoch, local)
        return link.host, port

    async def _connected(self) -> _Link:
        async with self._lock:
            if self._link is not None and not self._link.writer.is_closing():
                return self._link
            errors = []
            if not self.forwarders:
                raise ForwardingError(
                    f"{self.member} knows no forwarder: pass --forwarder HOST:PORT, or start a reachable member "
                    "with --offer-forwarding PORT (epoch orders name those)"
                )
            for host, port in self.forwarders:
                try:
                    self._link = await self._session(host, port)
                    self._tasks.add(task := asyncio.ensure_future(self._serve(self._link)))
                    task.add_done_callback(self._tasks.discard)
                    log.info("%s: forwarded through %s:%d", self.member, host, port)
                    return self._link
                except (OSError, TimeoutError, ProtocolError) as exc:
                    errors.append(f"{host}:{port}: {exc}")
            raise ForwardingError(f"no forwarder took {self.member}'s session: {'; '.join(errors)}")

    async def _knock(
        self, host: str, port: int, kind: str, conn: int = 0
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, object], str, str]:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=CHUNK), HANDSHAKE_S)
        try:
            challenge = str((await read_line(reader, HANDSHAKE_S)).get("challenge", ""))
            nonce = secrets.token_hex(16)
            mac = proof(self._token, kind, challenge, nonce, self.member, conn)
            write_line(writer, {"kind": kind, "member": self.member, "nonce": nonce, "proof": mac, "conn": conn})
            answer = await read_line(reader, HANDSHAKE_S)
        except BaseException:
            writer.close()
            raise
        if "error" in answer:
            writer.close()
            raise ProtocolError(f"refused: {answer['error']}")
        return reader, writer, answer, challenge, nonce

    async def _session(self, host: str, port: int) -> _Link:
        reader, writer, answer, challenge, nonce = await self._knock(host, port, "control")
        expected = proof(self._token, "forwarder", challenge, nonce, self.member)
        if not hmac.compare_digest(expected, str(answer.get("proof"))):
            writer.close()
            raise ProtocolError("it did not prove the job's token: not this job's forwarder")
        no_delay(writer)
        return _Link(host, port, str(answer.get("ok")), reader, writer)

    async def _serve(self, link: _Link) -> None:
        """The forwarder's lines: replies to opens, and connections to attach."""
        try:
            while True:
                line = await read_line(link.reader, float("inf"))
                if "dial" in line:
                    attach = self._attach(link, line.get("dial"), line.get("port"))
                    self._tasks.add(task := asyncio.ensure_future(attach))
                    task.add_done_callback(self._tasks.discard)
                elif isinstance(req := line.get("opened", line.get("refused", line.get("probed"))), int):
                    future = link.replies.pop(req, None)
                    if future is not None and not future.done():
                        future.set_result(line)
        except (ProtocolError, ConnectionError) as exc:
            log.warning("%s: lost the forwarder %s:%d (%s): the next epoch opens ports at the next one",
                        self.member, link.host, link.port, exc)  # fmt: skip
        finally:
            link.writer.close()
            for future in link.replies.values():
                future.cancel()

    async def _attach(self, link: _Link, conn: object, port: object) -> None:
        mapped = self._ports.get(port) if isinstance(port, int) else None
        if mapped is None or not isinstance(conn, int):
            return
        try:
            reader, writer, _, _, _ = await self._knock(link.host, link.port, "attach", conn)
        except (OSError, TimeoutError, ProtocolError) as exc:
            log.warning("%s: could not attach connection %s at the forwarder: %s", self.member, conn, exc)
            return
        try:
            local = await asyncio.wait_for(asyncio.open_connection(*mapped[1], limit=CHUNK), HANDSHAKE_S)
        except (OSError, TimeoutError):
            writer.close()
            return
        no_delay(writer)
        no_delay(local[1])
        await splice((reader, writer), local)

    async def _splice_to(self, epoch: int, target: tuple[str, int]) -> tuple[str, int]:
        if target not in self._splices:

            async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    remote = await asyncio.wait_for(asyncio.open_connection(*target, limit=CHUNK), HANDSHAKE_S)
                except (OSError, TimeoutError):
                    writer.close()
                    return
                no_delay(writer)
                no_delay(remote[1])
                await splice((reader, writer), remote)

            server = await asyncio.start_server(accept, "127.0.0.1", 0, limit=CHUNK)
            self._splices[target] = (epoch, server)
        epoch_, server = self._splices[target]
        self._splices[target] = (max(epoch, epoch_), server)
        return "127.0.0.1", server.sockets[0].getsockname()[1]

    def _forget(self, over: int) -> None:
        link = self._link
        for port, (epoch, _) in list(self._ports.items()):
            if epoch == over:
                del self._ports[port]
                if link is not None and not link.writer.is_closing():
                    write_line(link.writer, {"close": port})
        for target, (epoch, server) in list(self._splices.items()):
            if epoch <= over:
                server.close()
                del self._splices[target]

    async def _close(self) -> None:
        if self._link is not None:
            self._link.writer.close()
        for _, server in self._splices.values():
            server.close()
        # The session's reader and its attaches end here, not when the loop is stopped under
        # them (a coroutine destroyed with its loop closed is reported at interpreter exit).
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _names(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.forwarders)


class NatView:
    """The rendezvous as a NAT'd node writes and reads it (`unbroken.comm.group.Meeting`'s
    view): its entries advertise a forwarder port; its peers' entries are rewritten so its
    gloo dials exactly the peers that wait for it to (see the module docstring)."""

    def __init__(self, tunnel: Tunnel) -> None:
        self.tunnel = tunnel

    def advertise(self, epoch: int, raw: bytes) -> bytes:
        """Raises `CollectiveFailed` where no forwarder opened a port: the build cannot
        succeed, and the epoch is left as for any failed build (the next one tries again)."""
        try:
            host, port = self.tunnel.open(epoch, data_address(raw))
        except ForwardingError as exc:
            raise CollectiveFailed(f"epoch {epoch}: {exc}") from exc
        return entry_with(raw, host, port)

    def translate(self, epoch: int, own: bytes, advertised: bytes, peer: bytes) -> bytes:
        local, mine, theirs = data_address(own), data_address(advertised), data_address(peer)
        if not gloo_initiator(mine, theirs):
            return entry_with(peer, *NOWHERE)  # the peer dials our forwarder port
        if gloo_initiator(local, theirs):
            return peer  # below our loopback address: gloo dials it as it is
        try:
            return entry_with(peer, *self.tunnel.local_dial(epoch, theirs))
        except (OSError, TimeoutError) as exc:  # on the control thread too: the build fails instead
            log.warning("%s: no local splice to %s:%d (%s): this build cannot reach it", self.tunnel.member,
                        *theirs, exc)  # fmt: skip
            return peer

    def forget(self, epoch: int) -> None:
        self.tunnel.forget(epoch)
