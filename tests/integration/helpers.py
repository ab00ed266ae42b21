from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from jobs import mlp
from unbroken.testing import LocalCluster, check_promises, reference_state
from unbroken.testing.promises import environment

ATOL = 1e-5
"""Final parameters may differ from the single-process run only by float summation order."""


UNPACED = {"UB_TEST_DELAY_MS": "0", "UB_TEST_SAMPLE_MS": "0"}
"""The environment of a job's pacing sleeps, turned off (the test job's and the examples')."""


class Pace:
    """The test job's pacing sleeps (``UB_TEST_DELAY_MS``) for as long as a test needs a slow
    run, then released: a test that needs many steps only as time for its action to land
    mid-run (on a busy machine too) lets the rest of the run go at full speed, and waits for
    the end rather than for steps it needed as a clock. Pass ``env`` to the cluster."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "paced"
        self.path.touch()
        self.env = {"UB_TEST_PACE_FILE": str(self.path)}

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def job_for(env: dict[str, str]) -> Any:
    """The job the nodes ran with ``env`` (the test job reads its shape from the environment),
    without their pacing sleeps: those change no result, and a reference run would sleep
    through all of them."""
    with environment(env | UNPACED):
        # delay_ms given wins over the environment's (UNPACED): no pacing in a reference run.
        return mlp.make(int(env.get("UB_TEST_STEPS", "40")), delay_ms=0.0)


def assert_promises(c: LocalCluster, env: dict[str, str], finishers: int, reference: bool = True) -> None:
    """Promises of docs/design.md on every node's log, and the final model against the
    reference (unless ``reference`` is False: for a model whose training is so sensitive
    that float summation order alone moves it further than ``ATOL``)."""
    job = job_for(env)
    logs = {name: n.entries() for name, n in c.nodes.items()}
    report = check_promises(logs, job, finishers=finishers)
    assert report.ok, "\n".join(report.problems) + "\n" + c.diagnostics()
    if not reference:
        return
    ref = reference_state(job)
    finished = [n for n in c.nodes.values() if any(e["kind"] == "final" for e in n.entries())]
    assert finished
    got = torch.load(finished[0].final_state, weights_only=True)["model"]
    for k, v in ref.items():
        diff = (got[k] - v).abs().max().item()
        assert diff <= ATOL, f"{k} differs from the single-process reference by {diff:.2e} (> {ATOL})"


EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def load_example(name: str) -> Any:
    """``examples/NAME.py`` as a module (for its plain-loop reference, its data, its metric)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kill_and_join(c: LocalCluster, job_args: list[str]) -> tuple[Any, Any]:
    """Three nodes (one SIGKILLed at step 25), a fourth joining at step 40; all finish or die
    as planned. Returns the victim and the joiner."""
    c.start_coordinator()
    c.start_node("n1", job_args=job_args)
    victim = c.start_node("n2", fault="kill@compute:25", job_args=job_args)
    c.start_node("n3", job_args=job_args)
    c.wait_step(40)
    joiner = c.start_node("n4", job_args=job_args)
    codes = c.wait_exit(timeout=240)
    assert fired(victim, "kill") and codes == {"n1": 0, "n2": -signal.SIGKILL, "n3": 0, "n4": 0}, c.diagnostics()
    return victim, joiner


def fired(node: Any, signal_name: str) -> bool:
    return any(e["kind"] == "fault" and e["signal"] == signal_name for e in node.entries())


def exit_by(code: int | None, sig: int) -> bool:
    return code == -sig


def settled_step(c: LocalCluster, quiet_s: float, timeout: float) -> int:
    """The group's committed step once it has not moved for ``quiet_s`` (the group stopped
    committing; on a busy machine that may take a while to show), within ``timeout``."""
    deadline = time.monotonic() + timeout
    step, since = c.max_committed(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"still committing after {timeout:g} s (step {step})\n{c.diagnostics()}"
        time.sleep(0.05)
        now = c.max_committed()
        if now != step:
            step, since = now, time.monotonic()
    return step


def events_of(c: LocalCluster, kind: str) -> list[dict[str, Any]]:
    return [e for e in c.events() if e["kind"] == kind]


def gloo_entry(port: int = 4242, host: str = "127.0.0.1", peers: int = 0, name: bytes = b"vm") -> bytes:
    """A rank's rendezvous entry as gloo's TCP transport writes it (its ``Rank``: a host
    name, a ``sockaddr_storage`` and a sequence number, then one sequence number per peer)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    host, _, scope = host.partition("%")
    head = struct.pack("<H", family) + struct.pack(">H", port)
    if family == socket.AF_INET6:  # flow info, the address, its scope (an interface's index)
        sockaddr = head + bytes(4) + socket.inet_pton(family, host) + struct.pack("<I", int(scope or 0))
    else:
        sockaddr = head + socket.inet_pton(family, host)
    address = sockaddr.ljust(128, b"\0") + struct.pack("<q", 7)
    ids = struct.pack(f"<{peers}q", *range(peers))
    return struct.pack("<Q", len(name)) + name + struct.pack("<Q", len(address)) + address + ids


def socket_inodes(pid: int | str = "self") -> set[str]:
    """The inodes of the sockets process ``pid`` holds (its own process by default); raises
    FileNotFoundError when it is gone."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed while listed
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _established_rows(pid: int | str) -> list[tuple[int, str]]:
    """(local port, socket inode) of every established TCP connection in ``pid``'s network namespace."""
    rows = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01":
                    rows.append((int(fields[1].rsplit(":", 1)[1], 16), fields[9]))
    return rows


def established(pid: int) -> int | None:
    """Established TCP connections process ``pid`` holds (control session, group pairs);
    None when it is gone meanwhile (a node that killed itself on schedule)."""
    try:
        inodes = socket_inodes(pid)
        return sum(inode in inodes for _, inode in _established_rows(pid))
    except FileNotFoundError:
        return None


def established_to(ports: set[int]) -> int:
    """TCP connections this process accepted on ``ports`` (each connection counted once: at
    its listener). Only this process's own sockets count: another process on the machine may
    hold a connection on the same port number (another address, another test's group)."""
    inodes = socket_inodes()
    return sum(port in ports and inode in inodes for port, inode in _established_rows("self"))


def slowdown(sample_s: float = 0.1, *, load: bool = True) -> float:
    """How many times longer than on an idle machine a step of work may take here now (at
    least 1), for a test's time bound that must hold on a busy machine: ``bound * slowdown()``.

    The larger of two measures: the share of a core a busy loop of ``sample_s`` gets (wall
    over CPU time: 2.0 when it gets half a core), and the last minute's load per core (which
    a burst the sample missed still shows). ``load=False``: the first alone (what the
    machine gives now, not what a test's processes that just ended left in the average)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < sample_s:
        pass
    share = (time.thread_time() - cpu) / (time.perf_counter() - wall)
    per_core = os.getloadavg()[0] / len(os.sched_getaffinity(0)) if load else 0.0
    return max(1.0, 1.0 / max(share, 0.01), per_core)


def tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A certificate for 127.0.0.1, its key and the CA that signed it (PEM files in ``tmp_path``)."""
    trustme = pytest.importorskip("trustme")  # a dev dependency: installed by scripts/setup
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_pem, key_pem, ca_pem = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    return cert_pem, key_pem, ca_pem
