"""A local cluster of real processes: one coordinator and any number of nodes on loopback.

Used by the integration tests, the benchmarks and the demo; handy for users who want to
test their own job's behaviour under faults before renting machines::

    with LocalCluster("my_job.py:job", workdir) as c:
        c.start_coordinator()
        nodes = [c.start_node(f"n{i}") for i in range(3)]
        c.wait_step(20); nodes[1].kill()
        c.wait_finished()

With ``etcd`` (client URLs, e.g. of a `unbroken.testing.etcd.EtcdCluster`), every
coordinator started is a candidate and nodes find the leader through etcd and the
coordinators' addresses::

    with EtcdCluster(workdir) as etcd, LocalCluster(job, workdir, etcd=etcd.endpoints) as c:
        c.start_coordinator(); c.start_coordinator()
        c.kill_coordinator(c.leader())

With a `unbroken.testing.netns.Network`, each node runs in its own network namespace
(its data plane on its namespace's address) and the coordinator listens on the bridge, so
that links can be cut or slowed for real (root only)::

    with Network() as net, LocalCluster("my_job.py:job", workdir, network=net) as c:
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.config import READY_PREFIX
from unbroken.events import Recorded

if TYPE_CHECKING:
    from unbroken.testing.netns import Network
    from unbroken.testing.warm import WarmProcess


class JsonLines:
    """A JSON-lines log read as it grows: each `read` parses only the lines appended since the
    last one. Tests poll their nodes' logs every 20 ms while they wait: parsing three whole
    logs of 2,350 entries took 8 ms of CPU a poll, twice a poll in `LocalCluster.wait_step`
    (nearly half a core, taken from the processes waited on). A line cut short (SIGKILL
    mid-write) is left out; a file replaced or truncated is read again from its start."""

    def __init__(self, path: Path, convert: Callable[[Any], Any] = lambda item: item) -> None:
        self.path = path
        self._convert = convert
        """Applied to each parsed line once; what it raises reaches every `read` until the line
        is gone (e.g. an event of a kind this version does not know)."""
        self._items: list[Any] = []
        self._offset = 0
        self._identity: tuple[int, int] | None = None

    def read(self) -> list[Any]:
        try:
            f = open(self.path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            self._items, self._offset, self._identity = [], 0, None
            return []
        with f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != self._identity or st.st_size < self._offset:
                self._items, self._offset, self._identity = [], 0, (st.st_dev, st.st_ino)
            f.seek(self._offset)
            data = f.read()
        *lines, tail = data.split(b"\n")
        for line in lines:
            item = self._parse(line)
            if item is not None:
                self._items.append(self._convert(item))
            self._offset += len(line) + 1
        out = list(self._items)
        # A last line without its newline yet: counted if it parses, read again next time.
        item = self._parse(tail)
        if item is not None:
            out.append(self._convert(item))
        return out

    @staticmethod
    def _parse(line: bytes) -> Any:
        if not line.strip():
            return None
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):  # a line cut short by SIGKILL
            return None


class NodeProcess:
    """A node subprocess with its log files."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes] | WarmProcess, workdir: Path) -> None:
        self.name = name
        self.proc = proc
        self.commit_log = workdir / f"{name}.jsonl"
        self._log = JsonLines(self.commit_log)
        self.stderr_path = workdir / f"{name}.err"
        self.final_state = workdir / f"{name}.final.pt"
        self.started_at = time.time()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)  # nothing once it exited (a warm one may be reaped already)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def entries(self) -> list[dict[str, Any]]:
        """The commit log's entries so far (shared between calls: do not change them)."""
        return self._log.read()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""


class LocalCluster:
    """Coordinator and nodes as child processes; `close` reaps every one of them."""

    def __init__(
        self,
        job: str,
        workdir: Path,
        *,
        lease_s: float = 1.0,
        recovery_window_s: float = 3.0,
        node_args: list[str] | None = None,
        threads_per_node: int = 1,
        env: dict[str, str] | None = None,
        min_nodes: int = 1,
        coordinator_args: list[str] | None = None,
        network: Network | None = None,
        etcd: list[str] | None = None,
        etcd_args: list[str] | None = None,
        warm: bool = False,
    ) -> None:
        self.etcd = etcd
        self.etcd_args = etcd_args or []
        """Given with ``--etcd`` to every process (e.g. `ClusterTLS.args`: certificates)."""
        self.warm = warm and network is None
        """Nodes fork from a parent that imported torch once (`unbroken.testing.warm`) instead
        of starting cold; a node in its own namespace always starts cold."""
        self.network = network
        """Where nodes get a namespace each (None: every process on loopback, as usual)."""
        self.host = network.gateway if network is not None else "127.0.0.1"
        self.min_nodes = min_nodes
        self.coordinator_args = coordinator_args or []
        self.job = job
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lease_s = lease_s
        self.recovery_window_s = recovery_window_s
        self.node_args = node_args or []
        self.coordinator: subprocess.Popen[bytes] | None = None
        """The coordinator started last."""
        self.address: tuple[str, int] | None = None
        self.coordinators: list[tuple[subprocess.Popen[bytes], tuple[str, int]]] = []
        """Every coordinator started, with its address (several with etcd)."""
        self.relays: list[tuple[subprocess.Popen[bytes], tuple[str, int]]] = []
        """Every relay started, with its address."""
        self.nodes: dict[str, NodeProcess] = {}
        self._events = JsonLines(self.workdir / "events.jsonl", lambda item: Recorded.from_json(item).to_json())
        self._env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_node), PYTHONUNBUFFERED="1", **(env or {}))

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- coordinator

    def start_coordinator(
        self, port: int = 0, timeout: float = 30.0, extra: list[str] | None = None
    ) -> tuple[str, int]:
        cmd = [
            sys.executable, "-m", "unbroken", "-v", "coordinator", "--host", self.host, "--port", str(port),
            "--lease", str(self.lease_s), "--recovery-window", str(self.recovery_window_s),
            "--event-log", str(self.workdir / "events.jsonl"), "--min-nodes", str(self.min_nodes),
            *self.coordinator_args, *(extra or []),
        ]  # fmt: skip
        if self.etcd:
            cmd += ["--etcd", ",".join(self.etcd), *self.etcd_args]
        index = len(self.coordinators)
        err_path = self.workdir / ("coordinator.err" if index == 0 else f"coordinator{index}.err")
        proc, (host, port_s) = self._service(cmd, err_path, timeout, "coordinator")
        self.coordinator, self.address = proc, (host, int(port_s))
        self.coordinators.append((proc, self.address))
        return self.address

    def start_relay(self, zone: str = "", timeout: float = 30.0, extra: list[str] | None = None) -> tuple[str, int]:
        """A relay (a zone's sub-coordinator) linked to every coordinator started so far."""
        assert self.coordinators, "start a coordinator first"
        cmd = [
            sys.executable, "-m", "unbroken", "-v", "relay", "--host", self.host, "--port", "0",
            "--coordinator", ",".join(f"{h}:{p}" for _, (h, p) in self.coordinators),
            *(["--zone", zone] if zone else []), *(extra or []),
        ]  # fmt: skip
        if self.etcd:
            cmd += ["--etcd", ",".join(self.etcd), *self.etcd_args]
        err_path = self.workdir / f"relay{len(self.relays)}.err"
        proc, (host, port_s) = self._service(cmd, err_path, timeout, "relay")
        self.relays.append((proc, (host, int(port_s))))
        return host, int(port_s)

    def _service(
        self, cmd: list[str], err_path: Path, timeout: float, what: str
    ) -> tuple[subprocess.Popen[bytes], tuple[str, str]]:
        """Start a process that prints a READY line with its address; wait for that line."""
        err = open(err_path, "ab")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=self._env)
        err.close()
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith(READY_PREFIX.encode()) or not line:
                break
        if not line.startswith(READY_PREFIX.encode()):
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
            raise RuntimeError(f"{what} did not start: {err_path.read_text()[-2000:]}")
        host, port_s = line.decode().split()[1].rsplit(":", 1)
        return proc, (host, port_s)

    def kill_coordinator(self, index: int | None = None) -> None:
        """SIGKILL the coordinator started last, or the one at ``index`` (see `leader`)."""
        proc = self.coordinator if index is None else self.coordinators[index][0]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def coordinator_state(self, index: int, timeout: float = 2.0) -> dict[str, Any]:
        host, port = self.coordinators[index][1]
        with urllib.request.urlopen(f"http://{host}:{port}/api/state", timeout=timeout) as r:
            data: dict[str, Any] = json.load(r)
            return data

    def leader(self) -> int | None:
        """Index of the coordinator that leads now (None: none does)."""
        for i, (proc, _) in enumerate(self.coordinators):
            if proc.poll() is not None:
                continue
            with contextlib.suppress(OSError, ValueError):
                if self.coordinator_state(i, timeout=0.5)["leadership"]["role"] in ("leader", "single"):
                    return i
        return None

    def state(self, timeout: float = 2.0) -> dict[str, Any]:
        """The job's state as the leading coordinator (or the one started last) sees it."""
        if self.etcd:
            index = self.leader()
            if index is None:
                raise OSError("no coordinator leads")
            return self.coordinator_state(index, timeout)
        assert self.address is not None
        url = f"http://{self.address[0]}:{self.address[1]}/api/state"
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data: dict[str, Any] = json.load(r)
            return data

    # ---------------------------------------------------------------- nodes

    def start_node(
        self,
        name: str,
        *,
        fault: str = "",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        via: list[tuple[str, int]] | None = None,
        relays: list[tuple[str, int]] | None = None,
        job_args: list[str] | None = None,
        no_inbound: bool = False,
    ) -> NodeProcess:
        """``via``: the only coordinator addresses the node is given (no etcd), e.g. a standby's;
        ``relays``: relays it tries first (``--relay``); ``job_args``: the job's own (after ``--``);
        ``no_inbound``: its namespace drops every connection into it (`Network.drop_inbound`)."""
        assert self.address is not None or self.etcd, "start the coordinator first"
        # Every coordinator started here, or the one whose address the caller set (embedded).
        known = via or [a for _, a in self.coordinators] or ([self.address] if self.address else [])
        where = ",".join(f"{h}:{p}" for h, p in known)
        # A script keeps its own loop (`unbroken run`); a job is ``file.py:ATTR`` (`unbroken node`).
        verb = "run" if self.job.endswith(".py") else "node"
        cmd = [
            sys.executable, "-m", "unbroken", "-v", verb, self.job,
            *(["--coordinator", where] if where else []),
            *(["--relay", ",".join(f"{h}:{p}" for h, p in relays)] if relays else []),
            *(["--etcd", ",".join(self.etcd), *self.etcd_args] if self.etcd and via is None else []),
            "--name", name,
            "--commit-log", str(self.workdir / f"{name}.jsonl"),
            "--final-state", str(self.workdir / f"{name}.final.pt"),
            *self.node_args, *(extra or []),
        ]  # fmt: skip
        if fault:
            cmd += ["--fault", fault]
        if self.network is not None:
            # Its own namespace; `ip netns exec` execs in place, so `proc.pid` is the node's pid.
            self._reclaim_namespaces()
            address = self.network.add(name)
            if no_inbound:
                self.network.drop_inbound(name)
            cmd = [*self.network.prefix(name), *cmd, "--gloo-host", address]
        if job_args:
            cmd += ["--", *job_args]
        node_env = {**self._env, **(env or {})}
        proc: subprocess.Popen[bytes] | WarmProcess
        if self.warm:
            from unbroken.testing import warm

            proc = warm.start(cmd[3:], node_env, self.workdir / f"{name}.err")
        else:
            err = open(self.workdir / f"{name}.err", "ab")  # noqa: SIM115
            proc = subprocess.Popen(cmd, stdout=err, stderr=err, env=node_env)
            err.close()
        node = NodeProcess(name, proc, self.workdir)
        self.nodes[name] = node
        return node

    def _reclaim_namespaces(self) -> None:
        """Delete the namespaces of nodes that exited (a long soak starts hundreds of nodes)."""
        assert self.network is not None
        for name in self.network.nodes():
            node = self.nodes.get(name)
            if node is not None and node.proc.poll() is not None:
                self.network.remove(name)

    # ---------------------------------------------------------------- waiting

    def wait_for(self, predicate: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        last_error = ""
        while time.monotonic() < deadline:
            try:
                value = predicate()
                if value:
                    return value
            except OSError as exc:  # coordinator restarting
                last_error = str(exc)
            time.sleep(0.02)
        raise TimeoutError(f"timed out after {timeout} s waiting for {what} {last_error}\n{self.diagnostics()}")

    def max_committed(self) -> int:
        best = 0
        for n in self.nodes.values():
            for e in n.entries():
                if e.get("kind") in ("commit", "sync", "restore"):
                    best = max(best, int(e["step"]))
        return best

    def wait_step(self, step: int, timeout: float = 60.0) -> int:
        got: int = self.wait_for(lambda: (best := self.max_committed()) >= step and best, timeout, f"step {step}")
        return got

    def wait_exit(self, names: list[str] | None = None, timeout: float = 120.0) -> dict[str, int]:
        names = names or list(self.nodes)
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            left = max(0.1, deadline - time.monotonic())
            try:
                codes[name] = self.nodes[name].wait(left)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"node {name} did not exit within {timeout} s\n{self.diagnostics()}") from None
        return codes

    def events(self) -> list[dict[str, Any]]:
        """Every coordinator's events so far (`unbroken.events.Recorded`, read and checked:
        a kind this version does not know fails the caller), as the API shows them."""
        return self._events.read()

    def diagnostics(self) -> str:
        parts = []
        for n in self.nodes.values():
            parts.append(f"--- {n.name} (rc={n.proc.poll()}) ---\n{n.stderr()[-3000:]}")
        for cerr in sorted(self.workdir.glob("coordinator*.err")):
            parts.append(f"--- {cerr.stem} ---\n{cerr.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for n in self.nodes.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process must wake to die
                n.signal(sig)
        for n in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(10)
        for proc, _ in self.coordinators + self.relays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
