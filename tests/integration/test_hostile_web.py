"""The dashboard's HTTP API and the terminal against hostile pages and members (issue 39).

A page of another site, open in a browser on the coordinator's machine, sends what it
likes to ``127.0.0.1``: these tests send what such a browser would (its ``Origin``, a
rebound ``Host``) to a live job and assert that nothing is obeyed and the job trains on.
A member naming itself with escape sequences does not reach the operator's terminal.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import aiohttp

from unbroken.control import identity
from unbroken.control import messages as m
from unbroken.testing.fakes import FINGERPRINT as FAKE_FINGERPRINT

TOKEN = "s3cret-operator-token"
EVIL = "http://evil.example"


def post(c, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    assert c.address is not None
    url = f"http://{c.address[0]}:{c.address[1]}{path}"
    req = urllib.request.Request(url, data=b"", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def operator_events(c) -> list[dict[str, Any]]:
    assert c.address is not None
    url = f"http://{c.address[0]}:{c.address[1]}/api/events?kind=operator"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())["events"]


def websocket_status(c, origin: str) -> int:
    """The HTTP status a browser's websocket upgrade from a page of ``origin`` gets
    (101: the session opened)."""
    assert c.address is not None
    url = f"http://{c.address[0]}:{c.address[1]}/ws"

    async def knock() -> int:
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(url, origin=origin):
                    return 101
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    return asyncio.run(asyncio.wait_for(knock(), 20))


def test_a_page_from_another_site_cannot_act_on_a_job_without_a_token(make_cluster):
    """The operator opened the actions up on this machine (``--open-control``): a page of
    another site still cannot drain or kill a node, nor open a session, whether it sends
    its own origin or rebinds its name to the coordinator; the node trains on. The
    dashboard's own page can."""
    env = {"UB_TEST_STEPS": "100000", "UB_TEST_DELAY_MS": "10"}
    c = make_cluster(env=env, coordinator_args=["--open-control"])
    host, port = c.start_coordinator()
    c.start_node("a")
    c.wait_step(5, timeout=90)

    status, text = post(c, "/api/nodes/a/kill", {"Origin": EVIL})
    assert status == 403 and f"Origin '{EVIL}'" in text and "another site" in text, (status, text)
    rebound = {"Host": f"evil.example:{port}", "Origin": f"{EVIL}:{port}"}  # DNS rebinding: both agree
    status, text = post(c, "/api/nodes/a/kill", rebound)
    assert status == 403 and f"Host 'evil.example:{port}'" in text and "rebinding" in text, (status, text)
    status, text = post(c, "/api/nodes/a/drain", {"Host": f"evil.example:{port}"})  # no Origin: Host still
    assert status == 403, (status, text)
    assert websocket_status(c, EVIL) == 403

    step = c.max_committed()
    c.wait_step(step + 10, timeout=60)  # it trains on
    assert c.nodes["a"].proc.poll() is None and operator_events(c) == []

    own = {"Origin": f"http://{host}:{port}"}  # the dashboard, served by the coordinator itself
    assert post(c, "/api/nodes/a/drain", own)[0] == 200
    assert c.nodes["a"].proc.wait(timeout=60) == 0, c.diagnostics()
    assert [e["node"] for e in operator_events(c)] == ["a"]


def test_a_job_without_a_token_takes_no_action_unless_the_operator_asks(make_cluster):
    c = make_cluster(env={})
    c.start_coordinator()
    status, text = post(c, "/api/nodes/a/kill")  # from this machine, no Origin: as curl
    assert status == 403 and "--open-control" in text and "--token-file" in text, (status, text)
    with urllib.request.urlopen(f"http://{c.address[0]}:{c.address[1]}/api/state", timeout=10) as r:
        assert r.status == 200  # the read-only views stay open


def test_with_the_token_an_operator_acts_and_another_sites_page_cannot(make_cluster):
    env = {"UB_TEST_STEPS": "100000", "UB_TEST_DELAY_MS": "10", "UNBROKEN_TOKEN": TOKEN}
    c = make_cluster(env=env, coordinator_args=["--token", TOKEN])
    c.start_coordinator()
    c.start_node("a")
    c.wait_step(5, timeout=90)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert post(c, "/api/nodes/a/kill")[0] == 403
    assert post(c, "/api/nodes/a/kill", {**bearer, "Origin": EVIL})[0] == 403  # a token a page got hold of
    assert c.nodes["a"].proc.poll() is None
    assert post(c, "/api/nodes/a/kill", bearer)[0] == 200
    assert c.nodes["a"].proc.wait(timeout=30) == -signal.SIGKILL
    assert [e["node"] for e in operator_events(c)] == ["a"]


ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31m"
"""Retitle the terminal, clear the screen, paint it red."""


async def _member(url: str, name: str, device_name: str, leave: str) -> str:
    """A member of a job without a token, with what it chose to say; how its session ended."""
    key = identity.ephemeral()
    member_id = identity.member_id(name, key)
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        challenge = m.parse_coordinator_message((await ws.receive(timeout=10)).data)
        assert isinstance(challenge, m.Challenge)
        # Sent as raw JSON: the member bypasses this version's own checks.
        nonce = "0" * 32
        signature = identity.sign(key, challenge.nonce, nonce, member_id)
        knock = {"type": "knock", "member_id": member_id, "nonce": nonce, "key": identity.public_text(key)}
        await ws.send_str(json.dumps({"v": m.PROTOCOL_VERSION, **knock, "signature": signature}))
        hello = m.Hello.model_construct(
            job="probe", job_identity="probe", fingerprint=FAKE_FINGERPRINT, member_id=member_id, name=name,
            batch_size=6, capabilities=m.Capabilities(device_name=device_name),
        )  # fmt: skip
        await ws.send_str(hello.model_dump_json())
        answer = await ws.receive(timeout=10)
        if answer.type != aiohttp.WSMsgType.TEXT:
            return f"closed: {answer.type.name}"
        welcome = m.parse_coordinator_message(answer.data)
        if not isinstance(welcome, m.Welcome):
            return f"answered: {welcome}"
        await ws.send_str(m.encode(m.Leave(reason=leave)))
        return "welcomed"


def cli(c, *args: str) -> bytes:
    assert c.address is not None
    where = f"{c.address[0]}:{c.address[1]}"
    env = dict(os.environ, COLUMNS="300", TERM="dumb", NO_COLOR="1")
    env.pop("FORCE_COLOR", None)
    out = subprocess.run(
        [sys.executable, "-m", "unbroken", *args, "--coordinator", where], capture_output=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    return out.stdout


def test_escape_sequences_of_a_member_never_reach_the_operators_terminal(make_cluster):
    """A member names itself, its device and its reason for leaving with escape sequences:
    a name is refused (by its node's own configuration, by the coordinator at the knock of
    one that bypasses it), and what else it said shows escaped in ``unbroken status`` and
    ``unbroken events``: readable, never obeyed."""
    c = make_cluster(env={})
    host, port = c.start_coordinator()
    url = f"http://{host}:{port}/ws"

    where = f"{host}:{port}"
    name = f"ev{ESCAPES}il"
    node = subprocess.run(
        [sys.executable, "-m", "unbroken", "node", c.job, "--coordinator", where, "--name", name],
        capture_output=True,
        timeout=120,
    )
    assert node.returncode == 2, node.stderr.decode(errors="replace")
    assert b"\x1b" not in node.stderr and b"unprintable character '\\x1b'" in node.stderr, node.stderr

    said = asyncio.run(_member(url, "plain", f"gpu{ESCAPES}", f"bye{ESCAPES}\nforged line"))
    assert said == "welcomed"
    assert asyncio.run(_member(url, f"ev{ESCAPES}il", "cpu", "bye")).startswith("closed")

    status = cli(c, "status", "--once")
    events = cli(c, "events")
    for out in (status, events):
        assert b"\x1b" not in out and b"\x07" not in out, out
    assert b"bye\\x1b]0;owned\\x07\\x1b[2J\\x1b[31m\\nforged line" in events, events
    assert b"unprintable character '\\x1b'" in events, events  # the refused knock, as the log keeps it
    assert b"plain" in status and b"\\x1b[2J" in status, status
