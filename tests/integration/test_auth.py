"""Job tokens: wrong, missing and replayed proofs are refused; an impostor coordinator cannot
take a node; the token never crosses the wire."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from aiohttp import web

from integration.helpers import assert_promises, events_of, tls_files
from unbroken import Coordinator, CoordinatorConfig, MembershipConfig, ServiceConfig
from unbroken.control import auth, identity
from unbroken.control import messages as m

pytestmark = pytest.mark.timeout(180)

TOKEN = "job-secret-0123456789abcdef"
ENV = {"UB_TEST_STEPS": "60", "UB_TEST_DELAY_MS": "15"}


def test_wrong_or_missing_token_is_refused_and_the_job_goes_on(make_cluster):
    c = make_cluster(env=ENV, min_nodes=2, coordinator_args=["--token", TOKEN])
    c.start_coordinator()
    c.start_node("a", extra=["--token", TOKEN])
    c.start_node("b", env={"UNBROKEN_TOKEN": TOKEN})
    c.wait_step(5)
    epochs = len(events_of(c, "epoch"))
    wrong = c.start_node("wrong", extra=["--token", "not-the-job-token-at-all"])
    missing = c.start_node("missing")
    assert wrong.wait(60) == 2 and missing.wait(60) == 2
    assert "the job token does not match the coordinator's" in wrong.stderr()
    assert "requires the job token: pass --token, --token-file or set $UNBROKEN_TOKEN" in missing.stderr()
    del c.nodes["wrong"], c.nodes["missing"]
    assert c.wait_exit(timeout=120) == {"a": 0, "b": 0}, c.diagnostics()
    membership = [e for e in events_of(c, "epoch") if "rebalance" not in e["reason"]]
    assert len(membership) == epochs, "a refused node must not change membership"
    assert TOKEN not in (c.workdir / "events.jsonl").read_text()
    assert_promises(c, ENV, finishers=2)


async def _handshake(
    url: str, knock: m.Knock | None, token: str | None
) -> tuple[m.Knock, m.CoordinatorMessage, m.Challenge]:
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        challenge = m.parse_coordinator_message((await ws.receive()).data)
        assert isinstance(challenge, m.Challenge) and challenge.auth
        if knock is None:
            key = identity.ephemeral()
            knock = identity.knock(identity.member_id("m1", key), challenge.nonce, token, key)
        seal = auth.Seal(token or "", challenge.nonce, knock.nonce, knock.member_id, sending="up")
        await ws.send_str(m.encode(knock))
        hello = m.Hello(job="j", job_identity="i", fingerprint=[], member_id=knock.member_id, name="n", batch_size=4)
        await ws.send_str(seal.seal(m.encode(hello)))
        text = (await ws.receive()).data
        answer = m.parse_coordinator_message(text if text.startswith("{") else seal.open(text))
        return knock, answer, challenge


def test_a_replayed_hello_is_refused():
    coord = Coordinator(
        CoordinatorConfig(ServiceConfig(port=0, token=TOKEN), MembershipConfig(recovery_window_s=0))
    ).start()
    try:
        url = f"http://{coord.address[0]}:{coord.address[1]}/ws"
        knock, first, challenge = asyncio.run(_handshake(url, None, TOKEN))
        assert isinstance(first, m.Welcome)
        # The coordinator proves it holds the token, for this session's nonces only.
        assert auth.same(first.proof, auth.coordinator_proof(TOKEN, challenge.nonce, knock.nonce, knock.member_id))
        # The same bytes on a new session answer a challenge they were not made for.
        _, again, _ = asyncio.run(_handshake(url, knock, TOKEN))
        assert isinstance(again, m.Refused) and "replayed" in again.reason
        assert TOKEN not in json.dumps(coord.snapshot())
    finally:
        coord.stop()


class Impostor(threading.Thread):
    """Listens at an address a node was given, asks for a token it does not hold, and welcomes
    whoever knocks, sealing its answer with a guess at the token."""

    def __init__(self) -> None:
        super().__init__(name="impostor", daemon=True)
        self.ready = threading.Event()
        self.address = ("127.0.0.1", 0)

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(self._serve())
        loop.run_forever()

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/ws", self._ws)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.address = ("127.0.0.1", site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        self.ready.set()

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        challenge = auth.new_nonce()
        await ws.send_str(m.encode(m.Challenge(nonce=challenge, auth=True)))
        knock = m.parse_knock((await ws.receive()).data)
        await ws.receive()  # the sealed hello: unreadable without the token, and not needed
        guess = auth.Seal("a-guess-at-the-job-token", challenge, knock.nonce, knock.member_id, sending="down")
        welcome = m.Welcome(lease_s=1.0, heartbeat_s=0.2, coordinator_id="impostor", proof="0" * 64)
        await ws.send_str(guess.seal(m.encode(welcome)))
        await ws.receive()
        return ws


def test_an_impostor_coordinator_cannot_take_a_node(make_cluster):
    impostor = Impostor()
    impostor.start()
    assert impostor.ready.wait(10)
    c = make_cluster(env=ENV)
    c.address = impostor.address
    node = c.start_node("victim", extra=["--token", TOKEN])
    assert node.wait(60) == 2, c.diagnostics()
    assert "could not prove it holds the job token" in node.stderr()
    assert not [e for e in node.entries() if e["kind"] == "contrib"]


def test_tls_control_plane_end_to_end(make_cluster, tmp_path):
    cert_pem, key_pem, ca_pem = tls_files(tmp_path)
    coord = Coordinator(
        CoordinatorConfig(
            ServiceConfig(port=0, token=TOKEN, tls_cert=cert_pem, tls_key=key_pem), MembershipConfig(min_nodes=2)
        )
    ).start()
    try:
        c = make_cluster(env=ENV)
        c.address = coord.address
        for name in ("a", "b"):
            c.start_node(name, extra=["--token", TOKEN, "--tls-ca", str(ca_pem)])
        plain = c.start_node("plain", extra=["--token", TOKEN, "--connect-timeout", "3"])
        assert plain.wait(60) == 2 and "could not reach a coordinator" in plain.stderr()
        del c.nodes["plain"]
        assert c.wait_exit(timeout=120) == {"a": 0, "b": 0}, c.diagnostics()
        assert coord.snapshot()["finished"]
        assert_promises(c, ENV, finishers=2)
    finally:
        coord.stop()
