"""Configuration of coordinators and nodes.

Each component owns a small frozen dataclass; `__post_init__` says exactly which field is
wrong and what range is allowed. Environment variables are read here and in `cli/` only.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.errors import ConfigError
from unbroken.specs import ROLES, Policy, Preference, check_range, parse_throttle

ENV_COORDINATOR = "UNBROKEN_COORDINATOR"
ENV_ETCD = "UNBROKEN_ETCD"
READY_PREFIX = "UNBROKEN_COORDINATOR_READY"
"""A coordinator or relay prints this, then ``HOST:PORT``, on stdout once it serves."""
DEFAULT_ETCD_PREFIX = "/unbroken/job"


def parse_endpoints(text: str | Sequence[str]) -> tuple[str, ...]:
    """``http://h1:2379,http://h2:2379`` (or a list) as a tuple of base URLs."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in (i.strip().rstrip("/") for i in items):
        if not item:
            continue
        if "://" not in item:
            item = f"http://{item}"
        if not item.startswith(("http://", "https://")):
            raise ConfigError(f"etcd endpoint {item!r} must be an http:// or https:// URL (e.g. http://10.0.0.5:2379)")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class EtcdTLS:
    """How to reach an etcd cluster that serves its clients over TLS (``https://`` URLs),
    and may ask each client for a certificate (etcd's ``--client-cert-auth``)."""

    cacert: Path | None = None
    """The CA that signed the etcd members' certificates (``--etcd-cacert``; none: the system's)."""
    cert: Path | None = None
    """This client's certificate chain, PEM (``--etcd-cert``): what etcd's ``--trusted-ca-file`` signed..."""
    key: Path | None = None
    """...and its private key, PEM (``--etcd-key``)."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("give both --etcd-cert and --etcd-key (the client certificate and its key), or neither")
        for flag, path in (("--etcd-cacert", self.cacert), ("--etcd-cert", self.cert), ("--etcd-key", self.key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")

    def context(self) -> ssl.SSLContext:
        """The client's TLS context; a `ConfigError` naming the file that does not load."""
        try:
            ctx = ssl.create_default_context(cafile=str(self.cacert) if self.cacert else None)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"--etcd-cacert {self.cacert} is not a PEM CA certificate: {exc}") from None
        if self.cert is not None:
            try:
                ctx.load_cert_chain(str(self.cert), str(self.key))
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(
                    f"--etcd-cert {self.cert} and --etcd-key {self.key} are not a PEM certificate and its key: {exc}"
                ) from None
        return ctx


def check_tls(endpoints: Sequence[str], tls: EtcdTLS | None) -> None:
    """TLS options go with ``https://`` endpoints, and only with them."""
    plain = [e for e in endpoints if e.startswith("http://")]
    if tls is not None and plain:
        raise ConfigError(
            f"--etcd-cacert/--etcd-cert/--etcd-key are for an etcd that serves TLS: write its endpoints as "
            f"https://... (not {plain[0]})"
        )


def _check_etcd(owner: str, endpoints: tuple[str, ...], prefix: str, ttl_s: int, tls: EtcdTLS | None) -> None:
    check_tls(parse_endpoints(endpoints), tls)
    if not prefix.startswith("/") or len(prefix) > 200 or any(c.isspace() for c in prefix):
        raise ConfigError(
            f"{owner}.etcd_prefix = {prefix!r}: use a path such as /unbroken/myjob (one per job; "
            "every coordinator and node of the job the same)"
        )
    check_range(owner, "etcd_ttl_s", ttl_s, 1, 60)


def environment_coordinators() -> list[str]:
    """``$UNBROKEN_COORDINATOR``'s addresses (comma-separated), if set."""
    return [a for a in os.environ.get(ENV_COORDINATOR, "").split(",") if a.strip()]


def parse_address(text: str) -> tuple[str, int]:
    """Parse ``host:port`` into a pair, with an error that shows the expected form."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"coordinator address {text!r} is not of the form HOST:PORT (e.g. 127.0.0.1:29400)")
    return host.strip("[]"), int(port)


HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?$")
"""A DNS name as ``--allow-host`` takes it: no scheme, no port, no wildcard."""


@dataclass(frozen=True)
class ServiceConfig:
    """Where and how a coordinator serves: its address, who may talk to it, its election."""

    host: str = "127.0.0.1"
    """Interface to listen on (use 0.0.0.0 to accept nodes from other machines)."""
    port: int = 29400
    """Port of the control service (HTTP + node sessions); 0 picks a free one."""
    advertise: str = ""
    """HOST or HOST:PORT nodes use to reach this coordinator, published in etcd when it
    leads (default: ``host`` and the port it listens on; give it when ``host`` is 0.0.0.0)."""
    max_message_bytes: int = 1 << 20
    """Control messages larger than this are refused and their session dropped."""
    event_log: Path | None = None
    """Where to append the event log as JSON lines (none: keep it in memory only)."""
    token: str | None = field(default=None, repr=False)
    """The job's secret: nodes must prove they hold it to join (none: anyone may join)."""
    allowed_keys: Path | None = None
    """Only nodes (and relays) whose public key this file lists may join, one member per key
    (`unbroken.control.identity`; none: any key, as the token admits)."""
    tls_cert: Path | None = None
    """Serve the control plane over TLS with this certificate chain (PEM)..."""
    tls_key: Path | None = None
    """...and this private key (PEM)."""
    etcd: tuple[str, ...] = ()
    """Client URLs of an etcd cluster: coordinators of the job elect a leader there and the
    others stand by (empty: this coordinator alone leads, as in the embedded default)."""
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    """Where in etcd this job's leadership lives (one prefix per job)."""
    etcd_ttl_s: int = 1
    """The leader's etcd lease: a leader that cannot renew it for this long stops leading
    and a standby takes over (etcd may raise it to its own minimum)."""
    etcd_tls: EtcdTLS | None = None
    """Certificates for an etcd that serves TLS and may require client certificates."""
    open_control: bool = False
    """Without a token: allow the operator actions (drain, kill) from this machine all the
    same (by default a job without a token takes none: anything on the machine could ask)."""
    allow_hosts: tuple[str, ...] = ()
    """Names besides this machine's own that browsers may reach the coordinator by, and that
    pages acting on it may come from (a DNS alias, a reverse proxy's name: `control.browsers`)."""

    def __post_init__(self) -> None:
        _check_etcd("ServiceConfig", self.etcd, self.etcd_prefix, self.etcd_ttl_s, self.etcd_tls)
        if self.open_control and self.token:
            raise ConfigError(
                "ServiceConfig.open_control (--open-control) is for a job without a token: with one, "
                "operator actions need it (Authorization: Bearer <token>)"
            )
        for name in self.allow_hosts:
            if not HOST_NAME.fullmatch(name.lower()):
                raise ConfigError(
                    f"ServiceConfig.allow_hosts (--allow-host): {name!r} is not a host name: give one like "
                    "dash.example.org (no scheme, no port, no wildcard)"
                )
        if self.advertise and (len(self.advertise) > 256 or any(c.isspace() for c in self.advertise)):
            raise ConfigError(f"ServiceConfig.advertise = {self.advertise!r}: give HOST or HOST:PORT")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("ServiceConfig: give both tls_cert and tls_key (--tls-cert, --tls-key), or neither")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"TLS file {path} does not exist")
        check_range("ServiceConfig", "port", self.port, 0, 65535)
        check_range("ServiceConfig", "max_message_bytes", self.max_message_bytes, 1024)

    def security(self) -> str:
        """Who may do what, in one line for the coordinator's start: what an operator should
        see before exposing the port."""
        loopback = self.host.rstrip(".") in ("localhost", "::1") or self.host.startswith("127.")
        if self.token:
            who = "nodes proving the job's token"
        elif self.allowed_keys:
            who = "the listed keys alone (no token)"
        elif loopback:
            who = "anyone on this machine (no token)"
        else:
            who = f"ANYONE who reaches {self.host}:{self.port} (no token: give --token-file)"
        keys = f"keys listed in {self.allowed_keys}, one member each" if self.allowed_keys else "any key"
        wire = "TLS" if self.tls_cert else "plain TCP (readable on the way: give --tls-cert/--tls-key)"
        if self.token:
            acts = "with the token"
        elif self.open_control:
            acts = "from this machine (--open-control)"
        else:
            acts = "none (no token)"
        etcd = ""
        if self.etcd:
            etcd = ", etcd over TLS" if self.etcd_tls else ", etcd unencrypted and unauthenticated (access-control it)"
        return f"security: joins: {who}, {keys}; wire: {wire}; operator actions: {acts}{etcd}"


@dataclass(frozen=True)
class MembershipConfig:
    """How the leader decides who is in the group and with what share (`Membership`)."""

    lease_s: float = 1.0
    """A node whose heartbeats stop for this long is declared failed."""
    build_deadline_s: float = 5.0
    """How long after most of an epoch's group wrote its rendezvous entries a member that
    never wrote its own is benched (it never joined the data plane)."""
    recovery_window_s: float = 3.0
    """After a restart, how long to wait for the last epoch's members to reconnect."""
    min_nodes: int = 1
    """The first epoch waits until this many nodes have joined (later epochs do not)."""
    balance: bool = True
    """Shares and roles follow the nodes' measured throughput and memory; False splits the
    batch by the nodes' ``weight`` and never moves a node out of training for speed."""

    def __post_init__(self) -> None:
        check_range("MembershipConfig", "lease_s", self.lease_s, 0.05, 3600)
        check_range("MembershipConfig", "build_deadline_s", self.build_deadline_s, 0.5, 3600)
        check_range("MembershipConfig", "recovery_window_s", self.recovery_window_s, 0, 3600)
        check_range("MembershipConfig", "min_nodes", self.min_nodes, 1, 100_000)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of a coordinator, by owner: the service, the membership decisions, and the
    training policy every epoch order carries (`unbroken.specs.Policy`)::

        CoordinatorConfig(
            service=ServiceConfig(port=0, token=secret),
            membership=MembershipConfig(min_nodes=4),
            policy=Policy(codec=CodecSpec("int8"), diloco=DiLoCoPolicy(inner_steps=50)),
        )
    """

    service: ServiceConfig = field(default_factory=ServiceConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    policy: Policy = field(default_factory=Policy)


@dataclass(frozen=True)
class NodeConfig:
    """Settings of one node process."""

    coordinators: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    """Coordinator addresses, tried in order (a standby names the leader, which is tried next)."""
    etcd: tuple[str, ...] = ()
    """Client URLs of the job's etcd cluster: the node asks it who leads, before the
    addresses above (either may be empty, not both)."""
    relays: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    """Relays (zones' sub-coordinators) tried before the leader, in order: the leader then
    sees one session per relay, not one per node (`unbroken.control.relay`)."""
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    """The job's prefix in etcd (the coordinators' ``--etcd-prefix``)."""
    etcd_tls: EtcdTLS | None = None
    """Certificates for an etcd that serves TLS (the coordinators' ``--etcd-cacert`` and so on)."""
    coordinate: bool = False
    """Also be a coordinator candidate (needs ``etcd``): when elected, this node runs the
    job's coordinator in a child process beside its training."""
    coordinator_args: tuple[str, ...] = ()
    """Extra ``unbroken coordinator`` arguments for this node's candidate (``--coordinate``),
    e.g. ``("--min-nodes", "3", "--mode", "diloco")``: every candidate of a job the same."""
    name: str = ""
    """Human-readable name shown in events and the dashboard (default: host-pid)."""
    weight: float = 1.0
    """Relative share of the global batch, used when the coordinator does not balance by
    throughput (``--balance weights``) or before this node's speed is known (>0)."""
    max_microbatch: int = 0
    """Largest micro-batch run at once; the share is accumulated over several (0: no cap
    beyond what memory allows)."""
    device: str = "auto"
    """Compute device: ``auto`` (cuda, then mps, then cpu), ``cpu``, ``cuda``, ``cuda:N``, ``mps``."""
    memory_limit: int = 0
    """Bytes of device memory this node may use (0: what the device has free); sets the
    largest micro-batch together with the activation memory measured at start-up."""
    role: Preference = Preference.AUTO
    """``auto`` (the coordinator's cost model decides), ``trainer``, ``validator``, or
    ``standby`` (a hot spare, promoted when a trainer fails or leaves)."""
    zone: str = ""
    """Where this node is (a site, a region): reduction is two-level across zones (empty:
    the default zone)."""
    link_latency_ms: float = 0.0
    """Testing aid: emulated one-way latency of each inter-zone hop (in-process)."""
    link_mbit: float = 0.0
    """Testing aid: emulated inter-zone bandwidth in Mbit/s (0: unlimited)..."""
    link_mbit_from: tuple[tuple[str, float], ...] = ()
    """...and per zone it receives from, where it differs (``--link-mbit 800,B=20``)."""
    throttle: str = ""
    """Testing aid: emulate a slower device, ``F`` or ``F,STEP:F,...`` (see unbroken.train.throttle)."""
    checkpoint_dir: Path | None = None
    """Directory for asynchronous checkpoints (none: no checkpoints)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many committed steps (0: never)."""
    start_fresh: bool = False
    """Train from step 0 where ``checkpoint_dir`` holds checkpoints and every one is corrupt
    (they are set aside); without it such a node stops with an error that names each file,
    unless it joins a group that trains (the state then comes from the group)."""
    max_donors: int = 0
    """Peers this node fetches state from at once when it is behind (0: every peer holding it)."""
    absent_wait_s: float = 30.0
    """A sharded job: how long members wait for a holder of ranges lost in every zone to
    rejoin before the job goes back to its newest checkpoint that holds them (in process).
    The wait counts from the member that noticed first."""
    full_resync: bool = False
    """Fetch the whole state when behind, not only the chunks that differ from what this
    node holds (a baseline for benchmarks, or to rule the incremental path out)."""
    connect_timeout_s: float = 15.0
    """How long to wait for a coordinator at start-up before giving up with an error."""
    collective_timeout_s: float = 60.0
    """Deadline of one collective (only reached when the coordinator cannot abort it)."""
    stall_timeout_s: float = 300.0
    """A node whose step loop makes no progress for this long stops heartbeating, so the
    group expels it (a stuck data read or a hung kernel, while its control thread lives)."""
    digest_every: int = 0
    """Record a state digest every this many steps in the commit log (0: at the end only)."""
    commit_log: Path | None = None
    """Append one JSON line per contribution, commit and sync here (tests and audits)."""
    final_state: Path | None = None
    """Save the final model state here when the job finishes."""
    gloo_host: str | None = None
    """Address peers use to reach this node's gloo endpoint (default: this host's name)."""
    no_inbound: bool = False
    """This node accepts no connection (NAT, a firewall): its peers reach its data plane
    through a forwarder (`unbroken.comm.forward`): one of ``forwarders``, else one a member
    offers (epoch orders name them); it dials out only."""
    forwarders: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    """Forwarders this node dials, the first that answers (the next once it is lost): with
    ``no_inbound`` always; without, only where the forwarder finds at start that it cannot
    connect to this node's data-plane address."""
    offer_forwarding: tuple[str, int] | None = None
    """Serve as a forwarder for members behind NAT on this (host, port) (port 0: any)."""
    token: str | None = field(default=None, repr=False)
    """The job's secret, proven to the coordinator (which proves it back) without sending it."""
    key_file: Path | None = None
    """This node's identity: an Ed25519 key (`unbroken keygen`), made there if missing (none:
    a key of its own for the process, which a job admitting listed keys refuses)."""
    tls_ca: Path | None = None
    """Connect to the coordinator over TLS, trusting this CA bundle (PEM) for its certificate."""

    def __post_init__(self) -> None:
        if not self.coordinators and not self.etcd and not self.relays:
            raise ConfigError(
                f"NodeConfig.coordinators is empty: pass --coordinator HOST:PORT (or set {ENV_COORDINATOR}), "
                f"or --etcd URL,... (or set {ENV_ETCD}) to find the job's leader"
            )
        _check_etcd("NodeConfig", self.etcd, self.etcd_prefix, 1, self.etcd_tls)
        if self.coordinate and not self.etcd:
            raise ConfigError("NodeConfig.coordinate needs etcd (--etcd URL,...): candidates are elected there")
        if self.coordinate and self.tls_ca is not None:
            raise ConfigError(
                "NodeConfig.coordinate cannot serve TLS yet: run TLS coordinators separately "
                "(unbroken coordinator --etcd ... --tls-cert ... --tls-key ...)"
            )
        if not 0 < self.weight <= 1e9:
            raise ConfigError(f"NodeConfig.weight = {self.weight!r} must be greater than 0 and at most 1e9")
        if len(self.display_name) > 200:
            raise ConfigError(f"NodeConfig.name is {len(self.display_name)} characters long; at most 200 are allowed")
        if not self.display_name.isprintable():
            bad = next(c for c in self.display_name if not c.isprintable())
            raise ConfigError(
                f"NodeConfig.name {self.display_name!r} holds the unprintable character {bad!r}: "
                "give a name of printable characters (it is shown in terminals and logs)"
            )
        check_range("NodeConfig", "max_microbatch", self.max_microbatch, 0)
        check_range("NodeConfig", "checkpoint_every", self.checkpoint_every, 0)
        check_range("NodeConfig", "max_donors", self.max_donors, 0, 100_000)
        check_range("NodeConfig", "absent_wait_s", self.absent_wait_s, 0, 86400)
        check_range("NodeConfig", "connect_timeout_s", self.connect_timeout_s, 0.1, 86400)
        check_range("NodeConfig", "collective_timeout_s", self.collective_timeout_s, 1, 86400)
        check_range("NodeConfig", "digest_every", self.digest_every, 0)
        check_range("NodeConfig", "stall_timeout_s", self.stall_timeout_s, 0.5, 86400)
        check_range("NodeConfig", "memory_limit", self.memory_limit, 0)
        if self.tls_ca is not None and not Path(self.tls_ca).is_file():
            raise ConfigError(f"TLS CA bundle {self.tls_ca} does not exist")
        check_range("NodeConfig", "link_latency_ms", self.link_latency_ms, 0, 60_000)
        check_range("NodeConfig", "link_mbit", self.link_mbit, 0)
        for zone, mbit in self.link_mbit_from:
            check_range("NodeConfig", f"link_mbit_from[{zone!r}]", mbit, 0)
        if len(self.zone) > 128:
            raise ConfigError(f"NodeConfig.zone is {len(self.zone)} characters long; at most 128 are allowed")
        if self.role not in ROLES:
            raise ConfigError(f"NodeConfig.role = {self.role!r} is not one of {', '.join(ROLES)}")
        object.__setattr__(self, "role", Preference(self.role))  # given as text (the CLI, a script)
        parse_throttle(self.throttle)
        if (self.no_inbound or self.forwarders or self.offer_forwarding) and not self.token:
            raise ConfigError(
                "forwarding (--no-inbound, --offer-forwarding) needs the job's token (--token-file or "
                "$UNBROKEN_TOKEN): members prove it to the forwarder"
            )
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError("NodeConfig.checkpoint_every is set but checkpoint_dir is not: give a directory")

    @property
    def display_name(self) -> str:
        return self.name or f"{os.uname().nodename}-{os.getpid()}"
