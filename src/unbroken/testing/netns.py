"""Real link faults for a local cluster: one network namespace per node, joined by a bridge.

Signals fake a crash or a freeze, but a cut cable or a congested uplink is something else:
the process runs on, its sockets stay open, and the packets go nowhere or crawl. To test
that, each node runs in its own network namespace with a veth pair to a bridge on the
host; the coordinator listens on the bridge's address::

    host:  bridge unb<pid>b  10.213.X.1/24  ── coordinator, TCPStore
             ├─ veth unb<pid>h2 ═══ unb<pid>p2  (netns unb<pid>n2)  10.213.X.2  node "n1"
             └─ veth unb<pid>h3 ═══ unb<pid>p3  (netns unb<pid>n3)  10.213.X.3  node "n2"

- ``cut(node)`` sets the host end of its veth down: every packet to or from the node is
  dropped (control session and gloo alike) while its sockets stay open, as with a pulled
  cable; ``restore(node)`` sets it up again and TCP retransmits whatever was queued.
- ``drop_inbound(node)`` has the node's namespace drop every new inbound connection
  (nftables: only loopback and replies to what it dialled get in), as behind a NAT or a
  firewall; ``allow_inbound(node)`` lifts it. Needs `nft` (`inbound_probe` says why not).
- ``slow(node, mbit)`` caps both directions of its veth with ``tc tbf``. This kernel has no
  ``tc netem``, so there is no fixed delay and no random loss: the only added latency is
  tbf's queueing (up to 400 ms, then drops), which is what a saturated link does anyway.

Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, `tc`); `probe` says why not when it fails.
Names carry the creating process's id (interface names are at most 15 characters), so
parallel runs do not collide, and leftovers of a run that was SIGKILLed are swept by the
next one. ``close`` deletes everything; it is idempotent and also runs at exit::

    with Network() as net, LocalCluster(job, workdir, network=net) as c:
        c.start_coordinator(); c.start_node("n1"); c.start_node("n2")
        net.cut("n2"); time.sleep(2); net.restore("n2")
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0
"""Deadline of one `ip`/`tc` command (they take milliseconds; a hung one is a broken host)."""
SUBNET = "10.213"
"""Each run takes one free /24 in 10.213.0.0/16: 10.213.X.1 is the bridge, nodes from .2."""
PREFIX = "unb"
TBF = ("burst", "32kbit", "latency", "400ms")
"""tbf's bucket (a few full-size packets) and queue bound: a packet that would wait longer
than 400 ms is dropped, as a congested link's buffer would."""
_OURS = re.compile(rf"^{PREFIX}(\d+)[a-z]")


def names(pid: int, host: int) -> tuple[str, str, str]:
    """(namespace, host-side veth, node-side veth) of host number ``host`` in run ``pid``;
    the bridge is ``unb<pid>b``. At most 14 characters for any pid (pid_max is 2**22)."""
    base = f"{PREFIX}{pid}"
    return f"{base}n{host}", f"{base}h{host}", f"{base}p{host}"


class NetworkError(RuntimeError):
    """An `ip` or `tc` command failed; the message has the command and its stderr."""


@dataclass
class _Link:
    node: str
    netns: str
    host_dev: str
    node_dev: str
    address: str
    down: bool = False
    mbit: float = 0.0
    no_inbound: bool = False


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise NetworkError(f"`{' '.join(argv)}` did not finish within {TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise NetworkError(f"`{' '.join(argv)}` could not run: {exc}") from None
    if check and r.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


@functools.cache
def probe() -> str | None:
    """Why link faults cannot be injected here, or None when they can.

    A real probe, not a guess from the user id: it creates a bridge, a namespace and a veth
    pair with a tbf qdisc (everything `Network` needs), then deletes them.
    """
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    base = f"{PREFIX}{os.getpid()}x"
    try:
        _run("ip", "link", "add", base, "type", "bridge")
        _run("ip", "netns", "add", base)
        _run("ip", "link", "add", f"{base}h", "type", "veth", "peer", "name", f"{base}p", "netns", base)
        _run("ip", "link", "set", f"{base}h", "master", base, "up")
        _run("tc", "qdisc", "add", "dev", f"{base}h", "root", "tbf", "rate", "1mbit", *TBF)
    except NetworkError as exc:
        return str(exc)
    finally:
        _run("ip", "link", "delete", f"{base}h", check=False)
        _run("ip", "netns", "delete", base, check=False)
        _run("ip", "link", "delete", base, check=False)
    return None


INBOUND_TABLE = "unbroken_no_inbound"
INBOUND_RULES = f"""
table inet {INBOUND_TABLE} {{
    chain input {{
        type filter hook input priority 0; policy drop;
        iifname "lo" accept
        ct state established,related accept
    }}
}}
"""
"""A namespace that accepts nothing new from outside: loopback, and what answers its own connections."""


@functools.cache
def inbound_probe() -> str | None:
    """Why `Network.drop_inbound` cannot work here (no `nft`, or it fails), or None."""
    if (why := probe()) is not None:
        return why
    if shutil.which("nft") is None:
        return "`nft` (nftables) is not installed: apt-get install nftables"
    base = f"{PREFIX}{os.getpid()}y"
    try:
        _run("ip", "netns", "add", base)
        _nft(base, INBOUND_RULES)
    except NetworkError as exc:
        return str(exc)
    finally:
        _run("ip", "netns", "delete", base, check=False)
    return None


def _nft(netns: str, rules: str) -> None:
    try:
        r = subprocess.run(
            ["ip", "netns", "exec", netns, "nft", "-f", "-"],
            input=rules, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise NetworkError(f"`nft -f -` in {netns} could not run: {exc}") from None
    if r.returncode != 0:
        raise NetworkError(f"`nft -f -` in {netns} failed (exit {r.returncode}): {r.stderr.strip()}")


def available() -> bool:
    """True when `Network` works here (root, iproute2, netns, veth, bridge, tbf)."""
    return probe() is None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans() -> list[str]:
    """Delete namespaces and links left by runs whose process is gone (SIGKILLed); return them."""
    gone: list[str] = []
    netns = _run("ip", "netns", "list", check=False).stdout.split("\n")
    links = _run("ip", "-o", "link", "show", check=False).stdout.split("\n")
    spaces = [line.split()[0] for line in netns if line.strip()]
    devs = [line.split(":")[1].strip().split("@")[0] for line in links if line.count(":") >= 2]
    for kind, items in (("link", devs), ("netns", spaces)):
        for name in items:
            match = _OURS.match(name)
            if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
                cmd = ("ip", "link", "delete", name) if kind == "link" else ("ip", "netns", "delete", name)
                if _run(*cmd, check=False).returncode == 0:
                    gone.append(name)
    if gone:
        log.warning("deleted network namespaces and links left by dead runs: %s", ", ".join(gone))
    return gone


def _free_subnet(start: int) -> int:
    """The first X (from ``start``, wrapping) such that no interface has an address in 10.213.X.0/24."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    for i in range(254):
        x = (start + i) % 254 + 1
        if f" {SUBNET}.{x}." not in used:
            return x
    raise NetworkError(f"no free /24 left in {SUBNET}.0.0/16")


class Network:
    """A bridge on the host and, per node, a namespace wired to it (see the module docstring).

    Raises:
        NetworkError: a command failed (the message says which and why); run `probe` first
            to learn whether this host can do it at all.
    """

    def __init__(self) -> None:
        self._links: dict[str, _Link] = {}
        self._next_host = 2
        self._closed = False
        pid = os.getpid()
        self._pid = pid
        self.bridge = f"{PREFIX}{pid}b"
        sweep_orphans()
        atexit.register(self.close)
        try:
            # A bridge without a MAC of its own takes its ports' lowest one, and changes it when that
            # port goes away: every node's ARP entry for the coordinator would then point nowhere.
            mac = "02:" + ":".join(f"{b:02x}" for b in os.urandom(5))
            _run("ip", "link", "add", self.bridge, "address", mac, "type", "bridge")
            x = _free_subnet(pid % 254)
            _run("ip", "addr", "add", f"{SUBNET}.{x}.1/24", "dev", self.bridge)
            # Two runs may have picked the same /24 at the same moment: the later one moves on.
            taken = _run("ip", "-o", "-4", "addr", "show").stdout.count(f" {SUBNET}.{x}.")
            if taken > 1:
                _run("ip", "addr", "flush", "dev", self.bridge)
                x = _free_subnet(x + pid % 7)
                _run("ip", "addr", "add", f"{SUBNET}.{x}.1/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        self.subnet = f"{SUBNET}.{x}"
        self.gateway = f"{self.subnet}.1"
        """The bridge's address: where the coordinator listens so every namespace reaches it."""

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- nodes

    def add(self, node: str, host: int | None = None) -> str:
        """Create ``node``'s namespace and veth pair (once); return its address. ``host``:
        its address's last number (2..254, free), where the order of addresses matters (gloo
        has the member of the greater address dial); default: the next free one."""
        if self._closed:
            raise NetworkError("the network is closed")
        if node in self._links:
            return self._links[node].address
        if host is not None:
            used = {int(link.address.rsplit(".", 1)[1]) for link in self._links.values()}
            if not 2 <= host <= 254 or host in used:
                raise NetworkError(f"host number {host} for {node!r} is taken or outside 2..254")
        k = host if host is not None else self._allocate()
        link = _Link(node, *names(self._pid, k), f"{self.subnet}.{k}")
        self._links[node] = link
        try:
            _run("ip", "netns", "add", link.netns)
            _run("ip", "link", "add", link.host_dev, "type", "veth", "peer", "name", link.node_dev, "netns", link.netns)
            _run("ip", "link", "set", link.host_dev, "master", self.bridge, "up")
            _run("ip", "-n", link.netns, "addr", "add", f"{link.address}/24", "dev", link.node_dev)
            _run("ip", "-n", link.netns, "link", "set", link.node_dev, "up")
            _run("ip", "-n", link.netns, "link", "set", "lo", "up")  # gloo and the store may use loopback too
        except BaseException:
            self.remove(node)
            raise
        return link.address

    def remove(self, node: str) -> None:
        """Delete ``node``'s namespace and veth pair (a process still inside keeps the namespace alive)."""
        link = self._links.pop(node, None)
        if link is None:
            return
        _run("ip", "link", "delete", link.host_dev, check=False)  # deletes both ends
        _run("ip", "netns", "delete", link.netns, check=False)

    def nodes(self) -> list[str]:
        return list(self._links)

    def prefix(self, node: str) -> list[str]:
        """The argv prefix that runs a command inside ``node``'s namespace.

        `ip netns exec` execs the command in place, so the child keeps the pid that
        `subprocess.Popen` returned: signals by pid reach the node itself.
        """
        return ["ip", "netns", "exec", self._link(node).netns]

    def address(self, node: str) -> str:
        return self._link(node).address

    def counters(self, node: str) -> tuple[int, int]:
        """Bytes ``node`` has sent and received over its link so far (every frame, headers
        included: its data plane and its control session alike)."""
        link = self._link(node)
        stats = f"/sys/class/net/{link.host_dev}/statistics"
        try:
            with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:
                # The host end receives what the node sends.
                return int(rx.read()), int(tx.read())
        except OSError as exc:
            raise NetworkError(f"cannot read {node}'s link counters in {stats}: {exc}") from None

    # ---------------------------------------------------------------- faults

    def cut(self, node: str) -> None:
        """Drop every packet to and from ``node`` (its sockets stay open) until `restore`."""
        link = self._link(node)
        _run("ip", "link", "set", link.host_dev, "down")
        link.down = True

    def restore(self, node: str) -> None:
        """Undo `cut`; a no-op for a node that is not cut or no longer exists."""
        link = self._links.get(node)
        if link is None or not link.down:
            return
        _run("ip", "link", "set", link.host_dev, "up")
        link.down = False

    def slow(self, node: str, mbit: float) -> None:
        """Cap ``node``'s link at ``mbit`` Mbit/s each way (tbf; queueing delay only, no netem)."""
        if not mbit > 0:
            raise ValueError(f"Network.slow: mbit must be > 0, got {mbit}")
        link = self._link(node)
        rate = f"{int(mbit * 1000)}kbit"
        _run("tc", "qdisc", "replace", "dev", link.host_dev, "root", "tbf", "rate", rate, *TBF)
        _run("tc", "-n", link.netns, "qdisc", "replace", "dev", link.node_dev, "root", "tbf", "rate", rate, *TBF)
        link.mbit = mbit

    def unslow(self, node: str) -> None:
        """Undo `slow`; a no-op for a node that is not slowed or no longer exists."""
        link = self._links.get(node)
        if link is None or not link.mbit:
            return
        _run("tc", "qdisc", "del", "dev", link.host_dev, "root")
        _run("tc", "-n", link.netns, "qdisc", "del", "dev", link.node_dev, "root")
        link.mbit = 0.0

    def drop_inbound(self, node: str) -> None:
        """Drop every new connection into ``node``'s namespace (NAT, a firewall) until
        `allow_inbound`; what it dials out, and loopback, still work."""
        link = self._link(node)
        if not link.no_inbound:
            _nft(link.netns, INBOUND_RULES)
            link.no_inbound = True

    def allow_inbound(self, node: str) -> None:
        """Undo `drop_inbound`; a no-op for a node that accepts connections or no longer exists."""
        link = self._links.get(node)
        if link is None or not link.no_inbound:
            return
        _nft(link.netns, f"delete table inet {INBOUND_TABLE}\n")
        link.no_inbound = False

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Delete every namespace, veth and the bridge. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for node in list(self._links):
            with contextlib.suppress(NetworkError):
                self.remove(node)
        with contextlib.suppress(NetworkError):
            _run("ip", "link", "delete", self.bridge, check=False)

    # ---------------------------------------------------------------- internals

    def _link(self, node: str) -> _Link:
        try:
            return self._links[node]
        except KeyError:
            raise NetworkError(f"node {node!r} has no namespace: call Network.add({node!r}) first") from None

    def _allocate(self) -> int:
        """The next host number (2..254), round-robin so that a new node does not take the
        address of one that just went away (its peers may still hold its old ARP entry)."""
        used = {int(link.address.rsplit(".", 1)[1]) for link in self._links.values()}
        for i in range(253):
            host = (self._next_host - 2 + i) % 253 + 2
            if host not in used:
                self._next_host = host + 1
                return host
        raise NetworkError(f"all 253 addresses of {self.subnet}.0/24 are taken")
