"""Bad input is refused with a message that names the problem; the running job loses nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from conftest import JOB
from integration.helpers import assert_promises, events_of, slowdown
from unbroken.control import messages as m

pytestmark = pytest.mark.timeout(180)


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_coordinator_is_a_clear_error_after_a_bounded_wait():
    port = free_port()
    slow = slowdown()
    start = time.monotonic()
    r = run_cli("node", JOB, "--coordinator", f"127.0.0.1:{port}", "--connect-timeout", "2")
    took = time.monotonic() - start
    slow = max(slow, slowdown())  # most of it is the start of a process (torch's import): CPU
    assert r.returncode == 2, r.stderr
    assert f"could not reach a coordinator at 127.0.0.1:{port} within 2 s" in r.stderr
    assert "unbroken coordinator" in r.stderr  # says what to check
    assert took < 30 * slow, (took, slow)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["node", JOB, "--coordinator", "127.0.0.1:1", "--weight", "-1"],
            "NodeConfig.weight = -1.0 must be greater than 0",
        ),
        (["node", JOB, "--coordinator", "nowhere"], "coordinator address 'nowhere' is not of the form HOST:PORT"),
        (["node", JOB, "--coordinator", "127.0.0.1:1", "--checkpoint-every", "5"], "checkpoint_dir is not"),
        (["node", "no_such_file.py:job", "--coordinator", "127.0.0.1:1"], "job file no_such_file.py does not exist"),
        (["coordinator", "--lease", "0"], "MembershipConfig.lease_s = 0.0 is out of range"),
        (["node", JOB, "--coordinator", "127.0.0.1:1", "--fault", "boom@x:1"], "SIGNAL@PHASE:STEP"),
        (
            ["node", JOB, "--coordinator", "127.0.0.1:1", "--device", "cuda"],
            "asked for CUDA but this torch build sees no CUDA device",
        ),
        (["node", JOB, "--coordinator", "127.0.0.1:1", "--device", "tpu9"], "is not a device: use auto, cpu"),
        (["node", JOB, "--coordinator", "127.0.0.1:1", "--throttle", "2"], "throttle factor 2.0 must be greater"),
        (["node", JOB, "--coordinator", "127.0.0.1:1", "--throttle", "1,x:0.5"], "is not FACTOR or STEP:FACTOR"),
        (
            ["node", JOB, "--coordinator", "127.0.0.1:1", "--memory-limit", "lots"],
            "--memory-limit 'lots' is not a size",
        ),
    ],
)
def test_invalid_settings_name_the_field(args, message):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


BROKEN_JOB = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from unbroken import Job


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x[:, :3])  # the user's bug: a slice of the wrong width


job = Job(
    name="broken",
    model=Broken,
    optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
    dataset=TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))),
    loss=nn.functional.cross_entropy,
    batch_size=8,
    num_steps=5,
)
"""


def test_an_error_in_the_jobs_own_code_is_shown_with_its_traceback(tmp_path):
    """Not a coordinator error or a validation error about a micro-batch cap: the user's
    exception, where it was raised, before the node joins anything."""
    path = tmp_path / "broken_job.py"
    path.write_text(BROKEN_JOB)
    r = run_cli("node", f"{path}:job", "--coordinator", "127.0.0.1:1", "--connect-timeout", "2")
    assert r.returncode == 2, r.stderr
    assert "the job's code raised" in r.stderr, r.stderr
    assert "mat1 and mat2 shapes cannot be multiplied" in r.stderr, r.stderr
    assert f'File "{path}", line 14, in forward' in r.stderr, r.stderr
    assert "could not reach a coordinator" not in r.stderr and "max_microbatch" not in r.stderr, r.stderr


def test_mismatched_model_and_other_job_are_refused_and_the_job_goes_on(make_cluster):
    env = {"UB_TEST_STEPS": "120", "UB_TEST_DELAY_MS": "20"}
    c = make_cluster(env=env, min_nodes=2)
    c.start_coordinator()
    c.start_node("n1")
    c.start_node("n2")
    c.wait_step(5)

    def membership_epochs():  # plan changes for speed (rebalance) are epochs without membership change
        return [e for e in events_of(c, "epoch") if "rebalance" not in e["reason"]]

    epochs_before = len(membership_epochs())
    wrong_model = c.start_node("bad-model", env={"UB_TEST_HIDDEN": "48"})
    other_job = c.start_node("other-job", env={"UB_TEST_NAME": "someone-elses-job"})
    assert wrong_model.wait(60) == 2
    assert other_job.wait(60) == 2
    assert (
        "model does not match the group's: 'net.0.weight' has shape (48, 16) here but (64, 16) in the group"
        in wrong_model.stderr()
    )
    assert "this coordinator runs job 'test-mlp'" in other_job.stderr()
    del c.nodes["bad-model"], c.nodes["other-job"]
    codes = c.wait_exit(timeout=120)
    assert codes == {"n1": 0, "n2": 0}, c.diagnostics()
    assert len(membership_epochs()) == epochs_before, "a refused node must not change membership"
    assert len(events_of(c, "refused")) == 2
    assert_promises(c, env, finishers=2)


async def _hostile_sessions(host: str, port: int) -> list[str]:
    """Open sessions that misbehave in different ways; return how each ended."""
    url = f"http://{host}:{port}/ws"
    outcomes = []
    hello_extra = {"v": m.PROTOCOL_VERSION, "type": "knock", "member_id": "x#1", "evil": True}
    bad_version = {"v": 99, "type": "knock", "member_id": "x#1"}
    async with aiohttp.ClientSession() as http:
        for payload in ["not json {", json.dumps(hello_extra), json.dumps(bad_version), "x" * (2 << 20), b"\x00\x01"]:
            async with http.ws_connect(url, max_msg_size=0) as ws:
                try:
                    if isinstance(payload, bytes):
                        await ws.send_bytes(payload)
                    else:
                        await ws.send_str(payload)
                except ConnectionError:  # dropped before all of it went out (the 2 MB one)
                    outcomes.append("CLOSED")
                    continue
                msg = await asyncio.wait_for(ws.receive(), timeout=10)
                while msg.type.name == "TEXT":  # the coordinator's challenge comes first
                    msg = await asyncio.wait_for(ws.receive(), timeout=10)
                outcomes.append(msg.type.name)
        # Plain garbage on the HTTP port.
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"\x16\x03\x01 GARBAGE\r\n\r\n")
        await writer.drain()
        outcomes.append("http:" + (await asyncio.wait_for(reader.read(100), timeout=10)).decode(errors="replace")[:12])
        writer.close()
    return outcomes


def test_malformed_and_oversized_messages_drop_only_that_session(make_cluster):
    env = {"UB_TEST_STEPS": "120", "UB_TEST_DELAY_MS": "20"}
    c = make_cluster(env=env, min_nodes=2)
    host, port = c.start_coordinator()
    c.start_node("n1")
    c.start_node("n2")
    c.wait_step(5)

    def membership_epochs():  # plan changes for speed (rebalance) are epochs without membership change
        return [e for e in events_of(c, "epoch") if "rebalance" not in e["reason"]]

    epochs_before = len(membership_epochs())
    outcomes = asyncio.run(_hostile_sessions(host, port))
    assert outcomes[:5] == ["CLOSE"] * 5 or all(o in ("CLOSE", "CLOSED", "CLOSING") for o in outcomes[:5]), outcomes
    assert (outcomes[5].startswith("http:HTTP/1.") and "400" in outcomes[5]) or outcomes[5] == "http:", outcomes
    assert c.state()["epoch"] >= 1  # the service still answers
    codes = c.wait_exit(timeout=120)
    assert codes == {"n1": 0, "n2": 0}, c.diagnostics()
    assert len(membership_epochs()) == epochs_before, "hostile sessions must not change membership"
    reasons = [e["reason"] for e in events_of(c, "protocol")]
    assert any("not valid JSON" in r for r in reasons), reasons
    assert any("protocol version 99 is not supported" in r for r in reasons), reasons
    assert any("evil" in r and "Extra inputs are not permitted" in r for r in reasons), reasons
    assert any("size" in r.lower() or "too big" in r.lower() or "exceeds" in r for r in reasons), reasons
    assert_promises(c, env, finishers=2)


def test_coordinator_on_a_busy_port_says_so():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli("coordinator", "--host", "127.0.0.1", "--port", str(port))
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Use --port 0 or another port" in r.stderr
    assert "Traceback" not in r.stderr
