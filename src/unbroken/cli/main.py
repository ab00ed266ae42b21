"""``unbroken`` — coordinator, node and demo from the command line.

unbroken demo                                   # the embedded default, no flags needed
unbroken coordinator --host 0.0.0.0 --port 29400
unbroken node --coordinator HOST:29400 path/to/job.py:job
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import runpy
import shlex
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from unbroken.cli.args import etcd_args, etcd_endpoints, etcd_tls, offer_forwarding, token_args
from unbroken.cli.assemble import add_parser as add_assemble_parser
from unbroken.cli.keygen import add_parser as add_keygen_parser
from unbroken.cli.observe import add_parsers as add_observe_parsers
from unbroken.cli.relay import add_parser as add_relay_parser
from unbroken.cli.restore import add_parser as add_restore_parser
from unbroken.cli.showcase import add_parsers as add_showcase_parsers
from unbroken.cli.verify import add_parser as add_verify_parser
from unbroken.config import (
    ENV_COORDINATOR,
    READY_PREFIX,
    CoordinatorConfig,
    MembershipConfig,
    NodeConfig,
    ServiceConfig,
    parse_address,
)
from unbroken.control.auth import load_token
from unbroken.errors import ConfigError, NotFinal, UnbrokenError
from unbroken.observe.printable import Formatter as PrintableFormatter
from unbroken.observe.printable import printable
from unbroken.specs import (
    AUDIT_EVERY,
    BUCKET_MB,
    INNER_STEPS,
    OUTER_LR,
    OUTER_MOMENTUM,
    POLICY_FLAGS,
    ROLES,
    STREAMS,
    Policy,
)


def _policy(args: argparse.Namespace) -> Policy:
    """The training policy's flags, parsed; an error names the flag as it was typed."""
    try:
        return Policy.parse(**{name: getattr(args, name) for name in POLICY_FLAGS})
    except ConfigError as exc:
        text = str(exc)
        for name in POLICY_FLAGS:
            text = re.sub(rf"\b(?:DiLoCo)?Policy\.{name}\b", "--" + name.replace("_", "-"), text)
        raise ConfigError(text) from None


def _coordinator(args: argparse.Namespace) -> int:
    from unbroken.control.coordinator import Coordinator

    config = CoordinatorConfig(
        service=ServiceConfig(
            host=args.host,
            port=args.port,
            advertise=args.advertise or "",
            event_log=Path(args.event_log) if args.event_log else None,
            token=load_token(args.token, args.token_file),
            allowed_keys=Path(args.allowed_keys) if args.allowed_keys else None,
            tls_cert=Path(args.tls_cert) if args.tls_cert else None,
            tls_key=Path(args.tls_key) if args.tls_key else None,
            etcd=etcd_endpoints(args),
            etcd_prefix=args.etcd_prefix,
            etcd_ttl_s=args.etcd_ttl,
            etcd_tls=etcd_tls(args),
            open_control=args.open_control,
            allow_hosts=tuple(args.allow_host or ()),
        ),
        membership=MembershipConfig(
            lease_s=args.lease,
            build_deadline_s=args.build_deadline,
            recovery_window_s=args.recovery_window,
            min_nodes=args.min_nodes,
            balance=args.balance == "throughput",
        ),
        policy=_policy(args),
    )
    coord = Coordinator(config)

    async def serve() -> None:
        task = asyncio.create_task(coord.serve())
        while not coord.ready:
            await asyncio.sleep(0.01)
            if task.done():
                await task
        await asyncio.sleep(0.05)
        host, port = coord.address
        print(f"{READY_PREFIX} {host}:{port}", flush=True)
        scheme = "https" if config.service.tls_cert else "http"
        url = f"{scheme}://{host}:{port}"
        print(
            f"unbroken coordinator on {url}  (dashboard: {url}/, state: {url}/api/state)", file=sys.stderr, flush=True
        )
        print(config.service.security(), file=sys.stderr, flush=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, coord.stop_nowait)
        watcher = loop.create_task(_exit_with_parent(coord)) if args.exit_with_parent else None
        await task
        if watcher is not None:
            watcher.cancel()

    try:
        asyncio.run(serve())
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {config.service.host}:{config.service.port} ({exc.strerror or exc}); "
            "is another coordinator running there? Use --port 0 or another port"
        ) from None
    return 0


async def _exit_with_parent(coord: Any) -> None:
    """A node's candidate (``--coordinate``) resigns as soon as its node is gone, even SIGKILLed."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.05)
    coord.stop_nowait()


def _node_config(args: argparse.Namespace) -> NodeConfig:
    etcd = etcd_endpoints(args)
    addresses = args.coordinator or ([] if etcd else os.environ.get(ENV_COORDINATOR, "").split(","))
    return NodeConfig(
        coordinators=tuple(parse_address(p) for a in addresses for p in a.split(",") if p),
        etcd=etcd,
        etcd_prefix=args.etcd_prefix,
        etcd_tls=etcd_tls(args),
        relays=tuple(parse_address(p) for a in args.relay or [] for p in a.split(",") if p),
        coordinate=args.coordinate,
        coordinator_args=tuple(shlex.split(args.coordinator_args or "")),
        name=args.name or "",
        weight=args.weight,
        max_microbatch=args.max_microbatch,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_every=args.checkpoint_every,
        start_fresh=args.start_fresh,
        max_donors=args.max_donors,
        full_resync=args.full_resync,
        absent_wait_s=args.absent_wait,
        connect_timeout_s=args.connect_timeout,
        collective_timeout_s=args.collective_timeout,
        digest_every=args.digest_every,
        stall_timeout_s=args.stall_timeout,
        commit_log=Path(args.commit_log) if args.commit_log else None,
        final_state=Path(args.final_state) if args.final_state else None,
        gloo_host=args.gloo_host,
        no_inbound=args.no_inbound,
        forwarders=tuple(parse_address(p) for a in args.forwarder or [] for p in a.split(",") if p),
        offer_forwarding=offer_forwarding(args.offer_forwarding, args.gloo_host),
        device=args.device,
        memory_limit=_bytes(args.memory_limit),
        role=args.role,
        throttle=args.throttle or "",
        zone=args.zone or "",
        token=load_token(args.token, args.token_file),
        key_file=Path(args.key) if args.key else None,
        tls_ca=Path(args.tls_ca) if args.tls_ca else None,
        link_latency_ms=args.link_latency_ms,
        link_mbit=args.link_mbit[0],
        link_mbit_from=args.link_mbit[1],
    )


def _node(args: argparse.Namespace) -> int:
    from unbroken.control.outsiders import raise_open_files_limit
    from unbroken.job import Sharding, load_job
    from unbroken.testing.faults import FaultPlan, parse_faults
    from unbroken.train.runtime import run_node

    config = _node_config(args)
    raise_open_files_limit()  # its state server and data plane take connections from peers
    faults = FaultPlan(parse_faults(args.fault or ""))
    job = load_job(args.job, args.job_args)
    if args.shard and job.shard is None:
        job = dataclasses.replace(job, shard=Sharding())
    result = run_node(job, config, faults)
    print(
        f"{config.display_name}: {result.outcome} at step {result.step} "
        f"(digest {result.digest[:16]}, {result.epochs} epochs)",
        file=sys.stderr,
    )
    if result.outcome == "job-finished":  # promise 9: no exit 0 with a model older than the group's
        print(f"unbroken node: error: {NotFinal(result.step)}", file=sys.stderr)
        return _exit_now(3)
    return _exit_now(0)


def _run(args: argparse.Namespace) -> int:
    """A script with its own loop (`unbroken.swarm`), run in this process as ``__main__``
    with the job's arguments as its ``sys.argv``; its `unbroken.join` takes these options."""
    from unbroken import swarm
    from unbroken.testing.faults import FaultPlan, parse_faults

    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"unbroken run: {script} is not a file: give the path of a Python script")
    swarm.launch(_node_config(args), FaultPlan(parse_faults(args.fault or "")))
    sys.argv = [str(script), *args.job_args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
        return _exit_now(code)
    except UnbrokenError:
        raise
    except BaseException:
        traceback.print_exc()
        return _exit_now(1)
    return _exit_now(0)


def _exit_now(code: int) -> int:
    # Skip interpreter teardown: destroying a gloo group that still holds an abandoned
    # collective can std::terminate the process (seen with torch 2.13) after all is done.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _bytes(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    try:
        value = float(number) * units[t[len(number) :]]
    except (ValueError, KeyError):
        raise ConfigError(f"--memory-limit {text!r} is not a size: use e.g. 512MB, 2GB or 0") from None
    if not value >= 0:
        raise ConfigError(f"--memory-limit {text!r} must not be negative")
    return int(value)


def _link_mbit(text: str) -> tuple[float, tuple[tuple[str, float], ...]]:
    """``800`` or ``800,B=20,C=20``: the emulated Mbit/s from every zone, then per zone."""
    first, *rest = text.split(",")
    try:
        default = float(first) if first.strip() else 0.0
        per_zone = tuple((zone.strip(), float(mbit)) for zone, _, mbit in (r.partition("=") for r in rest))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MBIT or MBIT,ZONE=MBIT,... (e.g. 800,B=20)") from None
    if any(not zone for zone, _ in per_zone):
        raise argparse.ArgumentTypeError(f"{text!r}: a per-zone rate needs its zone (ZONE=MBIT)")
    return default, per_zone


def _node_options(n: argparse.ArgumentParser) -> None:
    """The options of one node (`unbroken node` and `unbroken run`)."""
    n.add_argument(
        "--coordinator",
        action="append",
        help=f"HOST:PORT, or several comma-separated: any of them names the leader (default ${ENV_COORDINATOR})",
    )
    n.add_argument(
        "--relay",
        action="append",
        help="HOST:PORT of this zone's relay (comma-separated for several), tried before the leader",
    )
    etcd_args(n)
    n.add_argument(
        "--coordinate", action="store_true", help="also be a coordinator candidate (with --etcd): no separate machine"
    )
    n.add_argument("--coordinator-args", help='with --coordinate: the candidate\'s options, e.g. "--min-nodes 3"')
    n.add_argument("--name", help="name shown in events (default: host-pid)")
    n.add_argument("--weight", type=float, default=1.0, help="relative share of the global batch")
    n.add_argument("--max-microbatch", type=int, default=0, help="largest micro-batch (0: as memory allows)")
    n.add_argument("--device", default="auto", help="compute device: auto, cpu, cuda, cuda:N, mps")
    n.add_argument("--memory-limit", default="0", help="device memory this node may use, e.g. 2GB (0: what is free)")
    n.add_argument(
        "--role",
        choices=ROLES,
        default="auto",
        help="auto: the cost model decides; standby: a hot spare promoted when a trainer fails",
    )
    n.add_argument(
        "--zone",
        help="where this node is (site, region): reduction is two-level across zones; auto: grouped by round-trip "
        "time to the coordinator",
    )
    n.add_argument("--link-latency-ms", type=float, default=0.0, help="testing aid: emulated inter-zone latency")
    n.add_argument(
        "--link-mbit",
        type=_link_mbit,
        default=(0.0, ()),
        help="testing aid: emulated inter-zone Mbit/s (0: none), and per zone received from: 800,B=20,C=20",
    )
    n.add_argument("--throttle", help="testing aid: emulate a slower device, e.g. 0.25 or 1,40:0.25,80:1")
    n.add_argument("--checkpoint-dir", help="directory for asynchronous checkpoints")
    n.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N committed steps")
    n.add_argument(
        "--start-fresh",
        action="store_true",
        help="train from step 0 where every checkpoint in --checkpoint-dir is corrupt (they are set aside)",
    )
    n.add_argument("--connect-timeout", type=float, default=15.0, help="seconds to wait for the coordinator")
    n.add_argument(
        "--max-donors", type=int, default=0, help="peers to fetch state from at once when behind (0: all holding it)"
    )
    n.add_argument(
        "--full-resync", action="store_true", help="fetch the whole state when behind, not only the chunks that differ"
    )
    n.add_argument(
        "--absent-wait",
        type=float,
        default=30.0,
        help="sharded: seconds to wait for a holder of ranges lost in every zone before going back to a checkpoint",
    )
    n.add_argument("--collective-timeout", type=float, default=60.0, help="deadline of one collective")
    n.add_argument("--stall-timeout", type=float, default=300.0, help="expel this node if its loop stalls this long")
    n.add_argument("--digest-every", type=int, default=0, help="log a state digest every N steps")
    n.add_argument("--commit-log", help="append commits, contributions and syncs here (JSON lines)")
    n.add_argument("--final-state", help="save the final state here")
    n.add_argument("--gloo-host", help="address peers use for this node's data plane")
    n.add_argument(
        "--no-inbound",
        action="store_true",
        help="this node accepts no connection (NAT, firewall): peers reach it through a --forwarder, or one a member "
        "offers (--offer-forwarding)",
    )
    n.add_argument(
        "--forwarder",
        action="append",
        help="HOST:PORT of forwarders (comma-separated): used with --no-inbound, or where one cannot connect to us",
    )
    n.add_argument(
        "--offer-forwarding",
        metavar="[HOST:]PORT",
        help="forward data-plane connections for members behind NAT on this port (host: --gloo-host)",
    )
    token_args(n)
    n.add_argument(
        "--key", metavar="FILE",
        help="this node's identity key (made there if missing; `unbroken keygen` prints its public line for "
        "the coordinator's --allowed-keys); default: a key for this process alone",
    )  # fmt: skip
    n.add_argument("--tls-ca", help="connect over TLS, trusting this CA bundle (PEM) for the coordinator")
    n.add_argument("--fault", help="testing aid: SIGNAL@PHASE:STEP[,...], e.g. kill@allreduce:12")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unbroken", description="Elastic PyTorch training that does not stop.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    fmt = argparse.ArgumentDefaultsHelpFormatter
    c = sub.add_parser("coordinator", help="run the membership service for one job", formatter_class=fmt)
    c.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for other machines)")
    c.add_argument("--port", type=int, default=29400, help="control port (0: pick a free one)")
    c.add_argument(
        "--build-deadline", type=float, default=5.0, metavar="S",
        help="seconds after most of an epoch's group started building it that a member which never "
        "joined the data plane (wrote no rendezvous entry) is benched",
    )  # fmt: skip
    c.add_argument("--lease", type=float, default=1.0, help="seconds without heartbeat before a node is failed")
    c.add_argument("--recovery-window", type=float, default=3.0, help="after a restart, seconds to wait for members")
    c.add_argument("--min-nodes", type=int, default=1, help="start training once this many nodes joined")
    c.add_argument("--event-log", help="append events here as JSON lines")
    c.add_argument(
        "--balance",
        choices=("throughput", "weights"),
        default="throughput",
        help="split the batch by measured throughput and memory (rebalancing live), or by the nodes' --weight",
    )
    c.add_argument(
        "--codec",
        default="none",
        help="inter-zone codec: none, fp16, bf16, int8, int4, int2, int1 (error feedback), topk[:RATIO]",
    )
    c.add_argument(
        "--streams",
        type=int,
        default=STREAMS,
        help="TCP connections each inter-zone hop (leaders' exchange, cross-zone state transfer) is spread over "
        "(1-16; one connection's window caps a long link)",
    )
    c.add_argument(
        "--bucket-mb",
        type=float,
        default=BUCKET_MB,
        help="sum the gradient in buckets of about this many MB while backward still runs (0: in one piece after it)",
    )
    c.add_argument(
        "--aggregate",
        default="mean",
        help="combine gradients: mean (exact), clip[:C] or trimmed[:F] (robust to a faulty node; an all-gather)",
    )
    c.add_argument(
        "--fragments",
        default="",
        metavar="K,M",
        help="checkpoints as K data + M parity fragments over the nodes' own --checkpoint-dir (any K rebuild it)",
    )
    c.add_argument(
        "--audit-every",
        type=int,
        default=AUDIT_EVERY,
        help="every N steps the trainers compare state digests; a corrupted replica is named and repaired (0: off)",
    )
    c.add_argument(
        "--mode",
        choices=["sync", "diloco"],
        default="sync",
        help="sync: one all-reduce per step; diloco: each zone trains alone for --inner-steps, then the zones "
        "exchange pseudo-gradients (compressed by --codec) and apply an outer Nesterov step",
    )
    c.add_argument("--inner-steps", type=int, default=INNER_STEPS, help="diloco: inner steps per round (H)")
    c.add_argument("--outer-lr", type=float, default=OUTER_LR, help="diloco: outer learning rate")
    c.add_argument(
        "--outer-momentum", type=float, default=OUTER_MOMENTUM, help="diloco: outer Nesterov momentum (0: plain SGD)"
    )
    c.add_argument(
        "--outer-overlap",
        action="store_true",
        help="diloco across zones: exchange a round's pseudo-gradients during the next round and apply them at its "
        "end (compute never waits for the slow links)",
    )
    token_args(c)
    c.add_argument(
        "--allowed-keys", metavar="FILE",
        help="admit only nodes and relays whose public key this file lists (one a line, as `unbroken keygen` "
        "prints them; read again when it changes), one member per key",
    )  # fmt: skip
    c.add_argument("--tls-cert", help="serve the control plane over TLS: certificate chain (PEM)")
    c.add_argument("--tls-key", help="...and its private key (PEM)")
    c.add_argument(
        "--open-control", action="store_true",
        help="a job without a token: take the operator actions (the dashboard's drain and kill) from this "
        "machine all the same (without it, such a job takes none; with a token they need it)",
    )  # fmt: skip
    c.add_argument(
        "--allow-host", action="append", metavar="NAME",
        help="a name besides this machine's own (and its addresses) that browsers reach the coordinator by, "
        "and that pages acting on it may come from: a DNS alias, a reverse proxy (repeatable)",
    )  # fmt: skip
    etcd_args(c)
    c.add_argument("--etcd-ttl", type=int, default=1, help="seconds of the leader's etcd lease (failover time)")
    c.add_argument("--advertise", help="HOST[:PORT] nodes reach this coordinator at (default: --host and the port)")
    c.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    c.set_defaults(func=_coordinator)

    add_relay_parser(sub, fmt)
    add_keygen_parser(sub, fmt)

    n = sub.add_parser("node", help="run one training node", formatter_class=fmt)
    n.add_argument(
        "job",
        help="the job: path/to/file.py:ATTR or package.module:ATTR; its own arguments follow -- "
        "(ATTR(argv) is called with them: `unbroken node job.py:make -- --lr 3e-4`)",
    )
    n.add_argument(
        "--shard",
        action="store_true",
        help="shard the job's state over the zone's members, each holding a range sized by its --memory-limit "
        "(Job.shard; every node of the job must say it)",
    )
    _node_options(n)
    n.set_defaults(func=_node)

    u = sub.add_parser(
        "run",
        help="run a script that keeps its own training loop (unbroken.join) as one node",
        formatter_class=fmt,
    )
    u.add_argument(
        "script",
        help="path/to/script.py, run as __main__; its own arguments follow -- (`unbroken run train.py -- --lr 3e-4`)",
    )
    _node_options(u)
    u.set_defaults(func=_run)

    add_showcase_parsers(sub, fmt)
    add_observe_parsers(sub, fmt)
    add_restore_parser(sub, fmt)
    add_assemble_parser(sub, fmt)
    add_verify_parser(sub, fmt)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job_args: list[str] = []
    if "--" in argv:  # what follows is the job's own: `unbroken node job.py:make -- --lr 3e-4`
        argv, job_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if job_args and args.command not in ("node", "run", "verify"):
        parser.error(f"only `unbroken node`, `run` and `verify` take job arguments after --, not {args.command}")
    args.job_args = job_args
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    if args.command in ("coordinator", "node", "run"):
        # Long-running services: show joins, epochs, failures and progress as they happen.
        logging.getLogger("unbroken").setLevel(logging.INFO)
    try:
        code: int = args.func(args)
        return code
    except UnbrokenError as exc:
        print(f"unbroken {args.command}: error: {printable(str(exc), keep=chr(10))}", file=sys.stderr)
        return 2
