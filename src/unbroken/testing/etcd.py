"""A real etcd cluster on loopback for tests, benchmarks and the HA demo.

Each member is Debian's ``etcd`` binary (package ``etcd-server``, installed by
``scripts/setup``) on ephemeral ports with its own data directory; `close` reaps them::

    with EtcdCluster(workdir) as etcd:
        etcd.endpoints          # ["http://127.0.0.1:41234", ...]
        etcd.kill(0)            # one member down: the others keep a majority
        etcd.restart(0)

Raft timing is tuned for a LAN (50 ms heartbeat, 500 ms election) so that a 1 s lease is
allowed; etcd refuses leases shorter than 1.5 election timeouts.

With ``tls=ClusterTLS.make(dir)`` the members serve their clients over TLS and admit only
clients with a certificate of the test CA (etcd's ``--client-cert-auth``); ``tls.client``
is what a coordinator, node or relay is given (``--etcd-cacert/--etcd-cert/--etcd-key``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from unbroken.control.etcd import EtcdTLS

HEARTBEAT_MS = 50
ELECTION_MS = 500


def etcd_binary() -> str:
    """Path of the etcd server binary; a clear error when it is missing."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise RuntimeError(
            "etcd is not installed: `apt-get install etcd-server` (scripts/setup does it when run as root)"
        )
    return path


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class ClusterTLS:
    """A test CA, the members' certificate and a client's, as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client: EtcdTLS

    @staticmethod
    def make(directory: Path, host: str = "127.0.0.1") -> ClusterTLS:
        """Write a new CA and certificates under ``directory`` (needs the ``trustme`` package)."""
        try:
            import trustme
        except ImportError:
            raise RuntimeError("ClusterTLS needs the trustme package: pip install trustme") from None
        directory.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        server, client = ca.issue_cert(host, "localhost"), ca.issue_cert("unbroken-client")
        paths = {name: directory / f"{name}.pem" for name in ("ca", "server", "server-key", "client", "client-key")}
        ca.cert_pem.write_to_path(str(paths["ca"]))
        server.private_key_pem.write_to_path(str(paths["server-key"]))
        client.private_key_pem.write_to_path(str(paths["client-key"]))
        with paths["server"].open("wb") as f:
            for blob in server.cert_chain_pems:
                f.write(blob.bytes())
        with paths["client"].open("wb") as f:
            for blob in client.cert_chain_pems:
                f.write(blob.bytes())
        client_tls = EtcdTLS(paths["ca"], paths["client"], paths["client-key"])
        return ClusterTLS(paths["ca"], paths["server"], paths["server-key"], client_tls)

    def args(self) -> list[str]:
        """The client flags of every ``unbroken`` command that talks to this cluster."""
        c = self.client
        return ["--etcd-cacert", str(c.cacert), "--etcd-cert", str(c.cert), "--etcd-key", str(c.key)]


class EtcdCluster:
    """``size`` etcd members on loopback, started at once."""

    def __init__(
        self,
        workdir: Path,
        size: int = 3,
        *,
        start: bool = True,
        host: str = "127.0.0.1",
        tls: ClusterTLS | None = None,
    ) -> None:
        """``host``: where clients reach the members (e.g. a `netns.Network` gateway); peers
        talk on loopback. ``tls``: serve clients over TLS, to holders of a client certificate only."""
        self.host = host
        self.tls = tls
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.size = size
        ports = _free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        if start:
            self.start()

    @property
    def endpoints(self) -> list[str]:
        scheme = "https" if self.tls is not None else "http"
        return [f"{scheme}://{self.host}:{p}" for p in self.client_ports]

    def _cmd(self, i: int, state: str) -> list[str]:
        cluster = ",".join(f"e{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        return [
            etcd_binary(), "--name", f"e{i}", "--data-dir", str(self.workdir / f"e{i}.data"),
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--listen-client-urls", self.endpoints[i],
            "--advertise-client-urls", self.endpoints[i],
            "--initial-cluster", cluster, "--initial-cluster-state", state,
            "--initial-cluster-token", f"unbroken-{self.peer_ports[0]}",
            "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
            "--log-level", "warn",
        ] + ([] if self.tls is None else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth",
        ])  # fmt: skip

    def _launch(self, i: int, state: str) -> None:
        log = open(self.workdir / f"e{i}.log", "ab")  # noqa: SIM115
        self.procs[i] = subprocess.Popen(self._cmd(i, state), stdout=log, stderr=log, start_new_session=True)
        log.close()

    def start(self, timeout: float = 30.0, attempts: int = 3) -> EtcdCluster:
        """Raises RuntimeError or TimeoutError where the cluster did not come up. A port
        found free and taken by another process before a member bound it is not the
        cluster's fault: the members start again on fresh ports (``attempts`` in all)."""
        for attempt in range(attempts):
            try:
                for i in range(self.size):
                    self._launch(i, "new")
                self.wait_healthy(timeout)
                return self
            except RuntimeError as exc:
                self.close()  # never leave members behind when the cluster did not come up
                if "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                for i in range(self.size):
                    shutil.rmtree(self.workdir / f"e{i}.data", ignore_errors=True)
                ports = _free_ports(2 * self.size)
                self.client_ports, self.peer_ports = ports[: self.size], ports[self.size :]
            except BaseException:
                self.close()
                raise
        return self

    def healthy(self, i: int) -> bool:
        try:
            req = urllib.request.Request(f"{self.endpoints[i]}/v3/maintenance/status", data=b"{}")
            context = self.tls.client.context() if self.tls is not None else None
            with urllib.request.urlopen(req, timeout=1, context=context) as r:
                return bool(json.load(r).get("leader"))
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 30.0, members: list[int] | None = None) -> None:
        members = list(range(self.size)) if members is None else members
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.healthy(i) for i in members):
                return
            for i in members:
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"etcd member e{i} exited: {self.log(i)[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"etcd did not become healthy within {timeout} s: {self.log(0)[-2000:]}")

    def log(self, i: int) -> str:
        path = self.workdir / f"e{i}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        self.procs[i] = None

    def restart(self, i: int, wait: bool = True) -> None:
        """Start a killed member again on its data directory (it rejoins the cluster)."""
        self.kill(i)
        self._launch(i, "existing")
        if wait:
            self.wait_healthy(30.0, [i])

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            if p is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            self.procs[i] = None

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
