"""``unbroken relay``: a zone's sub-coordinator (`unbroken.control.relay`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from unbroken.cli.args import etcd_args, etcd_endpoints, etcd_tls, offer_forwarding, token_args
from unbroken.config import ENV_COORDINATOR, READY_PREFIX, check_tls, parse_address
from unbroken.control import identity
from unbroken.control.auth import load_token
from unbroken.errors import ConfigError


def _relay(args: argparse.Namespace) -> int:
    from unbroken.control.relay import Relay, RelayConfig

    addresses = args.coordinator or os.environ.get(ENV_COORDINATOR, "").split(",")
    config = RelayConfig(
        coordinators=[parse_address(p) for a in addresses for p in a.split(",") if p],
        host=args.host,
        port=args.port,
        zone=args.zone or "",
        token=load_token(args.token, args.token_file),
        etcd=list(etcd_endpoints(args)),
        etcd_prefix=args.etcd_prefix,
        etcd_tls=etcd_tls(args),
        key=identity.load_or_create(Path(args.key)) if args.key else None,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        tls_ca=Path(args.tls_ca) if args.tls_ca else None,
    )
    check_tls(config.etcd, config.etcd_tls)
    if not config.coordinators and not config.etcd:
        raise ConfigError("a relay needs the job's coordinator: --coordinator HOST:PORT[,...] or --etcd URL,...")
    relay = Relay(config)
    offer = offer_forwarding(args.offer_forwarding, args.host)

    async def serve() -> None:
        forwarder = None
        if offer is not None:  # beside the relay, on its loop: members behind NAT dial both
            from unbroken.comm.forward import Forwarder, job_hosts, offered_address

            forwarder = Forwarder(config.token, *offer)
            host, port = await forwarder.start()
            try:  # the leader names it to members found unreachable
                relay.forwarding = offered_address(host, port, job_hosts(config.coordinators, config.etcd))
            except ConfigError:
                await forwarder.close()
                raise
        try:
            await serve_relay()
        finally:
            if forwarder is not None:
                await forwarder.close()

    async def serve_relay() -> None:
        task = asyncio.create_task(relay.serve())
        while not relay.ready:
            await asyncio.sleep(0.01)
            if task.done():
                await task
        host, port = relay.address
        print(f"{READY_PREFIX} {host}:{port}", flush=True)
        scheme = "https" if config.tls_cert else "http"
        print(f"unbroken relay {relay.relay_id} on {host}:{port} (state: {scheme}://{host}:{port}/api/state)",
              file=sys.stderr, flush=True)  # fmt: skip
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, relay.stop_nowait)
        await task

    try:
        asyncio.run(serve())
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {config.host}:{config.port} ({exc.strerror or exc}); use --port 0"
        ) from None
    return 0


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    r = sub.add_parser(
        "relay",
        help="a zone's sub-coordinator: holds its nodes' sessions, speaks for them to the leader",
        formatter_class=fmt,
    )
    r.add_argument("--coordinator", action="append", help="HOST:PORT of the job's coordinator(s), comma-separated")
    r.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for other machines)")
    r.add_argument("--port", type=int, default=29450, help="port nodes connect to (0: pick a free one)")
    r.add_argument("--zone", help="the zone this relay serves (shown on the dashboard)")
    etcd_args(r)
    token_args(r)
    r.add_argument("--key", metavar="FILE", help="the relay's identity key (as a node's --key)")
    r.add_argument("--tls-cert", help="serve the relay's nodes over TLS: certificate chain (PEM)")
    r.add_argument("--tls-key", help="...and its private key (PEM)")
    r.add_argument("--tls-ca", help="link to the leader over TLS, trusting this CA bundle (PEM)")
    r.add_argument(
        "--offer-forwarding",
        metavar="[HOST:]PORT",
        help="also forward data-plane connections for members behind NAT on this port (host: --host)",
    )
    r.set_defaults(func=_relay)
